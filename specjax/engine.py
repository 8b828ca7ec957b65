"""The speculative decoding engine and the autoregressive baseline.

One ``generate`` call = host-side preparation (:func:`prepare_batch`: checks, padding to
buckets, keys), then ONE jitted function: :meth:`SpeculativeEngine._prefill`, then a
``lax.while_loop`` of rounds until every row is done (:meth:`SpeculativeEngine._round`):

    propose : the proposer drafts up to K tokens and their processed log-probs q
    score   : the target runs ONE forward over [s[-1], x_1..x_K] (K+1 positions)
    process : the shared sampling pipeline turns target logits into log-probs p
    verify  : vmap(token_verify | block_verify | greedy_verify) over rows
    commit  : write the emitted tokens (cut at stop tokens / max_new_tokens),
              set cache lengths (rollback = lengths), mark finished rows
    stats   : per-row counters (:class:`RoundStats`)

The loop carries typed state: :class:`DecodeState` (committed tokens and row status),
:class:`RoundStats`, the target's KV cache, the proposer's state and the round index.

Cache convention: a row with committed sequence ``s`` of length c keeps the target's KV
for ``s[:c-1]``; the verify forward feeds ``s[c-1]`` followed by the drafts, so its K+1
output distributions are p(. | s), p(. | s x_1), ..., p(. | s x_1..x_K).

Keys: every row has its own key. Round r of a row uses ``fold_in(row_key, r)``; the
proposer folds in DRAFT and the position, the verifier ACCEPT / RESIDUAL / BONUS and the
position (see ``specjax.keys``). Nothing depends on the row's slot in the batch.

The engine depends on the :class:`specjax.drafts.base.Proposer` protocol only; turning a
draft model or a name into a proposer is ``specjax.drafts.make_proposer`` (and
``specjax.build`` assembles whole runs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import operator
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import keys, sampling, tree as _tree, verify
from specjax.drafts.base import (ChainTreeProposer, CommitContext, ProposeContext, Proposer, hidden_request,
                                 is_tree_proposer)
from specjax.models.base import PREFILL_CHUNK, TreeAttention, compute_id, move_slots, prefill
from specjax.sampling import process_rows, sample_rows

METHODS = ("token", "block", "greedy", "tree")
PAD_ID = verify.PAD_ID
_NO_STOP = -2  # never a token id
RUN_TO_THE_END = 2 ** 30  # the ``until`` of an advance that runs to the end (any generation)


# --------------------------------------------------------------------------------------
# results


@dataclasses.dataclass
class RowStats:
    """One row's statistics. ``accepted`` counts what the verifier accepted, also past a
    stop token or ``max_new_tokens`` (the commit cuts those tokens): a statistic of the
    verifier (``accepted / drafted``: the acceptance rate), so ``accepted + rounds`` may
    exceed ``emitted``, the tokens the row kept."""
    rounds: int
    drafted: int  # draft tokens proposed to the verifier (tree: the nodes)
    accepted: int
    emitted: int
    accepted_per_position: list  # acceptance rate at draft position i (given it was reached)
    reached_per_position: list
    tokens_per_round: float
    mean_alpha: float  # exact mean overlap sum_x min(p, q) at the reached draft positions


@dataclasses.dataclass
class GenerateOutput:
    tokens: list  # list of list[int], the generated tokens of each row (no prompt)
    stats: Optional[list]  # list[RowStats] (None for the autoregressive baseline)
    finished_by_stop: list  # bool per row: ended on a stop token
    raw: dict  # the device arrays as returned by the jitted function

    def as_dict(self):
        return {
            "tokens": self.tokens,
            "finished_by_stop": self.finished_by_stop,
            "stats": None if self.stats is None else [dataclasses.asdict(s) for s in self.stats],
        }


# --------------------------------------------------------------------------------------
# host-side preparation (shared by both engines)


def bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two (>= minimum): prompts and buffers use few shapes."""
    b = minimum
    while b < n:
        b *= 2
    return b


