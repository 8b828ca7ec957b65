"""Draft trees through the engine: the exact law of whole generations (chi-square against
the target's chain law, several rounds with rollback) for a tree grown by a tiny draft
model and for SAMPLED trees grown by an EAGLE head (without-replacement candidates from a
reduced-vocabulary EAGLE-3 head, which reads several of the target's layers along the
accepted path, into a full tree; an EAGLE-1 head's without-replacement candidates into a
tree shaped as it grows, and its i.i.d. candidates into the irregular positional tree), mutants the law test rejects (a wrong tree mask,
the accepted path's KV left where it was, siblings drawn without replacement but verified
as i.i.d.), greedy trees equal autoregressive greedy decoding, a chain as a tree draws
what the chain verifier draws, streaming and batch invariance."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import engine, sampling
from specjax.audit import chi_square_test
from specjax.drafts import DraftModelProposer, EagleProposer
from specjax.drafts.trees import DraftModelTreeProposer, EagleTreeProposer
from specjax.models.eagle import EagleConfig, EagleModel
from specjax.models.llama import LlamaLM, tiny_config
from tests.engine_law import exact_chain_law, histogram

V = 8
PROMPT = [1, 5, 2]
N_TOK = 4  # a tree round emits at most depth + 1 = 3 tokens: at least two rounds
ROWS = 20_000
ALPHA_SIG = 1e-3
# penalties: the target's law at a node depends on the node's path (its ancestors' tokens)
CFG = sampling.SamplingConfig(temperature=0.9, repetition_penalty=1.8, presence_penalty=0.7)


@pytest.fixture(scope="module")
def law(target):
    law = exact_chain_law(target, PROMPT, N_TOK, CFG)
    assert abs(law.sum() - 1) < 1e-5
    return law


def _tree(draft):
    return DraftModelTreeProposer(model=draft, topk=2, depth=2, nodes=4)


def _eagle(target, subset=0, layers=(), seed=3):
    cfg = EagleConfig.for_target(target.config, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32,
                                 vocab_subset=subset, feature_layers=layers)
    tm = np.array([0, 2, 3, 5, 6, 7]) if subset else None
    return EagleModel.for_target(target, cfg, token_map=tm, seed=seed)


@dataclasses.dataclass(frozen=True, eq=False)
class _DrawnWithoutReplacementVerifiedIid(EagleTreeProposer):
    """Siblings drawn without replacement, verified with the i.i.d. rule."""

    def draw_rule(self):
        return "without_replacement"


def _sampled(target, variant):
    if variant == "eagle3_without_replacement_subset":  # the embeddings, after layer 1, the final norm
        return EagleTreeProposer(model=_eagle(target, 6, (1, 0, 2)), candidates="without_replacement",
                                 branching=(3, 2))
    if variant == "eagle_dynamic_without_replacement":  # shaped as it grows: 2, then 3 of 6 drawn
        return EagleTreeProposer(model=_eagle(target), candidates="without_replacement", widths=(2, 3))
    if variant == "eagle_positional_iid":  # a fixed irregular shape (3, 3, 1 nodes per level)
        return EagleTreeProposer(model=_eagle(target), candidates="iid", sampled_nodes=7)
    return _DrawnWithoutReplacementVerifiedIid(model=_eagle(target), candidates="iid", branching=(3, 1))


class _CausalTreeMask(engine.SpeculativeEngine):
    """Every node attends to every earlier node (a chain's mask), not to its ancestors only."""

    @staticmethod
    def tree_mask(tree, max_depth=None):
        n = tree.parent.shape[1]
        return jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), tree.parent.shape + (n,))


class _PathNotMoved(engine.SpeculativeEngine):
    """The accepted path's KV stays at the nodes' slots: the next round reads stale KV."""

    @staticmethod
    def accepted_path_cache(cache, start, path, num):
        return cache


def _hist(eng):
    out = eng.generate([PROMPT] * ROWS, seed=0, row_indices=np.arange(ROWS), sampling_params=CFG,
                       max_new_tokens=N_TOK)
    toks = np.array(out.tokens)
    assert toks.shape == (ROWS, N_TOK)
    return histogram(toks, V, N_TOK), out.stats


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tree", "tree_mutant_causal_mask", "tree_mutant_path_not_moved",
                                     "eagle3_without_replacement_subset",
                                     "eagle_dynamic_without_replacement", "eagle_positional_iid",
                                     "eagle_mutant_without_replacement_as_iid"])
