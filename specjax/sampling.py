"""The one sampling pipeline: raw logits -> the normalized log-probs a token is drawn from.

Draft and target go through the SAME function, :func:`process_logits`, with the same
order of steps, so the law the verifier sees for the draft (q) and the target (p) is the
law each side really samples from.  The order is fixed:

1. cast to float32;
2. logit ``bias`` (added to the raw logits), then the ``allowed`` mask: tokens with
   ``allowed == False`` get logit ``-inf`` (banned tokens, an allowed-token set, and stop
   tokens before ``min_new_tokens``: :class:`Controls` builds both per row and position);
3. repetition penalty (CTRL / HF rule): for tokens seen in the history
   (``counts > 0``), a logit ``> 0`` is divided by the penalty, any other is multiplied;
4. presence penalty: ``presence_penalty`` is subtracted from the logit of every seen token;
5. temperature: ``z = (l - max l) / T``; ``T == 0`` is greedy, a point mass at the
   argmax (ties -> lowest id), which every later filter keeps unchanged;
6. top-k: keep every token whose ``z`` is ``>=`` the k-th largest ``z`` (counted with
   multiplicity), so ties at the boundary are all kept;
7. top-p (on the distribution renormalized after top-k): keep token ``x`` iff the total
   probability of the tokens STRICTLY more probable than ``x`` is ``< top_p``; tied
   tokens are kept or dropped together, and the most probable token is always kept;
8. min-p: keep ``x`` iff ``p(x) >= min_p * max_y p(y)`` (ratios do not depend on the
   renormalization, so this is ``z(x) >= log(min_p)``);
9. log-normalize over the kept tokens; every other token gets ``-inf``.

All three filters are "keep ``z >= threshold``" rules, defined only by the values (not
by any sort order), so the result does not depend on how ties are ordered.  A row whose
tokens are all excluded by ``allowed`` comes out as all ``-inf`` (no NaN); NaN in the
logits comes out as NaN, which the verifiers report as an error.

Performance (V = 49152): nothing is sorted.  When no row of the batch has top-k or top-p
on, the filter code is skipped by a batch-level ``lax.cond``.  Otherwise the thresholds
come from the ``_CANDIDATES`` largest values per row (``lax.top_k``), which is exact
whenever the cut lies among them; rows where it does not (top_k > _CANDIDATES, or a
nucleus wider than the candidates) get the exact threshold from a 32-step binary search
over the ordered float32 bit patterns (again behind a batch-level ``lax.cond``; with
``V <= _CANDIDATES`` every value is a candidate and that path is not even compiled; on a
GPU, :func:`sync_free`, a search with a fixed number of steps over every row instead, the
same threshold without the cond's host sync).  A draft's pipeline on a GPU
(:func:`process_rows` with ``cut="candidates"``, what ``ProposeContext.process`` passes
there: ``specjax.drafts.base.draft_cut``) leaves that search out: where a row's cut lies
past its candidates, its draft law is cut at the last of them (the same law wherever the cut
lies among them). The draft law may be any law the draft token was really drawn from, so
the output stays the target's; only the target's law needs the exact cut.  Call
``process_logits`` on the whole batch, not under ``jax.vmap`` (``vmap`` turns ``cond``
into ``select`` and every branch would run).

Batch hints (:class:`BatchHints`, :func:`batch_hints`): a batch-level ``cond`` costs little
on a CPU, but on a GPU XLA runs each one as a copy of its predicate to the host and a wait
for the stream (``ConditionalThunk``), several per token. What a whole call's settings
decide (every row greedy or none, some row filtering or none, penalties on or off) the host
knows before the call: the engine traces its programs under these hints, and each cond they
decide becomes its branch, the same ops as the branch the cond would take, so the same bits.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Callable, Optional, Sequence, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.keys import random_bits

__all__ = ["SamplingParams", "SamplingConfig", "Controls", "make_controls", "process_logits", "process_rows", "sample",
           "sample_rows", "draw_single", "at_most_one_possible", "gumbel", "BatchHints", "batch_hints",
           "current_hints", "hints_for", "settled", "known_cond", "known_greedy", "all_point_masses", "sync_free",
           "env_switch"]

Scalar = Union[float, int]
PerRow = Union[Scalar, Sequence[Scalar], np.ndarray]

# How many of each row's largest values the top-k / top-p thresholds are looked for in
# before falling back to the bit-pattern binary search.
_CANDIDATES = 256
CUTS = ("exact", "candidates")  # process_rows' cut: the target's, a draft's
# Rows whose cut is not among the candidates are bisected this many at a time.
_SLOW_ROWS = 8

_NEG_INF = -jnp.inf
_F32_MAX = float(np.finfo(np.float32).max)

# How the largest values of each row are found: ``top_values(z [N, V], m) -> [N, m]``
# descending. None = ``lax.top_k``; a sharded run passes ``MeshPlan.top_values`` (per-shard
# top-m, then the top-m of the gathered candidates: the same values).
TopValues = Optional[Callable]


def _top_values(z, m, top_values: TopValues = None):
    return jax.lax.top_k(z, m)[0] if top_values is None else top_values(z, m)


# --------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------

def _check_rows(name: str, values: np.ndarray, bad: np.ndarray, rule: str) -> None:
    if np.any(bad):
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"SamplingParams.{name}[{row}] = {values[row]!r} is invalid: {rule}")


def _per_row(name: str, value, batch_size: int, dtype) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim == 0:
        arr = np.full((batch_size,), arr)
    if arr.ndim != 1 or arr.shape[0] != batch_size:
        raise ValueError(
            f"SamplingParams.{name} must be a scalar or have length batch_size={batch_size}, "
            f"got shape {arr.shape}")
    if arr.dtype.kind not in "iuf":  # strings, bools, objects: never read as numbers
        raise ValueError(f"SamplingParams.{name} must be numeric, got {value!r}")
    if dtype == np.int32:
        if arr.dtype.kind == "f":
            as_float = arr.astype(np.float64)
            bad = ~np.isfinite(as_float) | (as_float != np.round(as_float))
            _check_rows(name, arr, bad, "must be an integer")
        # past int32 (top-k: <= 0 or >= V is off either way) clipped, never wrapped around
        info = np.iinfo(np.int32)
        return np.clip(arr.astype(np.float64), info.min, info.max).astype(np.int32)
    wide = arr.astype(np.float64)
    _check_rows(name, wide, np.isfinite(wide) & (np.abs(wide) > np.finfo(np.float32).max),
                "outside float32's range")
    return wide.astype(np.float32)


def _validate(f: dict) -> None:
    """Host-side checks; each raises ValueError naming the field and the first bad row."""
    t = f["temperature"]
    _check_rows("temperature", t, ~np.isfinite(t) | (t < 0), "must be finite and >= 0")
    p = f["top_p"]
    _check_rows("top_p", p, ~((p > 0) & (p <= 1)), "must lie in (0, 1]")
    m = f["min_p"]
    _check_rows("min_p", m, ~((m >= 0) & (m < 1)), "must lie in [0, 1)")
    r = f["repetition_penalty"]
    _check_rows("repetition_penalty", r, ~np.isfinite(r) | ~(r > 0),
                "must be finite and > 0")
    pp = f["presence_penalty"]
    _check_rows("presence_penalty", pp, ~np.isfinite(pp), "must be finite")


def _flush_subnormals(f: dict) -> None:
    """Values below float32's smallest normal number as the device reads them (XLA flushes
    subnormals to zero), so that host-side decisions (batch hints: is a row greedy?) agree
    with the program: temperature, min_p and presence_penalty to 0; top_p and
    repetition_penalty, which must stay > 0, to that number (top_p: the top tokens only)."""
    tiny = np.finfo(np.float32).tiny
    for name in ("temperature", "min_p", "presence_penalty"):
        f[name] = np.where(np.abs(f[name]) < tiny, np.float32(0), f[name]).astype(np.float32)
    for name in ("top_p", "repetition_penalty"):
        f[name] = np.maximum(f[name], tiny).astype(np.float32)


@flax.struct.dataclass
class SamplingParams:
    """Per-row sampling settings: a pytree of arrays (changing values never recompiles).

    temperature float32[B] (0 = greedy); top_k int32[B] (<= 0 or >= V: off);
    top_p float32[B] in (0, 1] (1: off); min_p float32[B] in [0, 1) (0: off);
    repetition_penalty float32[B] > 0 (1: off); presence_penalty float32[B] (0: off).
    Build it with :meth:`create` (validated on the host); the fields may also be any
    shape that aligns with the leading axes of the logits (see :func:`process_logits`).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array

    @classmethod
    def create(cls, batch_size: int, temperature: PerRow = 1.0, top_k: PerRow = 0,
               top_p: PerRow = 1.0, min_p: PerRow = 0.0, repetition_penalty: PerRow = 1.0,
               presence_penalty: PerRow = 0.0) -> "SamplingParams":
        """Scalars or per-row sequences, validated with numpy before any tracing."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        batch_size = int(batch_size)
        f = {
            "temperature": _per_row("temperature", temperature, batch_size, np.float32),
            "top_k": _per_row("top_k", top_k, batch_size, np.int32),
            "top_p": _per_row("top_p", top_p, batch_size, np.float32),
            "min_p": _per_row("min_p", min_p, batch_size, np.float32),
            "repetition_penalty": _per_row("repetition_penalty", repetition_penalty,
                                           batch_size, np.float32),
            "presence_penalty": _per_row("presence_penalty", presence_penalty,
                                         batch_size, np.float32),
        }
        _validate(f)
        _flush_subnormals(f)
        return cls(**{k: jnp.asarray(v) for k, v in f.items()})


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Host-side preset (e.g. from YAML): the same fields as :class:`SamplingParams`."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0

    def __post_init__(self):
        # Same checks as SamplingParams.create, on a batch of one.
        self.to_params(1)

    def to_params(self, batch_size: int) -> SamplingParams:
        return SamplingParams.create(batch_size, **dataclasses.asdict(self))


@flax.struct.dataclass
class Controls:
    """Per-row generation controls, applied by the one pipeline to draft and target alike
    (so the target law is the controlled one, and speculation stays exact for it).

    ``min_new`` int32[B]: stop tokens (``stop_mask`` bool[V]) are excluded while fewer than
    that many tokens have been generated; ``allowed`` bool[B, V] or None: only these tokens
    (banned tokens are folded in as ``False``); ``bias`` float32[B, V] or None: added to the
    logits. Whether ``allowed`` / ``bias`` are present is part of the program's structure (a
    run with them compiles its own program); their values and ``min_new`` are data.
    Build it with :func:`make_controls` (validated on the host)."""

    min_new: jax.Array
    stop_mask: jax.Array
    allowed: Optional[jax.Array] = None
    bias: Optional[jax.Array] = None

    def allowed_at(self, gen_index) -> jax.Array:
        """The ``allowed`` argument of :func:`process_logits` for logits generated at
        ``gen_index`` (int32[B] or [B, T]: how many tokens each row had generated before the
        token being drawn) -> bool[B, V] or [B, T, V]."""
        gen_index = jnp.asarray(gen_index)
        extra = gen_index.ndim - 1
        early = gen_index < self.min_new.reshape(self.min_new.shape + (1,) * extra)
        ok = ~(self.stop_mask & early[..., None])
        if self.allowed is not None:
            ok = ok & self.allowed.reshape(self.allowed.shape[:1] + (1,) * extra + self.allowed.shape[1:])
        return ok

    def bias_at(self, ndim: int):
        """``bias`` lined up with [B, V] (ndim 2) or [B, T, V] (ndim 3) logits, or None."""
        if self.bias is None:
            return None
        return self.bias.reshape(self.bias.shape[:1] + (1,) * (ndim - 2) + self.bias.shape[1:])


def _id_sequence(name: str, ids) -> list:
    """``ids`` as a list (a lone integer or string is an error, not a sequence of one)."""
    if isinstance(ids, (set, frozenset)):
        return sorted(ids)
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or getattr(ids, "ndim", 1) == 0:
        raise ValueError(f"{name}: expected a list of token ids, got {ids!r}")
    return list(ids)


def stop_token_ids(stop_tokens, vocab_size: int) -> np.ndarray:
    """The stop tokens as int64 ids in [0, vocab_size) (None: none; ValueError otherwise)."""
    return _token_ids("stop_tokens", [] if stop_tokens is None else _id_sequence("stop_tokens", stop_tokens),
                      vocab_size)


def _token_ids(name: str, ids, vocab_size: int) -> np.ndarray:
    """One flat list of token ids -> int64[n] (a nested or ragged list is an error, never
    flattened: stop tokens, say, are one set for every row)."""
    items = list(ids) if not isinstance(ids, np.ndarray) else ids
    if not isinstance(items, np.ndarray) and any(isinstance(x, (list, tuple, np.ndarray)) for x in items):
        raise ValueError(f"{name}: expected one flat list of token ids, got a nested list")
    arr = np.asarray(items)
    if arr.ndim > 1:
        raise ValueError(f"{name}: expected one flat list of token ids, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"{name}: token ids must be integers in [0, {vocab_size}), got {arr.tolist()}")
    return arr.astype(np.int64).reshape(-1)


def per_row_count(name: str, value, batch: int, minimum: int = 0) -> np.ndarray:
    """A count for every row (one integer, or one per row) -> int32[batch]; ValueError
    unless each is an integer in [minimum, 2**31) (checked before any cast, so a large
    value is an error, never wrapped around). Integral floats (``2.0``) are accepted."""
    arr = np.asarray(value)
    integral = arr.dtype.kind == "f" and bool(np.all(np.isfinite(arr) & (arr == np.round(arr))))
    if isinstance(value, (bool, np.bool_)) or not (arr.dtype.kind in "iu" or integral):
        raise ValueError(f"{name} must be integers, got {value!r}")
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] not in (1, batch)):
        raise ValueError(f"{name}: give one value or one per row ({batch}), got shape {arr.shape}")
    top = np.iinfo(np.int32).max
    if arr.size and (arr < minimum).any():
        raise ValueError(f"{name} must be >= {minimum}, got {arr.min()!r}")
    if arr.size and (arr > top).any():
        raise ValueError(f"{name} must be < 2**31, got {arr.max()!r}")
    return np.broadcast_to(arr.astype(np.int64), (batch,)).astype(np.int32)


def _per_row_tokens(name: str, value, batch: int, vocab_size: int) -> np.ndarray:
    """Token ids for every row (a flat list) or per row (a list of B lists) -> bool[B, V]."""
    out = np.zeros((batch, vocab_size), bool)
    rows = _id_sequence(name, value)
    nested = [isinstance(r, (list, tuple, np.ndarray)) for r in rows]
    per_row = any(nested)
    if per_row and (not all(nested) or len(rows) != batch):
        raise ValueError(f"{name}: give one list of token ids for every row, or one list per row "
                         f"({batch} lists), got {len(rows)} entries, {sum(nested)} of them lists")
    for b in range(batch):
        out[b, _token_ids(name, rows[b] if per_row else rows, vocab_size)] = True
    return out


def make_controls(batch: int, vocab_size: int, *, stop_tokens=(), min_new_tokens=0,
                  banned_tokens=None, allowed_tokens=None, logit_bias=None) -> Controls:
    """Host-side construction and checks of :class:`Controls` (ValueError on bad input).

    ``min_new_tokens``: an int or one per row; ``banned_tokens`` / ``allowed_tokens``: token
    ids for all rows or one list per row, or a bool array [V] / [B, V] (``allowed_tokens``
    only); ``logit_bias``: ``{token id: bias}`` for all rows, a list of such dicts (one per
    row), or a float array [V] / [B, V]. Every row must keep at least one token possible
    (and one that is not a stop token when ``min_new_tokens`` > 0)."""
    b, v = int(batch), int(vocab_size)
    min_new = per_row_count("min_new_tokens", min_new_tokens, b, 0)
    stop_mask = np.zeros((v,), bool)
    stop_mask[stop_token_ids(stop_tokens, v)] = True
    allowed = None
    if allowed_tokens is not None:
        a = np.asarray(allowed_tokens) if isinstance(allowed_tokens, np.ndarray) else None
        if a is not None and a.dtype == bool:
            if a.shape not in ((v,), (b, v)):
                raise ValueError(f"allowed_tokens mask must have shape ({v},) or ({b}, {v}), got {a.shape}")
            allowed = np.broadcast_to(a, (b, v)).copy()
        else:
            allowed = _per_row_tokens("allowed_tokens", allowed_tokens, b, v)
    if banned_tokens is not None:
        banned = _per_row_tokens("banned_tokens", banned_tokens, b, v)
        allowed = (np.ones((b, v), bool) if allowed is None else allowed) & ~banned
    bias = None
    if logit_bias is not None:
        if isinstance(logit_bias, dict) or (isinstance(logit_bias, (list, tuple)) and logit_bias
                                            and all(isinstance(d, dict) for d in logit_bias)):
            dicts = [logit_bias] * b if isinstance(logit_bias, dict) else list(logit_bias)
            if len(dicts) != b:
                raise ValueError(f"logit_bias: {len(dicts)} dicts for {b} rows")
            bias = np.zeros((b, v), np.float64)
            for r, d in enumerate(dicts):
                ids = _token_ids("logit_bias", list(d.keys()), v)
                bias[r, ids] = np.asarray(list(d.values()), np.float64)
        else:
            arr = np.asarray(logit_bias, np.float64)
            if arr.shape not in ((v,), (b, v)):
                raise ValueError(f"logit_bias array must have shape ({v},) or ({b}, {v}), got {arr.shape}")
            bias = np.broadcast_to(arr, (b, v))
        if np.isfinite(bias).all() and (np.abs(bias) > np.finfo(np.float32).max).any():
            raise ValueError("logit_bias values must lie within float32's range")
        if not np.isfinite(bias).all():
            raise ValueError("logit_bias values must be finite (ban a token with banned_tokens)")
    if allowed is not None:
        empty = ~allowed.any(axis=1)
        if empty.any():
            raise ValueError(f"row {int(np.flatnonzero(empty)[0])}: no token is allowed")
    no_go = (min_new > 0) & ~((np.ones((1, v), bool) if allowed is None else allowed) & ~stop_mask).any(axis=1)
    if no_go.any():
        raise ValueError(f"row {int(np.flatnonzero(no_go)[0])}: min_new_tokens > 0 but only stop "
                         "tokens are allowed")
    return Controls(min_new=jnp.asarray(min_new), stop_mask=jnp.asarray(stop_mask),
                    allowed=None if allowed is None else jnp.asarray(allowed),
                    bias=None if bias is None else jnp.asarray(bias.astype(np.float32)))


# --------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------

def _lead(a, batch_ndim: int):
    """Append unit axes so ``a`` lines up with the LEADING axes of a batch of that rank."""
    a = jnp.asarray(a)
    missing = batch_ndim - a.ndim
    return a.reshape(a.shape + (1,) * missing) if missing > 0 else a


def _lead_vocab(a, batch_ndim: int):
    """Like :func:`_lead` for a ``[..., V]`` array: unit axes go before the vocab axis."""
    a = jnp.asarray(a)
    missing = batch_ndim + 1 - a.ndim
    return a.reshape(a.shape[:-1] + (1,) * missing + a.shape[-1:]) if missing > 0 else a


def _ordered_key(x):
    """float32 -> int32 with the same order (for -inf <= x <= +inf; no NaN)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b >= 0, b, b ^ jnp.int32(0x7FFFFFFF))