def insert_width(n: int, width: int, chunk: int) -> int:
    """The prompt buffer of a dataset run's one-row prefill (:meth:`generate_dataset`'s
    inserts) for a prompt of ``n`` tokens in a dataset buffer of ``width``: ``n`` rounded up
    to a quarter of its power-of-two :func:`bucket` (at least 16), so at most a quarter of
    the bucket is padding and an octave has at most four widths (40 -> 48, 65 -> 96);
    ``width`` itself where that exceeds the prefill ``chunk`` (a chunked prefill skips the
    chunks past the prompt already) or ``width``."""
    step = max(16, bucket(n) // 4)
    w = -(-n // step) * step
    return w if w <= min(width, chunk) else width


def context_limit(model) -> Optional[int]:
    """The model's context length (positions it can attend over), or None if it sets none."""
    cfg = getattr(model, "config", None)
    for name in ("max_position", "max_seq_len", "context_length", "max_position_embeddings"):
        v = getattr(cfg, name, None)
        if v:
            return int(v)
    return None


@functools.lru_cache(maxsize=None)
def memory_limit() -> Optional[int]:
    """Bytes the local devices can hold in all (None where unknown): the host's physical
    memory for CPU devices (they share it), else the sum of the devices' own limits."""
    devs = jax.local_devices()
    if devs[0].platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        return int(sum(d.memory_stats()["bytes_limit"] for d in devs))
    except (TypeError, KeyError, AttributeError, NotImplementedError, RuntimeError):
        return None


def check_cache_memory(model, rows: int, cache_len: int) -> None:
    """ValueError (one line) where the model's KV cache for ``rows`` rows of ``cache_len``
    slots alone would not fit in :func:`memory_limit`: a clear error before any work
    instead of an allocation failure (or, on a CPU, the process killed) after a compile. A
    model without a context length (a random test model) takes any ``max_new_tokens``."""
    limit = memory_limit()
    init = getattr(model, "init_cache", None)
    if limit is None or init is None:
        return
    shapes = jax.eval_shape(lambda: init(int(rows), int(cache_len)))
    need = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    if need > limit:
        raise ValueError(f"the KV cache of {rows} row(s) x {cache_len} positions needs {need / 2 ** 30:.1f} GiB, "
                         f"more than the devices' {limit / 2 ** 30:.1f} GiB: lower max_new_tokens, the prompts' "
                         "length or the batch size")


def out_cap_for(max_new_tokens: int) -> int:
    """Output buffer slots for ``max_new_tokens`` (a bucket, so lengths share programs)."""
    return bucket(int(max_new_tokens), 32)


def cache_len_for(prompt_len: int, max_new_tokens: int, k: int = 0) -> int:
    """KV-cache slots of a ``generate`` call whose longest prompt has ``prompt_len`` tokens:
    the prompt bucket, the output bucket and K+1 slots for a round's scored tokens, rounded
    up to a multiple of 16 (k = 0: the autoregressive engine's one token)."""
    n = bucket(int(prompt_len)) + out_cap_for(max_new_tokens) + int(k) + 1
    return -(-n // 16) * 16


def _as_params(sampling_params, batch: int) -> sampling.SamplingParams:
    if sampling_params is None:
        return sampling.SamplingConfig().to_params(batch)
    if isinstance(sampling_params, sampling.SamplingParams):
        values = {}
        for f in dataclasses.fields(sampling_params):
            got = np.shape(getattr(sampling_params, f.name))
            if got != (batch,):
                raise ValueError(f"SamplingParams.{f.name} has batch shape {got}, expected ({batch},)")
            values[f.name] = np.asarray(getattr(sampling_params, f.name))
        # built without create() (its fields set directly): the same host checks as create()
        return sampling.SamplingParams.create(batch, **values)
    if isinstance(sampling_params, sampling.SamplingConfig):
        return sampling_params.to_params(batch)
    if isinstance(sampling_params, dict):
        return sampling.SamplingParams.create(batch, **sampling_params)
    raise TypeError(f"unsupported sampling parameters: {type(sampling_params).__name__}")


def _auto_compact(compact) -> bool:
    return isinstance(compact, str) and compact == "auto"


def tail_pays(rounds_left: int, round_s: float, slots: int, m: int, build_s: float) -> bool:
    """Whether moving a dataset run's tail from ``slots`` to ``m`` slots can save more time
    than building the programs of ``m`` slots, expected to take ``build_s`` seconds: a
    round of m rows costs at least m / slots of a round of ``slots`` rows (``round_s``
    seconds; the weights are read once for all rows, so a round's cost grows at most in
    proportion to its rows), and every running row commits at least one token a round, so
    at most ``rounds_left`` rounds (the largest token budget left) remain."""
    return rounds_left * round_s * (1.0 - m / slots) > build_s


CALIBRATION_WARMUP_TOKENS = 8  # tokens per row of calibrate's warm-up pass
CALIBRATION_ROUND_SECONDS = 1.0  # calibrate times each j over about this many seconds of rounds,
CALIBRATION_MIN_ROUNDS = 8  # and at least this many rounds


def calibration_tokens(seconds: float, rounds: int, tokens: int, most: int) -> int:
    """Tokens per row for a timed calibration pass of a j whose warm-up generated ``tokens``
    in ``rounds`` rounds taking ``seconds``: enough rounds to fill about
    ``CALIBRATION_ROUND_SECONDS``, at least ``CALIBRATION_MIN_ROUNDS``, at most ``most``
    tokens (a round of j commits tokens / rounds tokens a row, as in the warm-up)."""
    rounds = max(int(rounds), 1)
    per_round = max(float(seconds), 1e-9) / rounds
    want = max(CALIBRATION_MIN_ROUNDS, math.ceil(CALIBRATION_ROUND_SECONDS / per_round))
    return int(min(most, max(1, math.ceil(want * tokens / rounds))))


def calibration_sizes(prompt_len: int, new_tokens: int, k: int, limit: Optional[int],
                      min_prompt_len: int = 1) -> tuple:
    """(prompt tokens, new tokens) of adaptive K's calibration runs: as asked where they fit
    the model's context ``limit`` with K, else shorter (the prompt at most half of what is
    left); ValueError when not even a token fits."""
    if limit is None or prompt_len + new_tokens + k <= limit:
        return prompt_len, new_tokens
    room = limit - k
    plen = max(min_prompt_len, 1, min(prompt_len, room // 2))
    if room - plen < 1:
        raise ValueError(f"k='auto' cannot measure its round costs: the model's context of {limit} "
                         f"tokens leaves no room for a {plen}-token prompt, K = {k} and a token "
                         "(give them with set_costs)")
    return plen, min(new_tokens, room - plen)


def _prepare_prompts(prompts, vocab_size: int, min_len: int):
    if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 1:
        prompts = [prompts]
    rows = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat sequence of token ids, got shape {a.shape}")
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"prompt {i}: token ids must be integers, got dtype {a.dtype}")
        rows.append(a.astype(np.int64))
    if not rows:
        raise ValueError("no prompts given")
    for i, r in enumerate(rows):
        if r.size == 0:
            raise ValueError(f"prompt {i} is empty")
        if r.size < min_len:
            raise ValueError(
                f"prompt {i} has {r.size} token(s); this proposer needs at least {min_len}"
            )
        if r.min() < 0 or r.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
    lens = np.array([r.size for r in rows], dtype=np.int32)
    buf = np.zeros((len(rows), bucket(int(lens.max()))), dtype=np.int32)
    for i, r in enumerate(rows):
        buf[i, : r.size] = r
    return buf, lens


def _prepare_keys(row_keys, seed, row_indices, batch):
    if row_keys is not None:
        if seed is not None or row_indices is not None:
            raise ValueError("give either per-row keys or a seed (and row_indices), not both")
        row_keys = jnp.asarray(row_keys)
        if not jnp.issubdtype(row_keys.dtype, jax.dtypes.prng_key):
            try:
                row_keys = jax.random.wrap_key_data(row_keys)
            except (TypeError, ValueError) as e:
                raise ValueError(f"keys: expected one PRNG key per row (jax.random.key), got "
                                 f"{row_keys.dtype} data of shape {row_keys.shape}") from e
        if row_keys.shape != (batch,):
            raise ValueError(f"expected one key per row: shape ({batch},), got {row_keys.shape}")
        return row_keys
    if seed is None:
        raise ValueError("give either per-row keys or a seed")
    if row_indices is None:
        row_indices = np.arange(batch)
    row_indices = np.asarray(row_indices)
    if row_indices.shape != (batch,):
        raise ValueError(f"row_indices must have shape ({batch},)")
    return keys.row_keys(keys.check_seed(seed), row_indices)


def _count(name: str, value) -> int:
    """A count >= 1 given as any integer type (``numpy.int64`` included), else ValueError."""
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or isinstance(value, (bool, np.bool_)) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return n


def _chunk(chunk) -> int:
    """A stream's loop iterations per chunk: an integer in [1, 2**31) (``RUN_TO_THE_END``
    included), checked when the stream is made, not at its first chunk."""
    n = _count("chunk", chunk)
    if n > np.iinfo(np.int32).max:
        raise ValueError(f"chunk must be < 2**31, got {chunk!r}")
    return n


def _stop_array(stop_tokens, vocab_size):
    stops = sampling.stop_token_ids(stop_tokens, vocab_size).tolist()
    # a fixed small size so the number of stop tokens rarely changes the shape
    n = max(4, 1 << max(0, len(stops) - 1).bit_length())
    arr = np.full((n,), _NO_STOP, dtype=np.int32)
    arr[: len(stops)] = stops
    return arr


def _check_chunk(chunk) -> int:
    """The prefill chunk: a power of two >= 16 (prompt buffers are powers of two)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"prefill_chunk must be a power of two >= 16, got {chunk!r}")
    return chunk


def _use_penalties(params: sampling.SamplingParams) -> bool:
    rp = np.asarray(params.repetition_penalty)
    pp = np.asarray(params.presence_penalty)
    return bool((rp != 1.0).any() or (pp != 0.0).any())


@dataclasses.dataclass(frozen=True)
class Batch:
    """One ``generate`` call's inputs after the host checks (before device placement).

    ``prompts`` int32[B, P] (P a bucket), ``prompt_lens`` int32[B], ``row_keys`` key[B],
    ``params`` per-row SamplingParams, ``controls`` the generation controls
    (:class:`specjax.sampling.Controls`), ``max_new`` int32[B], ``stop_ids`` int32[n];
    ``out_cap`` and ``cache_len`` are the static buffer sizes of the program."""

    prompts: np.ndarray
    prompt_lens: np.ndarray
    row_keys: Any
    params: sampling.SamplingParams
    controls: sampling.Controls
    max_new: np.ndarray
    stop_ids: np.ndarray
    use_penalties: bool
    out_cap: int
    cache_len: int

    @property
    def size(self) -> int:
        return self.prompts.shape[0]


def prepare_batch(prompts, model, *, k: int = 0, min_prompt_len: int = 1, keys=None, seed=None,
                  row_indices=None, sampling_params=None, max_new_tokens=64,
                  stop_tokens=None, min_new_tokens=0, banned_tokens=None, allowed_tokens=None,
                  logit_bias=None) -> Batch:
    """Every host-side check and the padding of one ``generate`` call. ``k``: draft tokens
    per round (0 for the autoregressive engine); raises ValueError on bad input. The
    generation controls (``min_new_tokens``, ``banned_tokens``, ``allowed_tokens``,
    ``logit_bias``) are described in :func:`specjax.sampling.make_controls`."""
    v = model.vocab_size
    buf, lens = _prepare_prompts(prompts, v, max(1, min_prompt_len))
    b = buf.shape[0]
    params = _as_params(sampling_params, b)
    max_new = sampling.per_row_count("max_new_tokens", max_new_tokens, b, 0)
    limit = context_limit(model)
    need = int((lens + max_new).max()) + k
    if limit is not None and need > limit:
        what = "prompt + max_new_tokens + K" if k else "prompt + max_new_tokens"
        raise ValueError(f"{what} = {need} exceeds the model's context of {limit} tokens")
    controls = sampling.make_controls(b, v, stop_tokens=stop_tokens, min_new_tokens=min_new_tokens,
                                      banned_tokens=banned_tokens, allowed_tokens=allowed_tokens,
                                      logit_bias=logit_bias)
    return Batch(prompts=buf, prompt_lens=lens, row_keys=_prepare_keys(keys, seed, row_indices, b),
                 params=params, controls=controls, max_new=max_new, stop_ids=_stop_array(stop_tokens, v),
                 use_penalties=_use_penalties(params), out_cap=out_cap_for(int(max_new.max())),
                 cache_len=cache_len_for(buf.shape[1], int(max_new.max()), k))


# --------------------------------------------------------------------------------------
# device-side state shared by both loops


@flax.struct.dataclass
class DecodeState:
    """The committed sequences and the status of every row (carried by the while loop)."""

    out: jax.Array  # int32[B, out_cap]: generated tokens (PAD_ID past gen_len)
    seq: jax.Array  # int32[B, S]: prompt + generated tokens (garbage past seq_len)
    counts: jax.Array  # int32[B, V]: token counts of seq (penalties)
    gen_len: jax.Array  # int32[B]
    seq_len: jax.Array  # int32[B]
    done: jax.Array  # bool[B]: finished (stop token, max_new_tokens or error)
    stopped: jax.Array  # bool[B]: finished on a stop token
    error: jax.Array  # bool[B]: invalid probabilities met (NaN, or no token possible)

    @classmethod
    def initial(cls, prompts, prompt_lens, out_cap, seq_cap, vocab_size, max_new) -> "DecodeState":
        b, p = prompts.shape
        valid = jnp.arange(p)[None, :] < prompt_lens[:, None]
        counts = jnp.sum(jax.nn.one_hot(prompts, vocab_size, dtype=jnp.int32) * valid[..., None],
                         axis=1)
        return cls(
            out=jnp.full((b, out_cap), PAD_ID, jnp.int32),
            seq=jnp.zeros((b, seq_cap), jnp.int32).at[:, :p].set(prompts),
            counts=counts,
            gen_len=jnp.zeros((b,), jnp.int32),
            seq_len=prompt_lens,
            done=max_new <= 0,
            stopped=jnp.zeros((b,), bool),
            error=jnp.zeros((b,), bool),
        )

    def last_tokens(self) -> jax.Array:
        """int32[B]: the last committed token of each row."""
        return jnp.take_along_axis(self.seq, (self.seq_len - 1)[:, None], axis=1)[:, 0]

    def commit(self, emitted, num_emit, stop_ids, max_new, err):
        """Append ``emitted[b, :num_emit[b]]`` to each active row, cut at stops / max_new.
        Returns the new state and how many tokens each row took."""
        e = emitted.shape[1]
        j = jnp.arange(e)[None, :]
        active = ~self.done
        valid = j < num_emit[:, None]
        is_stop = jnp.any(emitted[:, :, None] == stop_ids[None, None, :], axis=-1) & valid
        first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), e)
        n = jnp.minimum(jnp.minimum(num_emit, max_new - self.gen_len), first_stop + 1)
        n = jnp.where(active & ~err, n, 0)
        mask = j < n[:, None]
        v = self.counts.shape[-1]
        add = jnp.sum(jax.nn.one_hot(jnp.where(mask, emitted, 0), v, dtype=jnp.int32)
                      * mask[..., None], axis=1)
        gen_len = self.gen_len + n
        stopped = active & (first_stop < n)
        return self.replace(
            out=_write_rows(self.out, self.gen_len, emitted, mask),
            seq=_write_rows(self.seq, self.seq_len, emitted, mask),
            counts=self.counts + add,
            gen_len=gen_len,
            seq_len=self.seq_len + n,
            done=self.done | stopped | (gen_len >= max_new) | (active & err),
            stopped=self.stopped | stopped,
            error=self.error | (active & err),
        ), n


def _write_rows(buf, start, values, mask):
    """buf[b, start[b] + j] = values[b, j] where mask[b, j] (fixed shapes, per row)."""

    def one(row, s, vals, m):
        old = jax.lax.dynamic_slice(row, (s,), vals.shape)
        return jax.lax.dynamic_update_slice(row, jnp.where(m, vals, old), (s,))

    return jax.vmap(one)(buf, start, values, mask)


@flax.struct.dataclass
class RoundStats:
    """Per-row counters of the speculative loop (active rows only)."""

    rounds: jax.Array  # int32[B]
    drafted: jax.Array  # int32[B]
    accepted: jax.Array  # int32[B]
    reached_pos: jax.Array  # int32[B, K]: rounds in which draft position i was verified
    accepted_pos: jax.Array  # int32[B, K]: ... and accepted
    alpha_sum: jax.Array  # float32[B]: sum of the exact overlap at the reached positions
    alpha_n: jax.Array  # int32[B]

    @classmethod
    def zeros(cls, b: int, k: int) -> "RoundStats":
        i = jnp.zeros((b,), jnp.int32)
        return cls(rounds=i, drafted=i, accepted=i, reached_pos=jnp.zeros((b, k), jnp.int32),
                   accepted_pos=jnp.zeros((b, k), jnp.int32),
                   alpha_sum=jnp.zeros((b,), jnp.float32), alpha_n=i)

    def update(self, active, num_draft, num_accepted, q_lp, p_lp) -> "RoundStats":
        """After a round that drafted ``j = q_lp.shape[1]`` tokens (j <= K)."""
        k, j = self.reached_pos.shape[1], q_lp.shape[1]
        pos = jnp.arange(k)[None, :]
        reached = (pos <= num_accepted[:, None]) & (pos < num_draft[:, None]) & active[:, None]
        acc = (pos < num_accepted[:, None]) & active[:, None]
        alpha = jnp.pad(verify.overlap_alpha(q_lp, p_lp[:, :j]), ((0, 0), (0, k - j)))
        return RoundStats(
            rounds=self.rounds + active.astype(jnp.int32),
            drafted=self.drafted + num_draft,
            accepted=self.accepted + jnp.where(active, num_accepted, 0),
            reached_pos=self.reached_pos + reached.astype(jnp.int32),
            accepted_pos=self.accepted_pos + acc.astype(jnp.int32),
            alpha_sum=self.alpha_sum + sampling.row_sum(jnp.where(reached, alpha, 0.0)),
            alpha_n=self.alpha_n + jnp.sum(reached.astype(jnp.int32), axis=1),
        )


    def update_tree(self, active, num_nodes, num_accepted, max_depth) -> "RoundStats":
        """A tree round: ``drafted`` counts valid nodes; depth i counts as reached when the
        accepted path got to depth i and the tree had a node that deep (no overlap)."""
        d = self.reached_pos.shape[1]
        pos = jnp.arange(d)[None, :]
        reached = (pos <= num_accepted[:, None]) & (pos < max_depth[:, None]) & active[:, None]
        acc = (pos < num_accepted[:, None]) & active[:, None]
        return self.replace(
            rounds=self.rounds + active.astype(jnp.int32),
            drafted=self.drafted + jnp.where(active, num_nodes, 0),
            accepted=self.accepted + jnp.where(active, num_accepted, 0),
            reached_pos=self.reached_pos + reached.astype(jnp.int32),
            accepted_pos=self.accepted_pos + acc.astype(jnp.int32),
        )


@flax.struct.dataclass
class AutoState:
    """What the adaptive speculation length (``k="auto"``) learns, for the whole batch:
    decayed counts of draft positions reached and accepted, rounds since the last round
    that drafted, the probe interval, how many rounds drafted each j = 0..K tokens, and how
    many times the loop entered a branch (``switches``: one per call or resume, and one per
    change of j; on a GPU each costs a few host syncs, the branch chain's conditionals)."""

    accepted: jax.Array  # float32[K]: decayed count of accepted drafts at position i
    reached: jax.Array  # float32[K]: decayed count of verified drafts at position i
    since: jax.Array  # int32 scalar: plain rounds since the last round that drafted
    k_rounds: jax.Array  # int32[K+1]: rounds that drafted j tokens
    gap: jax.Array  # int32 scalar: plain rounds in a row before a probe (AUTO_PROBE..AUTO_PROBE_MAX)
    probing: jax.Array  # bool scalar: the last round that drafted was a probe
    switches: jax.Array  # int32 scalar: branches entered (the outer loop's iterations)

    @classmethod
    def zeros(cls, k: int) -> "AutoState":
        return cls(accepted=jnp.zeros((k,), jnp.float32), reached=jnp.zeros((k,), jnp.float32),
                   since=jnp.int32(0), k_rounds=jnp.zeros((k + 1,), jnp.int32),
                   gap=jnp.int32(AUTO_PROBE), probing=jnp.bool_(False), switches=jnp.int32(0))

    def drafted(self, j: int, active, num_draft, num_accepted) -> "AutoState":
        """After a round that drafted j >= 1 tokens: a probe if it came after ``gap`` plain
        rounds; otherwise the rule chose to draft, and the probe interval starts afresh."""
        k = self.accepted.shape[0]
        pos = jnp.arange(k)[None, :]
        reached = (pos <= num_accepted[:, None]) & (pos < num_draft[:, None]) & active[:, None]
        acc = (pos < num_accepted[:, None]) & active[:, None]
        # only positions this round drafted fade: what a deeper position showed stays until
        # it is drafted again (else its counts fade to the prior, the position before's rate,
        # while j stays below it, and the rule under-drafts where acceptance is correlated)
        drafted = jnp.any((pos < num_draft[:, None]) & active[:, None], axis=0)
        g = jnp.where(drafted, AUTO_DECAY, 1.0).astype(jnp.float32)
        # a probe: drafted after ``gap`` plain rounds (a round the rule chose itself between
        # ``gap`` and the cost minimum of ``choose_k`` counts as one too; drafting is costly
        # and rare there)
        probe = self.since >= self.gap
        return AutoState(accepted=g * self.accepted + jnp.sum(acc, axis=0, dtype=jnp.float32),
                         reached=g * self.reached + jnp.sum(reached, axis=0, dtype=jnp.float32),
                         since=jnp.int32(0), k_rounds=self.k_rounds.at[j].add(1),
                         gap=jnp.where(probe, self.gap, jnp.int32(AUTO_PROBE)), probing=probe,
                         switches=self.switches)

    def plain(self) -> "AutoState":
        """After a round that drafted nothing. Right after a probe (the probe did not make
        drafting pay) the probe interval doubles, up to :data:`AUTO_PROBE_MAX`."""
        failed = (self.since == 0) & self.probing
        gap = jnp.where(failed, jnp.minimum(2 * self.gap, AUTO_PROBE_MAX), self.gap)
        return self.replace(since=self.since + 1, k_rounds=self.k_rounds.at[0].add(1), gap=gap,
                            probing=self.probing & ~failed)


AUTO_PRIOR = 0.5  # acceptance assumed at a draft position before any evidence ...
AUTO_PRIOR_WEIGHT = 8.0  # ... worth this many observations (later positions: the one before);
# the shipped head's acceptance varies little between texts (first position, 64 prompts of
# two independently written sets: 0.05-0.10 between prompts), so a prior worth 2 let one or
# two early rejections stop drafting for the rest of a short call (a probe comes only after
# 32+ plain rounds): k=auto made plain rounds 40-60% of the time at batch 1 where K=1 paid
AUTO_DECAY = 0.95  # evidence from older rounds fades (the text changes)
AUTO_PROBE = 32  # after this many plain rounds in a row, one round drafts (fresh evidence) ...
AUTO_PROBE_MAX = 256  # ... and after each probe that leaves drafting unpaid, twice as many
AUTO_PROBE_SHARE = 0.01  # ... and never more often than keeps probes' extra cost under 1%
# part of every cost table's key: bumped when the rounds' code or the way they are measured
# changes, so that tables measured before are not used (2: interleaved calibration passes;
# 3: the branches of j no longer copy the caches, drafting costs smoothed; 4: rounds timed
# without the prefill, one length, 4 passes; 5: always through the streamed programs; 6: a
# deferring proposer's pass over the prompt falls in the first drafting round)
COST_MODEL_VERSION = 6


def smooth_costs(cost) -> np.ndarray:
    """A measured cost table with the drafting rounds' costs (j >= 1) replaced by their
    least-squares line in j (when there are three or more): a drafting round is j draft
    steps and a (j+1)-token verify pass, linear in j, while the timings carry a few
    percent of noise each, which alone could make the rule skip a j (a measured 24.0,
    27.2, 27.8 ms never chooses j=2). Clipped from below at the plain round's cost."""
    cost = np.asarray(cost, np.float64).copy()
    j = np.arange(1, cost.shape[0])
    if j.shape[0] >= 3 and np.all(np.isfinite(cost[1:])):
        slope, icpt = np.polyfit(j, cost[1:], 1)
        cost[1:] = np.maximum(icpt + slope * j, cost[0])
    return cost


def _expected_max_normal(n) -> jax.Array:
    """E[max of n i.i.d. standard normals] (Blom's approximation, within 0.03 for n = 2..64;
    0 for n <= 1)."""
    n = jnp.maximum(jnp.asarray(n, jnp.float32), 1.0)
    return jnp.maximum(jax.scipy.special.ndtri((n - 0.375) / (n + 0.25)), 0.0)


def batch_tokens_per_round(e, surv, remaining) -> jax.Array:
    """Tokens per round of a batch that runs until its LAST row is done, for each j = 0..K
    (``e``: a row's expected tokens per round drafting j, ``surv``: P(at least i drafts
    accepted), i = 1..K; ``remaining``: int[B], each running row's token budget left, 0
    for done rows). The batch takes the most rounds of its rows: a row that needs r tokens
    takes about r / E_j rounds, with a standard deviation of sqrt(r V_j / E_j^3) (V_j: the
    variance of a round's tokens), and the longest of n rows about z_n standard deviations
    more (z_n: E[max of n standard normals]; n: the rows whose budget is within two
    standard deviations of the largest, m), never more than m rounds. The rate is m over
    that: E_j for one row or a long run, down to 1 (a plain step's) for many rows that
    need few tokens, where some row rejects every round."""
    k = surv.shape[0]
    i = jnp.arange(1, k + 1, dtype=jnp.float32)
    # E[A^2] = sum_i (2i - 1) P(A >= i) for the accepted count A of a round drafting j
    ea2 = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum((2.0 * i - 1.0) * surv)])
    var = jnp.maximum(ea2 - (e - 1.0) ** 2, 0.0)
    r = jnp.asarray(remaining, jnp.float32)
    m = jnp.max(r)
    spread = jnp.sqrt(m * var / e)  # standard deviation, in tokens, of what a row makes in m / E_j rounds
    close = (r[None, :] > 0) & (r[None, :] >= m - 2.0 * spread[:, None])
    z = _expected_max_normal(jnp.sum(close, axis=1))
    rounds = jnp.minimum((m + z * spread) / e, m)  # spread / E_j: the deviation in rounds
    return jnp.where(m > 0, m / jnp.maximum(rounds, 1e-6), e)


def choose_k(auto: AutoState, costs, remaining=None, tail=True) -> jax.Array:
    """The adaptive rule: the number of draft tokens j in 0..K that maximizes expected
    tokens per unit cost, ``E_j / costs[j]``, where ``E_j = 1 + sum_{i<=j} prod_{m<=i} a_m``
    with ``a_m`` the batch's (decayed, smoothed) acceptance rate at draft position m and
    ``costs[j]`` the measured cost of a round that drafts j tokens (``inf``: never). With
    ``remaining`` (each row's token budget left, 0 for done rows) and ``tail`` (the loop
    runs until every row is done: a fixed batch, not a dataset run's slots, which are
    refilled), ``E_j`` is the batch's rate, :func:`batch_tokens_per_round`: the rows wait
    for the slowest. After ``auto.gap`` plain rounds in a row (:data:`AUTO_PROBE`, doubled
    after every probe that is followed by a plain round, up to :data:`AUTO_PROBE_MAX`;
    back to :data:`AUTO_PROBE` when the rule drafts of itself), and at least ``x /
    AUTO_PROBE_SHARE`` where the probe costs ``x`` plain rounds more than a plain round,
    the best j >= 1 is tried once (in a fixed batch only while some row has at least that
    many tokens left to use it on). Reads only what earlier rounds left (``auto``, the
    budgets): the choice never depends on the current round's draws, so every round is an
    exact speculative (or plain) step whatever j is."""
    k = auto.accepted.shape[0]
    a, prev = [], jnp.float32(AUTO_PRIOR)
    for i in range(k):
        prev = (auto.accepted[i] + AUTO_PRIOR_WEIGHT * prev) / (auto.reached[i] + AUTO_PRIOR_WEIGHT)
        a.append(prev)
    surv = jnp.cumprod(jnp.stack(a))
    e = jnp.concatenate([jnp.ones((1,), jnp.float32), 1.0 + jnp.cumsum(surv)])
    if remaining is not None:
        e = jnp.where(tail, batch_tokens_per_round(e, surv, remaining), e)
    c = jnp.asarray(costs, jnp.float32)
    score = e / c
    best = jnp.argmax(score).astype(jnp.int32)
    best_spec = (1 + jnp.argmax(score[1:])).astype(jnp.int32)
    # a probe costs x = costs[j] / costs[0] - 1 plain rounds more than a plain round: at
    # least x / AUTO_PROBE_SHARE plain rounds between probes keep them under that share
    # of the time (a batch-16 probe on 2 CPU cores costs ~0.8 plain rounds; at batch 1 0.23-0.34)
    extra = jnp.where(jnp.isfinite(c[best_spec]), c[best_spec] / c[0] - 1.0, 0.0)
    gap = jnp.maximum(auto.gap, jnp.ceil(extra * (1.0 / AUTO_PROBE_SHARE)).astype(jnp.int32))
    probe = (best == 0) & (auto.since >= gap) & (jnp.max(score[1:]) > 0)
    if remaining is not None:
        # a batch with fewer tokens left than rounds between probes could not use what a
        # probe shows (at batch 4 x 48 tokens the first probe came at round 44: 1-2% of
        # the run for nothing)
        probe = probe & (~jnp.asarray(tail) | (jnp.max(remaining) >= gap))
    return jnp.where(probe, best_spec, best)


@flax.struct.dataclass
class SpecCarry:
    """The speculative while loop's carry."""

    state: DecodeState
    stats: RoundStats
    target_cache: Any  # the target's KVCache: KV for s[:c-1]
    proposer_state: Any
    round: jax.Array  # int32 scalar: loop iterations so far
    auto: AutoState  # adaptive K's evidence (unused with a fixed K)


@flax.struct.dataclass
class ARCarry:
    """The autoregressive while loop's carry."""

    state: DecodeState
    target_cache: Any
    round: jax.Array  # int32 scalar: the step index


class TokenStream:
    """What ``engine.stream(...)`` returns: iterate for the tokens each row committed in each
    chunk of the loop (a list with one list of token ids per row; empty for rows that
    committed nothing); once exhausted, :attr:`output` is the :class:`GenerateOutput`,
    the same as ``generate`` with the same arguments returns."""

    def __init__(self, gen):
        self._gen = gen
        self._ended = False
        self.output: Optional[GenerateOutput] = None

    def __iter__(self):  # the stream itself: a loop left early goes on where it stopped
        return self

    def __next__(self) -> list:
        if self._ended:
            raise StopIteration
        try:
            return next(self._gen)
        except StopIteration as e:
            self._ended = True
            self.output = e.value
            raise StopIteration from None

    def run(self) -> GenerateOutput:
        """Consume the rest of the stream (ignoring the chunks) and return the output."""
        for _ in self:
            pass
        return self.output


# --------------------------------------------------------------------------------------
# optional sharding (specjax.sharding.MeshPlan): no-ops when the engine has none

_LOGITS = ("batch", None, "vocab")


_OWN = object()  # _call_args: the hints of the batch it is given


def _all_greedy(params: sampling.SamplingParams) -> sampling.SamplingParams:
    """``params`` with temperature 0 for every row (``greedy=True`` of the autoregressive
    engine: the same program, since it is a value)."""
    return params.replace(temperature=np.zeros(np.shape(params.temperature), np.float32))


def resolve_batch_hints(batch_hints: Optional[bool] = None) -> bool:
    """Whether an engine traces its programs under each call's batch hints
    (:class:`specjax.sampling.BatchHints`): a bool as given; None: ``$SPECJAX_BATCH_HINTS``
    (1 / 0), else on a GPU only. There each batch-level ``cond`` the hints decide would be a
    device-to-host copy and a stream wait per round (XLA's ``ConditionalThunk``); on a CPU a
    cond costs about a microsecond, while the hints make a program per kind of call (greedy
    or not, filters, penalties) where one serves them all; on a TPU conds run on the chip.
    Either way the tokens are the same."""
    if batch_hints is not None:
        if not isinstance(batch_hints, bool):
            raise ValueError(f"batch_hints must be True, False or None, got {batch_hints!r}")
        return batch_hints
    on = sampling.env_switch("SPECJAX_BATCH_HINTS")
    return jax.default_backend() == "gpu" if on is None else on


def skip_empty_rounds() -> bool:
    """Whether a round in which no row drafted runs a 1-token step instead of the K+1-token
    pass (for proposers that may draft nothing, e.g. prompt lookup): on the CPU only. There a
    4-token pass costs ~1.4 one-token steps; on a GPU or TPU it costs about one (the weights
    are read once either way: 1.00-1.06 on the H200 up to 8 tokens, BENCHMARKS.md), so the
    test saves nothing there and its conditional costs copies of both KV caches (XLA copies
    the caches a conditional's branches update: 54.5 MB a round for a Llama-3-8B shape at
    batch 1, ``scripts/accel_aot.py``) and, on a GPU, a host sync per round. Decided when
    the program is traced. Either way the target's law; on the CPU, whose kernels keep a
    row's bits whatever the number of positions, also the same tokens (tested); on a GPU
    the position-0 logits of the two passes may round differently in their last bits."""
    return jax.default_backend() == "cpu"


def resolve_compiler_options(compiler_options=None) -> dict:
    """An engine's ``compiler_options`` (``jax.jit``'s): None or ``{}`` -> none (XLA's
    defaults, or what ``XLA_FLAGS`` sets); else a dict of XLA option names to bool / int /
    float / str values, part of every program the engine compiles and of its cost tables'
    key. (``scripts/bench_compiler_options.py`` times a set against XLA's defaults: on a CPU
    ``{"xla_cpu_use_fusion_emitters": False}`` compiles ~25% faster but samples 5-10%
    slower at T=1; ``{"xla_backend_optimization_level": 1}`` compiles 5-12% faster and
    decodes ~1% slower: BENCHMARKS.md.)"""
    if compiler_options is None:
        return {}
    if not isinstance(compiler_options, dict) or not all(
            isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in compiler_options.items()):
        raise ValueError(f"compiler_options must be a dict of XLA option names to bool, int, float or str "
                         f"values, got {compiler_options!r}")
    return dict(compiler_options)


class _Sharded:
    """Mixin: placement of inputs and constraints inside the trace for ``self.sharding``;
    the batch hints a call's programs are traced under."""

    sharding = None
    batch_hints = False
    compiler_options: Optional[dict] = None

    def _jit(self, fn, **kwargs):
        """``jax.jit(fn, **kwargs)`` with the engine's compile options."""
        return jax.jit(fn, compiler_options=self.compiler_options or None, **kwargs)

    def _jit_programs(self) -> None:
        """The engine's jitted programs: a whole generation (``_run``) and the streamed one in
        chunks (``_start``, ``_advance``, ``_finish``); compiled ones are kept per signature."""
        self._run = self._jit(self._program, static_argnames=("out_cap", "cache_len", "hints"))
        self._start = self._jit(self._start_program, static_argnames=("out_cap", "cache_len", "hints"))
        self._advance = self._jit(self._advance_program, donate_argnums=(0,), static_argnames=("hints",))
        self._finish = self._jit(self._finish_program, static_argnames=("out_cap",))
        self._compiled: dict = {}  # signature -> compiled program (see _executable)
        # id of a program in _compiled (kept there for the engine's life) -> seconds its
        # tracing, lowering and compiling (or loading from the compile cache) took
        self._build_seconds: dict = {}

    def _hints_of(self, batch: Batch, greedy: bool = False):
        """The :class:`specjax.sampling.BatchHints` of ``batch``'s settings (``greedy``: every
        row at temperature 0), or None when this engine does not use them."""
        if not self.batch_hints:
            return None
        params = _all_greedy(batch.params) if greedy else batch.params
        return sampling.hints_for(params, self.target.vocab_size, bool(batch.use_penalties))

    def _with_hints(self, full: Batch, static_opts: dict) -> dict:
        """A dataset run's options with the hints of the whole dataset (the rows a slot takes
        later included), so that every program of the run is traced under the same hints."""
        return dict(static_opts, hints=self._hints_of(full, static_opts.get("greedy", False)))

    @property
    def _top_values(self):
        """The sampling pipeline's top-m search: vocabulary-sharded under a mesh."""
        return None if self.sharding is None else self.sharding.top_values

    def _c(self, x, names, role="target"):
        return x if self.sharding is None else self.sharding.constrain(x, names, role)

    def _c_cache(self, cache, role="target"):
        return cache if self.sharding is None else self.sharding.constrain_caches(cache, role)

    def _c_state(self, state: DecodeState) -> DecodeState:
        if self.sharding is None:
            return state
        c = self.sharding.constrain
        return jax.tree.map(lambda v: c(v, ("batch",) + (None,) * (v.ndim - 1)),
                            state.replace(counts=None)).replace(counts=c(state.counts, ("batch", "vocab")))

    def _c_out(self, out):
        """Outputs replicated: every host can read them (multi-host ``device_get``)."""
        return out if self.sharding is None else self.sharding.constrain_replicated(out)

    def _put(self, x):
        """A small array every device reads (replicated under a mesh)."""
        return _on_device(x) if self.sharding is None else self.sharding.put_replicated(x)

    def _role(self, role):
        return contextlib.nullcontext() if self.sharding is None else self.sharding.role(role)

    def _context(self):
        return contextlib.nullcontext() if self.sharding is None else self.sharding.context()

    def lower(self, prompts, **kwargs):
        """Ahead-of-time: ``jax.jit(...).lower`` of the program ``generate`` would run with
        these arguments (the models' params may be abstract ``jax.ShapeDtypeStruct``s;
        ``greedy=`` for the autoregressive engine); ``.compile()`` it for the compiled HLO and
        its memory analysis (``temp_size_in_bytes``: what the program allocates besides its
        inputs and outputs, where a copy of a cache or of a layer's weights would show)."""
        opts = {"greedy": kwargs.pop("greedy")} if "greedy" in kwargs else {}
        args, static = self._call_args(self.prepare(prompts, **kwargs), **opts)
        with self._context():
            return self._run.lower(*args, **static)

    def _placed(self, params, role):
        """Parameters in the shardings the rules give (moved there if they are not)."""
        if self.sharding is None or params is None:
            return params
        return self.sharding.place_params(params, role)

    def _executable(self, args, static, program: str = "_run"):
        """The compiled ``program`` (``_run``: a whole generation; ``_start`` / ``_advance``:
        the streamed one in chunks) for these arguments: built once per signature (shapes,
        dtypes and shardings of the arguments, static settings) and kept by the engine."""
        sig = (program, tuple((getattr(a, "shape", None), getattr(a, "dtype", None),
                               getattr(a, "sharding", None)) for a in jax.tree.leaves(args)),
               tuple(sorted(static.items())))
        exe = self._compiled.get(sig)
        if exe is None:
            t0 = time.perf_counter()
            with self._context():
                exe = self._compiled[sig] = getattr(self, program).lower(*args, **static).compile()
            self._build_seconds[id(exe)] = time.perf_counter() - t0
        return exe

    def _stream_executables(self, args, static):
        """The compiled ``_start``, ``_advance`` and ``_finish`` programs of a streamed run:
        the last two are compiled for the carry as ``_start`` lays it out (shapes, dtypes and
        shardings), so that compiling needs no run."""
        start = self._executable(args, static, "_start")
        carry = jax.tree.map(lambda i, sh: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=sh),
                             start.out_info, start.output_shardings)
        advance = self._executable((carry, *self._advance_inputs(args), np.int32(0), np.bool_(False)),
                                   dict(hints=static["hints"]), "_advance")
        finish = self._executable((carry,), dict(out_cap=static["out_cap"]), "_finish")
        return start, advance, finish

    def _measure_streamed(self, batch: Batch, static_opts: dict) -> None:
        """For a streamed or dataset run of an adaptive engine whose cost table at this
        batch size is still to measure: measure it before the run (with the streamed
        programs the run compiles anyway)."""
        if getattr(self, "adaptive", False) and "costs" not in static_opts:
            self.costs_for(batch.size, like=batch)

    def _stream(self, batch: Batch, chunk: int, static_opts: dict, with_stats: bool,
                raise_on_error: bool):
        """Run ``batch`` in chunks of ``chunk`` loop iterations with the loop state kept on
        the devices (donated from chunk to chunk), yielding after each chunk the tokens
        every row committed in it; returns the :class:`GenerateOutput`. The chunks run the
        same rounds with the same keys as :meth:`generate`, so the tokens are the same.
        ``chunk``: checked by the callers (:func:`_chunk`), when the stream is made."""
        self._measure_streamed(batch, static_opts)
        args, static = self._call_args(batch, **static_opts)
        start, advance, finish = self._stream_executables(args, static)
        rest = self._advance_inputs(args)
        with self._context():
            carry = start(*args)
            seen = [0] * batch.size
            for until in itertools.count(chunk, chunk):
                carry = advance(carry, *rest, np.int32(until), np.bool_(False))
                st = jax.device_get(dict(out=carry.state.out, gen_len=carry.state.gen_len,
                                         done=carry.state.done))
                new = [st["out"][i, seen[i]: st["gen_len"][i]].tolist() for i in range(batch.size)]
                seen = [int(st["gen_len"][i]) for i in range(batch.size)]
                yield new
                if st["done"].all():
                    break
            res = finish(carry)
        return _to_output(res, with_stats=with_stats, raise_on_error=raise_on_error, rows=batch.size)

    def _dataset_executables(self, full: Batch, b: int, static_opts: dict):
        """The arguments of the first ``b`` rows and the compiled ``_start``, ``_advance``,
        ``_finish`` and ``_insert`` programs of a dataset run (built once per shapes;
        ``_insert`` once per :func:`insert_width` of the rows after the first ``b``, all
        before the run starts: the 4th value calls the one for its arguments' width)."""
        if self.sharding is not None:
            raise ValueError("generate_dataset runs without a mesh (sharding) for now")
        b = _count("batch_size", b)
        rows = _batch_rows(full, range(b))
        self._measure_streamed(rows, static_opts)
        args, static = self._call_args(rows, **static_opts)
        start, advance, finish = self._stream_executables(args, static)
        carry = jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), start.out_info)
        head = ("_insert", str(jax.tree.structure(carry)),
                tuple((x.shape, x.dtype) for x in jax.tree.leaves(carry)), tuple(sorted(static.items())))

        def program(one):  # the compiled _insert for one-row arguments of these shapes
            sig = head + (str(jax.tree.structure(one)), tuple((getattr(a, "shape", None), getattr(a, "dtype", None))
                                                              for a in jax.tree.leaves(one)))
            got = self._compiled.get(sig)
            if got is None:
                got = self._compiled[sig] = self._jit(
                    self._insert_program, donate_argnums=(0,), static_argnames=("out_cap", "cache_len", "hints")
                ).lower(carry, one, np.int32(0), **static).compile()
            return got

        def insert(c, one, slot):
            return program(one)(c, one, slot)

        widths = {}  # a row of each insert width the run prefills: all compiled before it starts
        for i in range(b, full.size):
            widths.setdefault(insert_width(int(full.prompt_lens[i]), full.prompts.shape[1],
                                           self.prefill_chunk), i)
        for i in widths.values():
            program(self._one_row_args(full, i, static_opts))
        return args, (start, advance, finish, insert)

    def _tail_sizes(self, b: int, compact=True) -> list:
        """The smaller batch sizes a dataset run's tail may move to (:meth:`_dataset`),
        largest first: ``compact="auto"`` or True b // 2, b // 4, ..., 1; a sequence: those
        sizes below b; False: none. An adaptive engine without a cost table at a size borrows
        one (:meth:`_opts_at`)."""
        if compact is True or _auto_compact(compact):
            sizes, s = [], b // 2
            while s >= 1:
                sizes.append(s)
                s //= 2
        elif compact is False or compact is None:
            sizes = []
        else:
            try:
                ok = all(not isinstance(m, bool) and int(m) == m >= 1 for m in compact)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"compact must be 'auto', True, False or a list of batch sizes >= 1, got {compact!r}")
            sizes = [int(m) for m in compact]
        return sorted({m for m in sizes if m < b}, reverse=True)

    def _opts_at(self, static_opts: dict, m: int, b: int) -> dict:
        """``_call_args`` options for a dataset run's loop at ``m`` of its ``b`` slots. An
        adaptive engine with no cost table at ``m`` borrows that of the nearest larger size
        up to ``b`` that has one (``b`` has one: the run measured it before it started), so
        that the tail never stops to measure a table. The ratios are what the rule reads,
        and drafting costs relatively more at larger batches: a borrowed table errs toward
        plain rounds, never toward drafting more than pays."""
        if not getattr(self, "adaptive", False) or self.has_costs(m):
            return static_opts
        for s in range(m + 1, b + 1):
            if self.has_costs(s):
                return dict(static_opts, costs=self.costs_for(s))
        return static_opts

    def _tail_executables(self, full: Batch, big, m: int, static_opts: dict):
        """For a dataset run's tail at ``m`` slots: the compiled ``_advance`` and ``_finish``
        of that batch size, the program that gathers rows ``idx`` (int32[m]) of a running
        loop state laid out like ``big`` (a loop state or its shapes) into one of ``m`` rows
        (leaves with a batch axis are gathered along it; batch-level leaves, such as the
        loop index and adaptive K's evidence, stay), and the shapes of the result. Built
        once per engine and shapes."""
        big = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), big)
        sig, args, static = self._tail_sig(full, big, m, static_opts)
        got = self._compiled.get(sig)
        if got is None:
            small = jax.eval_shape(functools.partial(self._start_program, **static), *args)
            small = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), small)
            advance = self._executable((small, *self._advance_inputs(args), np.int32(0), np.bool_(False)),
                                       dict(hints=static["hints"]), "_advance")
            finish = self._executable((small,), dict(out_cap=static["out_cap"]), "_finish")

            def gather(carry, idx):
                return jax.tree.map(lambda x, sm: _take_batch_rows(x, sm.shape, idx), carry, small)

            take = self._jit(gather).lower(big, np.zeros(m, np.int32)).compile()
            got = self._compiled[sig] = (advance, finish, take, small)
        return got

    def _tail_sig(self, full: Batch, big, m: int, static_opts: dict) -> tuple:
        """(signature, arguments, static settings) of :meth:`_tail_executables`."""
        args, static = self._call_args(_batch_rows(full, range(m)), **self._no_costs(static_opts))
        # the loop's other inputs too: the stop tokens' buffer and the controls present
        # (allowed, bias) change with the call, not with the loop state
        inputs = self._advance_inputs(args)
        sig = ("_tail", str(jax.tree.structure(big)), tuple((x.shape, x.dtype) for x in jax.tree.leaves(big)),
               m, tuple(sorted(static.items())), str(jax.tree.structure(inputs)),
               tuple((getattr(a, "shape", None), getattr(a, "dtype", None)) for a in jax.tree.leaves(inputs)))
        return sig, args, static

    def _tail_built(self, full: Batch, big, m: int, static_opts: dict) -> bool:
        """Whether :meth:`_tail_executables` has the programs of this move already (``big``:
        the loop state itself; its signature reads only shapes and dtypes)."""
        return self._tail_sig(full, big, m, static_opts)[0] in self._compiled

    def _compile_tail(self, full: Batch, b: int, carry, static_opts: dict, tail: list) -> None:
        """Compile every program a dataset run at ``b`` slots may move its tail to."""
        shapes = {b: carry}
        for size in [b] + tail:
            for m in tail:
                if m < size:
                    shapes[m] = self._tail_executables(full, shapes[size], m, static_opts)[3]

    def _compile_dataset(self, full: Batch, b: int, static_opts: dict, compact) -> None:
        """The programs of ``generate_dataset(batch_size=b, compact=compact)``."""
        static_opts = self._with_hints(full, static_opts)
        # "auto": the tail's programs are built during a run, where they pay (_dataset)
        tail = [] if _auto_compact(compact) else self._tail_sizes(b, compact)
        _, (start, *_) = self._dataset_executables(full, b, static_opts)
        if tail:
            carry = jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), start.out_info)
            self._compile_tail(full, b, carry, static_opts, tail)

    def _one_row_args(self, full: Batch, i: int, static_opts: dict) -> tuple:
        """The arguments of ``_insert`` for dataset row ``i``: its prompt in a buffer of
        :func:`insert_width` tokens (so that a 40-token prompt is prefilled as 48 tokens,
        not at the dataset's bucket of 64; one ``_insert`` program per width). The prefill
        reads no costs: an adaptive engine gets a placeholder table of the same shape, so
        that inserting never measures costs at batch size 1."""
        one = _batch_rows(full, [i])
        w = insert_width(int(one.prompt_lens[0]), one.prompts.shape[1], self.prefill_chunk)
        one = dataclasses.replace(one, prompts=one.prompts[:, :w])
        return self._call_args(one, **self._no_costs(static_opts))[0]

    def _no_costs(self, static_opts: dict) -> dict:
        """``_call_args`` options for a program that reads no costs (a prefill, or one only
        compiled): an adaptive engine gets a placeholder table of the right shape, so that
        nothing is measured for it."""
        if getattr(self, "adaptive", False):
            return dict(static_opts, costs=np.ones(self.k + 1))
        return static_opts

    def _insert_program(self, carry, args_one, slot, *, out_cap, cache_len, hints=None):
        """Prefill one prompt (``args_one``: :meth:`_call_args` of a one-row batch) and put
        it in batch row ``slot`` of the loop state: its state, statistics and caches
        start afresh; the loop index and batch-level evidence stay."""
        one = self._start_program(*args_one, out_cap=out_cap, cache_len=cache_len, hints=hints)
        b = carry.state.seq_len.shape[0]
        rows = {f.name: jax.tree.map(lambda big, small: _put_row(big, small, slot, b),
                                     getattr(carry, f.name), getattr(one, f.name))
                for f in dataclasses.fields(carry) if f.name not in ("round", "auto")}
        return carry.replace(**rows)

    def _dataset(self, full: Batch, batch_size: int, static_opts: dict, with_stats: bool,
                 raise_on_error: bool, on_row=None, compact="auto") -> GenerateOutput:
        """Continuous batching: ``batch_size`` slots; the loop pauses when a row finishes,
        its output is read, the next prompt is prefilled into its slot (one compiled
        ``_insert``) and the loop goes on. Every row keeps its dataset key and its own
        round / step count, so its tokens are those it gets alone. ``compact``: once no
        prompt is left and the running rows fit in a smaller size of :meth:`_tail_sizes`,
        they move to a loop state of the smallest such size (their state, caches and counts
        gathered, nothing recomputed), so that the tail does not pay for idle rows; with
        ``"auto"``, of those whose programs are built or pay for their building."""
        batch_size = _count("batch_size", batch_size)
        if on_row is not None and not callable(on_row):
            raise TypeError(f"on_row must be a function of (row index, row results), got {on_row!r}")
        n = full.size
        b = min(batch_size, n)
        # per-row values on the host once: every pause picks rows from them (numpy, not
        # one eager device gather per leaf and pause)
        on_host = lambda a: np.asarray(jax.device_get(a)) if isinstance(a, jax.Array) else a  # noqa: E731
        full = dataclasses.replace(full, params=jax.tree.map(on_host, full.params),
                                   controls=jax.tree.map(on_host, full.controls))
        static_opts = self._with_hints(full, static_opts)
        slots = list(range(b))  # dataset row in each slot (None: idle, nothing left)
        nxt = b
        tail = self._tail_sizes(b, compact)
        args, (start, advance, finish, insert) = self._dataset_executables(full, b, static_opts)
        # compact="auto": a size whose programs are not built yet is moved to only when the
        # move can save more than building them is expected to take, as long as building
        # this size's own took (tail_pays)
        when_pays = _auto_compact(compact)
        build_s = self._build_seconds.get(id(advance), 0.0) + self._build_seconds.get(id(finish), 0.0)
        run_s = 0.0  # seconds in `advance` at the current size
        opts_at = {m: self._opts_at(static_opts, m, b) for m in [b] + tail}  # b's table: measured now
        one_args = lambda i: self._one_row_args(full, i, static_opts)  # noqa: E731
        results: list = [None] * n
        inserts = 0
        stages = []  # (slots, loop iterations) of each batch size the run went through
        stage_start = 0
        with self._context():
            carry = start(*args)
            rest = self._advance_inputs(args)
            refill = True  # look before running: a row with max_new_tokens 0 is done at once
            while True:
                t0 = time.perf_counter()
                if not refill:
                    carry = advance(carry, *rest, np.int32(RUN_TO_THE_END), np.bool_(True))
                done, now = jax.device_get((carry.state.done, carry.round))
                done = np.asarray(done)
                if not refill:
                    run_s += time.perf_counter() - t0
                finished = [s for s in range(len(slots)) if slots[s] is not None and done[s]]
                refill = False
                if finished:
                    host = _host(finish(carry))
                    for s in finished:
                        results[slots[s]] = {k: v[s] for k, v in host.items() if k not in BATCH_LEVEL}
                        if on_row is not None:
                            on_row(slots[s], results[slots[s]])
                        if nxt < n:
                            carry = insert(carry, one_args(nxt), np.int32(s))
                            slots[s] = nxt
                            nxt += 1
                            inserts += 1
                            refill = True  # (so may the inserted row be)
                        else:
                            slots[s] = None
                    running = [s for s in range(len(slots)) if slots[s] is not None]
                    if not running:
                        break
                    fits = [m for m in tail if len(running) <= m < len(slots)] if nxt >= n else []
                    if fits and when_pays:
                        left = max(int(full.max_new[slots[s]]) - int(host["gen_len"][s]) for s in running)
                        round_s = run_s / max(int(now) - stage_start, 1)
                        # (the arithmetic first: the lookup prepares the size's arguments)
                        fits = [m for m in fits if tail_pays(left, round_s, len(slots), m, build_s)
                                or self._tail_built(full, carry, m, static_opts)]
                    if fits:  # the tail: move the running rows to fewer slots
                        m = min(fits)
                        idle = [s for s in range(len(slots)) if slots[s] is None]
                        idx = running + idle[: m - len(running)]  # idle rows are done: never read
                        stages.append((len(slots), int(now) - stage_start))
                        stage_start, run_s = int(now), 0.0
                        advance, finish, take, _ = self._tail_executables(full, carry, m, static_opts)
                        carry = take(carry, np.asarray(idx, np.int32))
                        slots = [slots[s] for s in idx]
                    live = [x if x is not None else 0 for x in slots]
                    # idle slots keep a finished row (done): its inputs are never used
                    args_now, _ = self._call_args(_batch_rows(full, live), **opts_at[len(slots)])
                    rest = self._advance_inputs(args_now)
            host = _host(finish(carry))
        stages.append((len(slots), int(host["iterations"]) - stage_start))
        rows = {k: np.stack([r[k] for r in results]) for k in results[0]}
        rows.update({k: host[k] for k in BATCH_LEVEL if k in host})
        out = _to_output(rows, with_stats=with_stats, raise_on_error=raise_on_error, rows=n)
        out.raw.update(batch_size=b, inserts=inserts, stages=stages,
                       slot_iterations=sum(m * it for m, it in stages))
        return out

    def _execute(self, batch: Batch, **opts) -> dict:
        args, static = self._call_args(batch, **opts)
        with self._context():
            return self._executable(args, static)(*args)

    def _device_inputs(self, batch: Batch) -> tuple:
        """(prompts, prompt_lens, row_keys, params, controls, max_new, stop_ids, use_penalties)
        on the devices: rows padded to a multiple of the ``data`` axis (with rows that emit
        nothing) and placed over it; the rest replicated."""
        buf, lens, rk, params, max_new = (batch.prompts, batch.prompt_lens, batch.row_keys,
                                          batch.params, batch.max_new)
        rowwise = batch.controls.replace(stop_mask=None)  # [B] / [B, V] fields
        if self.sharding is None:
            rows = [jax.tree.map(_on_device, r) for r in (buf, lens, rk, params, rowwise, max_new)]
            controls = rows[4].replace(stop_mask=_on_device(batch.controls.stop_mask))
            return (*rows[:4], controls, rows[5], _on_device(batch.stop_ids),
                    _on_device(batch.use_penalties))
        b = batch.size
        extra = (-b) % self.sharding.data_size
        if extra:
            rep = np.concatenate([np.arange(b), np.zeros(extra, np.int64)])
            rk = rk[jnp.asarray(rep)]
            params = jax.tree.map(lambda a: jnp.asarray(a)[rep], params)
            rowwise = jax.tree.map(lambda a: jnp.asarray(a)[rep], rowwise)
            max_new = np.concatenate([max_new, np.zeros(extra, max_new.dtype)])
            buf, lens = buf[rep], lens[rep]
        rows = [self.sharding.put_rows(r) for r in (buf, lens, rk, params, rowwise, max_new)]
        controls = rows[4].replace(stop_mask=self.sharding.put_replicated(np.asarray(batch.controls.stop_mask)))
        return (*rows[:4], controls, rows[5], self.sharding.put_replicated(batch.stop_ids),
                self.sharding.put_replicated(np.asarray(batch.use_penalties)))