def test_tree_engine_law(target, draft, law, variant):
    if variant.startswith("eagle"):
        eng = engine.SpeculativeEngine(target, _sampled(target, variant), "tree")
    else:
        cls = {"tree": engine.SpeculativeEngine, "tree_mutant_causal_mask": _CausalTreeMask,
               "tree_mutant_path_not_moved": _PathNotMoved}[variant]
        eng = cls(target, _tree(draft), "tree")
    hist, stats = _hist(eng)
    chi = chi_square_test(hist, law)
    print(f"{variant}: chi-square {chi.statistic:.1f}, p={chi.p_value:.3e}")
    if "mutant" not in variant:
        # the tree did its work: paths of depth 2 were accepted, not only first children
        assert np.mean([s.accepted / s.rounds for s in stats[:500]]) > 0.3
        assert chi.p_value > ALPHA_SIG, f"chi-square {chi.statistic:.1f}, p={chi.p_value:.2e}"
    else:
        assert chi.p_value < ALPHA_SIG, f"mutant passed: chi-square {chi.statistic:.1f}, p={chi.p_value:.2e}"


PROMPTS = [[1, 2, 3], [6, 5, 4, 3, 2, 1, 0, 7, 7, 1], [2, 2]]


@pytest.fixture(scope="module")
def big():
    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32, sliding_window=5,
                                   layer_types=("sliding", "full"), attn_chunk=4), seed=5)
    drf = LlamaLM.init(tiny_config(vocab_size=64, n_layers=1, dim=32), seed=6)
    return tgt, drf


def test_greedy_tree_equals_autoregressive(big):
    tgt, drf = big
    ar = engine.AutoregressiveEngine(tgt).generate(PROMPTS, seed=0, greedy=True, max_new_tokens=30)
    prop = DraftModelTreeProposer(model=drf, topk=3, depth=3, nodes=8)
    sp = engine.SpeculativeEngine(tgt, prop, "greedy").generate(PROMPTS, seed=0, max_new_tokens=30)
    assert sp.tokens == ar.tokens
    assert sum(s.accepted for s in sp.stats) > 0


def test_chain_as_tree_draws_what_the_chain_verifier_draws(big):
    tgt, drf = big
    kw = dict(seed=4, max_new_tokens=20, sampling_params=sampling.SamplingConfig(temperature=1.0))
    chain = engine.SpeculativeEngine(tgt, DraftModelProposer(drf, 3), "token").generate(PROMPTS, **kw)
    tree = engine.SpeculativeEngine(tgt, DraftModelProposer(drf, 3), "tree").generate(PROMPTS, **kw)
    assert tree.tokens == chain.tokens
    assert [s.rounds for s in tree.stats] == [s.rounds for s in chain.stats]


def test_tree_rows_independent_of_batch(big):
    # (streaming runs the same rounds for any method: tests/test_engine.py streams chains)
    tgt, drf = big
    eng = engine.SpeculativeEngine(tgt, DraftModelTreeProposer(model=drf, topk=2, depth=3, nodes=6), "tree")
    cfg = sampling.SamplingParams.create(3, temperature=[1.0, 0.7, 0.0], top_p=[1.0, 0.9, 1.0])
    kw = dict(seed=42, max_new_tokens=[20, 14, 17], stop_tokens=[9])
    batch = eng.generate(PROMPTS, row_indices=[10, 11, 12], sampling_params=cfg, **kw)
    for i in range(3):
        one = sampling.SamplingParams.create(1, temperature=[float(cfg.temperature[i])],
                                             top_p=[float(cfg.top_p[i])])
        alone = eng.generate([PROMPTS[i]], row_indices=[10 + i], sampling_params=one,
                             **dict(kw, max_new_tokens=kw["max_new_tokens"][i]))
        assert alone.tokens[0] == batch.tokens[i], f"row {i} changed with its batch"


# The 64-token target and its EAGLE-1 head of the tests below (and of tests/test_eagle.py's
# greedy test: the same models, so the same programs): one pair for the module, so that
# build.make_engine's memo hands the tests one engine for the default tree.
@pytest.fixture(scope="module")
def eagle_pair():
    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    return tgt, _eagle(tgt, seed=1)


# greedy runs of 40 tokens, and K = 4, as tests/test_eagle.py's greedy test (k=4, method
# "greedy", 3 prompts of at most 10 tokens): the EAGLE-1 chain below is that test's program,
# compiled once for the suite (the persistent compilation cache)
EAGLE_K, EAGLE_NEW = 4, 40


