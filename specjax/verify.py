"""Verification of one block of draft tokens, for ONE row (``jax.vmap`` over a batch).

Notation: K draft tokens ``x_1..x_K`` (``draft_tokens[i-1]``); ``q_i`` = draft law and
``p_i`` = target law at draft position i (``draft_logprobs[i-1]``,
``target_logprobs[i-1]``); ``p_{K+1}`` = ``target_logprobs[K]``, the law after the whole
block.  Inputs are processed, normalized log-probs (e.g. from
:func:`specjax.sampling.process_logits`, the SAME pipeline for draft and target).
Only the first ``num_draft`` draft positions are real: everything is computed exactly
as if K were ``num_draft``.

Samplers (the exactness contract: the emitted tokens follow the target's law):

* :func:`token_verify`: accept ``x_i`` w.p. ``min(1, p_i(x_i) / q_i(x_i))`` (in float32
  log space: accept iff ``log u < log p - log q``); at the first rejection emit a draw
  from the normalized residual ``max(0, p_i - q_i)``; if all are accepted emit a bonus
  draw from ``p_{K+1}``.
* :func:`block_verify` (Sun et al., "Block Verification Accelerates Speculative
  Decoding", ICLR 2025): ``w_0 = 1``, ``w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))``;
  ``h_i = r_i / (r_i + 1 - w_i)`` with ``r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x))``
  for ``i < K`` and ``h_K = w_K``; ``tau`` = the largest i with ``eta_i <= h_i`` (0 if
  none); emit ``x_1..x_tau`` and then a draw from ``p_{K+1}`` if ``tau = K``, else from
  the normalized ``max(0, w_tau p_{tau+1} - q_{tau+1})``.  ``0/0`` in ``h_i`` (only when
  ``w_i = 1`` and ``r_i = 0``) is taken as 1, the limit of ``h_i`` at ``w_i = 1``.

Contract for numerics: a residual that is zero everywhere (``p == q`` up to rounding,
an event of probability zero in exact arithmetic) falls back to the target ``p`` at that
position, so no NaN and no out-of-vocabulary id can come out; a token with target
probability 0 is never emitted; NaN or +inf in a used row, a used row with no finite
entry, a used row with an entry > 1e-3 (not log-probs: e.g. raw logits passed by
mistake), a real draft token outside ``[0, V)`` or with ``q = 0``, or ``num_draft``
outside ``[0, K]`` set ``error`` (tokens all ``PAD_ID``, 0 accepted).  Rows are
trusted to be normalized (checking that would cost a logsumexp per row).

The LAW of each sampler is computed by the same helpers (:func:`token_law`,
:func:`block_law`), written dtype-generically, so :mod:`specjax.audit` can evaluate it
in float64 and check it against the target by exact enumeration.

:func:`greedy_verify` is a DIFFERENT contract: it reproduces the greedy target output
(longest prefix equal to the target argmax, then the target argmax), not a sampling law.

Keys: ``key`` is the row's key for this round; acceptance uniforms use
``role_key(key, ACCEPT)``, the correction ``role_key(key, RESIDUAL)`` and the bonus
``role_key(key, BONUS)``, each folded with the position (number of accepted tokens for
the final draw).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import keys as _keys
from specjax.sampling import logsumexp, row_sum, sample

__all__ = [
    "PAD_ID", "VerifyResult", "RoundLaw", "token_verify", "block_verify", "greedy_verify",
    "overlap_alpha", "expected_tokens_per_round", "token_law", "block_law",
    "log_residual", "emission_log_weights", "token_log_accept", "token_stop_probs",
    "block_log_weights",
    "block_log_stop", "validate_inputs", "final_draw", "assemble",
    # the pieces the samplers are assembled from, public so that tests can build known-wrong
    # variants from the real parts (tests/_mutants.py)
    "prepare_inputs", "resolve_num_draft", "gather_at", "emission_table", "token_tau",
    "block_tau", "finish",
]

PAD_ID = -1
# A used row whose largest entry exceeds this is not log-probs (e.g. raw logits).
LOGPROB_TOL = 1e-3


class VerifyResult(NamedTuple):
    tokens: jax.Array  # int32[K+1]: accepted prefix, correction or bonus, then PAD_ID
    num_accepted: jax.Array  # int32 in [0, num_draft]
    error: jax.Array  # bool: invalid input; tokens all PAD_ID, num_accepted 0


class RoundLaw(NamedTuple):
    """The law of one verification round given the draft tokens."""

    stop_probs: jax.Array  # [K+1]: P(num_accepted = t)
    emit_logprobs: jax.Array  # [K+1, V]: log law of the emitted token after t accepted


# --------------------------------------------------------------------------------------
# Pure helpers shared by the samplers and the laws (dtype-generic)
# --------------------------------------------------------------------------------------

def resolve_num_draft(num_draft, k):
    return jnp.asarray(k if num_draft is None else num_draft, jnp.int32)


def gather_at(logprobs, tokens):
    """logprobs[i, tokens[i]] with out-of-range tokens clipped (they are flagged)."""
    v = logprobs.shape[-1]
    idx = jnp.clip(tokens, 0, v - 1).astype(jnp.int32)
    return jnp.take_along_axis(logprobs, idx[:, None], axis=-1)[:, 0]


def _log1mexp(a):
    """log(1 - exp(a)) for a <= 0 (``-inf`` at a = 0)."""
    return jnp.log(-jnp.expm1(a))


def log_residual(target_lp, draft_lp, log_w=0.0):
    """Elementwise ``log max(0, w p - q)`` (unnormalized), ``-inf`` where it is <= 0.

    Computed as ``log(w p) + log(1 - q / (w p))`` so that neither an overflow nor a
    cancellation of ``w p - q`` can produce NaN: exactly-equal values give ``-inf``.
    """
    a = log_w + jnp.asarray(target_lp)
    draft_lp = jnp.asarray(draft_lp)
    pos = a > draft_lp
    return jnp.where(pos, a + _log1mexp(jnp.where(pos, draft_lp - a, -1.0)), -jnp.inf)


def emission_log_weights(target_lp, draft_lp, log_w, is_bonus):
    """Unnormalized log law of the token emitted after ``t`` accepted tokens (one row [V]).

    Bonus: ``p_{t+1}``.  Otherwise the residual ``max(0, w_t p_{t+1} - q_{t+1})`` (w = 1
    for token verification), or ``p_{t+1}`` if that residual is zero everywhere.
    """
    r = log_residual(target_lp, draft_lp, log_w)
    use_p = is_bonus | ~(jnp.max(r, axis=-1) > -jnp.inf)
    return jnp.where(use_p, target_lp, r)


def _log_ratio(draft_tokens, draft_logprobs, target_logprobs):
    """[K] ``log p_i(x_i) - log q_i(x_i)`` (``-inf`` where p = 0)."""
    k = draft_tokens.shape[0]
    lp = gather_at(target_logprobs[:k], draft_tokens)
    lq = gather_at(draft_logprobs, draft_tokens)
    return jnp.where(lp > -jnp.inf, lp - lq, -jnp.inf)


def token_log_accept(draft_tokens, draft_logprobs, target_logprobs):
    """[K] log acceptance probabilities ``min(0, log p_i(x_i) - log q_i(x_i))``."""
    return jnp.minimum(0.0, _log_ratio(draft_tokens, draft_logprobs, target_logprobs))


def token_stop_probs(log_accept, num_draft):
    """[K+1] P(t accepted) = a_1 ... a_t (1 - a_{t+1}) with a_i = 0 for i > num_draft."""
    k = log_accept.shape[0]
    a = jnp.where(jnp.arange(k) < num_draft, jnp.exp(log_accept), 0.0)
    reach = jnp.concatenate([jnp.ones((1,), a.dtype), jnp.cumprod(a)])  # P(tau >= t)
    return reach * (1.0 - jnp.concatenate([a, jnp.zeros((1,), a.dtype)]))


def block_log_weights(draft_tokens, draft_logprobs, target_logprobs):
    """[K+1] ``log w_t``: ``w_0 = 1``, ``w_t = min(1, w_{t-1} p_t(x_t) / q_t(x_t))``."""
    log_ratio = _log_ratio(draft_tokens, draft_logprobs, target_logprobs)

    def step(lw, lr):
        lw = jnp.minimum(0.0, lw + lr)
        return lw, lw

    zero = jnp.zeros((), log_ratio.dtype)
    _, lws = jax.lax.scan(step, zero, log_ratio)
    return jnp.concatenate([zero[None], lws])


def block_log_stop(log_w, draft_logprobs, target_logprobs, num_draft):
    """[K+1] ``log h_t`` (``h_0 = 1``; ``h_t = r_t / (r_t + 1 - w_t)`` for 0 < t < n,
    ``h_n = w_n``, ``h_t = 0`` for t > n; ``0/0`` -> 1)."""
    k = draft_logprobs.shape[0]
    t = jnp.arange(k + 1)
    # r_t for t = 1..K-1 uses p_{t+1}, q_{t+1} = rows t of the inputs.
    log_r = logsumexp(log_residual(target_logprobs[1:k], draft_logprobs[1:k], log_w[1:k, None]))
    log_r = jnp.concatenate([jnp.zeros((1,), log_w.dtype), log_r,
                             jnp.zeros((1,), log_w.dtype)])
    # w_t = 1 gives h_t = 1 (r / r, or the limit at 0 / 0); otherwise 1 - w_t > 0.
    denom = jnp.logaddexp(log_r, _log1mexp(jnp.minimum(log_w, 0.0)))
    log_h = jnp.where(log_w >= 0, 0.0, log_r - denom)
    log_h = jnp.where(t == num_draft, log_w, log_h)
    log_h = jnp.where(t > num_draft, -jnp.inf, log_h)
    return jnp.where(t == 0, 0.0, log_h)


def validate_inputs(draft_tokens, draft_logprobs, target_logprobs, num_draft):
    """True if the used part of the inputs is not a valid verification problem."""
    k, v = draft_logprobs.shape
    n = resolve_num_draft(num_draft, k)
    d_used = jnp.arange(k) < n
    t_used = jnp.arange(k + 1) <= n

    def bad_rows(lp):
        # One fused pass: NaN anywhere, or max not in [-inf < max <= tol] (+inf, a row
        # with no finite entry, or a positive "log-prob" such as a raw logit).
        return jnp.any(jnp.isnan(lp), axis=-1) | ~(
            (jnp.max(lp, axis=-1) > -jnp.inf) & (jnp.max(lp, axis=-1) <= LOGPROB_TOL))

    tok_bad = (draft_tokens < 0) | (draft_tokens >= v)
    q_zero = ~(gather_at(draft_logprobs, draft_tokens) > -jnp.inf)
    return ((n < 0) | (n > k)
            | jnp.any(d_used & (tok_bad | q_zero | bad_rows(draft_logprobs)))
            | jnp.any(t_used & bad_rows(target_logprobs)))


def _normalize(lw):
    return lw - logsumexp(lw)[..., None]


def emission_table(draft_logprobs, target_logprobs, log_w, num_draft):
    """[K+1, V] normalized emission law after t = 0..K accepted tokens."""
    k, v = draft_logprobs.shape
    q_pad = jnp.concatenate([draft_logprobs, jnp.full((1, v), -jnp.inf,
                                                      draft_logprobs.dtype)])
    t = jnp.arange(k + 1)
    rows = jax.vmap(emission_log_weights)(target_logprobs, q_pad, log_w, t == num_draft)
    return _normalize(rows)


def token_law(draft_tokens, draft_logprobs, target_logprobs, num_draft=None) -> RoundLaw:
    """Law of :func:`token_verify` given the draft tokens (any float dtype)."""
    k = draft_tokens.shape[0]
    n = resolve_num_draft(num_draft, k)
    stop = token_stop_probs(token_log_accept(draft_tokens, draft_logprobs, target_logprobs), n)
    zeros = jnp.zeros((k + 1,), stop.dtype)
    return RoundLaw(stop, emission_table(draft_logprobs, target_logprobs, zeros, n))


def block_law(draft_tokens, draft_logprobs, target_logprobs, num_draft=None) -> RoundLaw:
    """Law of :func:`block_verify` given the draft tokens (any float dtype)."""
    k = draft_tokens.shape[0]
    n = resolve_num_draft(num_draft, k)
    log_w = block_log_weights(draft_tokens, draft_logprobs, target_logprobs)
    log_h = block_log_stop(log_w, draft_logprobs, target_logprobs, n)
    # P(tau = t) = h_t * prod_{j > t} (1 - h_j)
    miss = -jnp.expm1(log_h)  # 1 - h
    after = jnp.concatenate([jnp.cumprod(miss[::-1])[::-1][1:], jnp.ones((1,), miss.dtype)])
    stop = jnp.exp(log_h) * after
    return RoundLaw(stop, emission_table(draft_logprobs, target_logprobs, log_w, n))


# --------------------------------------------------------------------------------------
# Samplers
# --------------------------------------------------------------------------------------

def _acceptance_uniforms(key, k):
    ak = _keys.role_key(key, _keys.ACCEPT)
    return jax.vmap(lambda i: _keys.uniform_open(_keys.position_key(ak, i)))(jnp.arange(k))


def token_tau(key, log_accept, num_draft):
    """Accepted count: leading positions with ``log u_i < log a_i``; also returns u."""
    k = log_accept.shape[0]
    u = _acceptance_uniforms(key, k)
    accepted = (jnp.log(u) < log_accept) & (jnp.arange(k) < num_draft)
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32))), u


def block_tau(key, log_h):
    """tau = the largest t in 1..K with ``eta_t <= h_t`` (0 if none)."""
    k = log_h.shape[0] - 1
    eta = _acceptance_uniforms(key, k)  # eta_t for t = 1..K
    return jnp.max(jnp.where(jnp.log(eta) <= log_h[1:], jnp.arange(1, k + 1), 0))


def final_draw(key, weights, tau, num_draft, *, single: bool = False):
    """Draw the token emitted after ``tau`` accepted ones from its log weights [V]:
    role BONUS if ``tau == num_draft`` else RESIDUAL, position ``tau``. ``single``: see
    :func:`specjax.sampling.sample` (the caller knows every emission law has one token)."""
    role = jnp.where(tau == num_draft, _keys.BONUS, _keys.RESIDUAL)
    return sample(_keys.position_key(_keys.role_key(key, role), tau), weights, single=single)


def assemble(draft_tokens, tau, y, error) -> VerifyResult:
    """tokens = x_1..x_tau, y, PAD_ID...; everything PAD_ID (0 accepted) on error."""
    k = draft_tokens.shape[0]
    pos = jnp.arange(k + 1)
    draft_pad = jnp.concatenate([draft_tokens.astype(jnp.int32),
                                 jnp.full((1,), PAD_ID, jnp.int32)])
    tokens = jnp.where(pos < tau, draft_pad, jnp.where(pos == tau, y, PAD_ID))
    tokens = jnp.where(error, PAD_ID, tokens).astype(jnp.int32)
    return VerifyResult(tokens, jnp.where(error, 0, tau).astype(jnp.int32), error)


def finish(key, draft_tokens, draft_logprobs, target_logprobs, tau, n, log_w_tau, error,
            single: bool = False):
    """Draw the correction/bonus after ``tau`` accepted tokens and assemble the result."""
    k = draft_tokens.shape[0]
    is_bonus = tau == n
    q_row = jnp.where(is_bonus, -jnp.inf, draft_logprobs[jnp.minimum(tau, k - 1)])
    weights = emission_log_weights(target_logprobs[tau], q_row, log_w_tau, is_bonus)
    return assemble(draft_tokens, tau, final_draw(key, weights, tau, n, single=single), error)


def _int_tokens(draft_tokens, name: str = "draft_tokens"):
    """``draft_tokens`` as int32 [K]: TypeError for a non-integer dtype (a float array would
    be truncated into other tokens), ValueError unless 1-D (static checks: jit-safe)."""
    dt = jnp.result_type(draft_tokens)
    if not (jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.bool_)):
        raise TypeError(f"{name} must be integer token ids, got dtype {dt}")
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    if draft_tokens.ndim != 1:
        raise ValueError(f"{name} must be 1-D [K] (one row; vmap over a batch), got shape "
                         f"{draft_tokens.shape}")
    return draft_tokens


def _float_rows(x, name: str):
    dt = jnp.result_type(x)
    if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
        raise TypeError(f"{name} must be real numbers (log-probs), got dtype {dt}")
    return x


def prepare_inputs(draft_tokens, draft_logprobs, target_logprobs, num_draft):
    draft_tokens = _int_tokens(draft_tokens)
    draft_logprobs = jnp.asarray(_float_rows(draft_logprobs, "draft_logprobs"), jnp.float32)
    target_logprobs = jnp.asarray(_float_rows(target_logprobs, "target_logprobs"), jnp.float32)
    k = draft_tokens.shape[0]
    if draft_logprobs.ndim != 2 or draft_logprobs.shape[0] != k or draft_logprobs.shape[1] < 1 \
            or target_logprobs.shape != (k + 1,) + draft_logprobs.shape[1:]:
        raise ValueError(
            f"shapes: draft_tokens [K], draft_logprobs [K, V], target_logprobs [K+1, V]; got "
            f"{draft_tokens.shape}, {draft_logprobs.shape}, {target_logprobs.shape}")
    n = resolve_num_draft(num_draft, k)
    error = validate_inputs(draft_tokens, draft_logprobs, target_logprobs, n)
    return draft_tokens, draft_logprobs, target_logprobs, n, error


def token_verify(key, draft_tokens, draft_logprobs, target_logprobs,
                 num_draft=None, *, single: bool = False) -> VerifyResult:
    """Token-by-token speculative sampling (exact); see the module docstring. ``single``
    (static): every target row has at most one possible token (greedy), so the final draw
    needs no noise (:func:`specjax.sampling.sample`); the result is the same."""
    draft_tokens, draft_logprobs, target_logprobs, n, error = prepare_inputs(
        draft_tokens, draft_logprobs, target_logprobs, num_draft)
    log_a = token_log_accept(draft_tokens, draft_logprobs, target_logprobs)
    tau, _ = token_tau(key, log_a, n)
    return finish(key, draft_tokens, draft_logprobs, target_logprobs, tau, n,
                   jnp.float32(0.0), error, single)


def block_verify(key, draft_tokens, draft_logprobs, target_logprobs,
                 num_draft=None, *, single: bool = False) -> VerifyResult:
    """Block verification (Sun et al., ICLR 2025; exact); see the module docstring.
    ``single``: as for :func:`token_verify`."""
    draft_tokens, draft_logprobs, target_logprobs, n, error = prepare_inputs(
        draft_tokens, draft_logprobs, target_logprobs, num_draft)
    log_w = block_log_weights(draft_tokens, draft_logprobs, target_logprobs)
    log_h = block_log_stop(log_w, draft_logprobs, target_logprobs, n)
    tau = block_tau(key, log_h)
    return finish(key, draft_tokens, draft_logprobs, target_logprobs, tau, n, log_w[tau],
                   error, single)


def greedy_verify(draft_tokens, target_logits, num_draft=None) -> VerifyResult:
    """Greedy verification: a DIFFERENT contract from the samplers.

    Accepts the longest prefix of the draft equal to the target argmax (ties -> lowest
    id) at each position, then emits the target argmax at the first mismatch (or at the
    bonus position).  Under deterministic execution this reproduces the greedy target
    output token for token; it is not a sampling law and says nothing about
    temperature > 0.  ``target_logits`` [K+1, V] may be raw logits or log-probs.
    """
    draft_tokens = _int_tokens(draft_tokens)
    logits = jnp.asarray(_float_rows(target_logits, "target_logits"), jnp.float32)
    k = draft_tokens.shape[0]
    if logits.ndim != 2 or logits.shape[0] != k + 1 or logits.shape[1] < 1:
        raise ValueError(f"shapes: draft_tokens [K], target_logits [K+1, V]; got {draft_tokens.shape}, "
                         f"{logits.shape}")
    v = logits.shape[-1]
    n = resolve_num_draft(num_draft, k)
    t_used = jnp.arange(k + 1) <= n
    top_val = jnp.max(logits, axis=-1, keepdims=True)  # NaN propagates
    row_bad = jnp.isnan(top_val[:, 0]) | ~(top_val[:, 0] > -jnp.inf)
    tok_bad = (jnp.arange(k) < n) & ((draft_tokens < 0) | (draft_tokens >= v))
    error = (n < 0) | (n > k) | jnp.any(t_used & row_bad) | jnp.any(tok_bad)
    # argmax with ties -> lowest id (a min over equal positions is cheaper than argmax)
    top = jnp.min(jnp.where(logits == top_val, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    top = jnp.minimum(top, v - 1)
    match = (draft_tokens == top[:k]) & (jnp.arange(k) < n)
    tau = jnp.sum(jnp.cumprod(match.astype(jnp.int32)))
    return assemble(draft_tokens, tau, top[tau], error)


# --------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------

def overlap_alpha(draft_logprobs, target_logprobs) -> jax.Array:
    """``sum_x min(p(x), q(x))`` over the last axis (float32): the acceptance probability
    of one token-level proposal."""
    lq = jnp.asarray(draft_logprobs, jnp.float32)
    lp = jnp.asarray(target_logprobs, jnp.float32)
    # in an order independent of the batch; halves first (row_sum's neighbours-first order
    # fused here with the exp into a loop over a transposed layout: 1.2 ms of a batch-4
    # round on CPU, 0.1 ms this way)
    return row_sum(jnp.exp(jnp.minimum(lp, lq)), halves=True)


def expected_tokens_per_round(alphas, k=None) -> jax.Array:
    """E[tokens emitted by one token-verification round] = ``1 + sum_i prod_{j<=i} alpha_j``.

    ``alphas`` [..., K]: per-position acceptance probabilities.  With ``k`` given,
    ``alphas`` [...] is one i.i.d. rate for all k positions, giving
    ``(1 - alpha**(k+1)) / (1 - alpha)``.
    """
    a = jnp.asarray(alphas, jnp.float32)
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"expected_tokens_per_round: k must be an integer >= 0, got {k!r}")
        a = jnp.broadcast_to(a[..., None], a.shape + (int(k),))
    return 1.0 + jnp.sum(jnp.cumprod(a, axis=-1), axis=-1)
