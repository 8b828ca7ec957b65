"""The speculative decoding engine and the autoregressive baseline.

One ``generate`` call = host-side checks, padding to buckets, then ONE jitted function:
prefill both models, then a ``lax.while_loop`` of rounds until every row is done:

    propose : the proposer drafts up to K tokens and their processed log-probs q
    score   : the target runs ONE forward over [s[-1], x_1..x_K] (K+1 positions)
    process : the shared sampling pipeline turns target logits into log-probs p
    verify  : vmap(token_verify | block_verify | greedy_verify) over rows
    commit  : write the emitted tokens (cut at stop tokens / max_new_tokens),
              set cache lengths (rollback = lengths), mark finished rows

Cache convention: a row with committed sequence ``s`` of length L keeps the target's KV
for ``s[:L-1]``; the verify forward feeds ``s[L-1]`` followed by the drafts, so its K+1
output distributions are p(. | s), p(. | s x_1), ..., p(. | s x_1..x_K).

Keys: every row has its own key. Round r of a row uses ``fold_in(row_key, r)``; the
proposer folds in DRAFT and the position, the verifier ACCEPT / RESIDUAL / BONUS and the
position (see ``specjax.keys``). Nothing depends on the row's slot in the batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import keys as K_
from specjax import sampling
from specjax import verify as V_
from specjax.proposers import (
    CommitContext,
    DraftModelProposer,
    ProposeContext,
    PromptLookupProposer,
    process_rows,
    sample_rows,
)

METHODS = ("token", "block", "greedy")
PAD_ID = V_.PAD_ID
_NO_STOP = -2  # never a token id


# --------------------------------------------------------------------------------------
# results


@dataclasses.dataclass
class RowStats:
    rounds: int
    drafted: int
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
# host-side preparation


def bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two (>= minimum): prompts and buffers use few shapes."""
    b = minimum
    while b < n:
        b *= 2
    return b


def _as_params(sampling_params, batch: int) -> sampling.SamplingParams:
    if sampling_params is None:
        return sampling.SamplingConfig().to_params(batch)
    if isinstance(sampling_params, sampling.SamplingParams):
        got = np.shape(sampling_params.temperature)
        if got != (batch,):
            raise ValueError(f"SamplingParams have batch shape {got}, expected ({batch},)")
        return sampling_params
    if isinstance(sampling_params, sampling.SamplingConfig):
        return sampling_params.to_params(batch)
    if isinstance(sampling_params, dict):
        return sampling.SamplingParams.create(batch, **sampling_params)
    raise TypeError(f"unsupported sampling parameters: {type(sampling_params).__name__}")


def _prepare_prompts(prompts, vocab_size: int, min_len: int):
    if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 1:
        prompts = [prompts]
    rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
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
    p_bucket = bucket(int(lens.max()))
    buf = np.zeros((len(rows), p_bucket), dtype=np.int32)
    for i, r in enumerate(rows):
        buf[i, : r.size] = r
    return buf, lens


def _prepare_keys(keys, seed, row_indices, batch):
    if keys is not None:
        keys = jnp.asarray(keys)
        if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
            keys = jax.random.wrap_key_data(keys)
        if keys.shape != (batch,):
            raise ValueError(f"expected one key per row: shape ({batch},), got {keys.shape}")
        return keys
    if seed is None:
        raise ValueError("give either per-row keys or a seed")
    if row_indices is None:
        row_indices = np.arange(batch)
    row_indices = np.asarray(row_indices)
    if row_indices.shape != (batch,):
        raise ValueError(f"row_indices must have shape ({batch},)")
    return K_.row_keys(int(seed), row_indices)


def _per_row_int(value, batch, name, minimum):
    arr = np.broadcast_to(np.asarray(value, dtype=np.int64), (batch,)).copy()
    if (arr < minimum).any():
        raise ValueError(f"{name} must be >= {minimum}, got {arr.min()}")
    return arr.astype(np.int32)


