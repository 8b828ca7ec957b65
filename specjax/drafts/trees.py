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
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafts.base import (  # noqa: F401  (ChainTreeProposer, is_tree_proposer: re-exported)
    ChainTreeProposer, CommitContext, ModelBackedProposer, Proposal, ProposeContext, check_draft_model,
    is_tree_proposer)
from specjax.models.base import TreeAttention, prefill
from specjax.keys import DRAFT, fold_in, position_key, role_key
from specjax import sampling
from specjax.sampling import gumbel, sample
from specjax.tree import (DEFAULT_SIBLING_ACCEPT, DraftTree, accept_table, full_tree_shape, max_tries,
                          positional_tree_shape, select_level, shape_depths)


def _rank_logprobs(logits, allowed=None):
    """The ranking law: raw log-softmax, restricted to the allowed tokens if given."""
    logits = logits.astype(jnp.float32)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)


def region_width(topk: int, depth: int) -> int:
    """Draft slots the growth writes after the prefix: ``topk`` per fed level."""
    return topk * (depth - 1)


def grow_tree(root_lp, expand: Callable, carry, *, topk: int, depth: int, nodes: int,
              token_map=None):
    """EAGLE-2 style growth (see the module docstring), batched.

    ``root_lp`` [B, V]: ranking log-probs of the root's children. ``expand(carry, level,
    tokens [B, k], parent_slot [B, k], attn) -> (carry, lp [B, k, V])`` feeds the frontier
    at depth ``level`` (``parent_slot``: each node's parent's index in the previous
    frontier, -1 at level 1) with ``attn`` (a TreeAttention over the growth's region of
    ``topk * (depth - 1)`` slots after the draft's prefix; depths relative to the first
    level) and returns ranking log-probs of each node's children. With ``token_map``
    (int32[Vs]) the log-probs are over that subset of the vocabulary (a reduced-vocabulary
    head scores nothing else): ranking and top-k run over Vs entries, ``expand`` gets and
    the tree holds the mapped token ids.

    Returns ``(carry, DraftTree)`` with fields [B, nodes] (no q: point-mass candidates)."""
    if token_map is not None:
        tm = jnp.asarray(token_map, jnp.int32)

        def expand_sub(c, level, tokens_sub, pslot, attn):
            return expand(c, level, tm[tokens_sub], pslot, attn)

        carry, tree = grow_tree(root_lp, expand_sub, carry, topk=topk, depth=depth, nodes=nodes)
        return carry, tree._replace(tokens=tm[tree.tokens])
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


SAMPLED_CANDIDATES = ("iid", "without_replacement")


def sampled_shape(shape) -> dict:
    """Static layout of a sampled tree: ``shape`` is a tuple of branching factors (one per
    level: the full tree, :func:`specjax.tree.full_tree_shape`) or a parent array in level
    order, siblings in draw order (e.g. :func:`specjax.tree.positional_tree_shape`).
    Returns ``parent``, ``depth``, per level the node range ``[start, stop)``, ``rank`` (a
    node's number of earlier siblings), per level ``draws`` (children drawn per context:
    the most any of them has), and ``width``: the region slots of the fed levels (all but
    the last; node i's region slot is i)."""
    if isinstance(shape, np.ndarray):
        parent = shape.astype(np.int32)
        depth = shape_depths(parent)
        if np.any(np.diff(depth) < 0):
            raise ValueError("a sampled tree's parent array must be in level order")
    else:
        parent, depth = full_tree_shape(tuple(shape))
    levels, start = [], 0
    for d in range(1, int(depth.max()) + 1):
        stop = start + int(np.sum(depth == d))
        levels.append((start, stop))
        start = stop
    rank = np.zeros(len(parent), np.int32)
    for i in range(len(parent)):
        rank[i] = int(np.sum(parent[:i] == parent[i]))
    draws = [int(rank[a:b].max()) + 1 for a, b in levels]
    width = levels[-2][1] if len(levels) > 1 else 0
    anc = np.eye(len(parent), dtype=bool)
    for i, par in enumerate(parent):
        if par >= 0:
            anc[i] |= anc[par]
    return dict(parent=parent, depth=depth, levels=levels, width=width, ancestors=anc, rank=rank,
                draws=draws, nodes=len(parent))


