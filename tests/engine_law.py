"""Exact chain law of a model, by enumeration, and Monte Carlo checks of the engine.

Used by the full-engine exactness tests: the law of the first N generated tokens under
the target's processed sampling law, enumerated over all V**N continuations.
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from specjax import audit, sampling


@functools.partial(jax.jit, static_argnums=0)
def _logits(apply, params, seqs, cache):
    return apply(params, seqs, cache).logits


# the enumeration runs every continuation through the model and the sampling pipeline:
# compiled, one program each, instead of op by op (hundreds of small compiles per shape)
_process = jax.jit(sampling.process_logits)


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
    logits = _logits(model.apply, model.params, jnp.asarray(seqs), cache)[:, p - 1:, :]  # [M, n, V]
    # history counts at each position (prompt + the continuation so far)
    base = np.bincount(prompt, minlength=v)
    counts = np.zeros((m, n, v), np.int32)
    counts[:] = base
    for i in range(1, n):
        for j in range(i, n):
            counts[np.arange(m), j, prefixes[:, i - 1]] += 1
    params = cfg.to_params(m)
    params = jax.tree.map(lambda a: jnp.broadcast_to(a[:, None], (m, n)), params)
    lp = np.asarray(_process(logits, params, counts=jnp.asarray(counts)), np.float64)
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


def exact_controlled_law(model, prompt, n: int, cfg: sampling.SamplingConfig, stop: int,
                         **controls) -> np.ndarray:
    """As :func:`exact_chain_law` with generation controls (``specjax.sampling.make_controls``
    arguments) and a stop token that ends the generation: the law of the N-token outcome
    where every position after the first ``stop`` is 0 (see :func:`pad_after_stop`).

    Each full sequence is weighted by the product of its per-position probabilities (past a
    stop the factors are the model's continuation, which sums to 1 over the tail), then
    mapped to its outcome, so outcome probabilities are prefix probabilities up to the stop."""
    v = model.vocab_size
    prompt = np.asarray(prompt, np.int32)
    p = prompt.size
    seqs_all = np.array(list(itertools.product(range(v), repeat=n)), np.int32)  # [V^n, n]
    m = seqs_all.shape[0]
    seqs = np.concatenate([np.tile(prompt, (m, 1)), seqs_all[:, :-1]], axis=1)
    cache = model.init_cache(m, seqs.shape[1] + 1)
    logits = _logits(model.apply, model.params, jnp.asarray(seqs), cache)[:, p - 1:, :]  # [M, n, V]
    ctl = sampling.make_controls(m, v, stop_tokens=[stop], **{
        k: (np.broadcast_to(np.asarray(a), (m,) + np.shape(a)) if k == "min_new_tokens" else a)
        for k, a in controls.items()})
    params = jax.tree.map(lambda a: jnp.broadcast_to(a[:, None], (m, n)), cfg.to_params(m))
    gen_index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (m, n))
    lp = np.asarray(_process(logits, params, allowed=ctl.allowed_at(gen_index), bias=ctl.bias_at(3)),
                    np.float64)
    with np.errstate(invalid="ignore"):
        logp = sum(lp[np.arange(m), i, seqs_all[:, i]] for i in range(n))
    w = np.exp(logp)
    idx = audit.sequence_index(pad_after_stop(seqs_all, stop, n), v)
    return np.bincount(idx, weights=w, minlength=v ** n)


def pad_after_stop(rows, stop: int, n: int) -> np.ndarray:
    """[R, n] int array from token lists: positions after each row's first ``stop`` (and
    past its end) are 0."""
    out = np.zeros((len(rows), n), np.int64)
    for r, row in enumerate(rows):
        row = list(row)[:n]
        if stop in row:
            row = row[: row.index(stop) + 1]
        out[r, : len(row)] = row
    return out