def _stop_array(stop_tokens, vocab_size):
    stops = [] if stop_tokens is None else [int(t) for t in stop_tokens]
    for t in stops:
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop token {t} outside [0, {vocab_size})")
    # a fixed small size so the number of stop tokens rarely changes the shape
    n = max(4, 1 << max(0, len(stops) - 1).bit_length())
    arr = np.full((n,), _NO_STOP, dtype=np.int32)
    arr[: len(stops)] = stops
    return arr


def _context_limit(model) -> Optional[int]:
    cfg = getattr(model, "config", None)
    for name in ("max_position", "max_seq_len", "context_length", "max_position_embeddings"):
        v = getattr(cfg, name, None)
        if v:
            return int(v)
    return None


def _use_penalties(params: sampling.SamplingParams) -> bool:
    rp = np.asarray(params.repetition_penalty)
    pp = np.asarray(params.presence_penalty)
    return bool((rp != 1.0).any() or (pp != 0.0).any())


# --------------------------------------------------------------------------------------
# device-side pieces shared by both loops


def _gather_rows(buf, idx):
    return jnp.take_along_axis(buf, idx[:, None], axis=1)[:, 0]


def _write_rows(buf, start, values, mask):
    """buf[b, start[b] + j] = values[b, j] where mask[b, j] (fixed shapes, per row)."""

    def one(row, s, vals, m):
        old = jax.lax.dynamic_slice(row, (s,), vals.shape)
        return jax.lax.dynamic_update_slice(row, jnp.where(m, vals, old), (s,))

    return jax.vmap(one)(buf, start, values, mask)


def _commit(state, emitted, num_emit, stop_ids, max_new, err):
    """Append ``emitted[b, :num_emit[b]]`` to each active row, cut at stops / max_new."""
    e = emitted.shape[1]
    j = jnp.arange(e)[None, :]
    active = ~state["done"]
    remaining = max_new - state["gen_len"]
    valid = j < num_emit[:, None]
    is_stop = jnp.any(emitted[:, :, None] == stop_ids[None, None, :], axis=-1) & valid
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), e)
    n = jnp.minimum(jnp.minimum(num_emit, remaining), first_stop + 1)
    n = jnp.where(active & ~err, n, 0)
    mask = j < n[:, None]
    out = _write_rows(state["out"], state["gen_len"], emitted, mask)
    seq = _write_rows(state["seq"], state["seq_len"], emitted, mask)
    v = state["counts"].shape[-1]
    add = jnp.sum(jax.nn.one_hot(jnp.where(mask, emitted, 0), v, dtype=jnp.int32) * mask[..., None], axis=1)
    gen_len = state["gen_len"] + n
    stopped = active & (first_stop < n)
    done = state["done"] | stopped | (gen_len >= max_new) | (active & err)
    return dict(
        state,
        out=out,
        seq=seq,
        counts=state["counts"] + add,
        gen_len=gen_len,
        seq_len=state["seq_len"] + n,
        done=done,
        stopped=state["stopped"] | stopped,
        error=state["error"] | (active & err),
    ), n


def _initial_state(prompt_buf, prompt_lens, out_cap, seq_cap, vocab_size, max_new):
    b, p = prompt_buf.shape
    seq = jnp.zeros((b, seq_cap), jnp.int32).at[:, :p].set(prompt_buf)
    valid = jnp.arange(p)[None, :] < prompt_lens[:, None]
    counts = jnp.sum(
        jax.nn.one_hot(prompt_buf, vocab_size, dtype=jnp.int32) * valid[..., None], axis=1
    )
    return dict(
        out=jnp.full((b, out_cap), PAD_ID, jnp.int32),
        seq=seq,
        counts=counts,
        gen_len=jnp.zeros((b,), jnp.int32),
        seq_len=prompt_lens,
        done=max_new <= 0,
        stopped=jnp.zeros((b,), bool),
        error=jnp.zeros((b,), bool),
    )


