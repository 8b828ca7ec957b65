"""Batch hints (specjax.sampling.BatchHints): programs traced with the batch-level conds
that a call's settings decide replaced by their branch give the same tokens and statistics
as with the conds, and have fewer conditionals (on a GPU each is a host sync per round)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from specjax import engine, sampling
from specjax.drafts import DraftModelProposer
from specjax.drafts.trees import make_tree_proposer
from specjax.models.eagle import EagleConfig, EagleModel
from tests.test_dataset import _dataset

V = 8
PROMPTS = [[1, 5, 2], [3, 3, 0, 6, 1], [7, 2], [4, 4, 4, 1, 2, 0]]

CONFIGS = {
    "greedy": sampling.SamplingConfig(temperature=0.0),
    "t1": sampling.SamplingConfig(temperature=1.0),
    "filters": sampling.SamplingConfig(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05,
                                       repetition_penalty=1.8, presence_penalty=0.7),
    # no row greedy, yet every row a point mass: the conds would take the point-mass branches
    "topk1": sampling.SamplingConfig(temperature=1.0, top_k=1),
    # mixed rows: greedy undecided, filters on for the sampled rows
    "mixed": sampling.SamplingParams.create(4, temperature=[0.0, 1.0, 0.7, 0.0], top_p=[1.0, 0.8, 1.0, 0.5]),
}


def test_hints_for_decides_as_the_program_would():
    mk = sampling.SamplingParams.create
    h = sampling.hints_for(mk(3, temperature=0.0, top_p=0.5, top_k=2), V, False)
    assert h == sampling.BatchHints(greedy=True, filters=False, penalties=False, vocab=V,
                                    wide_top_k=False)  # greedy rows ignore filters
    h = sampling.hints_for(mk(2, temperature=[1.0, 0.5], top_k=[0, V]), V, True)
    assert (h.greedy, h.filters, h.penalties) == (False, False, True)  # top-k 0 and >= V are off
    assert sampling.hints_for(mk(2, temperature=1.0, top_k=[0, V - 1]), V, False).filters is True
    assert sampling.hints_for(mk(2, temperature=[0.0, 1.0], top_p=[0.5, 1.0]), V, False).greedy is None
    assert sampling.hints_for(mk(2, temperature=[0.0, 1.0], top_p=[0.5, 1.0]), V, False).filters is False
    assert sampling.hints_for(mk(2, temperature=[0.0, 1.0], top_p=[1.0, 0.5]), V, False).filters is True
    # a top-k past the pipeline's candidates, on a sampled row and below the vocabulary
    wide = lambda **kw: sampling.hints_for(mk(2, **kw), 1000, False).wide_top_k  # noqa: E731
    assert wide(temperature=1.0, top_k=[0, 257]) is True
    assert wide(temperature=1.0, top_k=[256, 1000]) is False
    assert wide(temperature=[1.0, 0.0], top_k=[3, 500]) is False


def test_resolve_batch_hints(monkeypatch):
    monkeypatch.delenv("SPECJAX_BATCH_HINTS", raising=False)
    assert engine.resolve_batch_hints() is False  # a CPU
    assert engine.resolve_batch_hints(True) is True and engine.resolve_batch_hints(False) is False
    monkeypatch.setenv("SPECJAX_BATCH_HINTS", "1")
    assert engine.resolve_batch_hints() is True and engine.resolve_batch_hints(False) is False
    monkeypatch.setenv("SPECJAX_BATCH_HINTS", "maybe")
    with pytest.raises(ValueError, match="SPECJAX_BATCH_HINTS"):
        engine.resolve_batch_hints()
    with pytest.raises(ValueError, match="batch_hints"):
        engine.resolve_batch_hints("yes")


def _engines(kind, target, draft, hints):
    if kind == "autoregressive":
        return engine.AutoregressiveEngine(target, batch_hints=hints)
    if kind == "tree":  # an EAGLE head: top-k trees in greedy rounds, sampled ones otherwise
        cfg = EagleConfig.for_target(target.config, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32)
        head = EagleModel.for_target(target, cfg, seed=3)
        prop = make_tree_proposer(head, 2, 2, 5, "without_replacement", (2, 1))
        return engine.SpeculativeEngine(target, prop, "tree", batch_hints=hints)
    if kind == "auto":  # adaptive K with a fixed cost table: rounds of 0..3 drafts
        return engine.SpeculativeEngine(target, DraftModelProposer(draft, 3), "token", adaptive=True,
                                        costs={4: [1.0, 1.2, 1.4, 1.6]}, batch_hints=hints)
    return engine.SpeculativeEngine(target, DraftModelProposer(draft, 3), kind, batch_hints=hints)


@pytest.fixture(scope="module")
def engines(target, draft):
    """``engines(kind, hints)``: one engine per kind and hints for the module's tests, so that
    a program one test compiled (kept by the engine and by its jitted function) is the one
    another test runs, or lowers to count its conditionals, with nothing traced again. Only
    ever used with the default (conditional) form, never under ``SPECJAX_SYNC_FREE=1``."""
    made = {}

    def get(kind, hints):
        if (kind, hints) not in made:
            made[kind, hints] = _engines(kind, target, draft, hints)
        return made[kind, hints]

    return get


# every config for the chain and the autoregressive engine (block verification shares the
# chain's branches); the tree the two the hints decide for its own (the greedy top-k tree,
# the point-mass verifier): every row greedy, and none greedy yet every row a point mass,
# and the mixed rows, whose program test_sync_free_settles_mixed_rows_without_conditionals
# runs again (so it compiles nothing new); adaptive K's programs (plain and drafting
# rounds) the second
SUBSETS = {"token": CONFIGS, "autoregressive": CONFIGS, "tree": ("greedy", "topk1", "mixed"), "auto": ("topk1",)}


# the calls of these tests, and the programs whose conditionals are counted: the same
# arguments and the same engines (the fixture), so that counting compiles nothing new
RUN = dict(seed=3, max_new_tokens=12, stop_tokens=[0])


@pytest.mark.parametrize("kind", [k if k == "token" else pytest.param(k, marks=pytest.mark.extended) for k in SUBSETS])
def test_same_outputs_with_and_without_hints(engines, kind):
    off, on = engines(kind, False), engines(kind, True)
    for name in SUBSETS[kind]:
        cfg = CONFIGS[name]
        kw = dict(RUN, sampling_params=cfg)
        a, b = off.generate(PROMPTS, **kw), on.generate(PROMPTS, **kw)
        assert a.tokens == b.tokens, name
        assert a.raw.keys() == b.raw.keys()
        for key in a.raw.keys() - {"proposer_state"}:  # every statistic, bit for bit
            np.testing.assert_array_equal(np.asarray(a.raw[key]), np.asarray(b.raw[key]), err_msg=f"{name}: {key}")


def _conditionals(eng, cfg, run=RUN):
    """Conditionals in the compiled program of ``eng`` for the call ``run`` with ``cfg``."""
    txt = eng.lower(PROMPTS, sampling_params=cfg, **run).compile().as_text()
    return len(re.findall(r"\bconditional\(", txt))


@pytest.mark.parametrize("kind", ["token", pytest.param("autoregressive", marks=pytest.mark.extended),
                                  pytest.param("auto", marks=pytest.mark.extended)])
def test_hints_take_the_decided_conds_out_of_the_programs(engines, kind):
    # uniform settings (V = 8: the top-k / top-p slow path, data-dependent, is not compiled):
    # no conditional left in a chain or autoregressive program; mixed rows keep those that
    # depend on which rows are greedy; adaptive K keeps its branch chain (counted with
    # "topk1", no row greedy, every row a point mass: the program the test above ran)
    off, on = engines(kind, False), engines(kind, True)
    names = ("topk1", "mixed") if kind == "auto" else ("greedy", "t1", "filters", "mixed")
    n_off = _conditionals(off, CONFIGS["mixed"])  # without hints one program serves every setting
    n_on = {c: _conditionals(on, CONFIGS[c]) for c in names}
    assert n_off >= 4, (kind, n_off)
    if kind == "auto":
        assert n_on["topk1"] == on.k + 1, n_on  # the chain of K + 1 branches
    else:
        assert all(n_on[c] == 0 for c in names[:-1]), (kind, n_on)
    assert 0 < n_on["mixed"] - n_on[names[0]] < n_off, (kind, n_on, n_off)


def test_dataset_hints_come_from_the_whole_dataset(engines):
    # the first slots' rows are greedy, later ones sampled: hints taken from the first batch
    # alone would draw the later rows as point masses. The dataset (prompt and output
    # buckets, ragged max_new_tokens, the stop token, 4 slots) is test_dataset.py's
    # (_dataset(), test_rows_equal_one_row_runs), so that the run without hints is the
    # programs that test compiles for the same engine (the suite's compilation cache)
    prompts, max_new = _dataset()
    n = len(prompts)
    params = sampling.SamplingParams.create(n, temperature=[0.0] * 4 + [1.0] * (n - 4))
    off, on = engines("token", False), engines("token", True)
    kw = dict(seed=9, sampling_params=params, max_new_tokens=max_new, stop_tokens=[0])
    a = off.generate_dataset(prompts, batch_size=4, **kw)
    b = on.generate_dataset(prompts, batch_size=4, **kw)
    assert a.tokens == b.tokens


@pytest.mark.parametrize("kind", ["token", pytest.param("autoregressive", marks=pytest.mark.extended),
                                  pytest.param("tree", marks=pytest.mark.extended)])
def test_sync_free_settles_mixed_rows_without_conditionals(engines, target, draft, monkeypatch, kind):
    """Mixed greedy and sampled rows leave the greedy-dependent conds undecided by the hints;
    sync-free (``SPECJAX_SYNC_FREE=1``, the GPU form) takes the branch that is exact for every
    row instead (``sampling.settled``): the same tokens and statistics as the conds give,
    and no conditional left in the program (autoregressive, the chain's, the sampled tree's).
    The conditional form's runs are those of the module's engines (the CPU's default form,
    which they were traced with: test_same_outputs_with_and_without_hints compiled them)."""
    import jax

    cfg = CONFIGS["mixed"]
    run = dict(RUN, seed=5)
    monkeypatch.delenv("SPECJAX_SYNC_FREE", raising=False)
    assert not sampling.sync_free()  # the form the module's engines were traced with
    eng = engines(kind, True)
    a, conds = eng.generate(PROMPTS, sampling_params=cfg, **run), _conditionals(eng, cfg, run)
    monkeypatch.setenv("SPECJAX_SYNC_FREE", "1")
    jax.clear_caches()  # the form is read when a program is traced
    eng = _engines(kind, target, draft, True)  # a new engine: its programs traced sync-free
    b, conds_free = eng.generate(PROMPTS, sampling_params=cfg, **run), _conditionals(eng, cfg, run)
    jax.clear_caches()
    assert a.tokens == b.tokens, kind
    for key in a.raw.keys() - {"proposer_state"}:
        np.testing.assert_array_equal(np.asarray(a.raw[key]), np.asarray(b.raw[key]), err_msg=f"{kind}: {key}")
    assert conds_free == 0 < conds, (kind, conds, conds_free)


def test_fixed_cut_gives_the_same_outputs_and_leaves_no_conditional(monkeypatch):
    """A vocabulary past the pipeline's candidates (cut to 16 here) and near-flat logits:
    top-p 0.95 cuts beyond the candidates, so the exact cut is searched for. Found without a conditional
    (``SPECJAX_SYNC_FREE=1``, the GPU form) it gives the conditional's tokens and statistics,
    and with batch hints the chain's and the autoregressive programs keep no conditional
    at all (with the conditional form each keeps one per pipeline pass)."""
    from specjax.models import LlamaLM
    from specjax.models.llama import tiny_config

    import jax

    target = LlamaLM.init(tiny_config(vocab_size=600, n_layers=1), seed=5)
    draft = LlamaLM.init(tiny_config(vocab_size=600, n_layers=1), seed=6)
    cfg = sampling.SamplingConfig(temperature=1.0, top_p=0.95)
    monkeypatch.setattr(sampling, "_CANDIDATES", 16)
    runs, conds = {}, {}
    for fixed in ("0", "1"):
        monkeypatch.setenv("SPECJAX_SYNC_FREE", fixed)
        jax.clear_caches()  # the form is read when a program is traced
        for kind in ("autoregressive", "token"):
            eng = _engines(kind, target, draft, True)
            run = dict(seed=4, max_new_tokens=10)
            runs[fixed, kind] = eng.generate(PROMPTS, sampling_params=cfg, **run)
            conds[fixed, kind] = _conditionals(eng, cfg, run)
    jax.clear_caches()
    for kind in ("autoregressive", "token"):
        a, b = runs["0", kind], runs["1", kind]
        assert a.tokens == b.tokens, kind
        for key in a.raw.keys() - {"proposer_state"}:
            np.testing.assert_array_equal(np.asarray(a.raw[key]), np.asarray(b.raw[key]), err_msg=f"{kind}: {key}")
        assert conds["1", kind] == 0 < conds["0", kind], (kind, conds)
