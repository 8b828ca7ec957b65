"""Prompt lookup (n-gram) drafting: a proposer with no weights and a point-mass q."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.drafts.base import CommitContext, Proposal, ProposeContext, check_fields


# the lookup is unrolled when traced: max_ngram * (max_ngram + 1) / 2 shifted comparisons of
# the whole sequence per row and round (a max_ngram of 10**6 never finished tracing)
MAX_NGRAM = 32


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
    always_drafts: bool = False  # num_draft is 0 where nothing matched
    params: Any = None

    def __post_init__(self):
        check_fields(self, vocab_size=1, k=1, min_ngram=1, max_ngram=1)
        if self.max_ngram > MAX_NGRAM:
            raise ValueError(f"PromptLookupProposer: max_ngram={self.max_ngram} is above {MAX_NGRAM} (the lookup "
                             "is unrolled when traced: its size grows with the square of max_ngram)")
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"PromptLookupProposer: max_ngram={self.max_ngram} is below "
                             f"min_ngram={self.min_ngram} (n-grams are tried from max_ngram down to min_ngram)")

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
        logprobs = jnp.where(onehot > 0, 0.0, -jnp.inf).astype(jnp.float32)
        return Proposal(toks, logprobs, num, state)

    def commit(self, params, state, ctx: CommitContext):
        return state
