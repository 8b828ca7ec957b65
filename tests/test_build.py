"""specjax.build: one place assembles a run (target, draft, K, method, sampling, mesh)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from specjax import build, sampling
from specjax.drafts import DraftModelProposer, PromptLookupProposer
from specjax.models import LlamaLM, tiny_config

PROMPTS = [[1, 2, 3, 1, 2], [4, 5, 4, 5]]


@pytest.fixture(scope="module")
def models():
    return (LlamaLM.init(tiny_config(vocab_size=16, n_layers=2), seed=0),
            LlamaLM.init(tiny_config(vocab_size=16, n_layers=1), seed=1))


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="typical"), "method must be one of"),
    (dict(k=0), "K must be an integer >= 1"),
    (dict(k=True), "K must be an integer >= 1"),
    (dict(draft="eagle2"), "expected default, lookup, none, layers:N or an existing path"),
    (dict(method="tree", k=3), "takes its depth from the tree spec"),
    (dict(method="token", tree=build.TreeSpec()), "needs method 'tree'"),
    (dict(param_dtype="float33"), "param_dtype must be one of"),  # was a KeyError in build()
    (dict(scan_layers="false"), "scan_layers must be True, False or 'auto'"),  # was read as True
    (dict(draft="pyproject.toml"), "a draft file is .npz"),
])
def test_run_spec_rejects_bad_settings_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build.RunSpec(**kwargs)
    if "draft" not in kwargs and "method" not in kwargs and "k" not in kwargs and "tree" not in kwargs:
        with pytest.raises(ValueError, match=message):
            build.load_target("tiny", **kwargs)


def test_build_a_tiny_run_greedy_equals_autoregressive():
    run = build.build(build.RunSpec(target="tiny", draft="lookup", k=2, method="greedy",
                                    sampling=sampling.SamplingConfig(temperature=0.0)))
    assert run.engine.k == 2 and run.tokenizer is None and run.draft_desc["kind"] == "lookup"
    prompts = [[5, 9, 5, 9, 5], [1, 2, 3]]
    spec = run.generate(prompts, seed=0, max_new_tokens=12)
    ar = run.generate_autoregressive(prompts, seed=0, max_new_tokens=12)
    assert spec.tokens == ar.tokens and all(len(t) == 12 for t in spec.tokens)


def test_build_without_a_draft_has_only_the_autoregressive_engine():
    run = build.build(build.RunSpec(target="tiny", draft="none"))
    assert run.engine is None
    with pytest.raises(ValueError, match="no draft"):
        run.generate([[1, 2]], seed=0)
    assert len(run.generate_autoregressive([[1, 2]], seed=0, max_new_tokens=3).tokens[0]) == 3


def test_k_has_one_default_and_comes_from_the_proposer(models):
    target, draft = models
    assert build.make_engine(target, draft).k == build.DEFAULT_K
    assert build.make_engine(target, "lookup", 5).k == 5
    prop = DraftModelProposer(draft, 2)
    assert build.make_engine(target, prop).k == 2
    with pytest.raises(ValueError, match="drafts K=2, asked for K=4"):
        build.make_engine(target, prop, 4)
    out = build.generate(target, PromptLookupProposer(vocab_size=16, k=3), PROMPTS, seed=0,
                         max_new_tokens=6)
    assert all(len(s.reached_per_position) == 3 for s in out.stats)


def test_engines_are_memoized_by_models_and_settings(models):
    target, draft = models
    a = build.make_engine(target, draft, 2, "token")
    assert build.make_engine(target, draft, 2, "token") is a
    assert build.make_engine(target, draft, 2, "block") is not a
    assert build.make_engine(target, draft, 3, "token") is not a
    other = LlamaLM.init(tiny_config(vocab_size=16, n_layers=2), seed=0)
    assert build.make_engine(other, draft, 2, "token") is not a
    assert build.make_autoregressive_engine(target) is build.make_autoregressive_engine(target, None)
    assert build.make_engine(target, draft) is build.make_engine(target, draft, build.DEFAULT_K)
    # memo=False: a new engine each call, built and checked alike (k="auto": adaptive, AUTO_MAX_K)
    fresh = build.make_engine(target, draft, "auto", memo=False)
    assert fresh is not build.make_engine(target, draft, "auto", memo=False)
    assert fresh is not build.make_engine(target, draft, "auto")
    assert fresh.adaptive and fresh.k == build.AUTO_MAX_K and not build.make_engine(target, draft, 2, memo=False).adaptive
    with pytest.raises(ValueError):
        build.make_engine(target, draft, 0, memo=False)


def test_resolve_draft_specs(models):
    target, _ = models
    d, desc = build.resolve_draft("layers:1", target)
    assert d.config.n_layers == 1 and desc == {"kind": "layers", "spec": "layers:1", "n_layers": 1}
    assert build.resolve_draft("default", target)[0] == "lookup"  # no shipped draft for it
    assert build.resolve_draft("ngram", target)[0] == "lookup"
    with pytest.raises(ValueError, match="the target has 2 layers"):
        build.resolve_draft("layers:3", target)
    with pytest.raises(ValueError, match="draft 'none'"):
        build.resolve_draft("none", target)


def test_importing_the_library_starts_no_jax_backend():
    """Importing must leave room for jax.distributed.initialize() (multi-host pods)."""
    code = ("import specjax.build, specjax.cli, specjax.train.distill\n"
            "from jax._src import xla_bridge\n"
            "print(xla_bridge.backends_are_initialized())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("text, message", [
    ("topk=3,depth", "expected key=value"),
    ("width=3", "expected key=value"),
    ("topk=x", "bad value for topk"),
    ("branching=2x0", "branching must be integers >= 1"),
    ("candidates=random", "candidates must be"),
    ("nodes=0", "nodes must be an integer >= 1"),
    ("depth=2,depth=3", "depth given twice"),
    ("widths=3x0", "widths must be integers >= 1"),
    ("widths=3x4,candidates=iid", "widths .* need candidates=without_replacement"),
    ("sampled_nodes=-1", "sampled_nodes must be an integer >= 0"),
    ("sampled_nodes=8,widths=2x2", "sampled_nodes .* needs sampled candidates"),
    ("sampled_nodes=8,candidates=point_mass", "sampled_nodes .* needs sampled candidates"),
])
def test_tree_spec_rejects_bad_text(text, message):
    with pytest.raises(ValueError, match=message):
        build.TreeSpec.parse(text)


def test_tree_spec_builds_each_drafts_tree(models):
    from specjax.drafts.base import ChainTreeProposer
    from specjax.drafts.trees import DraftModelTreeProposer, EagleTreeProposer
    from specjax.models.eagle import EagleConfig, EagleModel

    target, draft = models
    spec = build.TreeSpec.parse("topk=2, depth=4, nodes=5, branching=3x1, candidates=iid")
    assert spec == build.TreeSpec(topk=2, depth=4, nodes=5, branching=(3, 1), candidates="iid")
    assert build.TreeSpec.parse("") == build.TreeSpec()
    em = EagleModel.for_target(target, EagleConfig.for_target(target.config, n_heads=4, n_kv_heads=2,
                                                              head_dim=8, ffn_dim=32), seed=1)
    eng = build.make_engine(target, em, method="tree", tree=spec)
    p = eng.proposer
    assert isinstance(p, EagleTreeProposer) and (p.topk, p.depth, p.nodes) == (2, 4, 5)
    assert p.branching == (3, 1) and p.candidates == "iid" and p.tree_depth == 4
    dyn = build.TreeSpec.parse("topk=2,depth=2,nodes=3,widths=3x4x4x2")
    assert dyn.widths == (3, 4, 4, 2) and dyn.describe()["widths"] == [3, 4, 4, 2]
    p = build.make_engine(target, em, method="tree", tree=dyn).proposer
    assert p.dynamic and p.tree_depth == 4 and p.tree_nodes == 13 and p.k == dyn.max_slots == 13
    pos = build.TreeSpec.parse("topk=2,depth=2,nodes=3,sampled_nodes=15")
    p = build.make_engine(target, em, method="tree", tree=pos).proposer
    assert p.sampled_nodes == 15 and not p.dynamic and p.tree_depth == 4 and p.tree_nodes == 15
    # build.generate takes the tree too (it passed it on to generate: a TypeError)
    out = build.generate(target, draft, [[1, 2, 3]], method="tree", tree=build.TreeSpec(depth=2, topk=2, nodes=3),
                         seed=0, max_new_tokens=3, sampling_params=dict(temperature=0.0))
    ref = build.generate_autoregressive(target, [[1, 2, 3]], seed=0, max_new_tokens=3, greedy=True)
    assert out.tokens == ref.tokens
    assert p.k == pos.max_slots and pos.describe()["sampled_nodes"] == 15
    assert isinstance(build.make_engine(target, draft, method="tree").proposer, DraftModelTreeProposer)
    lookup = build.make_engine(target, "lookup", method="tree", tree=spec).proposer
    assert isinstance(lookup, ChainTreeProposer) and lookup.tree_depth == 4
    with pytest.raises(ValueError, match="takes its depth"):
        build.make_engine(target, em, 3, "tree")
    with pytest.raises(ValueError, match="only the EAGLE head grows sampled trees"):
        from specjax.drafts.trees import make_tree_proposer
        make_tree_proposer(draft, 2, 2, 3, "iid")