def _from_ordered_key(k):
    return jax.lax.bitcast_convert_type(jnp.where(k >= 0, k, k ^ jnp.int32(0x7FFFFFFF)),
                                        jnp.float32)


def _bisect_threshold(z, mass, target, lo, hi):
    """Exact threshold by binary search over ordered float32 bit patterns (<= 32 steps).

    z: float32[R, V]; mass: float32[R, V] (>= 0) or None (count); target: [R]; lo, hi:
    float32[R] brackets with ``lo <= answer <= hi``.  Returns the smallest float32 t
    with ``sum(mass[z > t]) < target`` (``mass=None``: ``count(z > t) < target``).
    This t is a value of z (or -inf), so ``z >= t`` is exactly the kept set.
    """
    lo, hi = _ordered_key(lo), _ordered_key(hi)

    def body(_, carry):
        lo, hi = carry
        mid = lo + (hi - lo) // 2
        above = z > _from_ordered_key(mid)[:, None]
        s = (jnp.sum(above, axis=-1, dtype=jnp.int32) if mass is None
             else row_sum(jnp.where(above, mass, 0.0)))
        ok = s < target
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return _from_ordered_key(hi)


# :func:`_lift_threshold` settles 8 bits of the answer per step (4 steps of 255 probes a row)
# where rows x 255 x V stays within this many compared values, else 4 (8 steps of 15 probes)
_LIFT_WIDE = 1 << 26
_SIGN = 0x80000000