def grow_sampled_tree(root_q, expand: Callable, draw: Callable, carry, *, branching):
    """Growth with SAMPLED candidates into a tree of fixed shape: ``branching`` is a
    tuple (the full tree of those factors) or a parent array (:func:`sampled_shape`).

    ``root_q`` [B, V]: the draft law (processed log-probs) of the root's children.
    ``draw(q [B, n, V], level, contexts int[n] (static), b) -> (tokens [B, n, b], ok
    [B, n, b])`` draws ``b`` children per context (``level``: their depth - 1; ``ok``
    False where there was nothing left to draw); a context with fewer children in the
    shape keeps its first draws (still draws in sequence). ``expand(carry, level, tokens,
    (start, stop), parent_local int[n] (static: index in the previous level), attn) ->
    (carry, q [B, n, V])`` feeds the n nodes of depth ``level`` (region slots = node
    indices, depths relative to level 1) and returns the draft law of their children; its
    ``tokens`` are all nodes' so far [B, stop] and it gets ``(start, stop)``, the level's
    node range (a node's history for penalties: :func:`sampled_shape`'s ``ancestors``).

    The shape does not depend on any draw (a node is only invalid when its context had
    fewer possible tokens than its rank, or its parent is invalid), so the candidates
    may be verified as ``"iid"`` / ``"without_replacement"`` draws (the ``draw`` rule).
    Returns ``(carry, DraftTree)`` with ``q_root`` [B, V] and ``q_node`` [B, N, V] (leaves:
    -inf rows, never read)."""
    lay = sampled_shape(branching)
    b, v = root_q.shape
    w = lay["width"]
    region_depth = jnp.broadcast_to(jnp.asarray(lay["depth"][:w] - 1, jnp.int32)[None], (b, w))

    def pick(tok, ok, level, ok_parent):
        """The level's nodes from ``draws`` per context: (context, rank) -> flat index."""
        start, stop = lay["levels"][level]
        par = lay["parent"][start:stop]
        ctx = np.zeros_like(par) if level == 0 else par - lay["levels"][level - 1][0]
        idx = ctx * lay["draws"][level] + lay["rank"][start:stop]
        ok = ok.reshape(b, -1)[:, idx]
        return tok.reshape(b, -1)[:, idx], ok if ok_parent is None else ok & ok_parent[:, ctx]

    tok, ok = draw(root_q[:, None], 0, np.zeros((1,), np.int32), lay["draws"][0])
    tok, ok = pick(tok, ok, 0, None)
    toks, oks, qs = [tok], [ok], []
    for level in range(1, len(lay["levels"])):
        start, stop = lay["levels"][level - 1]
        n = stop - start
        mask = jnp.asarray(lay["ancestors"][start:stop, :w])
        attn = TreeAttention(depth=jnp.full((b, n), level - 1, jnp.int32),
                             offset=jnp.full((b,), start, jnp.int32),
                             mask=jnp.broadcast_to(mask[None], (b, n, w)), region_depth=region_depth)
        par = lay["parent"][start:stop]
        plocal = par - (lay["levels"][level - 2][0] if level > 1 else 0)
        carry, q = expand(carry, level, jnp.concatenate(toks, axis=1), (start, stop),
                          plocal.astype(np.int32), attn)
        qs.append(q)
        tok, ok = draw(q, level, np.arange(start, stop, dtype=np.int32) + 1, lay["draws"][level])
        tok, ok = pick(tok, ok, level, oks[-1])
        toks.append(tok)
        oks.append(ok)
    n_all = len(lay["parent"])
    leaves = n_all - sum(q.shape[1] for q in qs)
    q_node = jnp.concatenate(qs + [jnp.full((b, leaves, v), -jnp.inf, root_q.dtype)], axis=1)
    tree = DraftTree(tokens=jnp.concatenate(toks, axis=1).astype(jnp.int32),
                     parent=jnp.broadcast_to(jnp.asarray(lay["parent"])[None], (b, n_all)),
                     depth=jnp.broadcast_to(jnp.asarray(lay["depth"])[None], (b, n_all)),
                     valid=jnp.concatenate(oks, axis=1), q_root=root_q, q_node=q_node)
    return carry, tree