# --------------------------------------------------------------------------------------
# optional sharding (specjax.sharding.MeshPlan): no-ops when the engine has none

_LOGITS = ("batch", None, "vocab")
_STATE_NAMES = {"counts": ("batch", "vocab")}  # every other state entry: rows over `batch`


class _Sharded:
    """Mixin: placement of inputs and constraints inside the trace for ``self.sharding``."""

    sharding = None

    def _c(self, x, names, role="target"):
        return x if self.sharding is None else self.sharding.constrain(x, names, role)

    def _c_cache(self, cache, role="target"):
        return cache if self.sharding is None else self.sharding.constrain_caches(cache, role)

    def _c_state(self, state):
        if self.sharding is None:
            return state
        return {k: self.sharding.constrain(v, _STATE_NAMES.get(k, ("batch",) + (None,) * (v.ndim - 1)))
                for k, v in state.items()}

    def _c_out(self, out):
        """Outputs replicated: every host can read them (multi-host ``device_get``)."""
        return out if self.sharding is None else self.sharding.constrain_replicated(out)

    def _role(self, role):
        return contextlib.nullcontext() if self.sharding is None else self.sharding.role(role)

    def _context(self):
        return contextlib.nullcontext() if self.sharding is None else self.sharding.context()

    def _placed(self, params, role):
        """Parameters in the shardings the rules give (moved there if they are not)."""
        if self.sharding is None or params is None:
            return params
        from specjax.sharding import param_shardings

        def place(a, sh):
            if getattr(a, "sharding", None) == sh:
                return a
            if isinstance(a, jax.ShapeDtypeStruct):  # abstract parameters (AOT lowering)
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
            return jax.device_put(a, sh)

        return jax.tree.map(place, params, param_shardings(params, self.sharding, role))

    def _pad_rows(self, buf, lens, rk, params, max_new):
        """Pad the batch to a multiple of the ``data`` axis with rows that emit nothing."""
        b = buf.shape[0]
        d = 1 if self.sharding is None else self.sharding.data_size
        extra = (-b) % d
        if not extra:
            return buf, lens, rk, params, max_new
        rep = np.concatenate([np.arange(b), np.zeros(extra, np.int64)])
        rk = rk[jnp.asarray(rep)]
        params = jax.tree.map(lambda a: jnp.asarray(a)[rep], params)
        max_new = np.concatenate([max_new, np.zeros(extra, max_new.dtype)])
        return buf[rep], lens[rep], rk, params, max_new

    def _put(self, rows, replicated):
        """Host arrays -> global arrays: ``rows`` over ``data``, ``replicated`` everywhere."""
        if self.sharding is None:
            return ([jax.tree.map(jnp.asarray, r) for r in rows],
                    [jax.tree.map(jnp.asarray, r) for r in replicated])
        return ([self.sharding.put_rows(r) for r in rows],
                [self.sharding.put_replicated(r) for r in replicated])


def _trim_rows(out: "GenerateOutput", b: int) -> "GenerateOutput":
    if len(out.tokens) == b:
        return out
    raw = {k: (v[:b] if isinstance(v, np.ndarray) and v.ndim else v) for k, v in out.raw.items()}
    return GenerateOutput(tokens=out.tokens[:b], stats=None if out.stats is None else out.stats[:b],
                          finished_by_stop=out.finished_by_stop[:b], raw=raw)


# --------------------------------------------------------------------------------------
# the engine