def _lift_bits(rows: int, v: int) -> int:
    return 8 if rows * 255 * v <= _LIFT_WIDE else 4


def _lift_threshold(z, mass, target, lo, hi, bits: Optional[int] = None):
    """:func:`_bisect_threshold`'s t, found in 32 / ``bits`` steps that each test
    2**bits - 1 thresholds per row at once (a fixed count of steps and no loop: the form
    for :func:`sync_free`; ``bits`` 4 or 8, by default :func:`_lift_bits`: on a GPU each
    step is ~4 small kernels, and a one-row pass has the compute to test 255 at once).

    Binary lifting over the unsigned ordered keys u of [u(lo), u(hi)]: ``c`` counts the
    keys known to fail ``sum(mass[z > t]) < target`` (the predicate rises once, from false
    to true, as t grows: removing terms never raises a rounded sum of non-negative terms),
    and step b adds to it j * 2**b for the largest j whose probe u(lo) + c + j * 2**b - 1
    still fails; ``c`` is a multiple of 2**(b + bits) then, so no offset wraps. The sums
    are :func:`row_sum`'s, as the bisection's: on the CPU the same bits, so the same t.
    """
    bits = _lift_bits(*z.shape) if bits is None else bits
    if 32 % bits:
        raise ValueError(f"bits must divide 32, got {bits}")

    def unsigned(x):  # float32 -> uint32 in the same order
        return jax.lax.bitcast_convert_type(_ordered_key(x), jnp.uint32) ^ jnp.uint32(_SIGN)

    def value(u):  # and back
        return _from_ordered_key(jax.lax.bitcast_convert_type(u ^ jnp.uint32(_SIGN), jnp.int32))

    base = unsigned(lo)
    span = unsigned(hi) - base  # the answer is base + c with c <= span
    c = jnp.zeros_like(base)
    j = jnp.arange(1, 2 ** bits, dtype=jnp.uint32)
    for b in range(32 - bits, -1, -bits):
        off = c[:, None] + j * jnp.uint32(1 << b)  # [R, P]
        inside = off - 1 < span[:, None]  # probes at or past hi hold (they are not tested)
        above = z[:, None, :] > value(base[:, None] + off - 1)[:, :, None]  # [R, P, V]
        s = (jnp.sum(above, axis=-1, dtype=jnp.int32) if mass is None
             else row_sum(jnp.where(above, mass[:, None, :], 0.0)))
        fails = inside & ~(s < target[:, None])
        c = c + jnp.sum(fails, axis=-1, dtype=jnp.uint32) * jnp.uint32(1 << b)
    return value(base + c)


