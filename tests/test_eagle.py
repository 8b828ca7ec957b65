"""EAGLE-style feature drafts through the engine: greedy equality with autoregressive
decoding, the exact law (chi-square over every 4-token continuation), the teacher-forced
unrolled pass against the cached chain the proposer runs, and draft files; EAGLE-1/2 heads
(the target's final hidden states) and EAGLE-3 heads (several layers' hidden states fused,
``feature_layers``) alike."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.eagle import EagleConfig, EagleModel
from specjax.models.llama import LlamaLM, tiny_config
from specjax import build, engine, sampling
from specjax.drafts import EagleProposer, make_proposer
from specjax.drafts.files import load_draft_model, save_draft
from specjax.audit import chi_square_test
from tests.engine_law import exact_chain_law, histogram

ALPHA_SIG = 1e-3


def _head(tgt, seed=1, **kw):
    cfg = EagleConfig.for_target(tgt.config, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32, **kw)
    tm = None
    if cfg.vocab_subset:
        tm = np.random.default_rng(seed).permutation(cfg.vocab_size)[: cfg.vocab_subset]
    return EagleModel.for_target(tgt, cfg, token_map=tm, seed=seed)


# EAGLE-3 heads on the 2-layer tiny targets: the embeddings, after layer 1, after the final norm
EAGLE3 = (1, 0, 2)


@pytest.mark.parametrize("feature_layers", [(), pytest.param((1, 0), marks=pytest.mark.extended)], ids=["eagle", "eagle3"])
def test_unrolled_matches_the_cached_chain(feature_layers):
    """Step j of the training pass at position p == the proposer's chain rooted at p-j+1
    (target features at the root, fused for EAGLE-3; the head's own outputs after it)."""
    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=1, dim=32), seed=5)
    em = _head(tgt, n_layers=2, feature_layers=feature_layers)
    h = jax.random.normal(jax.random.key(0), (2, 12, em.config.feature_dim))
    toks = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    u = jax.jit(lambda p, h, t: em.module(p).unrolled(h, t, 3))(em.params, h, toks)
    step = jax.jit(em.apply)
    for root in (0, 4, 8):
        c = em.init_cache(2, 16)
        out, c = step(em.params, em.fuse(em.params, h[:, : root + 1]), toks[:, : root + 1], c)
        f = out[:, -1:]
        np.testing.assert_allclose(u[0][:, root], f[:, 0], atol=1e-5)
        for j in (2, 3):
            p = root + j - 1
            f, c = step(em.params, f, toks[:, p : p + 1], c)
            np.testing.assert_allclose(u[j - 1][:, p], f[:, 0], atol=1e-5)


# (4, "greedy", 0), 3 prompts of 40 tokens: the program of tests/test_tree_engine.py's EAGLE-1
# chain (its greedy top-1 tree test), compiled once for the suite; keep the two in step
@pytest.mark.parametrize("k, method, subset", [pytest.param(1, "greedy", 0, marks=pytest.mark.extended), (4, "greedy", 0),
                                               (3, "token", 48), pytest.param(5, "block", 0, marks=pytest.mark.extended)])
def test_eagle_greedy_equals_autoregressive(k, method, subset):
    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    em = _head(tgt, vocab_subset=subset)
    prompts = [[3, 9, 27, 17], [5, 1], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6]]
    cfg = sampling.SamplingConfig(temperature=0.0)
    ar = build.generate_autoregressive(tgt, prompts, seed=0, sampling_params=cfg, max_new_tokens=40)
    sp = build.generate(tgt, EagleProposer(em, k), prompts, k=k, method=method, seed=0,
                         sampling_params=cfg, max_new_tokens=40)
    assert sp.tokens == ar.tokens
    assert all(s.drafted == k * s.rounds for s in sp.stats)


V = 8
PROMPT = [1, 5, 2]