def dynamic_shape(widths) -> dict:
    """Static layout of a dynamic sampled tree of ``widths`` (node slots per level):
    ``depth`` per slot, per level the slot range ``[start, stop)``, and ``width``: the
    region slots of the fed levels (all but the last; slot i's region slot is i)."""
    widths = tuple(int(x) for x in widths)
    stops = np.cumsum(widths)
    starts = stops - np.asarray(widths)
    depth = np.repeat(np.arange(1, len(widths) + 1, dtype=np.int32), widths)
    levels = [(int(a), int(b)) for a, b in zip(starts, stops)]
    return dict(depth=depth, levels=levels, width=int(starts[-1]), nodes=int(stops[-1]))


def grow_dynamic_tree(root_q, expand: Callable, draw: Callable, carry, *, widths,
                      select: Callable = select_level):
    """Growth with SAMPLED candidates into a tree of ``widths[l]`` node slots at depth
    ``l + 1``, shaped as it grows (:func:`select_level`): every node of a level draws up
    to ``widths[l + 1]`` children without replacement from its q, and the best-ranked
    ``widths[l + 1]`` of all of them form the next level. The same ``draw`` and a similar
    ``expand`` as :func:`grow_sampled_tree`: ``expand(carry, level, tokens [B, stop],
    (start, stop), parent_local int32[B, n], attn) -> (carry, q [B, n, V])`` (the
    parents' indices in the previous level are arrays here; ``attn.mask`` [B, n, W]
    names each node's ancestors among the region slots = node slots). Nodes are in
    level order, a level's in (parent, draw) order, so the tree is topological and
    siblings are tried in the order they were drawn. Returns ``(carry, DraftTree)`` with
    ``q_root`` and ``q_node`` (leaves: -inf rows)."""
    lay = dynamic_shape(widths)
    b, v = root_q.shape
    w = lay["width"]
    region_depth = jnp.broadcast_to(jnp.asarray(lay["depth"][:w] - 1, jnp.int32)[None], (b, w))
    select_b = jax.vmap(select, in_axes=(0, 0, 0, 0, None))

    def candidates(q, level, ctx_idx, m, f_score, f_ok):
        tok, ok = draw(q, level, ctx_idx, m)  # [B, n, m]
        lq = jnp.take_along_axis(q, tok, axis=-1)
        sel, keep, score = select_b(f_score, f_ok, lq, ok, m)
        return jnp.take_along_axis(tok.reshape(b, -1), sel, axis=1), sel // m, keep, score

    m0 = lay["levels"][0][1]
    tok, plocal, ok, score = candidates(root_q[:, None], 0, np.zeros((1,), np.int32), m0,
                                        jnp.zeros((b, 1), jnp.float32), jnp.ones((b, 1), bool))
    toks, oks, pars, qs = [tok], [ok], [jnp.full((b, m0), -1, jnp.int32)], []
    anc = jnp.zeros((b, m0, w), bool)
    for level in range(1, len(lay["levels"])):
        start, stop = lay["levels"][level - 1]
        own = jnp.asarray(np.eye(w, dtype=bool)[start:stop])
        anc = anc | own[None]
        attn = TreeAttention(depth=jnp.full((b, stop - start), level - 1, jnp.int32),
                             offset=jnp.full((b,), start, jnp.int32), mask=anc,
                             region_depth=region_depth)
        carry, q = expand(carry, level, jnp.concatenate(toks, axis=1), (start, stop), plocal, attn)
        qs.append(q)
        m = lay["levels"][level][1] - lay["levels"][level][0]
        tok, plocal, ok, score = candidates(q, level, np.arange(start, stop, dtype=np.int32) + 1, m,
                                            score, oks[-1])
        toks.append(tok)
        oks.append(ok)
        pars.append(jnp.where(ok, start + plocal, -1).astype(jnp.int32))
        anc = jnp.take_along_axis(anc, plocal[:, :, None], axis=1)
    n_all = lay["nodes"]
    leaves = n_all - sum(q.shape[1] for q in qs)
    q_node = jnp.concatenate(qs + [jnp.full((b, leaves, v), -jnp.inf, root_q.dtype)], axis=1)
    parent = jnp.concatenate(pars, axis=1)
    valid = jnp.concatenate(oks, axis=1)
    depth = jnp.broadcast_to(jnp.asarray(lay["depth"])[None], (b, n_all))
    # an unused slot is a valid-looking child of the root for the structure check: none
    # is valid, so no verifier reads it
    tree = DraftTree(tokens=jnp.concatenate(toks, axis=1).astype(jnp.int32),
                     parent=parent, depth=jnp.where(valid, depth, 1), valid=valid,
                     q_root=root_q, q_node=q_node)
    return carry, tree


