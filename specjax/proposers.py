"""Proposers: whatever proposes up to K draft tokens together with the draft law q.

Every proposer is a static Python object whose methods are pure functions, called
inside the engine's jitted ``lax.while_loop``:

* ``init(params, prompt_tokens[B, P], prompt_lens[B], cache_len, target_hidden) -> state``
  (prefill, once per generate call; ``target_hidden`` is the target's final hidden states
  over the padded prompt [B, P, D] when the proposer sets ``needs_target_hidden``, else None)
* ``propose(params, state, ProposeContext) -> Proposal`` (once per round)
* ``commit(params, state, CommitContext) -> state`` (after verification: the new committed
  tokens and lengths and, for feature-based drafts such as EAGLE-style heads, the target's
  final hidden states from this round's forward; rollback is resetting cache lengths)

A proposal carries ``tokens int32[B, K]``, the *processed* draft log-probs
``logprobs float32[B, K, V]`` that the tokens were actually drawn from, and
``num_draft int32[B]`` (how many of the K slots are real; the rest are ignored). A
proposer whose ``num_draft`` is always K sets ``always_drafts = True``: the engine then
scores every round with the full (K+1)-token step without first testing for rounds with
nothing drafted (that test is a conditional, which copies the target's whole KV cache).
The full step is always correct, so the flag changes speed only, never the output.
Exactness never depends on the proposer: only the verifier's maths does. What the
proposer must guarantee is that ``tokens[b, i]`` was drawn from ``exp(logprobs[b, i])``
(a deterministic proposer reports a point mass).

Cache convention for model drafts: at the start of a round, a row whose committed
sequence ``s`` has length L has the draft's KV for ``s[:L-2]``; the first draft step
feeds the two last committed tokens ``s[L-2], s[L-1]`` (a 2-token step costs about
what a 1-token step costs). So when all K draft tokens were accepted and the last one
was never fed to the draft, nothing special is needed: it is among the two tokens fed
next round. This needs prompts of at least 2 tokens, which ``init`` checks on the host.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from specjax import keys as K_
from specjax import sampling

NEG_INF = -jnp.inf


class ProposeContext(NamedTuple):
    seq: jax.Array  # int32[B, S_total] committed tokens (prompt + generated), garbage past seq_len
    seq_len: jax.Array  # int32[B]
    params: Any  # SamplingParams with fields [B]
    counts: jax.Array  # int32[B, V] token counts of the committed sequence (for penalties)
    round_keys: jax.Array  # key[B]: fold_in(row_key, round)
    use_penalties: jax.Array  # bool scalar: any row has a penalty on


class CommitContext(NamedTuple):
    """What a proposer learns after verification (its ``commit``)."""

    seq: jax.Array  # int32[B, S_total], the committed tokens after this round
    seq_len: jax.Array  # int32[B], the new committed lengths L'
    # [B, K+1, D] the target's final hidden states from this round's forward, or None when
    # the proposer did not ask (needs_target_hidden=False). Entry j is the hidden state after
    # the committed token at position L'-1-num_new+j, for j < num_new; later entries are stale.
    target_hidden: Optional[jax.Array]
    num_new: jax.Array  # int32[B]: valid leading entries of target_hidden (0 for finished rows)


class Proposal(NamedTuple):
    tokens: jax.Array  # int32[B, K]
    logprobs: jax.Array  # float32[B, K, V]
    num_draft: jax.Array  # int32[B]
    state: Any


def _bcast(params, ndim_extra: int):
    """Give per-row parameter arrays trailing singleton axes to broadcast over T."""
    return jax.tree.map(lambda a: a.reshape(a.shape + (1,) * ndim_extra), params)


def process_rows(logits, params, counts, use_penalties, allowed=None):
    """The one sampling pipeline applied to [B, V] or [B, T, V] logits.

    ``counts`` is [B, V] or [B, T, V], or a function of no arguments that returns them
    (then they are computed only when a penalty is on). Penalty work is skipped with a
    batch-level ``lax.cond`` when no row uses a penalty (same law, less work).
    """
    extra = logits.ndim - 2
    p = _bcast(params, extra)

    def with_pen(_):
        c = counts() if callable(counts) else counts
        return sampling.process_logits(logits, p, counts=c, allowed=allowed)

    def without_pen(_):
        return sampling.process_logits(logits, p, counts=None, allowed=allowed)

    return jax.lax.cond(use_penalties, with_pen, without_pen, None)


def sample_rows(keys, logprobs):
    """One token per row from [B, V] processed log-probs with per-row keys. When every row
    has at most one possible token (all rows greedy) the draw is that token, taken without
    generating noise (the same result: ``sampling.draw_single``)."""
    return jax.lax.cond(sampling.at_most_one_possible(logprobs),
                        lambda lp: jax.vmap(sampling.draw_single)(lp),
                        lambda lp: jax.vmap(sampling.sample)(keys, lp), logprobs)


def draft_chain(k: int, step, final_draw, carry):
    """A K-token autoregressive draft: ``step(carry, i) -> (carry, (x_i, lp_i))`` for the
    first K-1 positions under ``lax.scan`` (each feeds its token to the draft), then
    ``final_draw(carry, K-1) -> (x_K, lp_K)`` (the last token is never fed).

    Returns ``(carry, tokens int32[B, K], logprobs [B, K, V])``."""
    if k > 1:
        carry, (xs, lps) = jax.lax.scan(step, carry, jnp.arange(k - 1))
        xs, lps = jnp.moveaxis(xs, 0, 1), jnp.moveaxis(lps, 0, 1)
    x_last, lp_last = final_draw(carry, k - 1)
    if k > 1:
        tokens = jnp.concatenate([xs, x_last[:, None]], axis=1)
        logprobs = jnp.concatenate([lps, lp_last[:, None]], axis=1)
    else:
        tokens, logprobs = x_last[:, None], lp_last[:, None]
    return carry, tokens.astype(jnp.int32), logprobs


class ModelBackedProposer:
    """Base of proposers that wrap a draft model (``self.model``): the vocabulary size
    and the parameters handed to the jitted program are the model's."""

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def params(self):
        return self.model.params


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModelProposer(ModelBackedProposer):
    """An autoregressive draft model (any ``specjax.models.base.LanguageModel``)."""

    model: Any
    k: int
    needs_target_hidden: bool = False
    min_prompt_len: int = 2
    always_drafts: bool = True  # num_draft is K for every row (speed only: see module doc)

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        b = prompt_tokens.shape[0]
        cache = self.model.init_cache(b, cache_len)
        out = self.model.apply(params, prompt_tokens, cache)
        # KV for s[:L-2] is what the round start expects (see module docstring).
        return out.cache.with_lengths(prompt_lens - 2)

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        cache = state.with_lengths(ctx.seq_len - 2)
        idx = jnp.stack([ctx.seq_len - 2, ctx.seq_len - 1], axis=1)
        last2 = jnp.take_along_axis(ctx.seq, idx, axis=1)
        out = self.model.apply(params, last2, cache)
        logits0 = out.logits[:, -1]
        draft_keys = jax.vmap(lambda k: K_.role_key(k, K_.DRAFT))(ctx.round_keys)
        v = logits0.shape[-1]

        def draw(logits, counts, i):
            ks = jax.vmap(lambda k: K_.position_key(k, i))(draft_keys)
            return self._draw(ks, logits, counts, ctx)

        def step(carry, i):
            cache, logits, counts = carry
            x, lp = draw(logits, counts, i)
            o = self.model.apply(params, x[:, None], cache)
            counts = counts + jax.nn.one_hot(x, v, dtype=counts.dtype)
            return (o.cache, o.logits[:, 0], counts), (x, lp)

        (cache, _, _), tokens, logprobs = draft_chain(
            self.k, step, lambda c, i: draw(c[1], c[2], i), (out.cache, logits0, ctx.counts))
        b = tokens.shape[0]
        return Proposal(tokens, logprobs, jnp.full((b,), self.k, jnp.int32), cache)

    def _draw(self, keys, logits, counts, ctx):
        """Process [B, V] draft logits with the shared pipeline and sample one token per row.

        Returns the tokens and the log-probs they were drawn from (what the verifier sees)."""
        lp = process_rows(logits, ctx.params, counts, ctx.use_penalties)
        return sample_rows(keys, lp), lp

    def commit(self, params, state, ctx: CommitContext):
        return state.with_lengths(ctx.seq_len - 2)