@pytest.mark.slow
@pytest.mark.parametrize("layers", [(), EAGLE3], ids=["eagle", "eagle3"])
def test_eagle_engine_law(layers):
    """50k rows (as the other proposers' law tests), K=2, N=4 tokens (>= 2 rounds: rollback
    and true-feature re-feeding are exercised); the head scores a 6-of-8 token subset, so q
    is 0 on two tokens: still exact."""
    tgt = LlamaLM.init(tiny_config(vocab_size=V, n_layers=2), seed=11)
    em = _head(tgt, seed=3, vocab_subset=6, feature_layers=layers)
    k, n, rows, chunk = 2, 4, 50_000, 25_000
    cfg = sampling.SamplingConfig(temperature=1.0)
    law = exact_chain_law(tgt, PROMPT, n, cfg)
    eng = engine.SpeculativeEngine(tgt, EagleProposer(em, k), "token")
    hist = np.zeros(V ** n, np.int64)
    acc = 0
    for start in range(0, rows, chunk):
        out = eng.generate([PROMPT] * chunk, seed=0, row_indices=np.arange(start, start + chunk),
                           sampling_params=cfg, max_new_tokens=n)
        hist += histogram(out.tokens, V, n)
        acc += sum(s.accepted for s in out.stats)
    assert acc > 0
    chi = chi_square_test(hist, law)
    assert chi.p_value > ALPHA_SIG, f"chi-square {chi.statistic:.1f}, p={chi.p_value:.2e}"