def draw_candidates(candidates: str, draft_keys, token_map=None) -> Callable:
    """The ``draw`` of :func:`grow_sampled_tree`: ``b`` children per context from its q,
    i.i.d. (:func:`specjax.sampling.sample` per child) or without replacement (Gumbel
    top-b, which draws in sequence order: the k-th is q's draw with the earlier ones
    removed). Keys: ``position_key(draft_keys[row], level)`` folded with the context index
    (and, i.i.d., the child's rank): one key per draw, role DRAFT only. ``token_map``: q is
    -inf outside that subset (a reduced-vocabulary head), so drawing among the subset's
    entries alone is the same law."""
    if candidates not in SAMPLED_CANDIDATES:
        raise ValueError(f"sampled candidates must be one of {SAMPLED_CANDIDATES}, got {candidates!r}")
    tm = None if token_map is None else jnp.asarray(token_map, jnp.int32)

    def draw(q, level, ctx_idx, b):
        qs = q if tm is None else jnp.take(q, tm, axis=-1)
        lvl = jax.vmap(lambda k: position_key(k, level))(draft_keys)  # [B]
        keys = jax.vmap(lambda k: jax.vmap(lambda c: fold_in(k, c))(jnp.asarray(ctx_idx)))(lvl)
        if candidates == "without_replacement":
            g = jax.vmap(jax.vmap(lambda k: gumbel(k, qs.shape[-1:])))(keys)
            score, idx = jax.lax.top_k(qs.astype(jnp.float32) + g, b)
            ok = score > -jnp.inf
        else:
            def one(k, row):
                return jax.vmap(lambda c: sample(fold_in(k, c), row))(jnp.arange(b))
            idx = jax.vmap(jax.vmap(one))(keys, qs)
            ok = idx >= 0
        idx = jnp.maximum(idx, 0).astype(jnp.int32)
        return (idx if tm is None else tm[idx]), ok

    return draw


def pad_tree(tree: DraftTree, n: int) -> DraftTree:
    """A batched tree padded with invalid nodes (children of the root) to ``n`` nodes."""
    b, m = tree.tokens.shape
    if m == n:
        return tree
    pad = n - m

    def cat(a, fill):
        return jnp.concatenate([a, jnp.full((b, pad) + a.shape[2:], fill, a.dtype)], axis=1)

    return tree._replace(tokens=cat(tree.tokens, 0), parent=cat(tree.parent, -1), depth=cat(tree.depth, 1),
                         valid=cat(tree.valid, False),
                         q_node=None if tree.q_node is None else cat(tree.q_node, -jnp.inf))