@dataclasses.dataclass(frozen=True, eq=False)
class PromptLookupProposer:
    """Prompt lookup / n-gram drafting: a deterministic proposer (point mass q).

    For each row, find the most recent earlier occurrence of the last ``n`` committed
    tokens (trying ``max_ngram`` down to ``min_ngram``) and propose the up to K tokens
    that followed it. ``num_draft`` is how many such tokens exist (0 when nothing
    matched). q is a point mass, so acceptance is min(1, p(x)) and the correction
    comes from the residual p - delta_x, exactly.
    """

    vocab_size: int
    k: int
    max_ngram: int = 3
    min_ngram: int = 1
    needs_target_hidden: bool = False
    min_prompt_len: int = 1
    params: Any = None

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        return ()

    def _lookup_row(self, seq, length):
        s = seq.shape[0]
        pos = jnp.arange(s)
        best_start = jnp.int32(-1)
        found = jnp.bool_(False)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            # candidate end positions e (exclusive) of an earlier occurrence: the n tokens
            # seq[e-n:e] equal the last n tokens, e < length (so at least one follower).
            match = (pos >= n) & (pos < length)
            for j in range(1, n + 1):
                tail_tok = seq[jnp.clip(length - j, 0, s - 1)]
                prev = jnp.roll(seq, j)  # prev[e] = seq[e - j]
                match = match & (prev == tail_tok)
            match = match & (length - n >= 0)
            e = jnp.max(jnp.where(match, pos, -1))
            take = (~found) & (e >= 0)
            best_start = jnp.where(take, e, best_start)
            found = found | take
        idx = best_start + jnp.arange(self.k)
        valid = found & (idx < length)
        num = jnp.sum(valid.astype(jnp.int32))
        toks = jnp.where(valid, seq[jnp.clip(idx, 0, s - 1)], 0)
        return toks.astype(jnp.int32), num

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        toks, num = jax.vmap(self._lookup_row)(ctx.seq, ctx.seq_len)
        onehot = jax.nn.one_hot(toks, self.vocab_size, dtype=jnp.float32)
        logprobs = jnp.where(onehot > 0, 0.0, NEG_INF).astype(jnp.float32)
        return Proposal(toks, logprobs, num, state)

    def commit(self, params, state, ctx: CommitContext):
        return state