@pytest.mark.parametrize("layers", [(), EAGLE3], ids=["eagle", "eagle3"])
def test_draft_file_roundtrip(tmp_path, layers):
    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    em = _head(tgt, vocab_subset=40, feature_layers=layers)
    path = str(tmp_path / "d.npz")
    w = dict(em.trainable_weights(), token_map=em.token_map())
    save_draft(path, "eagle", em.config.to_dict(), w)
    prop = make_proposer(load_draft_model(path, tgt), 3, tgt.vocab_size)
    assert isinstance(prop, EagleProposer)
    assert prop.model.config == em.config and prop.hidden_layers == (layers or None)
    for a, b in zip(jax.tree.leaves(prop.model.params), jax.tree.leaves(em.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = LlamaLM.init(tiny_config(vocab_size=65, n_layers=2, dim=32), seed=5)
    with pytest.raises(ValueError, match="does not fit"):
        load_draft_model(path, other)
    if layers:  # feature layers the target does not have
        shallow = LlamaLM.init(tiny_config(vocab_size=64, n_layers=1, dim=32), seed=5)
        with pytest.raises(ValueError, match="feature_layers"):
            load_draft_model(path, shallow)


def test_eagle3_config():
    cfg = EagleConfig(vocab_size=64, dim=32, feature_layers=[3, 1])
    assert cfg.feature_layers == (3, 1) and cfg.eagle3 and cfg.feature_dim == 64
    assert EagleConfig.from_dict(cfg.to_dict()) == cfg
    assert not EagleConfig(vocab_size=64, dim=32).eagle3  # files written before the field load as EAGLE-1
    for bad in ([1, 1], [-1], "12", [True]):
        with pytest.raises(ValueError, match="feature_layers"):
            EagleConfig(vocab_size=64, dim=32, feature_layers=bad)


def test_default_draft_is_lookup_for_other_targets():
    from specjax.drafts.files import default_draft_for, shipped_draft_path

    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    assert shipped_draft_path(tgt) is None
    assert default_draft_for(tgt) == "lookup"


# ------------------------------------------- draft files that cannot be used


@pytest.fixture()
def draft_file(tmp_path):
    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    em = _head(tgt, vocab_subset=40)
    path = tmp_path / "good.npz"
    save_draft(str(path), "eagle", em.config.to_dict(), dict(em.trainable_weights(), token_map=em.token_map()))
    return tgt, em, path


def test_corrupt_or_foreign_draft_files_are_refused_naming_the_file(draft_file, tmp_path):
    from specjax.drafts.files import DraftFileError, read_draft

    tgt, em, good = draft_file
    data = good.read_bytes()
    cases = {
        "truncated.npz": data[: len(data) // 2],
        "random.npz": np.random.default_rng(0).bytes(5000),
        "empty.npz": b"",
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    np.savez(tmp_path / "nometa.npz", x=np.zeros(3))
    for name in list(cases) + ["nometa.npz", "missing.npz"]:
        path = str(tmp_path / name)
        with pytest.raises(DraftFileError) as e:
            load_draft_model(path, tgt)
        msg = str(e.value)
        assert path in msg and "allow_pickle" not in msg and "\n" not in msg, msg
    # a tensor of the wrong shape is refused at load, not at the first generate
    meta, w = read_draft(str(good), upcast=False)
    w["wq"] = w["wq"][:, :-1]
    save_draft(str(tmp_path / "shape.npz"), "eagle", meta["config"], w)
    with pytest.raises(DraftFileError, match="tensor 'wq' has shape"):
        load_draft_model(str(tmp_path / "shape.npz"), tgt)
    del w["wq"]
    save_draft(str(tmp_path / "lacking.npz"), "eagle", meta["config"], w)
    with pytest.raises(DraftFileError, match=r"missing \['wq'\]"):
        load_draft_model(str(tmp_path / "lacking.npz"), tgt)
    assert isinstance(load_draft_model(str(good), tgt), EagleModel)  # the good file still loads


def test_a_missing_shipped_draft_falls_back_to_prompt_lookup(monkeypatch):
    from specjax.drafts import files

    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32, name="shipped-test"), seed=5)
    monkeypatch.setitem(files.SHIPPED, "shipped-test", "no-such-draft.npz")
    with pytest.warns(UserWarning, match="no-such-draft.npz is missing"):
        assert files.default_draft_for(tgt) == "lookup"


@pytest.mark.parametrize("kernels, layers", [("kernel", ()), pytest.param("xla", (), marks=pytest.mark.extended),
                                             pytest.param("kernel", (1, 0), marks=pytest.mark.extended), pytest.param("xla", (1, 0), marks=pytest.mark.extended)],
                         ids=["kernel", "xla", "kernel-eagle3", "xla-eagle3"])
def test_tree_call_node_equals_its_path_alone(kernels, layers, monkeypatch):
    """EagleHead.tree_call (the attention kernel with a tree mask, or XLA's): each node's
    output equals feeding its path's pairs one after the other from the same prefix."""
    import specjax.models.eagle as eagle_mod
    from specjax.models.base import TreeAttention
    from specjax.tree import ancestor_mask

    if kernels == "xla":
        monkeypatch.setattr(eagle_mod, "use_attention", lambda *a: False)
    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=1, dim=32), seed=5)
    em = _head(tgt, feature_layers=layers)
    b, d = 2, 32
    h = em.fuse(em.params, jax.random.normal(jax.random.key(0), (b, 6, em.config.feature_dim)))
    toks = jax.random.randint(jax.random.key(1), (b, 6), 0, 64)
    parent = np.array([-1, -1, 0, 0, 1, 2])
    depth = np.array([1, 1, 2, 2, 2, 3])
    nf = jax.random.normal(jax.random.key(2), (b, 6, d))
    nt = jax.random.randint(jax.random.key(3), (b, 6), 0, 64)
    # the head's own cached steps, compiled (2 programs: the 6-pair prefix, a 1-pair step)
    # rather than op by op (~130 small compiles a case)
    step = jax.jit(em.apply)
    _, prefix = step(em.params, h, toks, em.init_cache(b, 32))
    mask = np.asarray(ancestor_mask(parent))
    attn = TreeAttention.dense(np.broadcast_to(depth - 1, (b, 6)), mask)
    out, _ = jax.jit(lambda p, f, t, c: em.module(p).tree_call(f, t, c, attn))(em.params, nf, nt, prefix)
    for i in range(6):
        path = [j for j in range(6) if mask[i, j]]
        f, c = None, prefix
        for j in path:
            f, c = step(em.params, nf[:, j:j + 1], nt[:, j:j + 1], c)
        np.testing.assert_allclose(np.asarray(out[:, i]), np.asarray(f[:, 0]), atol=2e-5)