class SpeculativeEngine(_Sharded):
    """Holds the static parts (models, proposer, K, method) and one jitted program.

    Calls that differ only in prompt content, sampling values, seeds or lengths within the
    same buckets reuse the compiled program; ``trace_count`` counts traces.

    ``sharding`` (a :class:`specjax.sharding.MeshPlan`, optional): run the whole program
    on its mesh: batch rows and KV caches over ``data``, the target's parameters and
    logits by the plan's rules (tensor-parallel over ``model``); verification then runs
    on vocabulary-sharded log-probs. Outputs are the same as without a mesh.
    """

    def __init__(self, target, proposer, k: int, method: str = "token", *, sharding=None):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"K must be an integer >= 1, got {k!r}")
        if proposer.k != k:
            raise ValueError(f"proposer drafts K={proposer.k}, engine asked for K={k}")
        if proposer.vocab_size != target.vocab_size:
            raise ValueError(
                f"vocabulary mismatch: target V={target.vocab_size}, draft V={proposer.vocab_size}"
            )
        self.target = target
        self.proposer = proposer
        self.k = k
        self.method = method
        self.sharding = sharding
        self.trace_count = 0
        self._run = jax.jit(self._impl, static_argnames=("out_cap", "cache_len"))

    # -- device program ---------------------------------------------------------------
    def _impl(self, target_params, draft_params, prompt_buf, prompt_lens, row_keys, params,
              max_new, stop_ids, use_penalties, *, out_cap, cache_len):
        self.trace_count += 1
        k = self.k
        tgt = self.target
        prop = self.proposer
        b = prompt_buf.shape[0]
        v = tgt.vocab_size
        want_hidden = prop.needs_target_hidden
        if self.method == "greedy":
            params = params.replace(temperature=jnp.zeros_like(params.temperature))

        # prefill: the target keeps KV for s[:L-1]
        tcache = self._c_cache(tgt.init_cache(b, cache_len))
        pre = tgt.apply(target_params, prompt_buf, tcache, return_hidden=want_hidden)
        tcache = self._c_cache(pre.cache.with_lengths(self._target_cache_lengths(prompt_lens)))
        with self._role("draft"):
            pstate = prop.init(draft_params, prompt_buf, prompt_lens, cache_len,
                               pre.hidden if want_hidden else None)
        pstate = self._c_cache(pstate, "draft")

        state = _initial_state(prompt_buf, prompt_lens, out_cap + k + 1, cache_len + k + 1, v, max_new)
        state = self._c_state(state)
        stats = dict(
            rounds=jnp.zeros((b,), jnp.int32),
            drafted=jnp.zeros((b,), jnp.int32),
            accepted=jnp.zeros((b,), jnp.int32),
            reached_pos=jnp.zeros((b, k), jnp.int32),
            accepted_pos=jnp.zeros((b, k), jnp.int32),
            alpha_sum=jnp.zeros((b,), jnp.float32),
            alpha_n=jnp.zeros((b,), jnp.int32),
        )

        verify_one = {
            "token": V_.token_verify,
            "block": V_.block_verify,
        }.get(self.method)

        def cond(carry):
            state = carry[0]
            return ~jnp.all(state["done"])

        def body(carry):
            state, stats, tcache, pstate, r = carry
            active = ~state["done"]
            rkeys = jax.vmap(lambda kk: K_.round_key(kk, r))(row_keys)
            ctx = ProposeContext(
                seq=state["seq"], seq_len=state["seq_len"], params=params, counts=state["counts"],
                round_keys=rkeys, use_penalties=use_penalties,
            )
            with self._role("draft"):
                prop_out = prop.propose(draft_params, pstate, ctx)
            x, q_lp, nd = prop_out.tokens, prop_out.logprobs, prop_out.num_draft
            q_lp = self._c(q_lp, _LOGITS)  # laid out like the target's (vocab-sharded)
            nd = jnp.where(active, nd, 0)
            last = _gather_rows(state["seq"], state["seq_len"] - 1)

            def score_full(_):
                o = tgt.apply(target_params, jnp.concatenate([last[:, None], x], axis=1), tcache,
                              return_hidden=want_hidden)
                hd = o.hidden if want_hidden else jnp.zeros((b, k + 1, 1), jnp.float32)
                return o.logits, hd, o.cache

            def score_one(_):
                o = tgt.apply(target_params, last[:, None], tcache, return_hidden=want_hidden)
                lg = jnp.broadcast_to(o.logits, (b, k + 1, v))
                hd = o.hidden if want_hidden else jnp.zeros((b, 1, 1), jnp.float32)
                return lg, jnp.broadcast_to(hd, (b, k + 1) + hd.shape[2:]), o.cache

            # a round where no row proposed anything costs one single-token target step; a
            # proposer that always drafts K tokens (``always_drafts``) skips the test, and
            # with it the copies of the whole KV cache that a conditional costs
            if getattr(prop, "always_drafts", False):
                t_logits, t_hidden, tcache = score_full(None)
            else:
                t_logits, t_hidden, tcache = jax.lax.cond(jnp.any(nd > 0), score_full, score_one, None)
            t_logits, tcache = self._c(t_logits, _LOGITS), self._c_cache(tcache)

            # the same pipeline, same order, for the target at each of the K+1 positions:
            # the history at position i includes the draft tokens x_1..x_{i}
            # (computed only when some row has a penalty on)
            p_lp = self._c(process_rows(t_logits, params, lambda: self._position_counts(state["counts"], x, nd),
                                        use_penalties), _LOGITS)

            if self.method == "greedy":
                res = jax.vmap(V_.greedy_verify)(x, p_lp, nd)
            else:
                # every target row greedy: the residual / bonus law of each row has at most
                # one possible token, so its draw needs no noise (sampling.single_draws)
                def verify_rows(single):
                    def f(_):
                        with sampling.single_draws(single):
                            return jax.vmap(verify_one)(rkeys, x, q_lp, p_lp, nd)
                    return f

                res = jax.lax.cond(sampling.at_most_one_possible(p_lp), verify_rows(True), verify_rows(False), None)
            n_acc = res.num_accepted
            state, n_commit = _commit(state, res.tokens, n_acc + 1, stop_ids, max_new, res.error)

            # rollback is setting lengths; finished rows stay where they are
            tcache = tcache.with_lengths(self._target_cache_lengths(state["seq_len"]))
            # the proposer sees the target's final hidden states of this forward: entries
            # 0..n_acc are those after s[L-1], x_1..x_n (committed tokens); the rest are stale
            num_new = jnp.where(active & ~res.error, n_acc + 1, 0)
            with self._role("draft"):
                pstate = prop.commit(draft_params, prop_out.state, CommitContext(
                    seq=state["seq"], seq_len=state["seq_len"],
                    target_hidden=t_hidden if want_hidden else None, num_new=num_new))
            pstate = self._c_cache(pstate, "draft")
            state = self._c_state(state)

            # statistics (active rows only)
            pos = jnp.arange(k)[None, :]
            reached = (pos <= n_acc[:, None]) & (pos < nd[:, None]) & active[:, None]
            acc = (pos < n_acc[:, None]) & active[:, None]
            alpha = V_.overlap_alpha(q_lp, p_lp[:, :k])
            stats = dict(
                rounds=stats["rounds"] + active.astype(jnp.int32),
                drafted=stats["drafted"] + nd,
                accepted=stats["accepted"] + jnp.where(active, n_acc, 0),
                reached_pos=stats["reached_pos"] + reached.astype(jnp.int32),
                accepted_pos=stats["accepted_pos"] + acc.astype(jnp.int32),
                alpha_sum=stats["alpha_sum"] + jnp.sum(jnp.where(reached, alpha, 0.0), axis=1),
                alpha_n=stats["alpha_n"] + jnp.sum(reached.astype(jnp.int32), axis=1),
            )
            return state, stats, tcache, pstate, r + 1

        carry = (state, stats, tcache, pstate, jnp.int32(0))
        state, stats, _, pstate, _ = jax.lax.while_loop(cond, body, carry)
        out = self._c_out(dict(
            tokens=state["out"][:, :out_cap], gen_len=state["gen_len"], stopped=state["stopped"],
            error=state["error"], **stats,
        ))
        return dict(out, proposer_state=pstate)

    @staticmethod
    def _position_counts(counts, x, nd):
        """Token counts of the history at each of the K+1 scored positions: position i
        sees the committed tokens (``counts`` [B, V]) and the draft tokens x_1..x_i of
        its row (only the ``nd`` real ones) -> [B, K+1, V]."""
        b, k = x.shape
        real = jnp.arange(k)[None, :] < nd[:, None]
        oh = jax.nn.one_hot(jnp.where(real, x, 0), counts.shape[-1], dtype=counts.dtype) * real[..., None]
        return counts[:, None, :] + jnp.concatenate(
            [jnp.zeros((b, 1, counts.shape[-1]), counts.dtype), jnp.cumsum(oh, axis=1)], axis=1)

    @staticmethod
    def _target_cache_lengths(seq_len):
        """After a commit the target keeps KV for s[:L-1] (rollback = this length)."""
        return seq_len - 1

    # -- host API ---------------------------------------------------------------------
    def generate(self, prompts, *, keys=None, seed=None, row_indices=None, sampling_params=None,
                 max_new_tokens=64, stop_tokens=None, raise_on_error=True) -> GenerateOutput:
        args, static, b = self._prepare(prompts, keys=keys, seed=seed, row_indices=row_indices,
                                        sampling_params=sampling_params,
                                        max_new_tokens=max_new_tokens, stop_tokens=stop_tokens)
        with self._context():
            res = self._run(*args, **static)
        out = _to_output(res, with_stats=True, k=self.k, raise_on_error=raise_on_error)
        return _trim_rows(out, b)

    def lower(self, prompts, **kwargs):
        """Ahead-of-time: ``jax.jit(...).lower`` of the program ``generate`` would run with
        these arguments (the models' params may be abstract ``jax.ShapeDtypeStruct``s);
        ``.compile()`` it for the compiled HLO and its memory analysis."""
        args, static, _ = self._prepare(prompts, **kwargs)
        with self._context():
            return self._run.lower(*args, **static)

    def _prepare(self, prompts, *, keys=None, seed=None, row_indices=None, sampling_params=None,
                 max_new_tokens=64, stop_tokens=None):
        tgt = self.target
        v = tgt.vocab_size
        buf, lens = _prepare_prompts(prompts, v, max(1, self.proposer.min_prompt_len))
        b = buf.shape[0]
        params = _as_params(sampling_params, b)
        max_new = _per_row_int(max_new_tokens, b, "max_new_tokens", 0)
        out_cap = bucket(int(max_new.max()), 32)
        cache_len = buf.shape[1] + out_cap + self.k + 1
        cache_len = int(math.ceil(cache_len / 16) * 16)
        limit = _context_limit(tgt)
        need = int((lens + max_new).max()) + self.k
        if limit is not None and need > limit:
            raise ValueError(
                f"prompt + max_new_tokens + K = {need} exceeds the model's context of {limit} tokens"
            )
        rk = _prepare_keys(keys, seed, row_indices, b)
        stops = _stop_array(stop_tokens, v)
        pen = _use_penalties(params)
        buf, lens, rk, params, max_new = self._pad_rows(buf, lens, rk, params, max_new)
        (buf, lens, rk, params, max_new), (stops, pen) = self._put(
            [buf, lens, rk, params, max_new], [stops, np.asarray(pen)])
        args = (self._placed(tgt.params, "target"), self._placed(self.proposer.params, "draft"),
                buf, lens, rk, params, max_new, stops, pen)
        return args, dict(out_cap=out_cap, cache_len=cache_len), b