@pytest.mark.parametrize("layers", [(), pytest.param((1, 2, 0), marks=pytest.mark.extended)], ids=["eagle", "eagle3"])
def test_eagle_tree_greedy_and_top1_tree_continues_like_the_chain(eagle_pair, layers):
    """A top-1 EAGLE tree is the head's greedy chain: the same rounds as the chain proposer
    (the head continues from the target's features along the accepted path; ``eagle3``: the
    hidden states of several layers, gathered along the path)."""
    from specjax import build

    tgt, em = eagle_pair
    if layers:
        em = _eagle(tgt, layers=layers, seed=1)
    cfg = sampling.SamplingConfig(temperature=0.0)
    kw = dict(seed=0, sampling_params=cfg, max_new_tokens=EAGLE_NEW)
    chain = engine.SpeculativeEngine(tgt, EagleProposer(em, EAGLE_K), "greedy").generate(PROMPTS, **kw)
    top1 = engine.SpeculativeEngine(tgt, EagleTreeProposer(model=em, topk=1, depth=EAGLE_K, nodes=EAGLE_K),
                                    "greedy").generate(PROMPTS, **kw)
    assert chain.tokens == top1.tokens  # the chain's are the autoregressive ones
    assert [s.rounds for s in top1.stats] == [s.rounds for s in chain.stats]
    if layers:
        return  # the rest is about the tree proposer, not the head
    # a sampled-tree proposer in a greedy call grows the top-k tree, verified by the
    # argmax (the engine's point-mass fast path) under method "tree": the default tree
    # (build.TreeSpec(): top-3, depth 3, 6 nodes; 2x1x1 drawn without replacement), whose
    # engine and program test_sync_free_descent_gives_the_same_generations runs again
    out = build.make_engine(tgt, em, method="tree").generate(PROMPTS, **kw)
    assert out.tokens == chain.tokens
    assert sum(s.accepted for s in out.stats) > 0


@pytest.mark.extended
def test_sampled_tree_dataset_rows_equal_one_row_runs(eagle_pair):
    """Continuous batching with a sampled EAGLE tree (T=1, ragged lengths, a stop token):
    every prompt's tokens are those of its one-row run with the same dataset index."""
    from specjax import build

    tgt, em = eagle_pair
    eng = build.make_engine(tgt, em, method="tree")
    prompts = PROMPTS + [[9, 8], [4, 4, 4, 4]]
    kw = dict(seed=0, stop_tokens=[63], sampling_params=sampling.SamplingConfig(temperature=1.0))
    max_new = [5, 20, 9, 14, 3]
    out = eng.generate_dataset(prompts, batch_size=2, max_new_tokens=max_new, **kw)
    assert out.raw["inserts"] == 3
    for i, p in enumerate(prompts):
        one = eng.generate([p], row_indices=[i], max_new_tokens=max_new[i], **kw)
        assert one.tokens[0] == out.tokens[i], f"prompt {i}"


@pytest.mark.extended
def test_sync_free_descent_gives_the_same_generations(eagle_pair, monkeypatch):
    """The default sampled EAGLE tree (2x1x1) at T=1: the descent as a loop of the
    proposer's ``max_tries`` steps (4 of its 6 nodes; the GPU form,
    ``SPECJAX_SYNC_FREE=1``) gives the ``while`` form's tokens and statistics, bit for bit.
    (The ``while`` form's program is that of the greedy test's default tree above: the
    same shapes, 3 rows of 40 tokens; read back from the persistent compilation cache.)"""
    import jax

    from specjax import build

    tgt, em = eagle_pair
    tree = build.TreeSpec()
    kw = dict(seed=2, max_new_tokens=EAGLE_NEW, sampling_params=sampling.SamplingConfig(temperature=1.0))
    runs = {}
    for free in ("0", "1"):
        monkeypatch.setenv("SPECJAX_SYNC_FREE", free)
        jax.clear_caches()  # the form is read when a program is traced: new engines
        build.clear_engines()
        eng = build.make_engine(tgt, em, method="tree", tree=tree)
        assert eng.proposer.max_tries < eng.proposer.tree_nodes
        runs[free] = eng.generate(PROMPTS, **kw)
    jax.clear_caches()
    build.clear_engines()
    a, b = runs["0"], runs["1"]
    assert a.tokens == b.tokens
    assert sum(s.accepted for s in a.stats) > 0
    for key in a.raw.keys() - {"proposer_state"}:
        np.testing.assert_array_equal(np.asarray(a.raw[key]), np.asarray(b.raw[key]), err_msg=key)
