"""Caches are updated in place and no weights are copied per step: read from the compiled
programs' memory analysis (``temp_size_in_bytes``: what a program allocates besides its
inputs and outputs). A copy of a KV cache inside the decode loop (a select between the old
and the new cache, a conditional that copies its operands) needs a cache-sized temporary;
so does a scanned layer whose weights are sliced out of the stacked parameters (one layer's
weights). The same JAX code runs on GPU/TPU, where such copies cost HBM bandwidth; the
device check there is ``scripts/bench_step.py``, which prints the same figure."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import engine
from specjax.drafts import DraftModelProposer
from specjax.models.llama import LlamaLM, tiny_config

# a cache that dwarfs everything else the program holds: 2 layers x 4 rows x 2 kv heads x
# ~1100 slots x 8 floats, K and V
MAX_NEW = 1000
PROMPTS = [[1, 2, 3], [4, 5], [6, 6, 6, 1], [2, 7]]


def _cache_bytes(model, batch: int, k: int = 0) -> int:
    c = model.config
    S = engine.cache_len_for(16, MAX_NEW, k)
    return 2 * c.n_layers * batch * c.n_kv_heads * S * c.head_dim * np.dtype(c.compute_dtype).itemsize


def _temp(lowered) -> int:
    return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config(vocab_size=64, n_layers=2, dim=32, ffn_dim=64, attn_chunk=256)
    target = LlamaLM.init(cfg, seed=0)
    draft = LlamaLM.init(cfg.replace(n_layers=1), seed=1)
    return target, draft


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_autoregressive_program_updates_the_cache_in_place(models, scan):
    target = models[0].with_config(scan_layers=scan, cpu_kernels="xla")
    eng = engine.AutoregressiveEngine(target)
    size = _cache_bytes(target, len(PROMPTS))
    extra = _temp(eng.lower(PROMPTS, seed=0, max_new_tokens=MAX_NEW)) - size  # the cache is the program's own
    # what is left: one copy of a zero-filled K or V tensor made once before the prefill
    # (XLA merges the two zero fills), small arrays; a copy in the loop would add a cache
    assert extra < size, (extra, size)


@pytest.mark.parametrize("always_drafts", [True, False], ids=["drafts", "mutant_conditional_step"])
def test_speculative_program_updates_both_caches_in_place(models, always_drafts):
    """The default: a draft model always drafts, so the target's step is not wrapped in the
    'no row drafted anything' conditional. With the conditional (what prompt lookup keeps,
    as it saves whole steps there) the loop copies the target's cache: the measure sees it."""
    import dataclasses

    target, draft = (m.with_config(cpu_kernels="xla") for m in models)
    prop = dataclasses.replace(DraftModelProposer(draft, 3), always_drafts=always_drafts)
    eng = engine.SpeculativeEngine(target, prop, "token")
    sizes = _cache_bytes(target, len(PROMPTS), 3), _cache_bytes(draft, len(PROMPTS), 3)
    extra = _temp(eng.lower(PROMPTS, seed=0, max_new_tokens=MAX_NEW)) - sum(sizes)
    # a copy of either cache (the draft's is the smaller) would add at least its size
    assert (extra < min(sizes) / 2) is always_drafts, (extra, sizes)


def test_the_measure_sees_a_copied_cache(models):
    """Mutant: a decode loop that selects between the old and the new cache (both alive, so
    the update cannot be in place) needs a cache-sized temporary; the plain loop does not."""
    target = models[0].with_config(cpu_kernels="xla")
    B, S = len(PROMPTS), 2048

    def decode(p, c, tok, select):
        def body(i, s):
            c, tok = s
            new = target.apply(p, tok[:, None], c).cache
            if select:
                new = jax.tree.map(lambda a, b: jnp.where(tok[0] >= 0, a, b), new, c)
            return new, tok
        return jax.lax.fori_loop(0, 8, body, (c, tok))

    cache = target.init_cache(B, S)
    size = cache.k.nbytes + cache.v.nbytes
    temps = [_temp(jax.jit(decode, donate_argnums=(1,), static_argnums=3).lower(
        target.params, cache, jnp.zeros((B,), jnp.int32), sel)) for sel in (False, True)]
    assert temps[0] < size / 4 and temps[1] >= size, temps


def test_scanned_layers_copy_no_weights_per_step():
    """A scanned layer's weights are read in place by the CPU kernel; with XLA's ops (what a
    GPU gets, unless XLA fuses the slice into the matmul) the decode loop copies one layer's
    weights out of the stack on every layer of every step, which the measure sees."""
    cfg = tiny_config(vocab_size=128, n_layers=3, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                      scan_layers=True)
    lm = LlamaLM.init(cfg, seed=0)
    layer = sum(x.nbytes for x in jax.tree.leaves(lm.params["layers"])) // cfg.n_layers

    def decode(m):
        def run(p, c, tok):
            def body(i, s):
                c, tok = s
                out = m.apply(p, tok[:, None], c)
                return out.cache, out.logits[:, -1].argmax(-1).astype(jnp.int32)
            return jax.lax.fori_loop(0, 4, body, (c, tok))
        return _temp(jax.jit(run, donate_argnums=(1,)).lower(m.params, m.init_cache(1, 32), jnp.zeros((1,), jnp.int32)))

    assert decode(lm) < layer / 4
    assert decode(lm.with_config(cpu_kernels="xla")) >= layer


@pytest.mark.parametrize("branches", ["conds", "mutant_switch"])
def test_adaptive_program_updates_both_caches_in_place(models, branches, monkeypatch):
    """k="auto" runs one inner loop of rounds per draft length j. As a chain of two-way
    conds they update the caches in place; as one ``lax.switch`` (the mutant, what the
    engine did before) XLA copies every operand, both caches included, on every switch,
    into temporaries allocated on every call."""
    target, draft = (m.with_config(cpu_kernels="xla") for m in models)
    eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, 2), "token", adaptive=True)
    eng.set_costs(len(PROMPTS), [1.0, 1.2, 1.4])  # K = 2: three branches (two conds)
    if branches == "mutant_switch":
        monkeypatch.setattr(engine, "_run_branch", lambda i, fns, c: jax.lax.switch(i, fns, c))
    sizes = _cache_bytes(target, len(PROMPTS), 2), _cache_bytes(draft, len(PROMPTS), 2)
    extra = _temp(eng.lower(PROMPTS, seed=0, max_new_tokens=MAX_NEW)) - sum(sizes)
    assert (extra < min(sizes) / 2) is (branches == "conds"), (extra, sizes)