def _gather_rows_vec(x, idx):
    """x [B, T, D], idx [B] -> [B, D]."""
    return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


def _to_output(res, *, with_stats, k, raise_on_error):
    pstate = res.pop("proposer_state", None)  # stays on device (it may hold a KV cache)
    res = jax.device_get(res)
    res["proposer_state"] = pstate
    err = np.asarray(res["error"])
    if raise_on_error and err.any():
        raise FloatingPointError(
            f"invalid (NaN) probabilities met in rows {np.nonzero(err)[0].tolist()}; "
            "no token was emitted for them past that point"
        )
    toks = np.asarray(res["tokens"])
    lens = np.asarray(res["gen_len"])
    tokens = [toks[i, : lens[i]].tolist() for i in range(toks.shape[0])]
    stats = None
    if with_stats:
        stats = []
        for i in range(toks.shape[0]):
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
    return GenerateOutput(tokens=tokens, stats=stats, finished_by_stop=np.asarray(res["stopped"]).tolist(), raw=res)


# --------------------------------------------------------------------------------------
# the autoregressive baseline


class AutoregressiveEngine(_Sharded):
    """Plain sampling from the target, same pipeline and API: the baseline for speed and law.

    Step t of a row draws its token with ``derive(row_key, t, TARGET, 0)``. ``sharding``:
    as for :class:`SpeculativeEngine`.
    """

    def __init__(self, target, *, sharding=None):
        self.target = target
        self.sharding = sharding
        self.trace_count = 0
        self._run = jax.jit(self._impl, static_argnames=("out_cap", "cache_len", "greedy"))

    def _impl(self, target_params, prompt_buf, prompt_lens, row_keys, params, max_new, stop_ids,
              use_penalties, *, out_cap, cache_len, greedy):
        self.trace_count += 1
        tgt = self.target
        b = prompt_buf.shape[0]
        v = tgt.vocab_size
        if greedy:
            params = params.replace(temperature=jnp.zeros_like(params.temperature))
        tcache = self._c_cache(tgt.init_cache(b, cache_len))
        tcache = tgt.apply(target_params, prompt_buf, tcache).cache.with_lengths(prompt_lens - 1)
        tcache = self._c_cache(tcache)
        state = self._c_state(_initial_state(prompt_buf, prompt_lens, out_cap + 1, cache_len + 1, v, max_new))

        def cond(carry):
            return ~jnp.all(carry[0]["done"])

        def body(carry):
            state, tcache, t = carry
            last = _gather_rows(state["seq"], state["seq_len"] - 1)
            o = tgt.apply(target_params, last[:, None], tcache.with_lengths(state["seq_len"] - 1))
            logits = self._c(o.logits, _LOGITS)[:, 0]
            lp = self._c(process_rows(logits, params, state["counts"], use_penalties), ("batch", "vocab"))
            ks = jax.vmap(lambda kk: K_.derive(kk, t, K_.TARGET, 0))(row_keys)
            x = sample_rows(ks, lp)
            err = jnp.any(jnp.isnan(lp), axis=-1)
            state, _ = _commit(state, x[:, None], jnp.ones((b,), jnp.int32), stop_ids, max_new, err)
            return (self._c_state(state), self._c_cache(o.cache.with_lengths(state["seq_len"] - 1)),
                    t + 1)

        state, _, _ = jax.lax.while_loop(cond, body, (state, tcache, jnp.int32(0)))
        return self._c_out(dict(tokens=state["out"][:, :out_cap], gen_len=state["gen_len"],
                                stopped=state["stopped"], error=state["error"]))

    def generate(self, prompts, *, keys=None, seed=None, row_indices=None, sampling_params=None,
                 max_new_tokens=64, stop_tokens=None, greedy=False, raise_on_error=True) -> GenerateOutput:
        tgt = self.target
        v = tgt.vocab_size
        buf, lens = _prepare_prompts(prompts, v, 1)
        b = buf.shape[0]
        params = _as_params(sampling_params, b)
        max_new = _per_row_int(max_new_tokens, b, "max_new_tokens", 0)
        out_cap = bucket(int(max_new.max()), 32)
        cache_len = int(math.ceil((buf.shape[1] + out_cap + 1) / 16) * 16)
        limit = _context_limit(tgt)
        need = int((lens + max_new).max())
        if limit is not None and need > limit:
            raise ValueError(f"prompt + max_new_tokens = {need} exceeds the model's context of {limit} tokens")
        rk = _prepare_keys(keys, seed, row_indices, b)
        pen = _use_penalties(params)
        buf, lens, rk, params, max_new = self._pad_rows(buf, lens, rk, params, max_new)
        (buf, lens, rk, params, max_new), (stops, pen) = self._put(
            [buf, lens, rk, params, max_new], [_stop_array(stop_tokens, v), np.asarray(pen)])
        with self._context():
            res = self._run(
                self._placed(tgt.params, "target"), buf, lens, rk, params, max_new, stops, pen,
                out_cap=out_cap, cache_len=cache_len, greedy=bool(greedy),
            )
        return _trim_rows(_to_output(res, with_stats=False, k=0, raise_on_error=raise_on_error), b)