def cache_root() -> Path:
    """specjax's on-disk state: ``$SPECJAX_CACHE_DIR``, by default ``~/.cache/specjax``."""
    return Path(os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specjax"))


def cost_file() -> Path:
    """Where adaptive K's measured cost tables are kept (one JSON file, keyed by
    :meth:`SpeculativeEngine.cost_key`): ``costs.json`` under :func:`cache_root`."""
    return cache_root() / "costs.json"


COMPILE_CACHE_MAX_BYTES = 2 * 2 ** 30  # least recently used programs are dropped beyond this
_CACHE_READ_ERROR = "Error reading persistent compilation cache entry"
_CACHE_OFF_MARK = "DISABLED"
# what XLA's loader says of a CPU program compiled for another machine (jax issue 38445)
_OTHER_MACHINE = ("is not supported on the host machine", "doesn't match the machine type")


def _host_tag() -> str:
    """The host's kind of CPU (architecture and instruction-set flags) as a short hash: a
    compiled CPU program is kept per kind, so a home folder shared by different machines
    never offers one a program built for another's instruction set."""
    import platform

    flags = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), flags)
    except OSError:
        pass
    return f"{platform.machine() or 'cpu'}-{hashlib.sha1(flags.encode()).hexdigest()[:12]}"


def _cache_turned_off() -> bool:
    return os.environ.get("SPECJAX_COMPILE_CACHE", "1").strip().lower() in ("0", "false", "no", "off")


