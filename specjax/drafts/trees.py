"""Tree proposers: drafts that return a :class:`specjax.tree.DraftTree` per row.

A tree proposer is a :class:`specjax.drafts.base.Proposer` with three more attributes:

* ``tree_depth`` (D): the deepest node (the verifier's ``max_depth``; a round emits at
  most D + 1 tokens);
* ``tree_nodes`` (N): nodes per tree (static);
* ``candidates``: how the nodes were drawn (``specjax.tree.CANDIDATES``), the verifier's
  static choice.

Its ``propose`` returns a :class:`~specjax.drafts.base.Proposal` whose ``tree`` is a batched
``DraftTree`` (fields with a leading B axis; ``tokens`` is ``tree.tokens``). Its ``k`` is
the number of cache slots a round may write past the committed length (at least N, for
the target's verify pass over the whole tree). ``commit`` gets the target's hidden states
along the ACCEPTED PATH (the engine gathers them), so a feature draft continues from the
path exactly as after a chain round.

* :class:`ChainTreeProposer`: any chain proposer's K drafts as a chain tree (``"iid"``
  candidates with their q; verification draws what ``token_verify`` draws).
* :class:`EagleTreeProposer`: the EAGLE head grows a tree EAGLE-2 style (below).
* :class:`DraftModelTreeProposer`: the same growth with an independent draft model
  (tree attention in the draft, :class:`specjax.models.base.TreeAttention`).

Growth (:func:`grow_tree`, static shapes): the root's top-``topk`` tokens are the depth-1
nodes; at each of the next ``depth - 1`` levels the ``topk`` best nodes of the previous
level (by cumulative log-probability under the draft, the frontier) are fed to the draft
in ONE call with tree attention, and each proposes its top-``topk`` children; finally the
``nodes`` best of all generated nodes (a child never outranks its parent) form the tree,
in topological order. The candidates are deterministic (the draft's top-k): they are
verified as point masses (``candidates="point_mass"``), exact for any choice of
candidates. Ranking uses the draft's raw log-softmax (temperature 1, no top-k / top-p),
so a greedy round still gets several candidates; it is a heuristic only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax.drafts.base import (  # noqa: F401  (ChainTreeProposer, is_tree_proposer: re-exported)
    ChainTreeProposer, CommitContext, ModelBackedProposer, Proposal, ProposeContext, is_tree_proposer)
from specjax.models.base import TreeAttention, prefill
from specjax.tree import DraftTree


def _rank_logprobs(logits, allowed=None):
    """The ranking law: raw log-softmax, restricted to the allowed tokens if given."""
    logits = logits.astype(jnp.float32)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)


def region_width(topk: int, depth: int) -> int:
    """Draft slots the growth writes after the prefix: ``topk`` per fed level."""
    return topk * (depth - 1)


def grow_tree(root_lp, expand: Callable, carry, *, topk: int, depth: int, nodes: int):
    """EAGLE-2 style growth (see the module docstring), batched.

    ``root_lp`` [B, V]: ranking log-probs of the root's children. ``expand(carry, level,
    tokens [B, k], parent_slot [B, k], attn) -> (carry, lp [B, k, V])`` feeds the frontier
    at depth ``level`` (``parent_slot``: each node's parent's index in the previous
    frontier, -1 at level 1) with ``attn`` (a TreeAttention over the growth's region of
    ``topk * (depth - 1)`` slots after the draft's prefix; depths relative to the first
    level) and returns ranking log-probs of each node's children.

    Returns ``(carry, DraftTree)`` with fields [B, nodes] (no q: point-mass candidates)."""
    b, v = root_lp.shape
    k = min(topk, v)
    w = region_width(k, depth)
    s, t = jax.lax.top_k(root_lp, k)
    s = jnp.minimum(s, 0.0)
    g_tok, g_score, g_parent, g_depth = [t], [s], [jnp.full((b, k), -1, jnp.int32)], [1]
    f_gen = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None], (b, k))
    f_tok, f_score, f_pslot = t, s, jnp.full((b, k), -1, jnp.int32)
    f_anc = jnp.zeros((b, k, w), bool)  # region slots of each frontier node's ancestors
    n_gen = k
    region_depth = jnp.broadcast_to(jnp.repeat(jnp.arange(depth - 1, dtype=jnp.int32), k)[None], (b, w))
    for level in range(1, depth):
        own = jax.nn.one_hot((level - 1) * k + jnp.arange(k), w, dtype=bool)  # [k, W]
        mask = f_anc | own[None]
        attn = TreeAttention(depth=jnp.full((b, k), level - 1, jnp.int32),
                             offset=jnp.full((b,), (level - 1) * k, jnp.int32),
                             mask=mask, region_depth=region_depth)
        carry, lp = expand(carry, level, f_tok, f_pslot, attn)
        cs, ct = jax.lax.top_k(lp, k)  # [B, k, k]
        score = (f_score[:, :, None] + jnp.minimum(cs, 0.0)).reshape(b, k * k)
        ct = ct.reshape(b, k * k)
        g_tok.append(ct)
        g_score.append(score)
        g_parent.append(jnp.repeat(f_gen, k, axis=1))
        g_depth.append(level + 1)
        fs, fi = jax.lax.top_k(score, k)
        f_pslot = (fi // k).astype(jnp.int32)
        f_gen = (n_gen + fi).astype(jnp.int32)
        f_tok = jnp.take_along_axis(ct, fi, axis=1)
        f_score = fs
        f_anc = jnp.take_along_axis(mask, f_pslot[:, :, None], axis=1)
        n_gen += k * k
    tok = jnp.concatenate(g_tok, axis=1).astype(jnp.int32)
    score = jnp.concatenate(g_score, axis=1)
    parent = jnp.concatenate(g_parent, axis=1)
    dep = jnp.concatenate([jnp.full((b, x.shape[1]), d, jnp.int32) for x, d in zip(g_tok, g_depth)],
                          axis=1)
    n = min(nodes, n_gen)
    # the best n (stable: on ties the earlier, shallower node; a child scores <= its parent),
    # then in generation order, which is topological
    order = jnp.argsort(-score, axis=1, stable=True)[:, :n]
    sel = jnp.sort(order, axis=1)
    take = lambda a: jnp.take_along_axis(a, sel, axis=1)
    p_gen = take(parent)
    found = sel[:, None, :] == p_gen[:, :, None]  # [B, n, n]
    new_parent = jnp.where(p_gen < 0, -1, jnp.argmax(found, axis=-1)).astype(jnp.int32)
    ok = take(score) > -jnp.inf
    ok = ok & ((p_gen < 0) | jnp.any(found, axis=-1))

    def chain_valid(valid, par):  # a node is valid only if its parent is
        def body(i, vv):
            return vv.at[i].set(vv[i] & jnp.where(par[i] < 0, True, vv[jnp.maximum(par[i], 0)]))
        return jax.lax.fori_loop(0, n, body, valid)

    ok = jax.vmap(chain_valid)(ok, new_parent)
    tree = DraftTree(tokens=take(tok), parent=new_parent, depth=take(dep), valid=ok)
    return carry, tree


def make_tree_proposer(draft, topk: int, depth: int, nodes: int):
    """A tree proposer from a draft: an EAGLE head (:class:`EagleTreeProposer`) or a draft
    model with tree attention (:class:`DraftModelTreeProposer`)."""
    from specjax.models.eagle import EagleModel

    if isinstance(draft, EagleModel):
        return EagleTreeProposer(model=draft, topk=topk, depth=depth, nodes=nodes)
    if getattr(draft, "supports_tree", False):
        return DraftModelTreeProposer(model=draft, topk=topk, depth=depth, nodes=nodes)
    raise TypeError(f"cannot grow a tree with {type(draft).__name__}: expected an EAGLE head "
                    "or a draft model with tree attention")


def _allowed(ctx: ProposeContext, position):
    if ctx.controls is None:
        return None
    gen = jnp.zeros_like(ctx.seq_len) if ctx.gen_len is None else ctx.gen_len
    return ctx.controls.allowed_at(gen + position)


@dataclasses.dataclass(frozen=True, eq=False)
class _TreeConfig:
    topk: int = 4
    depth: int = 4
    nodes: int = 16

    def _check(self):
        for f in ("topk", "depth", "nodes"):
            x = getattr(self, f)
            if not isinstance(x, int) or isinstance(x, bool) or x < 1:
                raise ValueError(f"tree {f} must be an int >= 1, got {x!r}")
        if self.depth < 1 or self.nodes < 1:
            raise ValueError("tree depth and nodes must be >= 1")

    @property
    def tree_depth(self) -> int:
        return self.depth

    @property
    def tree_nodes(self) -> int:
        return min(self.nodes, self.topk + (self.depth - 1) * self.topk ** 2)

    @property
    def k(self) -> int:  # slots a round writes past the committed length (engine's K)
        return max(self.tree_nodes, region_width(self.topk, self.depth) + 2)


@dataclasses.dataclass(frozen=True, eq=False)
class EagleTreeProposer(_TreeConfig, ModelBackedProposer):
    """The EAGLE head (:class:`specjax.models.eagle.EagleModel`) growing a tree: the root's
    children from the kept prediction of ``h_{c-1}``; a frontier node is fed as the pair
    (its parent's predicted feature, its token) with tree attention over the head's cache.
    ``commit`` is :class:`specjax.drafts.eagle.EagleProposer`'s (the engine passes the
    target's features along the accepted path)."""

    model: Any = None
    candidates: str = "point_mass"
    needs_target_hidden: bool = True
    min_prompt_len: int = 2
    always_drafts: bool = True

    def __post_init__(self):
        self._check()

    def _chain(self):
        from specjax.drafts.eagle import EagleProposer

        return EagleProposer(self.model, self.depth)

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        return self._chain().init(params, prompt_tokens, prompt_lens, cache_len, target_hidden)

    def commit(self, params, state, ctx: CommitContext):
        return self._chain().commit(params, state, ctx)

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        m = self.model.module(params)
        cache = state["cache"].with_lengths(ctx.seq_len - 1)
        root_lp = _rank_logprobs(m.full_logits(state["h"]), _allowed(ctx, 0))

        def expand(carry, level, tokens, pslot, attn):
            cache, feats = carry  # feats [B, k, D]: the previous frontier's predictions
            if level == 1:
                h_in = jnp.broadcast_to(state["h"][:, None], tokens.shape + state["h"].shape[-1:])
            else:
                h_in = jnp.take_along_axis(feats, pslot[:, :, None], axis=1)
            hn, cache = m.tree_call(h_in, tokens, cache, attn)
            al = _allowed(ctx, level)
            lp = _rank_logprobs(m.full_logits(hn), None if al is None else al[:, None])
            return (cache, hn), lp

        b, d = state["h"].shape
        k = min(self.topk, self.vocab_size)
        (cache, _), tree = grow_tree(root_lp, expand, (cache, jnp.zeros((b, k, d), state["h"].dtype)),
                                     topk=self.topk, depth=self.depth, nodes=self.nodes)
        return Proposal(tree.tokens, None, jnp.sum(tree.valid, axis=1).astype(jnp.int32),
                        dict(cache=cache, h=state["h"]), tree)


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModelTreeProposer(_TreeConfig, ModelBackedProposer):
    """An independent draft model (a ``LanguageModel`` with ``supports_tree``) growing a
    tree. Its cache holds correct KV for ``s[:c - depth - 2]`` at least: each round feeds
    the last ``depth + 2`` committed tokens (the root's law is the last output), then grows
    the tree in the region after the committed length; ``commit`` needs nothing."""

    model: Any = None
    candidates: str = "point_mass"
    needs_target_hidden: bool = False
    min_prompt_len: int = 2
    always_drafts: bool = True

    def __post_init__(self):
        self._check()
        if not getattr(self.model, "supports_tree", False):
            raise TypeError(f"{type(self.model).__name__} does not take tree attention")

    @property
    def feed(self) -> int:
        return self.depth + 2

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        cache = self.model.init_cache(prompt_tokens.shape[0], cache_len)
        cache, _ = prefill(self.model, params, prompt_tokens, prompt_lens, cache)
        return cache

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        c = ctx.seq_len
        f = self.feed
        start = jnp.maximum(c - f, 0)
        idx = jnp.clip(start[:, None] + jnp.arange(f)[None], 0, ctx.seq.shape[1] - 1)
        out = self.model.apply(params, jnp.take_along_axis(ctx.seq, idx, axis=1),
                               state.with_lengths(start))
        last = jnp.take_along_axis(out.logits, (c - 1 - start)[:, None, None], axis=1)[:, 0]
        root_lp = _rank_logprobs(last, _allowed(ctx, 0))

        def expand(cache, level, tokens, pslot, attn):
            o = self.model.apply(params, tokens, cache.with_lengths(c), tree=attn)
            al = _allowed(ctx, level)
            return o.cache, _rank_logprobs(o.logits, None if al is None else al[:, None])

        cache, tree = grow_tree(root_lp, expand, out.cache, topk=self.topk, depth=self.depth,
                                nodes=self.nodes)
        return Proposal(tree.tokens, None, jnp.sum(tree.valid, axis=1).astype(jnp.int32), cache, tree)

    def commit(self, params, state, ctx: CommitContext):
        return state
