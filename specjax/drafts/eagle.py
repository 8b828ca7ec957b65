"""The EAGLE-style feature draft as a proposer (the head itself: ``specjax.models.eagle``).

:class:`EagleProposer` keeps the head's KV cache over the pairs ``(h_t, s_{t+1})`` of the
committed sequence ``s`` (length c) for t < c-1: target features ``h_t`` are known up to
position c-2 (the target's cache holds ``s[:c-1]``) and ``s_{c-1}`` is the last token, so the
pair at t = c-2 is the last complete one. Its output, the predicted ``h_{c-1}``, is kept in
the state; its logits through the target's head are the draft law of ``x_1``.

* ``init``: feed the prompt's pairs (t < c-1) from the prefill hidden states;
* ``propose``: draw x_1 from the kept prediction, then K-1 steps that feed
  ``(h_hat, x_i)`` (the head's OWN predicted feature) to get x_{i+1}; every draw goes through
  the shared pipeline (``ProposeContext.process`` / ``sample_rows``) with keys DRAFT + position, so the
  reported q is the law the token was drawn from;
* ``commit``: roll the cache back to the pairs before the round (lengths), and feed the
  round's K+1 pairs with the TRUE target features (only ``num_new`` are valid; the rest
  land in slots past the new length and are never read). Rows with ``num_new == 0``
  (finished) keep their state.

An EAGLE-3 head (``EagleConfig.feature_layers``) works the same way: the proposer asks the
engine for those hidden states (``hidden_layers``), ``init`` / ``commit`` map them to head
features with ``fuse`` before feeding them, and the chain feeds back the head's own output
feature (its layer output, which ``logits`` norms), as above.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.drafts.base import (
    CommitContext,
    ModelBackedProposer,
    Proposal,
    ProposeContext,
    check_draft_model,
    check_fields,
    draft_chain,
)
from specjax.keys import DRAFT, position_key, role_key
from specjax.sampling import sample_rows


def _take_rows(x, idx):
    """x [B, T, D], idx [B] -> [B, D]."""
    return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True, eq=False)
class EagleProposer(ModelBackedProposer):
    """Proposer for an :class:`specjax.models.eagle.EagleModel` (needs the target's hidden states)."""

    model: Any
    k: int
    needs_target_hidden: bool = True
    min_prompt_len: int = 2
    always_drafts: bool = True  # num_draft is K for every row
    # adaptive K: the head steps of up to this many plain rounds (j = 0) in a row wait in the
    # state (the target's hidden states) and run before the next drafting round
    # (``catch_up``, in forwards of ``catch_up_chunk`` pairs, as many as the longest backlog
    # needs); 0: one head step per plain round. Speed only: where drafting does not pay
    # (large batches) the head then runs only for probes, and not at all for what a row
    # commits after its last one.
    plain_backlog: int = 128
    catch_up_chunk: int = 32

    def __post_init__(self):
        check_fields(self, k=1, plain_backlog=0, catch_up_chunk=0)
        check_draft_model(self, "apply", "init_cache", "vocab_size", "fuse", "hidden_layers")

    @property
    def hidden_layers(self):
        """The target hidden states to hand to ``init`` / ``commit`` (the engine's
        ``return_hidden``): None = the final ones; an EAGLE-3 head's feature layers."""
        return self.model.hidden_layers

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        if target_hidden is None:
            raise ValueError("EagleProposer needs the target's hidden states")
        b, p = prompt_tokens.shape
        nxt = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((b, 1), prompt_tokens.dtype)], axis=1)
        cache = self.model.init_cache(b, cache_len)
        h, cache = self.model.apply(params, self.model.fuse(params, target_hidden), nxt, cache)
        state = dict(cache=cache.with_lengths(prompt_lens - 1), h=_take_rows(h, prompt_lens - 2))
        if self.plain_backlog:  # the plain rounds' target hidden states, not yet fed (n of them)
            state.update(backlog=jnp.zeros((b, self.plain_backlog) + target_hidden.shape[2:], target_hidden.dtype),
                         n=jnp.zeros((b,), jnp.int32))
        return state

    def init_deferred(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        """``init`` with the head's pass over the prompt left to :meth:`catch_up`: the
        prompt's c-1 pairs wait in the backlog, in front of the room for ``plain_backlog``
        plain rounds (the backlog is that much wider: the prompt's width, rounded up to
        whole ``catch_up_chunk`` forwards), and the head's cache is empty. For adaptive K,
        which catches up before any drafting round: a batch that never drafts never runs
        the head. Without a backlog: :meth:`init`."""
        if not self.plain_backlog:
            return self.init(params, prompt_tokens, prompt_lens, cache_len, target_hidden)
        if target_hidden is None:
            raise ValueError("EagleProposer needs the target's hidden states")
        b, p = prompt_tokens.shape
        c = self.catch_up_chunk
        width = self.plain_backlog + (-(-p // c) * c if c > 0 else p)
        backlog = jnp.zeros((b, width) + target_hidden.shape[2:], target_hidden.dtype)
        cfg = self.model.config  # the kept prediction: set by the catch-up (every row has a pair)
        return dict(cache=self.model.init_cache(b, cache_len),  # empty (lengths 0)
                    h=jnp.zeros((b, cfg.dim), cfg.layer_config().compute_dtype),
                    backlog=backlog.at[:, :p].set(target_hidden), n=(prompt_lens - 1).astype(jnp.int32))

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        m = self.model.module(params)
        cache = state["cache"].with_lengths(ctx.seq_len - 1)
        draft_keys = jax.vmap(lambda k: role_key(k, DRAFT))(ctx.round_keys)
        v = self.vocab_size

        tm = m.token_map[...] if self.model.config.vocab_subset else None

        def draw(h, counts, i):
            ks = jax.vmap(lambda k: position_key(k, i))(draft_keys)
            lp = ctx.process(m.full_logits(h), counts, i)
            if tm is None:
                return sample_rows(ks, lp), lp
            # q is 0 outside the scored tokens (the pipeline keeps -inf at -inf), so drawing
            # among them alone is the same law at a sixth of the noise to generate
            j = sample_rows(ks, jnp.take(lp, tm, axis=-1))
            return jnp.where(j < 0, j, tm[jnp.maximum(j, 0)]), lp  # -1 (nothing possible) stays -1

        def step(carry, i):
            cache, h, counts = carry
            x, lp = draw(h, counts, i)
            hn, cache = m(h[:, None], x[:, None], cache)
            counts = counts + jax.nn.one_hot(x, v, dtype=counts.dtype)
            return (cache, hn[:, 0], counts), (x, lp)

        (cache, _, _), tokens, logprobs = draft_chain(
            self.k, step, lambda c, i: draw(c[1], c[2], i), (cache, state["h"], ctx.counts))
        b = tokens.shape[0]
        return Proposal(tokens, logprobs, jnp.full((b,), self.k, jnp.int32), dict(state, cache=cache))

    def commit(self, params, state, ctx: CommitContext):
        num_new = ctx.num_new
        base = ctx.seq_len - 1 - num_new  # pairs before this round's new ones
        kk = ctx.target_hidden.shape[1]
        idx = jnp.clip(base[:, None] + 1 + jnp.arange(kk)[None, :], 0, ctx.seq.shape[1] - 1)
        toks = jnp.take_along_axis(ctx.seq, idx, axis=1)
        h, cache = self.model.apply(params, self.model.fuse(params, ctx.target_hidden), toks,
                                    state["cache"].with_lengths(base))
        ok = num_new > 0
        h_last = _take_rows(h, jnp.maximum(num_new - 1, 0))
        return dict(state, cache=cache.with_lengths(base + num_new),
                    h=jnp.where(ok[:, None], h_last, state["h"]))

    def commit_plain(self, params, state, ctx: CommitContext):
        """After a plain round: keep the target's hidden state of the step in the backlog
        (the engine calls :meth:`catch_up` before the backlog overflows and before the next
        drafting round); without a backlog, one head step now."""
        if not self.plain_backlog:
            return self.commit(params, state, ctx)
        n = state["n"]
        rows = jnp.arange(n.shape[0])
        at = jnp.minimum(n, self.backlog_room(state) - 1)  # the engine keeps n below the room here
        return dict(state, backlog=state["backlog"].at[rows, at].set(ctx.target_hidden[:, 0]),
                    n=n + ctx.num_new)

    def backlog(self, state) -> jax.Array:
        """int32[B]: pairs whose head step has not run yet (plain rounds', and the prompt's
        after :meth:`init_deferred`)."""
        return state["n"]

    def backlog_room(self, state) -> int:
        """How many pairs the backlog of ``state`` holds (static)."""
        return state["backlog"].shape[1]

    def catch_up(self, params, state, seq, seq_len):
        """Feed the backlog's pairs (the target's hidden state after s[c-1-n+j], with the
        token s[c-n+j], j < n, c = ``seq_len``) in forwards of the head of ``catch_up_chunk``
        pairs (the whole backlog when the chunk does not divide it), as many as the longest
        row's backlog needs: the state is then what one head step per plain round would
        have left (up to rounding)."""
        n = state["n"]
        w = state["backlog"].shape[1]
        c = self.catch_up_chunk if 0 < self.catch_up_chunk < w and w % self.catch_up_chunk == 0 else w
        base = seq_len - 1 - n  # pairs fed before the backlog

        def chunk(i, st):  # backlog pairs [i*c, i*c + c) of each row (m of them are real)
            start = i * c
            m = jnp.clip(n - start, 0, c)
            fed = jnp.minimum(start, n)
            return self.commit(params, st, CommitContext(
                seq=seq, seq_len=base + fed + m + 1, num_new=m,
                target_hidden=jax.lax.dynamic_slice_in_dim(state["backlog"], start, c, axis=1)))

        out = jax.lax.fori_loop(0, (jnp.max(n) + c - 1) // c, chunk, state)
        return dict(out, n=jnp.zeros_like(n))