def compile_cache_dir() -> Optional[Path]:
    """The folder :func:`use_compile_cache` keeps compiled programs in for this host:
    ``xla/<host>`` under :func:`cache_root`; None when ``$SPECJAX_COMPILE_CACHE`` is ``0`` or
    when the folder is marked off (programs saved there did not load on this host)."""
    if _cache_turned_off():
        return None
    path = cache_root() / "xla" / _host_tag()
    return None if (path / _CACHE_OFF_MARK).exists() else path


def use_compile_cache(enable: bool = True) -> Optional[str]:
    """Keep compiled programs on disk (JAX's persistent compilation cache), so that a later
    process with the same programs loads them instead of compiling again (the command line's
    k=auto program for SmolLM2 on 2 CPU cores: 13.9 s of compiling saved, 1.2 s to load). Call it
    before the first compile that should be kept. A folder JAX already has
    (``$JAX_COMPILATION_CACHE_DIR`` or ``jax_compilation_cache_dir``) is kept as it is;
    otherwise :func:`compile_cache_dir`, least recently used programs dropped beyond
    :data:`COMPILE_CACHE_MAX_BYTES`. Returns the folder in use, or None (off). Programs are
    cached by their HLO, compile options, devices and JAX/XLA version, so a cached program
    is the one a compile would give. A saved program that does not load is compiled again
    and said in one line; one built for another kind of CPU marks the folder off for this
    host, a damaged one is removed. ``enable=False`` (the command line's
    ``--no-compile-cache``) or ``$SPECJAX_COMPILE_CACHE=0``: nothing is kept or loaded, not
    even in a folder JAX was given."""
    if not enable or _cache_turned_off():
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = compile_cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"specjax: compiled programs are not kept on disk: cannot create {path}: {e}", file=sys.stderr)
        return None
    import importlib.util

    # JAX's default is no limit; its eviction needs filelock (a dependency of specjax)
    if jax.config.jax_compilation_cache_max_size == -1 and importlib.util.find_spec("filelock"):
        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", str(path))
    _watch_cache_reads(path)
    return str(path)


