"""Exact chain law of a model, by enumeration, and Monte Carlo checks of the engine.

Used by the full-engine exactness tests: the law of the first N generated tokens under
the target's processed sampling law, enumerated over all V**N continuations.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from specjax import audit, sampling


def exact_chain_law(model, prompt, n: int, cfg: sampling.SamplingConfig) -> np.ndarray:
    """float64 probabilities of every N-token continuation of ``prompt``, flattened
    (token i of the continuation is digit i, most significant first, base V)."""
    v = model.vocab_size
    prompt = np.asarray(prompt, np.int32)
    p = prompt.size
    prefixes = np.array(list(itertools.product(range(v), repeat=n - 1)), np.int32).reshape(-1, n - 1)
    m = prefixes.shape[0]
    seqs = np.concatenate([np.tile(prompt, (m, 1)), prefixes], axis=1)
    cache = model.init_cache(m, seqs.shape[1] + 1)
    logits = model.apply(model.params, jnp.asarray(seqs), cache).logits[:, p - 1:, :]  # [M, n, V]
    # history counts at each position (prompt + the continuation so far)
    base = np.bincount(prompt, minlength=v)
    counts = np.zeros((m, n, v), np.int32)
    counts[:] = base
    for i in range(1, n):
        for j in range(i, n):
            counts[np.arange(m), j, prefixes[:, i - 1]] += 1
    params = cfg.to_params(m)
    params = jax.tree.map(lambda a: jnp.broadcast_to(a[:, None], (m, n)), params)
    lp = np.asarray(sampling.process_logits(logits, params, counts=jnp.asarray(counts)), np.float64)
    pre = np.zeros(m)
    for i in range(n - 1):
        pre += lp[np.arange(m), i, prefixes[:, i]]
    logp = pre[:, None] + lp[:, n - 1, :]  # [M, V]
    law = np.exp(logp).reshape(-1)
    return law


def histogram(tokens, v: int, n: int) -> np.ndarray:
    """Counts of each N-token outcome, indexed like :func:`exact_chain_law`."""
    idx = audit.sequence_index(np.asarray(tokens, np.int64)[:, :n], v)
    return np.bincount(idx, minlength=v ** n)
