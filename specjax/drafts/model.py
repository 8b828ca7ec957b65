"""An independent draft model (any ``specjax.models.base.LanguageModel``) as a proposer.

Cache convention: at the start of a round, a row whose committed sequence ``s`` has length
c has the draft's KV for ``s[:c-2]``; the first draft step feeds the two last committed
tokens ``s[c-2], s[c-1]`` (a 2-token step costs about what a 1-token step costs). So when
all K draft tokens were accepted and the last one was never fed to the draft, nothing
special is needed: it is among the two tokens fed next round. This needs prompts of at
least 2 tokens (``min_prompt_len``, checked on the host).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.keys import DRAFT, position_key, role_key
from specjax.drafts.base import (
    CommitContext,
    ModelBackedProposer,
    Proposal,
    ProposeContext,
    check_draft_model,
    check_fields,
    draft_chain,
)
from specjax.models.base import prefill
from specjax.sampling import sample_rows


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModelProposer(ModelBackedProposer):
    """An autoregressive draft model (any ``specjax.models.base.LanguageModel``)."""

    model: Any
    k: int
    needs_target_hidden: bool = False
    min_prompt_len: int = 2
    always_drafts: bool = True  # num_draft is K for every row (speed only: see module doc)

    def __post_init__(self):
        check_fields(self, k=1)
        check_draft_model(self, "apply", "init_cache", "vocab_size")
        if hasattr(self.model, "fuse"):  # its apply reads the target's features: another contract
            raise TypeError(f"DraftModelProposer: {type(self.model).__name__} is a feature head "
                            "(it needs the target's hidden states): use EagleProposer")

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        b = prompt_tokens.shape[0]
        cache = self.model.init_cache(b, cache_len)
        cache, _ = prefill(self.model, params, prompt_tokens, prompt_lens, cache)
        # KV for s[:c-2] is what the round start expects (see the module docstring).
        return cache.with_lengths(prompt_lens - 2)

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        cache = state.with_lengths(ctx.seq_len - 2)
        idx = jnp.stack([ctx.seq_len - 2, ctx.seq_len - 1], axis=1)
        last2 = jnp.take_along_axis(ctx.seq, idx, axis=1)
        out = self.model.apply(params, last2, cache)
        logits0 = out.logits[:, -1]
        draft_keys = jax.vmap(lambda k: role_key(k, DRAFT))(ctx.round_keys)
        v = logits0.shape[-1]

        def draw_at(logits, counts, i):
            ks = jax.vmap(lambda k: position_key(k, i))(draft_keys)
            return self.draw(ks, logits, counts, ctx, i)

        def step(carry, i):
            cache, logits, counts = carry
            x, lp = draw_at(logits, counts, i)
            o = self.model.apply(params, x[:, None], cache)
            counts = counts + jax.nn.one_hot(x, v, dtype=counts.dtype)
            return (o.cache, o.logits[:, 0], counts), (x, lp)

        (cache, _, _), tokens, logprobs = draft_chain(
            self.k, step, lambda c, i: draw_at(c[1], c[2], i), (out.cache, logits0, ctx.counts))
        b = tokens.shape[0]
        return Proposal(tokens, logprobs, jnp.full((b,), self.k, jnp.int32), cache)

    def draw(self, keys, logits, counts, ctx, position):
        """Process [B, V] draft logits with the shared pipeline and sample one token per row.

        Returns the tokens and the log-probs they were drawn from (what the verifier sees)."""
        lp = ctx.process(logits, counts, position)
        return sample_rows(keys, lp), lp

    def commit(self, params, state, ctx: CommitContext):
        return state.with_lengths(ctx.seq_len - 2)

    def commit_plain(self, params, state, ctx: CommitContext):
        """After a round that drafted nothing (adaptive K): the cache holds s[:c-2] of the old
        length c and the round committed ``num_new`` (0 or 1) tokens, so feed s[c-2] (one
        draft step) to get back to s[:c'-2]."""
        pos = jnp.maximum(ctx.seq_len - ctx.num_new - 2, 0)
        tok = jnp.take_along_axis(ctx.seq, pos[:, None], axis=1)
        out = self.model.apply(params, tok, state.with_lengths(pos))
        return out.cache.with_lengths(ctx.seq_len - 2)




def check_first_layers(n_layers: int, target_layers: int) -> None:
    """ValueError unless a ``layers:N`` draft can take ``n_layers`` of ``target_layers``."""
    if isinstance(n_layers, (bool, np.bool_)) or not isinstance(n_layers, (int, np.integer)) \
            or not 1 <= n_layers <= target_layers:
        raise ValueError(f"layers:{n_layers}: the target has {target_layers} layers (give 1 to {target_layers})")


def first_layers_draft(target, n_layers: int):
    """A training-free draft: the target's first ``n_layers`` layers with its embedding,
    final norm and head (same vocabulary, same dtype settings)."""
    from specjax.models.llama import LlamaLM

    cfg = target.config
    check_first_layers(n_layers, cfg.n_layers)
    w = target.canonical_weights(blocks=True) if getattr(cfg, "weight_blocks", False) else target.canonical_weights()
    w = {k: (v[:n_layers] if getattr(v, "ndim", 0) >= 1 and v.shape[0] == cfg.n_layers
             and k not in ("embed", "final_norm", "lm_head") else v) for k, v in w.items()}
    return LlamaLM.from_weights(cfg.replace(n_layers=n_layers, name=f"{cfg.name}-first{n_layers}"), w)