def _drop_unreadable(path: Path) -> int:
    """Remove the saved programs in ``path`` that do not decompress (a process killed while
    JAX wrote one: JAX never rewrites an entry that exists). Returns how many."""
    try:
        from jax._src.compilation_cache import decompress_executable
    except ImportError:  # a JAX without it: leave the folder as it is
        return 0
    n = 0
    for f in path.glob("*-cache"):
        try:
            decompress_executable(f.read_bytes())
        except Exception:  # noqa: BLE001 (zlib and zstd raise their own errors)
            f.unlink(missing_ok=True)
            n += 1
    return n


def _watch_cache_reads(path: Path) -> None:
    """Turn JAX's warning about a saved program that did not load (JAX then compiles it, so
    only time is lost) into one line, and act on it: a program built for another kind of
    CPU (XLA's check of the host's features) marks ``path`` off for this host, so later
    processes do not try again; a damaged entry is removed, so that it is written afresh."""
    import warnings

    shown = warnings.showwarning
    if getattr(shown, "_specjax_cache_watch", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if _CACHE_READ_ERROR not in text:
            return shown(message, category, filename, lineno, file, line)
        if any(m in text for m in _OTHER_MACHINE):
            try:
                (path / _CACHE_OFF_MARK).write_text(text + "\n")
            except OSError:
                pass
            what = "compiled programs are not kept for this host from now on"
        else:
            n = _drop_unreadable(path)
            what = f"{n} damaged file(s) removed" if n else "the cache stays on"
        print(f"specjax: a compiled program saved in {path} did not load (it was compiled again; "
              f"{what}): {text[:300]}", file=sys.stderr)
        return None

    showwarning._specjax_cache_watch = True
    warnings.showwarning = showwarning


def _load_costs() -> dict:
    try:
        return json.loads(cost_file().read_text())
    except (OSError, ValueError):
        return {}


def _save_costs(key: str, costs: list) -> None:
    path = cost_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = _load_costs()
        table[key] = costs
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: measured again next time, said once here
        print(f"specjax: could not save the cost table to {path}: {e}", file=sys.stderr)


def _more(carry, until, pause):
    """The while loop's condition: some row is running, the loop index is below ``until``
    (if given) and, with ``pause`` (a bool array), no row that was running when the loop
    started has finished since (``generate_dataset`` then refills its slot)."""
    running0 = ~carry.state.done

    def more(c):
        go = ~jnp.all(c.state.done)
        if until is not None:
            go = go & (c.round < until)
        if pause is not None:
            go = go & ~(pause & jnp.any(c.state.done & running0))
        return go

    return more


def _on_device(x):
    """A host value on the default device by one transfer (``jnp.asarray`` of a numpy array
    also dispatches a conversion op, ~0.5 ms each on CPU: a dataset run's pauses paid
    about 20 of them per pause); device arrays stay as they are."""
    return x if isinstance(x, jax.Array) else jax.device_put(np.asarray(x))


def _batch_axis(big_shape, small_shape, rows: int, what: str) -> int:
    """The batch axis of a loop-state leaf: the one axis where its shape at two batch sizes
    differs (``small_shape`` being the one with ``rows`` rows)."""
    diff = [a for a, (x, y) in enumerate(zip(big_shape, small_shape)) if x != y]
    if len(big_shape) != len(small_shape) or len(diff) != 1 or small_shape[diff[0]] != rows:
        raise ValueError(f"cannot {what}: shapes {tuple(small_shape)} and {tuple(big_shape)}")
    return diff[0]


def _put_row(big, one, slot, batch: int):
    """``big`` with its batch row ``slot`` replaced by ``one`` (the same leaf of a batch of
    one row): the batch axis is the one axis where the shapes differ (a batch of one:
    ``one`` itself); other leaves of the same shape keep ``big``'s value."""
    if big.shape == one.shape:
        return one if batch == 1 else big
    start = [jnp.int32(0)] * big.ndim
    start[_batch_axis(big.shape, one.shape, 1, "insert a row")] = jnp.asarray(slot, jnp.int32)
    return jax.lax.dynamic_update_slice(big, one.astype(big.dtype), start)


def _take_batch_rows(big, shape, idx):
    """Rows ``idx`` of ``big`` along its batch axis (:func:`_batch_axis`, ``shape`` being the
    same leaf at ``len(idx)`` rows); a leaf of the same shape is batch-level and stays."""
    if big.shape == tuple(shape):
        return big
    return jnp.take(big, idx, axis=_batch_axis(big.shape, shape, idx.shape[0], "take rows"))


def _batch_rows(batch: Batch, idx) -> Batch:
    """The rows ``idx`` of a prepared batch, with its buffer sizes (one program for all)."""
    idx = np.asarray(idx)
    take = lambda a: jnp.asarray(a)[idx] if isinstance(a, jax.Array) else np.asarray(a)[idx]  # noqa: E731
    rowwise = jax.tree.map(take, batch.controls.replace(stop_mask=None))
    return dataclasses.replace(
        batch, prompts=batch.prompts[idx], prompt_lens=batch.prompt_lens[idx],
        row_keys=batch.row_keys[jnp.asarray(idx)], params=jax.tree.map(take, batch.params),
        controls=rowwise.replace(stop_mask=batch.controls.stop_mask), max_new=batch.max_new[idx])


def _run_branch(index, branches, operand):
    """``branches[index](operand)`` as a chain of two-way conds, not a ``lax.switch``: XLA
    copies every operand of a switch whose branches loop (adaptive K's inner loops: both
    caches, twice per switch, into cache-sized temporaries allocated on every call), while
    the chain updates them in place (tests/test_inplace.py). Only branch ``index`` runs."""
    for i, fn in enumerate(branches):
        operand = jax.lax.cond(index == i, fn, lambda x: x, operand)
    return operand


def _with_k(proposer, j: int):
    """A copy of ``proposer`` that drafts ``j`` tokens (adaptive K compiles one per j)."""
    if dataclasses.is_dataclass(proposer) and any(f.name == "k" for f in dataclasses.fields(proposer)):
        return dataclasses.replace(proposer, k=j)
    raise TypeError(f"adaptive K needs a proposer whose K can be changed (a dataclass with a "
                    f"field k); {type(proposer).__name__} is not one")


BATCH_LEVEL = ("k_rounds", "switches", "iterations")  # results of the whole loop, not per row


def _host(res: dict) -> dict:
    """A program's results on the host (the proposer's state, a cache, stays on device)."""
    return jax.device_get({k: v for k, v in res.items() if k != "proposer_state"})


def _to_output(res, *, with_stats, raise_on_error, rows) -> GenerateOutput:
    """Device results -> per-row Python lists for the first ``rows`` rows (the rest pad)."""
    pstate = res.pop("proposer_state", None)  # stays on device (it may hold a KV cache)
    res = {k: (v[:rows] if np.ndim(v) and k not in BATCH_LEVEL else v) for k, v in jax.device_get(res).items()}
    res["proposer_state"] = pstate
    err = np.asarray(res["error"])
    if raise_on_error and err.any():
        raise FloatingPointError(
            f"invalid probabilities (NaN, or no token possible) met in rows {np.nonzero(err)[0].tolist()}; "
            "no token was emitted for them past that point"
        )
    toks = np.asarray(res["tokens"])
    lens = np.asarray(res["gen_len"])
    tokens = [toks[i, : lens[i]].tolist() for i in range(rows)]
    stats = None
    if with_stats:
        stats = []
        for i in range(rows):
            rounds = int(res["rounds"][i])
            reached = np.asarray(res["reached_pos"][i])
            accp = np.asarray(res["accepted_pos"][i])
            stats.append(RowStats(
                rounds=rounds,
                drafted=int(res["drafted"][i]),
                accepted=int(res["accepted"][i]),
                emitted=int(lens[i]),
                accepted_per_position=[float(a / r) if r else float("nan") for a, r in zip(accp, reached)],
                reached_per_position=reached.tolist(),
                tokens_per_round=float(lens[i] / rounds) if rounds else float("nan"),
                mean_alpha=float(res["alpha_sum"][i] / res["alpha_n"][i]) if res["alpha_n"][i] else float("nan"),
            ))
    return GenerateOutput(tokens=tokens, stats=stats, finished_by_stop=np.asarray(res["stopped"]).tolist(),
                          raw=res)


def _outputs(state: DecodeState, out_cap: int) -> dict:
    return dict(tokens=state.out[:, :out_cap], gen_len=state.gen_len, stopped=state.stopped,
                error=state.error)


# --------------------------------------------------------------------------------------
# the engine


class SpeculativeEngine(_Sharded):
    """Holds the static parts (target, proposer, method) and one jitted program; K is the
    proposer's ``k``.

    Calls that differ only in prompt content, sampling values, seeds or lengths within the
    same buckets reuse the compiled program; ``trace_count`` counts traces.

    ``sharding`` (a :class:`specjax.sharding.MeshPlan`, optional): run the whole program
    on its mesh: batch rows and KV caches over ``data``, the target's parameters and
    logits by the plan's rules (tensor-parallel over ``model``); verification then runs
    on vocabulary-sharded log-probs. Outputs are the same as without a mesh.
    ``compiler_options``: XLA options its programs compile with (:func:`resolve_compiler_options`;
    default none).
    """

    def __init__(self, target, proposer: Proposer, method: str = "token", *, sharding=None,
                 prefill_chunk: int = PREFILL_CHUNK, adaptive: bool = False, costs=None,
                 batch_hints: Optional[bool] = None, compiler_options: Optional[dict] = None):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not isinstance(proposer, Proposer):
            raise TypeError(f"{type(proposer).__name__} is not a Proposer (specjax.drafts.base)")
        if method == "tree" and not is_tree_proposer(proposer):
            proposer = ChainTreeProposer(proposer)  # a chain is a tree with one child per node
        if is_tree_proposer(proposer):
            if method not in ("tree", "greedy"):
                raise ValueError(f"a tree proposer is verified with method 'tree' or 'greedy', not {method!r}")
            if not getattr(target, "supports_tree", False):
                raise TypeError(f"the target {type(target).__name__} does not take tree attention")
        k = proposer.k
        if isinstance(k, np.integer) and k >= 1:  # numpy's integers as Python's (K is static)
            try:
                proposer = _with_k(proposer, int(k))
                k = proposer.k
            except TypeError:
                pass
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"K must be an integer >= 1, got {k!r}")
        if proposer.vocab_size != target.vocab_size:
            raise ValueError(
                f"vocabulary mismatch: target V={target.vocab_size}, draft V={proposer.vocab_size}"
            )
        self.target = target
        self.proposer = proposer
        self.method = method
        self.sharding = sharding
        self.prefill_chunk = _check_chunk(prefill_chunk)
        self.adaptive = bool(adaptive)
        self.batch_hints = resolve_batch_hints(batch_hints)
        self.compiler_options = resolve_compiler_options(compiler_options)
        if self.adaptive:
            if self.tree:
                raise ValueError("adaptive K (k='auto') takes a chain proposer, not a draft tree")
            self._proposers = [None] + [_with_k(proposer, j) for j in range(1, k)] + [proposer]
        # adaptive K: batch size -> float64[K+1], the cost of a round that drafts j tokens
        self.costs: dict = {}
        if costs is not None:
            for b, c in dict(costs).items():
                self.set_costs(b, c)
        self.trace_count = 0
        self._jit_programs()

    @property
    def k(self) -> int:
        return self.proposer.k

    @property
    def _defers_plain(self) -> bool:
        """The proposer keeps plain rounds' work (and, for adaptive K, its pass over the
        prompt) in a backlog for ``catch_up`` (``plain_backlog`` > 0)."""
        return getattr(self.proposer, "plain_backlog", 0) > 0

    @property
    def tree(self) -> bool:
        """Tree rounds (a tree proposer, or a chain under ``method="tree"``)."""
        return is_tree_proposer(self.proposer)

    @property
    def stat_positions(self) -> int:
        """Draft positions the per-position statistics count (K, or a tree's depth)."""
        return self.proposer.tree_depth if self.tree else self.k

    # -- device programs --------------------------------------------------------------
    # _run: a whole generation (prefill + the loop until every row is done); _start and
    # _advance: the same split in chunks for streaming (the carry stays on the devices).
    def _program(self, target_params, draft_params, prompts, prompt_lens, row_keys, params,
                 controls, max_new, stop_ids, use_penalties, costs, *, out_cap, cache_len, hints=None):
        carry = self._start_program(target_params, draft_params, prompts, prompt_lens, row_keys,
                                    params, controls, max_new, stop_ids, use_penalties, costs,
                                    out_cap=out_cap, cache_len=cache_len, hints=hints)
        with sampling.batch_hints(hints):
            carry = self._loop(carry, target_params, draft_params, row_keys, params, controls,
                               max_new, stop_ids, use_penalties, costs)
        return self._finish_program(carry, out_cap)

    def _start_program(self, target_params, draft_params, prompts, prompt_lens, row_keys, params,
                       controls, max_new, stop_ids, use_penalties, costs, *, out_cap,
                       cache_len, hints=None) -> SpecCarry:
        self.trace_count += 1
        with sampling.batch_hints(hints):
            return self._prefill(target_params, draft_params, prompts, prompt_lens, max_new,
                                 out_cap=out_cap, cache_len=cache_len)

    def _loop(self, carry: SpecCarry, target_params, draft_params, row_keys, params, controls,
              max_new, stop_ids, use_penalties, costs, until=None, pause=None) -> SpecCarry:
        """Rounds until every row is done (or the round index reaches ``until``, or, with
        ``pause``, a row that was running at the start finishes)."""
        if self.method == "greedy":
            params = params.replace(temperature=jnp.zeros_like(params.temperature))
        inputs = (target_params, draft_params, row_keys, params, controls, max_new, stop_ids,
                  use_penalties)

        more = _more(carry, until, pause)
        if not self.adaptive:
            round_fn = self._tree_round if self.tree else self._round
            return jax.lax.while_loop(more, lambda c: round_fn(c, *inputs), carry)

        # adaptive K: draft tokens per row chosen from earlier rounds; a round runs the
        # branch of the largest (rows that chose fewer cap their num_draft). Each branch is
        # an inner loop that goes on while the choice stays the same, so that the switch
        # (whose operands, the caches included, XLA may copy) is crossed only on a change.
        # the batch's rate counts the wait for its slowest row unless finished rows' slots
        # are refilled (a dataset run pauses for that)
        tail = True if pause is None else ~pause

        def choice(c):
            rows_k = jnp.clip(self.choose_k(c, costs, inputs, tail), 0, self.k)
            return rows_k, jnp.max(jnp.where(c.state.done, 0, rows_k))

        # a proposer that defers plain rounds' work (plain_backlog, e.g. the EAGLE head; its
        # pass over the prompt waits there too) catches up when a drafting branch starts, and
        # when the plain branch starts with a full backlog; the plain branch's loop stops
        # before a row's backlog is full. These conditionals run once per switch, not per
        # round.
        room = self.proposer.backlog_room(carry.proposer_state) if self._defers_plain else 0  # static

        def settle(c, drafting):
            """``drafting``: a traced bool (the branch entered drafts); one catch-up in the
            program for every branch (traced once, not once per branch)."""
            if not room:
                return c
            n = self.proposer.backlog(c.proposer_state)
            need = jnp.where(drafting, jnp.any(n > 0), jnp.any(n >= room))

            def run(ps):
                with self._role("draft"):
                    return self._c_cache(self.proposer.catch_up(draft_params, ps, c.state.seq,
                                                                c.state.seq_len), "draft")

            return c.replace(proposer_state=jax.lax.cond(need, run, lambda ps: ps, c.proposer_state))

        def has_room(c):
            return jnp.all(self.proposer.backlog(c.proposer_state) < room) if room else True

        # the loops carry the choice for the next round (computed once, after the round
        # before it), so the inner loop's condition and the round read the same one
        def branch(j):
            def step(x):
                c, rows_k, _ = x
                if j == 0:
                    c = self._plain_round(c, *inputs)
                else:
                    c = self._round(c, *inputs, proposer=self._proposers[j], rows_k=rows_k)
                return (c, *choice(c))

            def go_on(x):
                c, _, jmax = x
                return more(c) & (jmax == j) & (has_room(c) if j == 0 else True)

            return lambda x: jax.lax.while_loop(go_on, step, x)

        branches = [branch(j) for j in range(self.k + 1)]

        def enter(x):  # one iteration per branch entered: counted (AutoState.switches)
            c = x[0].replace(auto=x[0].auto.replace(switches=x[0].auto.switches + 1))
            return _run_branch(x[2], branches, (settle(c, drafting=x[2] > 0),) + x[1:])

        out = jax.lax.while_loop(lambda x: more(x[0]), enter, (carry, *choice(carry)))
        return out[0]

    def _advance_program(self, carry, target_params, draft_params, row_keys, params, controls,
                         max_new, stop_ids, use_penalties, costs, until, pause, *, hints=None) -> SpecCarry:
        with sampling.batch_hints(hints):
            return self._loop(carry, target_params, draft_params, row_keys, params, controls,
                              max_new, stop_ids, use_penalties, costs, until, pause)

    def choose_k(self, c: SpecCarry, costs, inputs, tail=True) -> jax.Array:
        """Adaptive K: the draft tokens of the next round per row (int32[B] in 0..K; the
        rule gives every row the same), from what earlier rounds left in the carry
        (:func:`choose_k`: the acceptance seen, and each running row's token budget left,
        its ``max_new`` less what it has made). Of ``inputs`` (the loop's arguments) only
        ``max_new`` is read: the choice must not look at this round. ``tail``: the loop
        runs until every row is done (False: a dataset run, whose finished rows' slots
        are refilled). A row whose j is below the round's largest drafts j tokens all the
        same: its num_draft is capped, and the verifiers' keys are by position, so its
        tokens do not depend on the other rows' j."""
        max_new = inputs[5]
        remaining = jnp.where(c.state.done, 0, jnp.maximum(max_new - c.state.gen_len, 0))
        return jnp.broadcast_to(choose_k(c.auto, costs, remaining, tail), c.state.seq_len.shape)

    def _finish_program(self, carry: SpecCarry, out_cap: int) -> dict:
        stats = {f.name: getattr(carry.stats, f.name) for f in dataclasses.fields(carry.stats)}
        stats.update(k_rounds=carry.auto.k_rounds, switches=carry.auto.switches, iterations=carry.round)
        out = self._c_out(dict(_outputs(carry.state, out_cap), **stats))
        return dict(out, proposer_state=carry.proposer_state)

    @staticmethod
    def _advance_inputs(args) -> tuple:
        """``_call_args``' arguments that the loop reads (all but the prompts and lengths)."""
        return args[:2] + args[4:]

    def _prefill(self, target_params, draft_params, prompts, prompt_lens, max_new, *, out_cap,
                 cache_len) -> SpecCarry:
        """Both models over the prompts: the target keeps KV for s[:c-1]; the proposer's
        ``init`` gets the target's hidden states when it asks for them."""
        tgt, prop, k = self.target, self.proposer, self.k
        want_hidden = hidden_request(prop)
        b = prompts.shape[0]
        tcache = self._c_cache(tgt.init_cache(b, cache_len))
        tcache, hidden = prefill(tgt, target_params, prompts, prompt_lens, tcache,
                                 chunk=self.prefill_chunk, return_hidden=want_hidden)
        tcache = self._c_cache(tcache.with_lengths(self.target_cache_lengths(prompt_lens)))
        # adaptive K catches up before drafting: a proposer that can leave its pass over the
        # prompt to that (init_deferred) costs nothing in a run that never drafts
        init = prop.init_deferred if self.adaptive and self._defers_plain else prop.init
        with self._role("draft"):
            pstate = init(draft_params, prompts, prompt_lens, cache_len, hidden if want_hidden else None)
        state = DecodeState.initial(prompts, prompt_lens, out_cap + k + 1, cache_len + k + 1,
                                    tgt.vocab_size, max_new)
        return SpecCarry(state=self._c_state(state), stats=RoundStats.zeros(b, self.stat_positions),
                         target_cache=tcache, proposer_state=self._c_cache(pstate, "draft"),
                         round=jnp.int32(0), auto=AutoState.zeros(self.stat_positions))

    def _round(self, c: SpecCarry, target_params, draft_params, row_keys, params, controls,
               max_new, stop_ids, use_penalties, proposer=None, rows_k=None) -> SpecCarry:
        """One round: propose, score, process, verify, commit, statistics. ``proposer``: a
        copy of the engine's drafting fewer tokens (adaptive K), else the engine's;
        ``rows_k`` (int32[B], adaptive K): each row's cap on its draft tokens."""
        proposer = self.proposer if proposer is None else proposer
        k = proposer.k
        state = c.state
        active = ~state.done
        round_keys, proposal = self._propose(c, draft_params, row_keys, params, controls,
                                             use_penalties, proposer)
        x = proposal.tokens
        q_lp = self._c(proposal.logprobs, _LOGITS)  # laid out like the target's (vocab-sharded)
        nd = jnp.where(active, proposal.num_draft if rows_k is None else jnp.minimum(proposal.num_draft, rows_k), 0)

        # score + process: the same pipeline, same order, for the target at each of the K+1
        # positions; the history at position i includes the draft tokens x_1..x_i
        # (computed only when some row has a penalty on), and the controls at generated-token
        # index gen_len + i
        t_logits, t_hidden, tcache = self._score(target_params, state, x, nd, c.target_cache)
        gen_index = self.generated_before(state.gen_len, k)
        p_lp = self._c(process_rows(t_logits, params,
                                    lambda: self.position_counts(state.counts, x, nd),
                                    use_penalties, allowed=controls.allowed_at(gen_index),
                                    bias=controls.bias_at(3), top_values=self._top_values), _LOGITS)

        # verify + commit
        res = self._verify(round_keys, x, q_lp, p_lp, nd)
        n_acc = res.num_accepted
        state, _ = state.commit(res.tokens, n_acc + 1, stop_ids, max_new, res.error)
        # rollback is setting lengths; finished rows stay where they are
        tcache = tcache.with_lengths(self.target_cache_lengths(state.seq_len))
        # the proposer sees the target's hidden states of this forward (hidden_request): entries
        # 0..n_acc are those after s[c-1], x_1..x_n (committed tokens); the rest are stale
        with self._role("draft"):
            pstate = self.proposer.commit(draft_params, proposal.state, CommitContext(
                seq=state.seq, seq_len=state.seq_len, target_hidden=t_hidden,
                num_new=jnp.where(active & ~res.error, n_acc + 1, 0)))

        return SpecCarry(state=self._c_state(state),
                         stats=c.stats.update(active, nd, n_acc, q_lp, p_lp),
                         target_cache=tcache, proposer_state=self._c_cache(pstate, "draft"),
                         round=c.round + 1, auto=c.auto.drafted(k, active, nd, n_acc))

    def _plain_round(self, c: SpecCarry, target_params, draft_params, row_keys, params, controls,
                     max_new, stop_ids, use_penalties) -> SpecCarry:
        """A round that drafts nothing (adaptive K chose j = 0): one target step, one token
        per row drawn from p with the round's BONUS key at position 0 (what a round with no
        accepted draft draws it with); the proposer catches up (``commit_plain``)."""
        state = c.state
        active = ~state.done
        b = state.seq_len.shape[0]
        round_keys = self.round_keys(c, row_keys)
        want_hidden = hidden_request(self.proposer)
        o = self.target.apply(target_params, state.last_tokens()[:, None], c.target_cache,
                              return_hidden=want_hidden)
        p_lp = self._c(process_rows(self._c(o.logits, _LOGITS), params, lambda: state.counts[:, None, :],
                                    use_penalties, allowed=controls.allowed_at(self.generated_before(state.gen_len, 0)),
                                    bias=controls.bias_at(3), top_values=self._top_values), _LOGITS)[:, 0]
        x = sample_rows(jax.vmap(lambda kk: keys.position_key(keys.role_key(kk, keys.BONUS), 0))(round_keys), p_lp)
        err = x < 0  # NaN, or no token possible: what sample() marks with -1
        state, _ = state.commit(x[:, None], jnp.ones((b,), jnp.int32), stop_ids, max_new, err)
        tcache = self._c_cache(o.cache.with_lengths(self.target_cache_lengths(state.seq_len)))
        ctx = CommitContext(seq=state.seq, seq_len=state.seq_len,
                            target_hidden=o.hidden if want_hidden else None,
                            num_new=jnp.where(active & ~err, 1, 0))
        with self._role("draft"):
            commit = getattr(self.proposer, "commit_plain", self.proposer.commit)
            pstate = commit(draft_params, c.proposer_state, ctx)
        zeros = jnp.zeros((b,), jnp.int32)
        return SpecCarry(state=self._c_state(state),
                         stats=c.stats.replace(rounds=c.stats.rounds + active.astype(jnp.int32)),
                         target_cache=tcache, proposer_state=self._c_cache(pstate, "draft"),
                         round=c.round + 1, auto=c.auto.plain())

    @staticmethod
    def round_keys(c: SpecCarry, row_keys):
        """``fold_in(row_key, r)`` with r the row's own round count (the rounds it took part
        in): the same as the loop index for a row that starts with the batch, and what a
        row inserted later (``generate_dataset``) would have had alone."""
        return jax.vmap(keys.round_key)(row_keys, c.stats.rounds)

    def _propose(self, c: SpecCarry, draft_params, row_keys, params, controls, use_penalties,
                 proposer=None):
        """The round's keys (:meth:`round_keys`) and the proposer's proposal."""
        state = c.state
        round_keys = self.round_keys(c, row_keys)
        ctx = ProposeContext(seq=state.seq, seq_len=state.seq_len, params=params,
                             counts=state.counts, round_keys=round_keys,
                             use_penalties=use_penalties, top_values=self._top_values,
                             gen_len=state.gen_len, controls=controls)
        with self._role("draft"):
            return round_keys, (proposer or self.proposer).propose(draft_params, c.proposer_state, ctx)

    def _tree_round(self, c: SpecCarry, target_params, draft_params, row_keys, params, controls,
                    max_new, stop_ids, use_penalties) -> SpecCarry:
        """One round with a draft tree: propose a tree, score all its nodes in ONE target
        forward with tree attention, process, verify (:mod:`specjax.tree`), commit, move
        the accepted path's KV to contiguous slots, hand the proposer the target's
        hidden states along the path."""
        state = c.state
        active = ~state.done
        round_keys, proposal = self._propose(c, draft_params, row_keys, params, controls, use_penalties)
        depth_max = self.proposer.tree_depth
        tree = proposal.tree
        tgt = self.target
        b, n = tree.tokens.shape
        v = tgt.vocab_size
        tokens = jnp.clip(tree.tokens, 0, v - 1)
        anc = self.tree_mask(tree, depth_max)  # [B, N, N]
        # the committed last token (the root, depth 0) then the nodes
        full_mask = jnp.concatenate([
            jnp.concatenate([jnp.ones((b, 1, 1), bool), jnp.zeros((b, 1, n), bool)], axis=2),
            jnp.concatenate([jnp.ones((b, n, 1), bool), anc], axis=2)], axis=1)
        depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tree.depth.astype(jnp.int32)], axis=1)
        want_hidden = hidden_request(self.proposer)
        o = tgt.apply(target_params, jnp.concatenate([state.last_tokens()[:, None], tokens], axis=1),
                      c.target_cache, return_hidden=want_hidden,
                      tree=TreeAttention.dense(depth, full_mask))
        t_logits = self._c(o.logits, _LOGITS)

        def node_counts():  # history at each context: committed tokens + the node's path
            oh = jax.nn.one_hot(tokens, v, dtype=state.counts.dtype) * tree.valid[..., None]
            path = jnp.einsum("bij,bjv->biv", anc.astype(state.counts.dtype), oh)
            return state.counts[:, None, :] + jnp.concatenate(
                [jnp.zeros((b, 1, v), state.counts.dtype), path], axis=1)

        p_lp = self._c(process_rows(t_logits, params, node_counts, use_penalties,
                                    allowed=controls.allowed_at(state.gen_len[:, None] + depth),
                                    bias=controls.bias_at(3), top_values=self._top_values), _LOGITS)
        res = self._tree_verify(round_keys, tree, p_lp, depth_max)
        n_acc = res.num_accepted
        c0 = state.seq_len
        state, _ = state.commit(res.tokens, n_acc + 1, stop_ids, max_new, res.error)
        ok = active & ~res.error
        path = jnp.maximum(res.path, 0)
        # node i sits at slot c0 + i; the path's d-th node goes to slot c0 + d
        tcache = self.accepted_path_cache(o.cache, c0, path, jnp.where(ok, n_acc, 0))
        tcache = self._c_cache(tcache.with_lengths(self.target_cache_lengths(state.seq_len)))
        hidden = None
        if want_hidden:  # entry 0: after the root token; entry d: after the path's d-th node
            idx = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), 1 + path], axis=1)
            hidden = jnp.take_along_axis(o.hidden, idx[:, :, None], axis=1)
        with self._role("draft"):
            pstate = self.proposer.commit(draft_params, proposal.state, CommitContext(
                seq=state.seq, seq_len=state.seq_len, target_hidden=hidden,
                num_new=jnp.where(ok, n_acc + 1, 0)))
        valid_depth = jnp.max(jnp.where(tree.valid, tree.depth, 0), axis=1)
        return SpecCarry(state=self._c_state(state),
                         stats=c.stats.update_tree(active, jnp.sum(tree.valid, axis=1).astype(jnp.int32),
                                                   n_acc, valid_depth),
                         target_cache=tcache, proposer_state=self._c_cache(pstate, "draft"),
                         round=c.round + 1, auto=c.auto)

    @staticmethod
    def tree_mask(tree, max_depth=None) -> jax.Array:
        """bool[B, N, N]: node i attends to node j iff j is i or an ancestor of i
        (``max_depth``: the proposer's static bound on a node's depth, None: N)."""
        mask = jax.vmap(lambda p, v: _tree.ancestor_mask(p, v, max_depth))(tree.parent, tree.valid)
        return mask | jnp.eye(tree.parent.shape[1], dtype=bool)

    @staticmethod
    def accepted_path_cache(cache, start, path, num):
        """The target's cache with the accepted path's KV moved to contiguous slots."""
        return move_slots(cache, start, path, num)

    def _tree_verify(self, round_keys, tree, p_lp, max_depth) -> _tree.TreeVerifyResult:
        """vmap of the one-row tree verifier over the batch."""
        if self.method == "greedy":
            return jax.vmap(lambda t, lp: _tree.greedy_tree_verify(t, lp[0], lp[1:], max_depth=max_depth))(
                tree, p_lp)
        cand = self.proposer.candidates

        tries = getattr(self.proposer, "max_tries", None)  # static shapes: the descent's bound

        def sampled(_):
            return jax.vmap(lambda kk, t, lp: _tree.tree_verify(
                kk, t, lp[0], lp[1:], cand, max_depth=max_depth, max_tries=tries))(round_keys, tree, p_lp)

        def point_masses(_):
            # every row of p is a point mass (greedy rows): any of the candidate rules
            # accepts a child iff it is p's token, and the final draw is that token, so the
            # result is the greedy descent's (specjax.tree.point_mass_target_verify), without
            # the residual pass over the vocabulary at every node
            return jax.vmap(lambda t, lp: _tree.point_mass_target_verify(
                t, lp[0], lp[1:], max_depth=max_depth))(tree, p_lp)

        return sampling.known_cond(sampling.all_point_masses(), lambda: sampling.at_most_one_possible(p_lp),
                                   point_masses, sampled, None)

    def _score(self, target_params, state: DecodeState, x, nd, tcache):
        """The target's forward over [s[c-1], x_1..x_K] -> (logits [B, K+1, V], the proposer's hidden
        states or None, cache). On CPU a round where no row drafted anything costs one 1-token
        step instead; a proposer that always drafts K tokens (``always_drafts``) skips that
        test, and with it the copies of the whole KV cache that a conditional costs, and so
        does every proposer off the CPU (:func:`skip_empty_rounds`)."""
        tgt = self.target
        want_hidden = hidden_request(self.proposer)
        b, k = x.shape
        v = tgt.vocab_size
        last = state.last_tokens()

        def score_full(_):
            o = tgt.apply(target_params, jnp.concatenate([last[:, None], x], axis=1), tcache,
                          return_hidden=want_hidden)
            return o.logits, o.hidden, o.cache

        def score_one(_):
            o = tgt.apply(target_params, last[:, None], tcache, return_hidden=want_hidden)
            hd = None if o.hidden is None else jnp.broadcast_to(o.hidden, (b, k + 1) + o.hidden.shape[2:])
            return jnp.broadcast_to(o.logits, (b, k + 1, v)), hd, o.cache

        if self.proposer.always_drafts or not skip_empty_rounds():
            logits, hidden, tcache = score_full(None)
        else:
            logits, hidden, tcache = jax.lax.cond(jnp.any(nd > 0), score_full, score_one, None)
        return self._c(logits, _LOGITS), (hidden if want_hidden else None), self._c_cache(tcache)

    def _verify(self, round_keys, x, q_lp, p_lp, nd) -> verify.VerifyResult:
        """vmap of the method's one-row verifier over the batch."""
        if self.method == "greedy":
            return jax.vmap(verify.greedy_verify)(x, p_lp, nd)
        one_row = {"token": verify.token_verify, "block": verify.block_verify}[self.method]

        def rows(single):
            # single: every target row is greedy, so each residual / bonus law has at most
            # one possible token and its draw needs no noise (the same token)
            return lambda _: jax.vmap(lambda kk, *a: one_row(kk, *a, single=single))(
                round_keys, x, q_lp, p_lp, nd)

        return sampling.known_cond(sampling.all_point_masses(), lambda: sampling.at_most_one_possible(p_lp),
                                   rows(True), rows(False), None)

    @staticmethod
    def position_counts(counts, x, nd):
        """Token counts of the history at each of the K+1 scored positions: position i
        sees the committed tokens (``counts`` [B, V]) and the draft tokens x_1..x_i of
        its row (only the ``nd`` real ones) -> [B, K+1, V]."""
        b, k = x.shape
        real = jnp.arange(k)[None, :] < nd[:, None]
        oh = jax.nn.one_hot(jnp.where(real, x, 0), counts.shape[-1], dtype=counts.dtype) * real[..., None]
        return counts[:, None, :] + jnp.concatenate(
            [jnp.zeros((b, 1, counts.shape[-1]), counts.dtype), jnp.cumsum(oh, axis=1)], axis=1)

    @staticmethod
    def generated_before(gen_len, k):
        """Tokens generated before each of the K+1 scored positions: position i follows
        ``gen_len`` committed ones and the drafts x_1..x_i -> int32[B, K+1] (what the
        generation controls, e.g. ``min_new_tokens``, are evaluated at)."""
        return gen_len[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]

    @staticmethod
    def target_cache_lengths(seq_len):
        """After a commit the target keeps KV for s[:c-1] (rollback = this length)."""
        return seq_len - 1

    # -- adaptive K: the cost model ---------------------------------------------------
    def set_costs(self, batch_size: int, costs) -> None:
        """The cost of a round that drafts j = 0..K tokens at this batch size (any unit,
        ``inf``: never choose j), as :meth:`calibrate` measures it."""
        c = np.asarray(costs, np.float64).reshape(-1)
        if c.shape != (self.k + 1,) or np.isnan(c).any() or (c <= 0).any() or not np.isfinite(c).any():
            raise ValueError(f"costs must be K+1 = {self.k + 1} positive numbers (inf allowed), got {costs!r}")
        self.costs[int(batch_size)] = c

    def costs_for(self, batch_size: int, like: Optional[Batch] = None) -> np.ndarray:
        """The cost table adaptive K uses at ``batch_size``: set, else read from the cost
        file (:func:`cost_file`) for this machine, models and K, else measured now
        (:meth:`calibrate`, with the streamed programs of ``like`` when given) and saved
        there."""
        b = int(batch_size)
        if b not in self.costs:
            saved = _load_costs().get(self.cost_key(b))
            if saved is not None and len(saved) == self.k + 1:
                self.set_costs(b, saved)
            else:
                self.calibrate(b, like=like)
        return self.costs[b]

    def cost_key(self, batch_size: int) -> str:
        """What a cost table is measured for: device, target, proposer, K, method, batch, the
        compile options, and on CPU the build of the project's kernels (new kernels: measured
        again)."""
        dev = jax.devices()[0]
        prop = self.proposer
        draft = getattr(getattr(prop, "model", None), "config", None)
        kernels = (compute_id(self.target), compute_id(getattr(prop, "model", None)))
        what = repr((dev.platform, getattr(dev, "device_kind", ""), jax.device_count(), os.cpu_count(),
                     repr(getattr(self.target, "config", type(self.target).__name__)),
                     str(jax.tree.leaves(self.target.params)[0].dtype) if self.target.params is not None else "",
                     type(prop).__name__, repr(draft), self.k, self.method, self.sharding is not None,
                     COST_MODEL_VERSION, kernels)
                    + ((sorted(self.compiler_options.items()),) if self.compiler_options else ()))
        return f"{hashlib.sha256(what.encode()).hexdigest()[:24]}/b{int(batch_size)}"

    def calibrate(self, batch_size: int, *, like: Optional[Batch] = None, prompt_len: int = 32,
                  new_tokens: int = 32, repeats: int = 4, save: bool = True) -> np.ndarray:
        """Measure the cost (seconds) of a round that drafts j = 0..K tokens at
        ``batch_size``: a generation of ``new_tokens`` tokens per row (random prompts, T=1,
        no stop) with j forced, timed without its prefill and first round, over its rounds. Every j
        runs once per pass and the passes repeat (``repeats`` after a warm-up pass), keeping
        each j's fastest time, so that a slow spell of a shared machine does not skew the
        ratios between j. The warm-up generates a few tokens; the timed passes generate as
        many of the ``new_tokens`` as fill about ``CALIBRATION_ROUND_SECONDS`` with rounds
        of every j, at least ``CALIBRATION_MIN_ROUNDS`` of each (:func:`calibration_tokens`).
        ``like`` (a prepared batch of that size): run its program (buffer
        sizes, controls). The rounds are timed as one ``_advance`` of the streamed programs
        (``_start``, ``_advance``, ``_finish``, what a streamed or dataset run of ``like``
        compiles anyway; a whole-generation call compiles them for this). Sets the table
        (:meth:`set_costs`) and saves it to the cost file."""
        if not self.adaptive:
            raise ValueError("calibrate is for an adaptive-K engine (k='auto')")
        b = _count("batch_size", batch_size)
        rng = np.random.default_rng(0)
        width = bucket(prompt_len) if like is None else like.prompts.shape[1]
        plen, n = calibration_sizes(min(int(prompt_len), width), int(new_tokens), self.k,
                                    context_limit(self.target), self.proposer.min_prompt_len)
        prompts = rng.integers(0, self.target.vocab_size, (b, plen))
        # per j: tokens per row -> a timer (runs the generation once -> (seconds of its rounds, rounds))
        makers = []
        for j in range(self.k + 1):
            forced = np.full(self.k + 1, np.inf)  # one program, j forced by the cost argument
            forced[j] = 1.0
            batch = self.prepare(prompts, seed=0, max_new_tokens=n,
                                 sampling_params=sampling.SamplingConfig(temperature=1.0))
            if like is not None:  # the call's program: its sizes, controls and penalties flag
                if like.size != b:
                    raise ValueError(f"like has {like.size} rows, calibrating batch {b}")
                pad = np.zeros((b, width), np.int32)
                pad[:, :plen] = prompts
                batch = dataclasses.replace(
                    like, prompts=pad, prompt_lens=np.full(b, plen, np.int32), row_keys=batch.row_keys,
                    params=batch.params, max_new=np.full(b, min(n, like.out_cap), np.int32),
                    stop_ids=np.full_like(like.stop_ids, _NO_STOP))
            makers.append(functools.partial(self._sized_timer, batch, forced))
        # the warm-up pass (first runs of the programs) generates a few tokens per j; its
        # rounds' cost sizes the timed passes (calibration_tokens), so that a large batch,
        # whose rounds take tenths of a second, is not timed over as many rounds as a batch
        # of one row: the same cost per round in a fraction of the time. Every j generates
        # the same tokens, so that their rounds see the same context lengths.
        n_warm = min(n, CALIBRATION_WARMUP_TOKENS)
        warm = [make(n_warm)() for make in makers]
        n_timed = max(calibration_tokens(dt, rounds, n_warm, n) for dt, rounds in warm)
        sized = [make(n_timed) for make in makers]
        # every j once per pass, passes repeated, the fastest kept: a slow spell of a shared
        # machine hits all j alike instead of skewing their ratios (the rule reads ratios)
        best = np.full(self.k + 1, np.inf)
        for _ in range(repeats):
            for j, timer in enumerate(sized):
                dt, rounds = timer()
                best[j] = min(best[j], max(dt, 1e-9) / max(rounds, 1))
        cost = smooth_costs(best)
        self.set_costs(b, cost)
        if save:
            _save_costs(self.cost_key(b), cost.tolist())
        return cost

    def _sized_timer(self, batch: Batch, forced, tokens: int):
        """For :meth:`calibrate`: :meth:`_round_timer` of ``batch`` (j forced by ``forced``)
        with every row generating ``tokens`` tokens: a value, not a shape, so every number
        of tokens runs the same compiled programs. Each call of the timer runs the
        generation once."""
        b = batch.size
        sized = dataclasses.replace(batch, max_new=np.full(b, min(int(tokens), int(batch.max_new.max())), np.int32))
        return self._round_timer(*self._call_args(sized, costs=forced))

    def _round_timer(self, args, static):
        """For :meth:`calibrate`: a function running one generation of ``args`` through the
        streamed programs and returning (seconds of its rounds, its number of rounds): the
        time of the rounds after an untimed ``_start`` and an untimed first round. (Timing
        the whole program less a separate run of ``_start`` left the prefill's noise in the
        difference: cost ratios moved by 20% between calibrations, against 3-5% this way.
        The first drafting round also runs a deferred draft's pass over the prompt, once
        per generation: a cost of the rounds' number, not of a round.)"""
        start, advance, finish = self._stream_executables(args, static)
        rest = self._advance_inputs(args)

        def timer():
            with self._context():
                carry = jax.block_until_ready(advance(start(*args), *rest, np.int32(1), np.bool_(False)))
                first = 1
                if np.all(jax.device_get(carry.state.done)):  # one round was all: time that one
                    carry, first = jax.block_until_ready(start(*args)), 0
                t0 = time.perf_counter()
                carry = jax.block_until_ready(advance(carry, *rest, np.int32(RUN_TO_THE_END), np.bool_(False)))
                dt = time.perf_counter() - t0
                return dt, int(jax.device_get(finish(carry)["iterations"])) - first
        return timer

    # -- host API ---------------------------------------------------------------------
    def prepare(self, prompts, **kwargs) -> Batch:
        """The host-side checks and padding of :meth:`generate` (ValueError on bad input)."""
        return prepare_batch(prompts, self.target, k=self.k,
                             min_prompt_len=self.proposer.min_prompt_len, **kwargs)

    def _call_args(self, batch: Batch, costs=None, hints=_OWN):
        """(the program's arguments, its static settings) for ``batch``; ``hints``: as
        ``_hints_of(batch)`` unless given (a dataset run's, of the whole dataset)."""
        check_cache_memory(self.target, batch.size, batch.cache_len)
        if costs is None:
            costs = self.costs_for(batch.size, like=batch) if self.adaptive else np.ones(self.k + 1)
        args = (self._placed(self.target.params, "target"), self._placed(self.proposer.params, "draft"),
                *self._device_inputs(batch), self._put(np.asarray(costs, np.float32)))
        return args, dict(out_cap=batch.out_cap, cache_len=batch.cache_len,
                          hints=self._hints_of(batch) if hints is _OWN else hints)

    def generate(self, prompts, *, raise_on_error=True, **kwargs) -> GenerateOutput:
        """Generate for a batch of prompts (lists of token ids). ``kwargs``: ``keys`` (one per
        row) or ``seed`` (+ ``row_indices``), ``sampling_params``, ``max_new_tokens``,
        ``stop_tokens`` and the generation controls ``min_new_tokens``, ``banned_tokens``,
        ``allowed_tokens``, ``logit_bias`` (see :func:`prepare_batch`)."""
        batch = self.prepare(prompts, **kwargs)
        res = self._execute(batch)
        return _to_output(res, with_stats=True, raise_on_error=raise_on_error, rows=batch.size)

    def generate_dataset(self, prompts, *, batch_size: int = 16, raise_on_error=True, on_row=None,
                         compact="auto", **kwargs) -> GenerateOutput:
        """Generate for a whole dataset of prompts with ``batch_size`` slots kept busy
        (continuous batching): when a row finishes (stop token or its max_new_tokens) the
        next prompt is prefilled into its slot and the loop goes on, with no retrace. Row i
        keeps the key of dataset index i (``seed`` + i, or ``keys[i]``) and its own round
        count, so with a fixed K its output is what ``generate([prompt_i], row_indices=[i])``
        gives (with ``k="auto"`` the law is exact and the draft lengths are the batch's).
        ``kwargs``: as :meth:`generate`, per-row values given for the whole dataset.
        ``on_row(i, row)``: called as row i finishes, with its raw results (a dict of numpy
        values, as the program returns them: ``tokens`` is the padded buffer, of which the
        first ``gen_len`` are the row's; its counters, not yet :class:`RowStats`). The output lists rows in dataset
        order; ``raw`` adds ``iterations`` (loop iterations of the whole run),
        ``batch_size``, ``inserts``, ``stages`` ((slots, loop iterations) per batch size
        the run went through), ``slot_iterations`` (their sum of slots x iterations) and,
        for this engine, ``k_rounds`` and ``switches``. ``compact``: when no prompt is left, the running
        rows move to fewer slots, b/2, b/4, ..., 1: ``"auto"`` (the default) moves to a size
        whose programs are built (by an earlier run or by ``compile(..., compact=True)``),
        and to one not built yet only when the move can save more time than building it
        is expected to take (:func:`tail_pays`: about as long as this size's programs
        took); True: every move, building what it needs; a list of sizes (e.g. ``[12, 8, 6,
        4, 3, 2, 1]``: fewer idle slots, more programs): every move to those; False: never.
        With k="auto" a size with no cost table borrows the table of the nearest larger
        size that has one (it never stops to measure). Each size is compiled once per
        engine; the rows' tokens do not change."""
        full = self.prepare(prompts, **kwargs)
        return self._dataset(full, batch_size, {}, True, raise_on_error, on_row, compact)

    def has_costs(self, batch_size: int) -> bool:
        """Adaptive K: a cost table for this batch size is set or saved (no measuring)."""
        return int(batch_size) in self.costs or self.cost_key(batch_size) in _load_costs()

    def stream(self, prompts, *, chunk: int = 4, raise_on_error=True, **kwargs) -> TokenStream:
        """As :meth:`generate`, streamed: the loop runs ``chunk`` rounds at a time with its
        state kept on the devices, and the returned :class:`TokenStream` yields the tokens
        each row committed in each chunk; its ``output`` then equals what :meth:`generate`
        returns for the same arguments (the same rounds with the same keys). Each chunk
        ends with one transfer of the token buffer to the host."""
        batch = self.prepare(prompts, **kwargs)
        check_cache_memory(self.target, batch.size, batch.cache_len)  # at creation, as every check
        return TokenStream(self._stream(batch, _chunk(chunk), {}, True, raise_on_error))

    def compile(self, prompts, *, stream: bool = False, dataset_batch: Optional[int] = None,
                compact="auto", **kwargs) -> None:
        """Compile the program :meth:`generate` runs for these arguments (the same shapes and
        static settings: buckets, not values) without running it, so that such a
        ``generate`` then spends its time decoding; ``stream=True``: the programs of
        :meth:`stream` instead; ``dataset_batch=B``: those of
        ``generate_dataset(prompts, batch_size=B, compact=compact)`` (with ``compact="auto"``
        those of the B slots only; True or a list: every tail size's too). With ``k="auto"`` this also
        measures the round costs for that batch size if none are known (:meth:`costs_for`)."""
        batch = self.prepare(prompts, **kwargs)
        if dataset_batch is not None:
            self._compile_dataset(batch, min(dataset_batch, batch.size), {}, compact)
            return
        if stream:
            self._measure_streamed(batch, {})
        args, static = self._call_args(batch)
        self._stream_executables(args, static) if stream else self._executable(args, static)