# --------------------------------------------------------------------------------------
# functional front door

_ENGINES: dict = {}


def make_proposer(draft, k: int, vocab_size: int):
    """A proposer from a draft model (a ``LlamaLM`` or an EAGLE head, ``specjax.models.eagle.EagleModel``),
    the string 'lookup' / 'ngram', or a proposer object."""
    if draft is None or (isinstance(draft, str) and draft in ("lookup", "ngram", "prompt-lookup")):
        return PromptLookupProposer(vocab_size=vocab_size, k=k)
    if hasattr(draft, "propose"):
        return draft
    from specjax.models.eagle import EagleModel

    if isinstance(draft, EagleModel):
        from specjax.eagle import EagleProposer

        return EagleProposer(draft, k)
    if hasattr(draft, "apply") and hasattr(draft, "init_cache"):
        return DraftModelProposer(model=draft, k=k)
    raise TypeError(f"cannot make a proposer from {type(draft).__name__}")


def get_engine(target, draft, k: int, method: str) -> SpeculativeEngine:
    key = (id(target), id(draft) if not isinstance(draft, str) else draft, k, method)
    eng = _ENGINES.get(key)
    if eng is None or eng.target is not target:
        eng = SpeculativeEngine(target, make_proposer(draft, k, target.vocab_size), k, method)
        _ENGINES[key] = eng
    return eng


