"""Bitwise batch invariance on CPU (default ``cpu_kernels="auto"``, float32): a row's logits,
and a whole generation's tokens and float statistics, are bit-identical whether the row
runs alone or inside a batch of any size, with ragged cache lengths. ``np.array_equal``,
never ``allclose``: a token can flip when two logits are within float32 rounding."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import engine, sampling
from specjax.drafts import DraftModelProposer
from specjax.models import cpu_kernels as ck
from specjax.models.base import KVCache
from specjax.models.llama import LlamaLM, expected_shapes, tiny_config

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu" or jax.device_count() != 1,
                       reason="the bitwise guarantee is for the single-device CPU backend"),
    pytest.mark.skipif(ck.compiler() is None, reason="no C++ compiler to build the CPU kernels"),
]

BATCHES = (1, 2, 3, 5, 8, 13, 16, 17, 24, 32)
BMAX = max(BATCHES)
S = 48  # cache slots


def _init(cfg, seed):
    """LlamaLM with numpy-drawn weights (LlamaLM.init's jax.random draws compile per shape)."""
    rng = np.random.default_rng(seed)
    w = {k: (1.0 + 0.1 * rng.standard_normal(s) if k.endswith("norm") else
             rng.standard_normal(s) / (1.0 if k == "embed" else np.sqrt(s[-1]))).astype(np.float32)
         for k, s in expected_shapes(cfg).items()}
    return LlamaLM.from_weights(cfg, w)


@pytest.fixture(scope="module")
def model():
    # vocab 200 and dim 48: neither a multiple of the kernel's 64-column unit; 2 layers, GQA
    cfg = tiny_config(vocab_size=200, n_layers=2, dim=48, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96)
    assert cfg.cpu_kernels == "auto"
    return _init(cfg, 3)


@pytest.fixture(scope="module")
def rows(model):
    """Per-row cache contents, ragged lengths (0..S-9) and tokens for BMAX rows."""
    c = model.config
    rng = np.random.default_rng(0)
    shape = (c.n_layers, BMAX, c.n_kv_heads, S, c.head_dim)
    return dict(k=rng.standard_normal(shape, np.float32), v=rng.standard_normal(shape, np.float32),
                lengths=rng.integers(0, S - 8, BMAX).astype(np.int32),
                tokens=rng.integers(0, c.vocab_size, (BMAX, 8)).astype(np.int32))


@pytest.mark.parametrize("t", [1, 4], ids=["decode_1_token", "verify_4_tokens"])
def test_row_logits_bit_identical_for_every_batch_size(model, rows, t):
    """The last-position (and every-position) logits of row r: alone == inside a batch of B
    rows, for B from 1 to 32 (B * t crosses the kernel's small-M limit of 64 rows)."""
    fwd = jax.jit(lambda p, tok, c: model.apply(p, tok, c).logits)

    def run(idx):
        cache = KVCache(k=jnp.asarray(rows["k"][:, idx]), v=jnp.asarray(rows["v"][:, idx]),
                        lengths=jnp.asarray(rows["lengths"][idx]))
        return np.asarray(fwd(model.params, jnp.asarray(rows["tokens"][idx, :t]), cache))

    alone = [run([r])[0] for r in range(BMAX)]
    for b in BATCHES:
        out = run(list(range(b)))
        bad = [r for r in range(b) if not np.array_equal(out[r], alone[r])]
        assert not bad, (f"B={b}, {t} token(s): rows {bad} differ from their 1-row results by up to "
                         f"{max(np.abs(out[r] - alone[r]).max() for r in bad):.3g}")
    # and in another order: row r at another index of the batch
    perm = np.random.default_rng(1).permutation(BMAX)
    out = run(list(perm))
    assert all(np.array_equal(out[i], alone[r]) for i, r in enumerate(perm))


def test_prefill_bit_identical_for_any_batch_and_prompt_buffer(model, rows):
    """A prompt's forward (prefill): the logits at its real positions are the same alone in a
    16-token buffer and inside a batch of 13 rows padded to 32 tokens (M = 416 rows in each
    matmul)."""
    fwd = jax.jit(lambda p, tok: model.apply(p, tok, model.init_cache(tok.shape[0], S)).logits)
    rng = np.random.default_rng(2)
    lens = rng.integers(1, 17, 13)
    tok = rng.integers(0, model.config.vocab_size, (13, 32)).astype(np.int32)
    batch = np.asarray(fwd(model.params, jnp.asarray(tok)))
    for r, n in enumerate(lens):
        alone = np.asarray(fwd(model.params, jnp.asarray(tok[r:r + 1, :16])))[0]
        assert np.array_equal(alone[:n], batch[r, :n]), f"row {r}"


@pytest.fixture(scope="module")
def spec_engine():
    tgt = _init(tiny_config(vocab_size=200, n_layers=1, dim=48, ffn_dim=96), 5)
    dft = _init(tiny_config(vocab_size=200, n_layers=1, dim=32), 6)
    # always_drafts: one conditional fewer to compile (speed only: test_engine.py)
    return engine.SpeculativeEngine(tgt, dataclasses.replace(DraftModelProposer(dft, 3), always_drafts=True),
                                    "token")


def _prompts(n):
    rng = np.random.default_rng(7)
    # lengths 2..16: one prompt buffer (16 tokens) alone and in a batch, so the engine compiles
    # three programs (B = 1, 8, 17); prompt buffers of other lengths: test_prefill_...
    return [rng.integers(0, 200, int(rng.integers(2, 17))).tolist() for _ in range(n)]


def _params(n):
    temps = [0.0, 1.0, 0.7, 1.3]
    top_p = [1.0, 1.0, 0.9, 0.8]
    return [(temps[i % 4], top_p[i % 4]) for i in range(n)]


@pytest.mark.parametrize("b", [8, 17])
def test_generation_bit_identical_alone_and_in_a_batch(spec_engine, b):
    """Whole speculative generations (prefill, draft, verify, sample): each row's tokens and
    statistics (mean_alpha and every other float) are identical alone and in a batch."""
    prompts, params = _prompts(b), _params(b)
    sp = sampling.SamplingParams.create(b, temperature=[t for t, _ in params], top_p=[p for _, p in params])
    kw = dict(seed=42, max_new_tokens=12)
    batch = spec_engine.generate(prompts, row_indices=list(range(b)), sampling_params=sp, **kw)
    for r in sorted({0, 1, 2, 3, b - 1}):
        one = sampling.SamplingParams.create(1, temperature=[params[r][0]], top_p=[params[r][1]])
        alone = spec_engine.generate([prompts[r]], row_indices=[r], sampling_params=one, **kw)
        assert alone.tokens[0] == batch.tokens[r], f"row {r}: tokens changed with the batch"
        assert dataclasses.asdict(alone.stats[0]) == dataclasses.asdict(batch.stats[r]), (
            f"row {r}: statistics changed with the batch")