# --------------------------------------------------------------------------------------
# the autoregressive baseline


class AutoregressiveEngine(_Sharded):
    """Plain sampling from the target, same pipeline and API: the baseline for speed and law.

    Step t of a row (its t-th generated token, from 0) draws with ``derive(row_key, t, TARGET, 0)``. ``sharding``,
    ``compiler_options``: as for :class:`SpeculativeEngine`.
    """

    def __init__(self, target, *, sharding=None, prefill_chunk: int = PREFILL_CHUNK,
                 batch_hints: Optional[bool] = None, compiler_options: Optional[dict] = None):
        self.target = target
        self.sharding = sharding
        self.prefill_chunk = _check_chunk(prefill_chunk)
        self.batch_hints = resolve_batch_hints(batch_hints)
        self.compiler_options = resolve_compiler_options(compiler_options)
        self.trace_count = 0
        self._jit_programs()

    def _program(self, target_params, prompts, prompt_lens, row_keys, params, controls, max_new,
                 stop_ids, use_penalties, *, out_cap, cache_len, hints=None):
        carry = self._start_program(target_params, prompts, prompt_lens, row_keys, params, controls,
                                    max_new, stop_ids, use_penalties, out_cap=out_cap, cache_len=cache_len)
        with sampling.batch_hints(hints):
            carry = self._loop(carry, target_params, row_keys, params, controls, max_new, stop_ids,
                               use_penalties)
        return self._finish_program(carry, out_cap)

    def _start_program(self, target_params, prompts, prompt_lens, row_keys, params, controls, max_new,
                       stop_ids, use_penalties, *, out_cap, cache_len, hints=None) -> "ARCarry":
        self.trace_count += 1
        tgt = self.target
        b = prompts.shape[0]
        tcache = self._c_cache(tgt.init_cache(b, cache_len))
        tcache, _ = prefill(tgt, target_params, prompts, prompt_lens, tcache, chunk=self.prefill_chunk)
        tcache = self._c_cache(tcache.with_lengths(prompt_lens - 1))
        state = self._c_state(DecodeState.initial(prompts, prompt_lens, out_cap + 1, cache_len + 1,
                                                  tgt.vocab_size, max_new))
        return ARCarry(state=state, target_cache=tcache, round=jnp.int32(0))

    def _loop(self, carry: "ARCarry", target_params, row_keys, params, controls, max_new, stop_ids,
              use_penalties, until=None, pause=None) -> "ARCarry":
        """Steps until every row is done (or as :meth:`SpeculativeEngine._loop` says)."""
        tgt = self.target

        def body(c: ARCarry) -> ARCarry:
            state, t = c.state, c.round
            b = state.seq_len.shape[0]
            o = tgt.apply(target_params, state.last_tokens()[:, None],
                          c.target_cache.with_lengths(state.seq_len - 1))
            logits = self._c(o.logits, _LOGITS)[:, 0]
            lp = self._c(process_rows(logits, params, state.counts, use_penalties,
                                      allowed=controls.allowed_at(state.gen_len),
                                      bias=controls.bias_at(2), top_values=self._top_values),
                         ("batch", "vocab"))
            # step index = the row's own generated count (the loop index for a row that
            # starts with the batch; what a row inserted later would have had alone)
            x = sample_rows(jax.vmap(lambda kk, g: keys.derive(kk, g, keys.TARGET, 0))(row_keys, state.gen_len), lp)
            err = x < 0  # NaN, or no token possible: what sample() marks with -1
            state, _ = state.commit(x[:, None], jnp.ones((b,), jnp.int32), stop_ids, max_new, err)
            return ARCarry(state=self._c_state(state),
                           target_cache=self._c_cache(o.cache.with_lengths(state.seq_len - 1)),
                           round=t + 1)

        return jax.lax.while_loop(_more(carry, until, pause), body, carry)

    def _advance_program(self, carry, target_params, row_keys, params, controls, max_new, stop_ids,
                         use_penalties, until, pause, *, hints=None) -> "ARCarry":
        with sampling.batch_hints(hints):
            return self._loop(carry, target_params, row_keys, params, controls, max_new, stop_ids,
                              use_penalties, until, pause)

    def _finish_program(self, carry: "ARCarry", out_cap: int) -> dict:
        return self._c_out(dict(_outputs(carry.state, out_cap), iterations=carry.round))

    @staticmethod
    def _advance_inputs(args) -> tuple:
        """``_call_args``' arguments that the loop reads (all but the prompts and lengths)."""
        return args[:1] + args[3:]

    def prepare(self, prompts, **kwargs) -> Batch:
        return prepare_batch(prompts, self.target, **kwargs)

    def _call_args(self, batch: Batch, greedy: bool = False, hints=_OWN):
        if not isinstance(greedy, (bool, np.bool_)):
            raise TypeError(f"greedy must be True or False, got {greedy!r}")
        check_cache_memory(self.target, batch.size, batch.cache_len)
        if greedy:
            batch = dataclasses.replace(batch, params=_all_greedy(batch.params))
        args = (self._placed(self.target.params, "target"), *self._device_inputs(batch))
        return args, dict(out_cap=batch.out_cap, cache_len=batch.cache_len,
                          hints=self._hints_of(batch) if hints is _OWN else hints)

    def generate(self, prompts, *, greedy=False, raise_on_error=True, **kwargs) -> GenerateOutput:
        """As :meth:`SpeculativeEngine.generate`; ``greedy``: temperature 0 for every row."""
        batch = self.prepare(prompts, **kwargs)
        res = self._execute(batch, greedy=greedy)
        return _to_output(res, with_stats=False, raise_on_error=raise_on_error, rows=batch.size)

    def generate_dataset(self, prompts, *, batch_size: int = 16, greedy=False, raise_on_error=True,
                         on_row=None, compact="auto", **kwargs) -> GenerateOutput:
        """As :meth:`SpeculativeEngine.generate_dataset` (row i's step t draws with its
        dataset key, so its tokens are those it gets alone)."""
        full = self.prepare(prompts, **kwargs)
        return self._dataset(full, batch_size, dict(greedy=greedy), False, raise_on_error, on_row, compact)

    def stream(self, prompts, *, chunk: int = 8, greedy=False, raise_on_error=True,
               **kwargs) -> "TokenStream":
        """As :meth:`SpeculativeEngine.stream` (``chunk``: decoding steps per chunk)."""
        batch = self.prepare(prompts, **kwargs)
        check_cache_memory(self.target, batch.size, batch.cache_len)  # at creation, as every check
        return TokenStream(self._stream(batch, _chunk(chunk), dict(greedy=greedy), False, raise_on_error))

    def compile(self, prompts, *, greedy=False, stream: bool = False,
                dataset_batch: Optional[int] = None, compact="auto", **kwargs) -> None:
        """As :meth:`SpeculativeEngine.compile`."""
        batch = self.prepare(prompts, **kwargs)
        if dataset_batch is not None:
            self._compile_dataset(batch, min(dataset_batch, batch.size), dict(greedy=greedy), compact)
            return
        args, static = self._call_args(batch, greedy)
        self._stream_executables(args, static) if stream else self._executable(args, static)
