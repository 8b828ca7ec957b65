"""An engine's XLA compile options (``compiler_options=``, ``specjax.engine.resolve_compiler_options``):
none by default; given, they reach every program the engine compiles and k=auto's cost-table key."""
from __future__ import annotations

import pytest

from specjax import engine, sampling
from specjax.drafts import DraftModelProposer

PROMPTS = [[1, 5, 2], [3, 3, 0, 6, 1], [7, 2]]


def test_no_options_by_default(target, draft):
    assert engine.resolve_compiler_options(None) == {} and engine.resolve_compiler_options({}) == {}
    assert engine.AutoregressiveEngine(target).compiler_options == {}
    assert engine.SpeculativeEngine(target, DraftModelProposer(draft, 2)).compiler_options == {}


@pytest.mark.parametrize("bad", [["xla_cpu_use_fusion_emitters"], {1: True}, {"xla_x": None}, "fast"])
def test_bad_compiler_options_are_rejected_when_the_engine_is_made(target, bad):
    with pytest.raises(ValueError, match="compiler_options must be a dict"):
        engine.AutoregressiveEngine(target, compiler_options=bad)


def test_options_reach_every_program_and_the_cost_key(target, draft):
    """An option XLA does not know fails the whole-generation, streamed and dataset
    runs of both engines: the engine's options are what their programs compile with."""
    kw = dict(seed=3, sampling_params=sampling.SamplingConfig(temperature=1.0), max_new_tokens=10)
    unknown = {"xla_cpu_no_such_option": False}
    for eng in (engine.AutoregressiveEngine(target, compiler_options=unknown),
                engine.SpeculativeEngine(target, DraftModelProposer(draft, 2), "token", compiler_options=unknown)):
        with pytest.raises(Exception, match="No such compile option"):
            eng.generate(PROMPTS, **kw)
        with pytest.raises(Exception, match="No such compile option"):
            list(eng.stream(PROMPTS, chunk=4, **kw))
        with pytest.raises(Exception, match="No such compile option"):
            eng.generate_dataset(PROMPTS, batch_size=2, **kw)
    auto = [engine.SpeculativeEngine(target, DraftModelProposer(draft, 3), "token", adaptive=True,
                                     compiler_options=opts) for opts in (None, {}, {"xla_cpu_use_fusion_emitters": False})]
    assert auto[0].cost_key(4) == auto[1].cost_key(4) != auto[2].cost_key(4)
