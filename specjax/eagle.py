"""EAGLE-style feature drafts: the proposer, and draft files (save / load).

:class:`EagleProposer` keeps the head's KV cache over the pairs ``(h_t, s_{t+1})`` of the
committed sequence ``s`` (length L) for t < L-1: target features ``h_t`` are known up to
position L-2 (the target's cache holds ``s[:L-1]``) and ``s_{L-1}`` is the last token, so the
pair at t = L-2 is the last complete one. Its output, the predicted ``h_{L-1}``, is kept in
the state; its logits through the target's head are the draft law of ``x_1``.

* ``init``: feed the prompt's pairs (t < L-1) from the prefill hidden states;
* ``propose``: draw x_1 from the kept prediction, then K-1 steps that feed
  ``(h_hat, x_i)`` (the head's OWN predicted feature) to get x_{i+1}; every draw goes through
  the shared pipeline (``process_rows`` / ``sample_rows``) with keys DRAFT + position, so the
  reported q is the law the token was drawn from;
* ``commit``: roll the cache back to the pairs before the round (lengths), and feed the
  round's K+1 pairs with the TRUE target features (only ``num_new`` are valid; the rest
  land in slots past the new length and are never read). Rows with ``num_new == 0``
  (finished) keep their state.

Draft files (``.npz``): ``meta`` (JSON: kind, config, training info) plus the weights.
``kind == "eagle"``: the head's trainable weights and ``token_map`` (the target's
embedding / head are taken from the target at load time, so files stay small);
``kind == "llama"``: an independent draft's canonical weights (``embed`` may be omitted
when ``embed_from_target``, e.g. a target-initialised draft with a frozen embedding).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax import keys as K_
from specjax.proposers import (
    CommitContext,
    DraftModelProposer,
    ModelBackedProposer,
    Proposal,
    ProposeContext,
    draft_chain,
    process_rows,
    sample_rows,
)


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

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        if target_hidden is None:
            raise ValueError("EagleProposer needs the target's hidden states")
        b, p = prompt_tokens.shape
        nxt = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((b, 1), prompt_tokens.dtype)], axis=1)
        cache = self.model.init_cache(b, cache_len)
        h, cache = self.model.apply(params, target_hidden, nxt, cache)
        return dict(cache=cache.with_lengths(prompt_lens - 1), h=_take_rows(h, prompt_lens - 2))

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        m = self.model.module(params)
        cache = state["cache"].with_lengths(ctx.seq_len - 1)
        draft_keys = jax.vmap(lambda k: K_.role_key(k, K_.DRAFT))(ctx.round_keys)
        v = self.vocab_size

        tm = m.token_map[...] if self.model.config.vocab_subset else None

        def draw(h, counts, i):
            ks = jax.vmap(lambda k: K_.position_key(k, i))(draft_keys)
            lp = process_rows(m.full_logits(h), ctx.params, counts, ctx.use_penalties)
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
        return Proposal(tokens, logprobs, jnp.full((b,), self.k, jnp.int32),
                        dict(cache=cache, h=state["h"]))

    def commit(self, params, state, ctx: CommitContext):
        num_new = ctx.num_new
        base = ctx.seq_len - 1 - num_new  # pairs before this round's new ones
        kk = ctx.target_hidden.shape[1]
        idx = jnp.clip(base[:, None] + 1 + jnp.arange(kk)[None, :], 0, ctx.seq.shape[1] - 1)
        toks = jnp.take_along_axis(ctx.seq, idx, axis=1)
        h, cache = self.model.apply(params, ctx.target_hidden, toks, state["cache"].with_lengths(base))
        ok = num_new > 0
        h_last = _take_rows(h, jnp.maximum(num_new - 1, 0))
        return dict(cache=cache.with_lengths(base + num_new),
                    h=jnp.where(ok[:, None], h_last, state["h"]))


# --------------------------------------------------------------------------------------
# draft files


def save_draft(path: str, kind: str, config: dict, weights: dict, info: Optional[dict] = None,
               dtype: str = "float32") -> None:
    """Write a draft file (npz): ``meta`` JSON plus int arrays and float weights stored as
    ``dtype`` (float32, or float16 for half the size; :func:`read_draft` returns float32)."""
    if kind not in ("eagle", "llama"):
        raise ValueError(f"unknown draft kind {kind!r}")
    if dtype not in ("float32", "float16"):
        raise ValueError(f"draft files store float32 or float16 weights, not {dtype!r}")
    meta = dict(kind=kind, config=config, info=info or {}, format=1)
    arrays = {}
    for k, v in weights.items():
        if v is None:
            continue
        a = np.asarray(v)
        if np.issubdtype(a.dtype, np.floating):
            if dtype == "float16" and np.isfinite(a).all() and np.abs(a).max(initial=0.0) >= 65504:
                raise ValueError(f"draft weight {k!r} does not fit float16 (max |x| = {np.abs(a).max()})")
            a = a.astype(dtype)
        arrays[k] = a
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    os.replace(tmp, path)


def _float32(weights: dict) -> dict:
    return {k: (v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v) for k, v in weights.items()}


def read_draft_meta(path: str) -> dict:
    """The ``meta`` dict of a draft file, without reading its weights."""
    with np.load(path) as f:
        return json.loads(bytes(f["meta"]).decode())


def read_draft(path: str, upcast: bool = True):
    """(meta dict, weights dict of numpy arrays); float weights as float32 unless not ``upcast``."""
    with np.load(path) as f:
        meta = json.loads(bytes(f["meta"]).decode())
        weights = {k: f[k] for k in f.files if k != "meta"}
    return meta, (_float32(weights) if upcast else weights)


def load_draft_model(path: str, target, param_dtype: str = "auto"):
    """The draft model in a file: an ``EagleModel`` or a ``LlamaLM`` (checked against the target).

    ``param_dtype`` (EAGLE heads): ``"auto"`` keeps weights stored in float16 as float16 (the
    same values; the CPU matmul kernel reads them as they are, streaming half the bytes, and
    computes in float32), otherwise the file's config; or a dtype name. A draft's numerics
    change only its q, which the verifier uses as it is: the output law stays the target's."""
    from specjax.models.eagle import EagleConfig, EagleModel
    from specjax.models.llama import LlamaConfig, LlamaLM

    meta, w = read_draft(path, upcast=False)
    kind = meta.get("kind")
    if kind == "eagle":
        c = dict(meta["config"])
        floats = [v for v in w.values() if np.issubdtype(v.dtype, np.floating)]
        if param_dtype == "auto":
            if floats and all(v.dtype == np.float16 for v in floats):
                c["param_dtype"] = "float16"
        else:
            c["param_dtype"] = param_dtype
        cfg = EagleConfig.from_dict(c)
        tm = w.pop("token_map", None)
        return EagleModel.for_target(target, cfg, trainable=w, token_map=tm)
    w = _float32(w)
    if kind == "llama":
        cfg = LlamaConfig(**meta["config"])
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocabulary V={cfg.vocab_size} does not match the target's "
                             f"V={target.vocab_size}")
        if meta.get("info", {}).get("embed_from_target") or "embed" not in w:
            tw = target.canonical_weights()
            w["embed"] = tw["embed"]
            if not cfg.tie_embeddings and "lm_head" not in w:
                w["lm_head"] = tw.get("lm_head", tw["embed"])
        return LlamaLM.from_weights(cfg, w)
    raise ValueError(f"{path}: unknown draft kind {kind!r}")


def load_draft(path: str, target, k: int = 4):
    """A proposer for ``target`` from a draft file (``EagleProposer`` or ``DraftModelProposer``)."""
    from specjax.models.eagle import EagleModel

    model = load_draft_model(path, target)
    if isinstance(model, EagleModel):
        return EagleProposer(model, k)
    return DraftModelProposer(model, k)