def make_tree_proposer(draft, topk: int, depth: int, nodes: int, candidates: str = "point_mass",
                       branching=None, widths=(), sampled_nodes: int = 0, sampled_accept=()):
    """A tree proposer from a draft: an EAGLE head (:class:`EagleTreeProposer`; with
    ``candidates`` ``"iid"`` / ``"without_replacement"``, sampled rounds draw a full tree
    of ``branching``) or a draft model with tree attention (:class:`DraftModelTreeProposer`,
    top-k trees only)."""
    from specjax.models.eagle import EagleModel

    if isinstance(draft, EagleModel):
        extra = {} if branching is None else dict(branching=tuple(int(b) for b in branching))
        if widths:
            extra["widths"] = tuple(int(x) for x in widths)
        if sampled_nodes:
            extra["sampled_nodes"] = int(sampled_nodes)
        if sampled_accept:
            extra["sampled_accept"] = accept_table(sampled_accept)
        return EagleTreeProposer(model=draft, topk=topk, depth=depth, nodes=nodes,
                                 candidates=candidates, **extra)
    if candidates != "point_mass" or widths or sampled_nodes:
        raise ValueError(f"candidates={candidates!r}: only the EAGLE head grows sampled trees "
                         "(a draft model grows top-k trees: point_mass)")
    if getattr(draft, "supports_tree", False):
        return DraftModelTreeProposer(model=draft, topk=topk, depth=depth, nodes=nodes)
    raise TypeError(f"cannot grow a tree with {type(draft).__name__}: expected an EAGLE head "
                    "or a draft model with tree attention")


def _allowed(ctx: ProposeContext, position):
    if ctx.controls is None:
        return None
    gen = jnp.zeros_like(ctx.seq_len) if ctx.gen_len is None else ctx.gen_len
    return ctx.controls.allowed_at(gen + position)


MAX_TREE_NODES = 1024  # a tree's nodes: one verify pass, an [N, N] mask (44 is the largest measured)


def check_tree_settings(topk, depth, nodes, branching=(1,), candidates="point_mass",
                        widths=(), sampled_nodes=0) -> None:
    """ValueError unless the tree settings are valid: ``topk``, ``depth``, ``nodes`` ints
    >= 1, ``branching`` a non-empty tuple of ints >= 1, ``widths`` an empty tuple or one
    of ints >= 1 (a dynamic sampled tree: ``candidates="without_replacement"`` only),
    ``sampled_nodes`` an int >= 0 (> 0: sampled rounds fill the positional tree of that
    many nodes; sampled candidates, no ``widths``),
    ``candidates`` one of ``"point_mass"`` and :data:`SAMPLED_CANDIDATES` (the proposers'
    and :class:`specjax.build.TreeSpec`'s one check)."""
    for name, x in (("topk", topk), ("depth", depth), ("nodes", nodes)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"tree {name} must be an integer >= 1, got {x!r}")
    if not isinstance(branching, tuple) or not branching or any(
            not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in branching):
        raise ValueError(f"tree branching must be integers >= 1 per level, got {branching!r}")
    if not isinstance(widths, tuple) or any(
            not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in widths):
        raise ValueError(f"tree widths must be integers >= 1 per level, got {widths!r}")
    if candidates not in ("point_mass",) + SAMPLED_CANDIDATES:
        raise ValueError(f"tree candidates must be point_mass, iid or without_replacement, "
                         f"got {candidates!r}")
    if widths and candidates != "without_replacement":
        raise ValueError(f"tree widths (a dynamic sampled tree) need candidates="
                         f"without_replacement, got {candidates!r}")
    if not isinstance(sampled_nodes, int) or isinstance(sampled_nodes, bool) or sampled_nodes < 0:
        raise ValueError(f"tree sampled_nodes must be an integer >= 0, got {sampled_nodes!r}")
    if sampled_nodes and (widths or candidates == "point_mass"):
        raise ValueError("tree sampled_nodes (the positional tree of sampled rounds) needs sampled "
                         "candidates (iid or without_replacement) and no widths")
    full, level = 0, 1  # the full tree of ``branching``: its nodes (stopping once past the bound)
    for b in branching:
        level *= b
        full += level
        if full > MAX_TREE_NODES:
            break
    for name, n in (("nodes", nodes), ("branching", full), ("widths", sum(widths)),
                    ("sampled_nodes", sampled_nodes)):
        if n > MAX_TREE_NODES:
            raise ValueError(f"tree {name}: {n if name != 'branching' else 'more than ' + str(MAX_TREE_NODES)} "
                             f"nodes; at most {MAX_TREE_NODES} per tree")