def _mass_above(c, pc):
    """For c [N, M] sorted descending with masses pc: S_j = sum of pc_i over c_i > c_j."""
    m = c.shape[-1]
    excl = jnp.cumsum(pc, axis=-1) - pc
    idx = jnp.arange(m)
    new_group = jnp.concatenate([jnp.ones_like(c[:, :1], bool), c[:, 1:] != c[:, :-1]], -1)
    start = jax.lax.cummax(jnp.where(new_group, idx, 0), axis=1)  # first index of its tie
    return jnp.take_along_axis(excl, start, axis=-1)


# backends where row_sum adds in its fixed pairwise order (CPU: a row's bits do not depend
# on the batch there, tests/test_batch_invariance.py). Elsewhere one XLA reduce: the
# pairwise tree is ~log2(V) dependent passes over the row, i.e. as many kernels per sum on
# a GPU, for bits that its matmuls do not keep batch-independent anyway.
PAIRWISE_SUM_BACKENDS = ("cpu",)


def row_sum(x: jax.Array, halves: bool = False) -> jax.Array:
    """Sum over the last axis. On CPU (:data:`PAIRWISE_SUM_BACKENDS`) in a fixed pairwise
    order that depends only on its length (elementwise adds of neighbouring pairs, level by
    level), so a row's sum does not depend on how many rows there are: XLA's reduce picks
    its summation order, hence the bits, from the whole shape (on CPU a row's log-softmax or
    overlap alpha changed with the batch size). On other backends XLA's reduce (one kernel;
    the same sum up to float32 rounding). ``halves``: pair each level's first half with its
    second instead (also fixed by the length; contiguous adds, which XLA CPU keeps fast where
    the neighbours' reshape fused into a loop over a transposed layout, as in
    :func:`specjax.verify.overlap_alpha`), for sums that need not stay inside the shards of
    a sharded vocabulary."""
    if jax.default_backend() not in PAIRWISE_SUM_BACKENDS:
        return jnp.sum(x, axis=-1)
    # neighbours first (x[2i] + x[2i+1], via a reshape): a vocabulary sharded in contiguous
    # blocks keeps every level inside its shards until the blocks are a few entries long
    # (halves of the whole axis would move half of every shard to another device)
    n = x.shape[-1]
    while n > 1:
        even = n - n % 2
        if halves:
            s = x[..., : even // 2] + x[..., even // 2: even]
        else:
            pairs = x[..., :even].reshape(x.shape[:-1] + (even // 2, 2))
            s = pairs[..., 0] + pairs[..., 1]
        x = jnp.concatenate([s, x[..., even:]], axis=-1) if n % 2 else s
        n = x.shape[-1]
    return x[..., 0]


def logsumexp(x: jax.Array) -> jax.Array:
    """``log sum exp(x)`` over the last axis (in ``x``'s dtype) with :func:`row_sum`'s
    batch-independent order; rows of -inf give -inf, +inf gives +inf, NaN stays NaN (as
    jax.nn.logsumexp)."""
    x = jnp.asarray(x)
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    return jnp.log(row_sum(jnp.exp(x - m))) + m[..., 0]


def _log_mass(z):
    """log sum exp(z) over the last axis, for rows whose maximum is 0 (or all -inf)."""
    return jnp.log(row_sum(jnp.exp(z)))


# backends where a round's data-dependent control flow takes its sync-free form (:func:`sync_free`)
SYNC_FREE_BACKENDS = ("gpu",)


def sync_free() -> bool:
    """Whether the programs take the sync-free form of a round's control flow that no batch
    hint decides, because its predicates depend on the logits and the draws, or on a mix of
    rows: on a GPU each would be a copy to the host and a wait for the stream.

    * The exact top-k / top-p cut of rows whose cut is not among the candidates: found by a
      search over every row with a fixed number of steps (:func:`_lift_threshold`, 13-28 more
      kernels per filtered pass) instead of a batch-level ``lax.cond`` over the few such rows
      (:func:`_exact_thresholds`): with the CLI's default top-p 0.9, a cond per pipeline
      pass, four per K=3 round and one per autoregressive step beside the loop's own.
    * A sampled tree's descent (:func:`specjax.tree.descend`): a loop with a known trip
      count (the most nodes the tree's shape lets a descent try), the finished descent
      masked, instead of a ``while`` over the nodes tried (one predicate per tried node).
    * The batch-level conds the hints leave undecided (mixed greedy and sampled rows, or no
      hints): their branch that is exact for every row (:func:`settled`).

    ``$SPECJAX_SYNC_FREE`` (1 / 0), else :data:`SYNC_FREE_BACKENDS`; read when a program is
    traced. The same results either way (on the CPU the same bits, tested)."""
    on = env_switch("SPECJAX_SYNC_FREE")
    return jax.default_backend() in SYNC_FREE_BACKENDS if on is None else on


def env_switch(name: str) -> Optional[bool]:
    """An on / off environment variable: 1 / on / true, 0 / off / false, or unset / auto
    (None: the caller's default); anything else is a ValueError naming it."""
    env = os.environ.get(name, "").strip().lower()
    if env in ("1", "on", "true"):
        return True
    if env in ("0", "off", "false"):
        return False
    if env not in ("", "auto"):
        raise ValueError(f"{name} must be 1, 0 or auto, got {env!r}")
    return None


def _exact_thresholds(z, top_k, top_p, topk_on, slow_k, t_k, t_p, slow):
    """Recompute (t_k, t_p) by bisection for the rows flagged ``slow``, _SLOW_ROWS at a time.

    The cost grows with the number of such rows, not with the batch.
    """
    n = z.shape[0]
    r = min(_SLOW_ROWS, n)
    neg = jnp.full((r,), -jnp.inf, jnp.float32)
    zero = jnp.zeros((r,), jnp.float32)

    def body(state):
        t_k, t_p, todo = state
        idx = jnp.nonzero(todo, size=r, fill_value=n)[0]  # n = out of range: dropped
        at = jnp.minimum(idx, n - 1)
        rows = z[at]
        tk = jnp.where(slow_k[at], _bisect_threshold(rows, None, top_k[at], neg, zero), t_k[at])
        tk = jnp.where(topk_on[at], tk, -jnp.inf)
        zk = jnp.where(rows >= tk[:, None], rows, -jnp.inf)
        pk = jnp.exp(zk - _log_mass(zk)[:, None])
        tp = jnp.where(top_p[at] < 1, _bisect_threshold(zk, pk, top_p[at], neg, zero), -jnp.inf)
        return (t_k.at[idx].set(tk, mode="drop"), t_p.at[idx].set(tp, mode="drop"),
                todo.at[idx].set(False, mode="drop"))

    t_k, t_p, _ = jax.lax.while_loop(lambda s: jnp.any(s[2]), body, (t_k, t_p, slow))
    return t_k, t_p


def _filter_threshold(z, top_k, top_p, topk_on, topp_on, top_values: TopValues = None,
                      cut: str = "exact"):
    """max(top-k threshold, top-p threshold) per row of z [N, V] (max 0); -inf if off.
    ``cut="candidates"``: a cut that lies past the candidates is made at the last of them
    (what the candidates alone give: see :func:`process_rows`)."""
    n, v = z.shape
    m = min(_CANDIDATES, v)
    cand = _top_values(z, m, top_values)  # [N, M], descending
    k = jnp.clip(top_k, 1, v)
    t_k = jnp.where(topk_on, jnp.take_along_axis(cand, (jnp.minimum(k, m) - 1)[:, None],
                                                 axis=-1)[:, 0], _NEG_INF)

    # top-p on the distribution renormalized after top-k; S(c_j) = mass strictly above c_j.
    zk = jnp.where(z >= t_k[:, None], z, _NEG_INF)
    lse_k = _log_mass(zk)
    c = jnp.where(cand >= t_k[:, None], cand, _NEG_INF)
    above = _mass_above(c, jnp.exp(c - lse_k[:, None]))
    ok = (above < top_p[:, None]) & (c > _NEG_INF)
    t_p = jnp.where(topp_on, jnp.min(jnp.where(ok, c, jnp.inf), axis=-1), _NEG_INF)
    if m == v or cut == "candidates":
        # every value is a candidate, so every cut lies among them (k <= V = M): the
        # bisection could never run, and is not compiled (a small vocabulary's program,
        # e.g. the tests' models, is ~20% fewer kernels); a draft's cut ("candidates") is
        # what the candidates give: where the cut lies past them, t_k / t_p are the last one
        return jnp.maximum(t_k, t_p)
    slow_k = topk_on & (k > m)
    # The cut lies among the candidates iff the last one is already cut (or -inf).
    resolved = (c[:, -1] == _NEG_INF) | (above[:, -1] >= top_p)
    slow = slow_k | (topp_on & ~resolved)
    if sync_free():
        # every row searched, the slow rows' results kept: the same thresholds, no conditional
        neg, zero = jnp.full((n,), _NEG_INF, jnp.float32), jnp.zeros((n,), jnp.float32)
        h = current_hints(v)
        if h is None or h.wide_top_k is not False:  # a new top-k cut renormalizes its rows
            t_k = jnp.where(slow_k, _lift_threshold(z, None, top_k, neg, zero), t_k)
            zk = jnp.where(z >= t_k[:, None], z, _NEG_INF)
            lse_k = _log_mass(zk)
        pk = jnp.exp(zk - lse_k[:, None])
        tp = jnp.where(top_p < 1, _lift_threshold(zk, pk, top_p, neg, zero), _NEG_INF)
        return jnp.maximum(t_k, jnp.where(slow, tp, t_p))
    t_k, t_p = jax.lax.cond(
        jnp.any(slow),
        lambda a: _exact_thresholds(z, top_k, top_p, topk_on, slow_k, *a, slow),
        lambda a: a, (t_k, t_p))
    return jnp.maximum(t_k, t_p)


@dataclasses.dataclass(frozen=True)
class BatchHints:
    """What the host knows of a whole call's sampling settings (:func:`hints_for`), for the
    programs traced under :func:`batch_hints`: each field decides a batch-level ``cond`` of
    the pipeline, or leaves it to the program (``None``). Static: part of a program's identity.

    * ``greedy``: every row has temperature 0 (True) or none has (False); ``None`` mixed. True
      also decides the draws (:func:`sample_rows`) and the engine's verification branches:
      every processed row is then a point mass;
    * ``filters``: some non-greedy row has top-p < 1 or 0 < top-k < ``vocab`` (True), or none
      has (False);
    * ``penalties``: the call's ``use_penalties``;
    * ``wide_top_k``: some non-greedy row has a top-k past the candidates (``_CANDIDATES <
      top_k < vocab``): only then does :func:`sync_free`'s search for the top-k cut run;
    * ``vocab``: the vocabulary ``filters`` and ``wide_top_k`` were decided for (logits of
      another width keep their conds)."""
    greedy: Optional[bool]
    filters: bool
    penalties: bool
    vocab: int
    wide_top_k: Optional[bool] = None


def hints_for(params: "SamplingParams", vocab: int, use_penalties: bool) -> BatchHints:
    """The :class:`BatchHints` of a call's per-row settings (host values, as the engine
    holds them before the call), decided as the program would decide its conds."""
    t, top_k, top_p = np.broadcast_arrays(np.asarray(params.temperature, np.float32),
                                          np.asarray(params.top_k, np.int32), np.asarray(params.top_p, np.float32))
    greedy = t == 0
    on = (((top_k > 0) & (top_k < vocab)) | (top_p < 1)) & ~greedy  # as _filtered's topk_on | topp_on
    wide = (top_k > _CANDIDATES) & (top_k < vocab) & ~greedy  # as _filter_threshold's slow_k
    return BatchHints(greedy=bool(greedy.all()) if greedy.all() or not greedy.any() else None,
                      filters=bool(on.any()), penalties=bool(use_penalties), vocab=int(vocab),
                      wide_top_k=bool(wide.any()))


_HINTS: contextvars.ContextVar = contextvars.ContextVar("specjax_batch_hints", default=None)


@contextlib.contextmanager
def batch_hints(hints: Optional[BatchHints]):
    """Trace the pipeline under ``hints`` (None: every batch-level ``cond`` stays a cond)."""
    token = _HINTS.set(hints)
    try:
        yield
    finally:
        _HINTS.reset(token)


def current_hints(vocab: Optional[int] = None) -> Optional[BatchHints]:
    """The hints being traced under (None outside :func:`batch_hints`, or when ``vocab`` is
    given and is not the one they were decided for)."""
    h = _HINTS.get()
    if h is None or (vocab is not None and h.vocab != vocab):
        return None
    return h


def settled(known: Optional[bool], exact_for_all: bool) -> Optional[bool]:
    """A batch-level cond's branch as far as the trace can fix it: ``known`` (the hints'),
    else under :func:`sync_free` ``exact_for_all``, the branch that gives every row its
    result whatever the others' settings (mixed greedy and sampled rows, or no hints), so
    the program tests nothing; else None (the cond tests the data)."""
    if known is not None:
        return known
    return exact_for_all if sync_free() else None


def known_cond(known: Optional[bool], pred, true_fn, false_fn, operand):
    """``lax.cond(pred(), true_fn, false_fn, operand)``, or the branch ``known`` names
    (the same ops, traced without the cond)."""
    if known is True:
        return true_fn(operand)
    if known is False:
        return false_fn(operand)
    return jax.lax.cond(pred(), true_fn, false_fn, operand)


def _leading(params_field, batch_shape, dtype):
    """A per-row field aligned with the leading axes, as a flat [N] array."""
    return jnp.broadcast_to(_lead(params_field, len(batch_shape)), batch_shape).astype(dtype).reshape(-1)


def _controlled(logits, allowed=None, bias=None) -> jax.Array:
    """float32 logits with the bias added and the disallowed tokens at -inf."""
    x = jnp.asarray(logits).astype(jnp.float32)
    nb = x.ndim - 1
    if bias is not None:
        # a finite bias that overflows a logit leaves it the largest float, not +inf (whose
        # normalization, inf - inf, would be NaN): the limit of the law as the bias grows
        x = jnp.minimum(x + _lead_vocab(bias, nb).astype(jnp.float32), _F32_MAX)
    if allowed is not None:
        x = jnp.where(_lead_vocab(allowed, nb), x, _NEG_INF)
    return x


def _penalized(x, params: SamplingParams, counts) -> jax.Array:
    """Repetition and presence penalties on float32 logits, from the history ``counts``."""
    batch_shape = x.shape[:-1]
    seen = _lead_vocab(counts, len(batch_shape)) > 0
    pen = _leading(params.repetition_penalty, batch_shape, jnp.float32).reshape(batch_shape + (1,))
    pres = _leading(params.presence_penalty, batch_shape, jnp.float32).reshape(batch_shape + (1,))
    # an overflow to +inf kept at the largest float, as in _controlled
    return jnp.where(seen, jnp.minimum(jnp.where(x > 0, x / pen, x * pen) - pres, _F32_MAX), x)


def process_logits(logits, params: SamplingParams, counts=None, allowed=None, bias=None,
                   top_values: TopValues = None) -> jax.Array:
    """Logits [..., V] (any float dtype) -> float32 normalized log-probs [..., V].

    ``params`` fields, ``counts`` (int[..., V], occurrences of each token in the
    history), ``allowed`` (bool[..., V] or [V]) and ``bias`` (float[..., V] or [V], added
    to the logits) are aligned with the LEADING axes of
    the logits: a ``[B]`` field with ``[B, T, V]`` logits applies to all T positions of
    row b (numpy broadcasting is the special case of equal rank).  Excluded tokens get
    ``-inf``.  See the module docstring for the order of steps and the filter rules.
    For penalties at draft/verify positions, ``counts`` must include the drafted prefix
    before each position, or the law is not the autoregressive one.
    ``top_values``: how the largest values of each row are found (None: ``lax.top_k``;
    a sharded run passes its vocabulary-sharded ``MeshPlan.top_values``).
    """
    x = _controlled(logits, allowed, bias)
    if counts is not None:
        x = _penalized(x, params, counts)
    return _filtered(x, params, top_values)


def _filtered(x, params: SamplingParams, top_values: TopValues = None, cut: str = "exact") -> jax.Array:
    """The steps of :func:`process_logits` after the controls and penalties: temperature
    (0: greedy), top-k, top-p, min-p, normalization."""
    batch_shape, v = x.shape[:-1], x.shape[-1]

    def row(a, dtype):
        return _leading(a, batch_shape, dtype)

    temperature = row(params.temperature, jnp.float32)
    top_k = row(params.top_k, jnp.int32)
    top_p = row(params.top_p, jnp.float32)
    min_p = row(params.min_p, jnp.float32)

    x = x.reshape(-1, v)
    xmax = jnp.max(x, axis=-1, keepdims=True)
    empty = xmax == _NEG_INF  # every token masked out
    greedy = (temperature == 0)[:, None]
    safe_t = jnp.where(greedy, 1.0, temperature[:, None])
    iota = jnp.arange(v, dtype=jnp.int32)
    # Greedy: a point mass at the first maximum (ties -> lowest id).
    h = current_hints(v)
    first = known_cond(  # the argmax is computed for every row then, used for the greedy ones
        settled(None if h is None else h.greedy, True), lambda: jnp.any(greedy),
        lambda x: jnp.min(jnp.where(x == xmax, iota, v), axis=-1, keepdims=True),
        lambda x: jnp.zeros((x.shape[0], 1), jnp.int32), x)

    def scaled(x):
        z = jnp.where(greedy, jnp.where(iota == first, 0.0, _NEG_INF), (x - xmax) / safe_t)
        return jnp.where(empty, _NEG_INF, z)  # max 0 per row; NaN stays NaN

    topk_on = (top_k > 0) & (top_k < v) & ~greedy[:, 0]
    topp_on = (top_p < 1) & ~greedy[:, 0]
    thr = known_cond(  # rows without a filter get -inf from _filter_threshold as well
        settled(None if h is None else h.filters, True), lambda: jnp.any(topk_on | topp_on),
        lambda x: _filter_threshold(scaled(x), top_k, top_p, topk_on, topp_on, top_values, cut),
        lambda x: jnp.full(x.shape[:1], _NEG_INF, jnp.float32), x)
    # min-p: p(x) >= min_p * max p  <=>  z(x) >= log(min_p)  (log(0) = -inf: off).
    thr = jnp.maximum(thr, jnp.where(greedy[:, 0], _NEG_INF, jnp.log(min_p)))[:, None]
    z = scaled(x)
    z = jnp.where(z >= thr, z, _NEG_INF)
    # The maximum (0) is always kept, so the sum is >= 1.
    out = jnp.where(empty, _NEG_INF, z - _log_mass(z)[:, None])
    out = jnp.where(jnp.isnan(xmax), jnp.nan, out)  # NaN in, NaN out (verify flags it)
    return out.reshape(batch_shape + (v,))


# --------------------------------------------------------------------------------------
# Drawing a token
# --------------------------------------------------------------------------------------

def gumbel(key, shape) -> jax.Array:
    """Standard Gumbel noise from 32 random bits per value (float32).

    ``-log(E)`` with ``E = -log1p(-v)`` and ``v = (bits + 0.5) / 2**32`` clipped below 1:
    the upper tail (the one that lets an improbable token win) reaches ~22.9 instead of
    ~15.9 for a 23-bit uniform, so tokens down to ~1e-11 of the top probability keep
    their chance.
    """
    bits = random_bits(key, shape)  # jax.random.bits(key, shape, uint32), bit for bit
    v = (bits.astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -32)
    v = jnp.minimum(v, jnp.float32(1.0 - 2.0 ** -24))
    return -jnp.log(-jnp.log1p(-v))


def at_most_one_possible(logprobs) -> jax.Array:
    """bool[]: every row of ``logprobs`` [..., V] has at most one finite entry (greedy rows)."""
    return jnp.all(jnp.sum(jnp.asarray(logprobs) > _NEG_INF, axis=-1) <= 1)


def draw_single(logprobs) -> jax.Array:
    """What :func:`sample` returns, whatever its key, for a row with at most one finite entry:
    that entry's index, or -1 when there is none or a NaN. No noise is generated."""
    lp = jnp.asarray(logprobs, jnp.float32)
    ok = lp > _NEG_INF
    tok = jnp.argmax(ok, axis=-1).astype(jnp.int32)
    bad = ~jnp.any(ok, axis=-1) | jnp.any(jnp.isnan(lp), axis=-1)
    return jnp.where(bad, jnp.int32(-1), tok)


def sample(key, logprobs, *, single: bool = False) -> jax.Array:
    """Draw one int32 token from one row's processed log-probs [V] (Gumbel-max).

    Exact up to float32 resolution; a ``-inf`` token is never drawn.  A row with no
    finite entry (nothing allowed) or with NaN returns -1 (``verify.PAD_ID``).
    ``single`` (static): the caller knows the row has at most one finite entry (a greedy
    row; callers test :func:`at_most_one_possible` for the whole batch and branch with a
    ``lax.cond``): the draw is :func:`draw_single`, the same token without generating noise.
    """
    if single:
        return draw_single(logprobs)
    lp = jnp.asarray(logprobs, jnp.float32)
    score = lp + gumbel(key, lp.shape)
    best = jnp.max(score, axis=-1, keepdims=True)
    # first maximum, as argmax (a min over the equal positions is cheaper on CPU)
    tok = jnp.min(jnp.where(score == best, jnp.arange(lp.shape[-1], dtype=jnp.int32),
                            lp.shape[-1]), axis=-1)
    bad = ~(jnp.max(lp, axis=-1) > _NEG_INF) | jnp.any(jnp.isnan(lp), axis=-1)
    return jnp.where(bad, jnp.int32(-1), tok)


# --------------------------------------------------------------------------------------
# Batches of rows (what the engine and the proposers call)
# --------------------------------------------------------------------------------------

def _bcast(params, ndim_extra: int):
    """Give per-row parameter arrays trailing singleton axes to broadcast over T."""
    return jax.tree.map(lambda a: a.reshape(a.shape + (1,) * ndim_extra), params)


def process_rows(logits, params, counts, use_penalties, allowed=None, bias=None,
                 top_values: TopValues = None, cut: str = "exact"):
    """The one sampling pipeline applied to [B, V] or [B, T, V] logits.

    ``counts`` is [B, V] or [B, T, V], or a function of no arguments that returns them
    (then they are computed only when a penalty is on). Penalty work is skipped with a
    batch-level ``lax.cond`` when no row uses a penalty (same law, less work).
    ``cut`` (static): ``"exact"`` (the target's law) or ``"candidates"`` (a draft's: a
    top-k / top-p cut that lies past the ``_CANDIDATES`` largest values of a row is made
    at the last of them, without the exact search: the same law wherever the cut lies
    among them, which at top-p 0.9 is nearly every row).
    """
    if cut not in CUTS:
        raise ValueError(f"cut must be one of {CUTS}, got {cut!r}")
    extra = logits.ndim - 2
    p = _bcast(params, extra)
    x = _controlled(logits, allowed, bias)
    # only the penalties are inside the cond: the rest of the pipeline is traced once (the
    # same ops in the same order as process_logits, so the same bits)
    if counts is not None:
        h = current_hints()
        x = known_cond(None if h is None else h.penalties, lambda: use_penalties,
                       lambda x: _penalized(x, p, counts() if callable(counts) else counts), lambda x: x, x)
    return _filtered(x, p, top_values, cut)


def sample_rows(keys, logprobs):
    """One token per row from [B, V] processed log-probs with per-row keys. When every row
    has at most one possible token (all rows greedy) the draw is that token, taken without
    generating noise (the same result: :func:`draw_single`); under batch hints the branch
    is :func:`all_point_masses`' when it is known."""
    return known_cond(all_point_masses(), lambda: at_most_one_possible(logprobs),
                      lambda lp: jax.vmap(draw_single)(lp),
                      lambda lp: jax.vmap(sample)(keys, lp), logprobs)


def known_greedy() -> Optional[bool]:
    """Whether every row is greedy (True) or none is (False), as the hints being traced
    under say; None without hints or with mixed rows."""
    h = current_hints()
    return None if h is None else h.greedy


def all_point_masses() -> Optional[bool]:
    """For the branches on :func:`at_most_one_possible` (the draws here, the engine's
    verifiers): True when the hints being traced under say every row is greedy (every
    processed row is then a point mass); False when they say none is: the general branch,
    which gives the same tokens for a row that happens to be a point mass (top-k 1, one
    allowed token): the Gumbel-max of a row with one finite entry is that entry, and a
    residual or bonus law with one is drawn alike; None (mixed rows, or no hints): test it,
    except under :func:`sync_free`, which takes the general branch (:func:`settled`)."""
    return settled(known_greedy(), False)