def generate(target, draft, prompts, *, k: int = 4, method: str = "token", keys=None, seed=None,
             row_indices=None, sampling_params=None, max_new_tokens=64, stop_tokens=None,
             raise_on_error=True) -> GenerateOutput:
    """Speculative decoding: see :class:`SpeculativeEngine`. ``draft`` is a model, a proposer,
    or ``"lookup"`` for prompt lookup."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"K must be an integer >= 1, got {k!r}")
    eng = get_engine(target, draft, k, method)
    return eng.generate(prompts, keys=keys, seed=seed, row_indices=row_indices,
                        sampling_params=sampling_params, max_new_tokens=max_new_tokens,
                        stop_tokens=stop_tokens, raise_on_error=raise_on_error)


_AR: dict = {}


def generate_autoregressive(target, prompts, *, keys=None, seed=None, row_indices=None,
                            sampling_params=None, max_new_tokens=64, stop_tokens=None, greedy=False,
                            raise_on_error=True) -> GenerateOutput:
    eng = _AR.get(id(target))
    if eng is None or eng.target is not target:
        eng = _AR[id(target)] = AutoregressiveEngine(target)
    return eng.generate(prompts, keys=keys, seed=seed, row_indices=row_indices,
                        sampling_params=sampling_params, max_new_tokens=max_new_tokens,
                        stop_tokens=stop_tokens, greedy=greedy, raise_on_error=raise_on_error)