@dataclasses.dataclass(frozen=True, eq=False)
class _TreeConfig:
    topk: int = 4
    depth: int = 4
    nodes: int = 16

    def _check(self):
        check_tree_settings(self.topk, self.depth, self.nodes)

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
    target's features along the accepted path).

    ``candidates="point_mass"``: every round grows the top-k tree (``topk``, ``depth``,
    ``nodes``; :func:`grow_tree`). ``"without_replacement"`` / ``"iid"``: a round in which
    every row is greedy (temperature 0) grows that top-k tree all the same (greedy rows
    are verified by the argmax, exact for any candidates), any other round draws a full
    tree of ``branching`` from the head's processed law q (:func:`grow_sampled_tree`),
    the candidate rule the engine verifies with."""

    model: Any = None
    candidates: str = "point_mass"
    branching: tuple = (2, 2, 1)
    widths: tuple = ()
    sampled_nodes: int = 0
    sampled_accept: tuple = ()  # the positional tree's acceptance model; () = DEFAULT_SIBLING_ACCEPT
    needs_target_hidden: bool = True
    min_prompt_len: int = 2
    always_drafts: bool = True

    def __post_init__(self):
        check_tree_settings(self.topk, self.depth, self.nodes, self.branching, self.candidates,
                            self.widths, self.sampled_nodes)
        if self.sampled_nodes:
            self.sampled_tree_shape()  # a bad acceptance model fails here, before any tracing
        if self.model is not None:  # None: the tree's shape only (its k, for context checks)
            check_draft_model(self, "apply", "init_cache", "vocab_size", "fuse", "hidden_layers")

    @property
    def sampled(self) -> bool:
        return self.candidates != "point_mass"

    @property
    def dynamic(self) -> bool:
        """Sampled rounds grow a tree of ``widths`` (:func:`grow_dynamic_tree`) instead of
        the full tree of ``branching``."""
        return self.sampled and bool(self.widths)

    def sampled_tree_shape(self):
        """What sampled rounds fill: the ``sampled_nodes``-node positional tree
        (:func:`specjax.tree.positional_tree_shape`, a parent array) if set, else the
        full tree of ``branching``. ``sampled_accept`` (a vector or a per-depth table)
        shapes the positional tree; it changes which tree is verified, never the law."""
        if self.sampled_nodes:
            return positional_tree_shape(self.sampled_nodes, self.sampled_accept or DEFAULT_SIBLING_ACCEPT)[0]
        return self.branching

    def _sampled_layout(self):
        if self.dynamic:
            return dynamic_shape(self.widths)
        return sampled_shape(self.sampled_tree_shape())

    @property
    def max_tries(self) -> Optional[int]:
        """The most nodes a sampled round's descent can try (:func:`specjax.tree.max_tries` of
        the static shape it fills; None for trees grown by ``widths``, whose shape depends
        on the draws): the steps of the sync-free descent."""
        if not self.sampled or self.dynamic:
            return None
        return max_tries(self._sampled_layout()["parent"])

    @property
    def sampled_depth(self) -> int:
        return len(self.widths) if self.dynamic else len(self._sampled_layout()["levels"])

    @property
    def tree_depth(self) -> int:
        return max(self.depth, self.sampled_depth) if self.sampled else self.depth

    @property
    def tree_nodes(self) -> int:
        n = _TreeConfig.tree_nodes.fget(self)
        return max(n, self._sampled_layout()["nodes"]) if self.sampled else n

    @property
    def k(self) -> int:
        k = max(_TreeConfig.k.fget(self), self.tree_nodes)
        return max(k, self._sampled_layout()["width"] + 2) if self.sampled else k

    @property
    def hidden_layers(self):
        """The target hidden states the head reads (see ``EagleProposer.hidden_layers``)."""
        return self.model.hidden_layers

    def _chain(self):
        from specjax.drafts.eagle import EagleProposer

        return EagleProposer(self.model, self.depth, plain_backlog=0)  # trees: no adaptive K

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        return self._chain().init(params, prompt_tokens, prompt_lens, cache_len, target_hidden)

    def commit(self, params, state, ctx: CommitContext):
        return self._chain().commit(params, state, ctx)

    def draw_rule(self) -> str:
        """How sampled rounds draw siblings (the verifier's rule: ``candidates``)."""
        return self.candidates

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        m = self.model.module(params)
        cache = state["cache"].with_lengths(ctx.seq_len - 1)
        tm = m.token_map[...] if self.model.config.vocab_subset else None
        n = self.tree_nodes

        def topk_tree(cache):
            def rank(h, al):  # ranking log-probs over the head's scored tokens
                lg = m.logits(h) if tm is not None else m.full_logits(h)
                if al is not None and tm is not None:
                    al = jnp.take(al, tm, axis=-1)
                return _rank_logprobs(lg, al)

            def expand(carry, level, tokens, pslot, attn):
                cache, feats = carry  # feats [B, k, D]: the previous frontier's predictions
                if level == 1:
                    h_in = jnp.broadcast_to(state["h"][:, None], tokens.shape + state["h"].shape[-1:])
                else:
                    h_in = jnp.take_along_axis(feats, pslot[:, :, None], axis=1)
                hn, cache = m.tree_call(h_in, tokens, cache, attn)
                al = _allowed(ctx, level)
                return (cache, hn), rank(hn, None if al is None else al[:, None])

            b, d = state["h"].shape
            k = min(self.topk, self.vocab_size)
            (cache, _), tree = grow_tree(rank(state["h"], _allowed(ctx, 0)), expand,
                                         (cache, jnp.zeros((b, k, d), state["h"].dtype)),
                                         topk=self.topk, depth=self.depth, nodes=self.nodes,
                                         token_map=tm)
            if self.sampled:  # the same pytree as the sampled branch's (q never read: greedy)
                v = self.vocab_size
                tree = tree._replace(q_root=jnp.full((b, v), -jnp.inf, jnp.float32),
                                     q_node=jnp.full(tree.tokens.shape + (v,), -jnp.inf, jnp.float32))
            return cache, pad_tree(tree, n)

        if not self.sampled:
            cache, tree = topk_tree(cache)
        else:
            draft_keys = jax.vmap(lambda k: role_key(k, DRAFT))(ctx.round_keys)
            v = self.vocab_size

            def sampled_tree(cache):
                def expand(carry, level, tokens, rng, plocal, attn):
                    # plocal: the parents' indices in the previous level (static for a fixed
                    # shape, an array for a dynamic tree); attn.mask: each node's ancestors
                    # among the node slots (region slot i = node i)
                    cache, feats = carry
                    start, stop = rng
                    cur = tokens[:, start:stop]
                    if level == 1:
                        h_in = jnp.broadcast_to(state["h"][:, None], cur.shape + state["h"].shape[-1:])
                    elif isinstance(plocal, np.ndarray):
                        h_in = feats[:, plocal]
                    else:
                        h_in = jnp.take_along_axis(feats, plocal[:, :, None], axis=1)
                    hn, cache = m.tree_call(h_in, cur, cache, attn)

                    def counts():  # committed tokens + each node's path (itself included)
                        anc = attn.mask[:, :, :stop].astype(ctx.counts.dtype)
                        oh = jax.nn.one_hot(tokens, v, dtype=ctx.counts.dtype)
                        return ctx.counts[:, None] + jnp.einsum("bij,bjv->biv", anc, oh)

                    return (cache, hn), ctx.process(m.full_logits(hn), counts, level)

                root_q = ctx.process(m.full_logits(state["h"]), ctx.counts, 0)
                draw = draw_candidates(self.draw_rule(), draft_keys, tm)
                if self.dynamic:
                    (cache, _), tree = grow_dynamic_tree(root_q, expand, draw, (cache, None),
                                                         widths=self.widths)
                else:
                    (cache, _), tree = grow_sampled_tree(root_q, expand, draw, (cache, None),
                                                         branching=self.sampled_tree_shape())
                return cache, pad_tree(tree, n)

            # a call known to be all greedy or none: no cond (sync-free: a mixed call's
            # sampled tree, which its greedy rows verify by the argmax all the same)
            cache, tree = sampling.known_cond(sampling.settled(sampling.known_greedy(), False),
                                              lambda: jnp.all(ctx.params.temperature <= 0),
                                              topk_tree, sampled_tree, cache)
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
