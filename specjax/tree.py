"""Draft trees and their exact verification, for ONE row (``jax.vmap`` over a batch).

Tree format (:class:`DraftTree`, static size N, nodes in topological order):

* ``tokens int32[N]``: the candidate token at each node;
* ``parent int32[N]``: the parent node, ``-1`` for a child of the root (the committed
  prefix); ``parent[i] < i``;
* ``depth int32[N]``: ``1 + depth[parent]`` (the root has depth 0): a node's token sits at
  sequence position ``c - 1 + depth`` after a committed prefix of length c;
* ``valid bool[N]``: unused slots are ``False`` (their other entries are ignored);
* ``q_root [V]``, ``q_node [N, V]`` (processed log-probs): the draft law of the CHILDREN of
  the root and of node j.  Siblings share their parent's context, and i.i.d. (or
  without-replacement) candidates are drawn from that one law, so the law is stored once
  per context: the same size as a per-node ``[N, V]`` table (plus one row), the same
  layout as the target's ``p_root [V]`` / ``p_node [N, V]`` (the target's law at the same
  contexts), and "siblings drawn from one q" holds by construction.  ``None`` for
  point-mass candidates, which need no q.

Contexts: index 0 is the root, index ``j + 1`` is node j (so a node's context is
``parent + 1``).  Siblings are tried in index order.

How the candidates were drawn is a static choice of the verifier (``candidates``):

* ``"iid"``: the children of a context were drawn i.i.d. from its q (SpecInfer's
  recursive rejection sampling).  At an accepted context the residual starts as
  ``r = p``; child ``x`` is accepted w.p. ``min(1, r(x) / q(x))``; after a rejection
  ``r := norm(max(0, r - q))``.
* ``"without_replacement"``: the k-th child was drawn from q with the earlier siblings'
  tokens removed and renormalized (``q_k``); same rule with ``q_k`` in place of q:
  accept w.p. ``min(1, r(x) / q_k(x))``, on rejection ``r := norm(max(0, r - q_k))``.
* ``"point_mass"``: deterministic candidates (e.g. the draft's top-k), each a point-mass
  proposal: accept ``x`` w.p. ``r(x)``; after a rejection ``r := norm(r with x zeroed)``.
  Exact for ANY candidates chosen without the verifier's random numbers (also for trees
  whose shape depends on the draft's own tokens, such as EAGLE-2's score-ranked trees).

All three: when a context's children are all rejected, one token is drawn from the final
residual ``r``; at a context with no children (a leaf reached by accepting every token
on its path) the bonus token is drawn from ``p`` there.  A residual that is zero
everywhere (an event of probability zero in exact arithmetic) falls back to ``p`` at
that context, as :mod:`specjax.verify` does.

Contract on the proposer for ``"iid"`` / ``"without_replacement"``: given its ancestors'
tokens, a node's children are drawn (i.i.d. / without replacement, in sibling order) from
the stored q, and whether a node's k-th child exists may depend on anything but that
child's token, its later siblings' tokens and their descendants (a stopping rule: the
decision to draw the k-th is made before it is seen; a full tree of fixed shape is the
simplest case, :func:`select_level` a dynamic one).  A shape chosen by looking at the
drawn tokens (keep the best-scoring) needs ``"point_mass"``.

Keys (the chain's roles): node i's acceptance uniform uses
``position_key(role_key(key, ACCEPT), i)``; the final draw uses ``RESIDUAL`` (children
tried, all rejected) or ``BONUS`` (a leaf) at position = the number of accepted tokens.
Each node is decided at most once and there is one final draw, so no key serves two
decisions; a chain written as a tree (:func:`chain_tree`) draws exactly what
:func:`specjax.verify.token_verify` draws with the same key.

:func:`tree_law` gives the law of a round given the tree (stop probabilities per context
and the emitted token's law there), from the same step function the sampler runs, written
dtype-generically so :mod:`specjax.audit` can evaluate it in float64.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax import keys as _keys
from specjax import verify as _verify
from specjax.sampling import logsumexp, sample, sync_free

__all__ = [
    "ROOT", "CANDIDATES", "DraftTree", "TreeVerifyResult", "TreeLaw",
    "full_tree_shape", "positional_tree_shape", "accept_table", "DEFAULT_SIBLING_ACCEPT", "shape_depths", "make_tree", "chain_tree", "ancestor_mask",
    "tree_step", "tree_prepare", "tree_validate", "max_tries", "descend", "tree_finish", "assemble",
    "law_scan", "tree_law",
    "tree_verify", "iid_tree_verify", "point_mass_tree_verify", "point_mass_target_verify",
    "without_replacement_tree_verify", "greedy_tree_verify", "contexts", "select_level", "keep_best",
]

ROOT = -1
CANDIDATES = ("iid", "without_replacement", "point_mass")
PAD_ID = _verify.PAD_ID


class DraftTree(NamedTuple):
    tokens: jax.Array  # int32[N]
    parent: jax.Array  # int32[N], -1 = a child of the root
    depth: jax.Array  # int32[N], root children 1
    valid: jax.Array  # bool[N]
    q_root: Optional[jax.Array] = None  # [V] law of the root's children
    q_node: Optional[jax.Array] = None  # [N, V] law of node j's children


class TreeVerifyResult(NamedTuple):
    tokens: jax.Array  # int32[D+1]: accepted path's tokens, correction or bonus, PAD_ID
    path: jax.Array  # int32[D]: accepted node indices, then -1
    num_accepted: jax.Array  # int32
    error: jax.Array  # bool: invalid input; tokens all PAD_ID, path -1, 0 accepted


class TreeLaw(NamedTuple):
    """The law of one tree verification round given the tree."""

    stop_probs: jax.Array  # [N+1]: P(the descent ends at context c) (0: root, j+1: node j)
    emit_logprobs: jax.Array  # [N+1, V]: log law of the emitted token when it ends at c


# --------------------------------------------------------------------------------------
# Shapes and construction (host-side shapes are numpy; trees are jax arrays)
# --------------------------------------------------------------------------------------

def full_tree_shape(branching, depth: Optional[int] = None):
    """``(parent, depth)`` int32 numpy arrays of a full tree in breadth-first order.

    ``branching`` is an int (with ``depth`` levels) or a sequence, one branching factor
    per level (e.g. ``(3, 2, 1)``: 3 root children, 2 children each, 1 child each).
    """
    def whole(x, what):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"full_tree_shape: {what} must be an integer, got {x!r}")
        return int(x)

    if depth is not None:
        depth = whole(depth, "depth")
    if isinstance(branching, (int, np.integer)) and not isinstance(branching, (bool, np.bool_)):
        if depth is None:
            raise ValueError("full_tree_shape(b, depth): give depth with an int branching")
        branching = (int(branching),) * depth
    try:
        branching = tuple(branching)
    except TypeError:
        raise ValueError(f"full_tree_shape: branching must be an int or a sequence of ints, "
                         f"got {branching!r}") from None
    branching = tuple(whole(b, "a branching factor") for b in branching)
    if depth is not None and len(branching) != depth:
        raise ValueError(f"{len(branching)} branching factors for depth {depth}")
    if not branching or min(branching) < 1:
        raise ValueError(f"branching factors must be >= 1, got {branching}")
    parent, depths, level = [], [], [ROOT]
    for d, b in enumerate(branching, start=1):
        nxt = []
        for par in level:
            for _ in range(b):
                nxt.append(len(parent))
                parent.append(par)
                depths.append(d)
        level = nxt
    return np.asarray(parent, np.int32), np.asarray(depths, np.int32)


# The chance that the k-th child drawn (without replacement) at a node is on the accepted
# path, given the node is: a rough fit for the shipped SmolLM2 EAGLE head at T=1 (first
# child 0.42 from its chain's 1.67 tokens per round at K=3; the rest halve or so). Only
# the SHAPE of positional_tree_shape's trees depends on it, never the law.
DEFAULT_SIBLING_ACCEPT = (0.42, 0.14, 0.07, 0.04, 0.025, 0.015, 0.01, 0.007)


def accept_table(accept) -> tuple:
    """A positional acceptance model as a tuple of per-depth tuples of floats (a flat
    vector: one row for every depth); ValueError unless every row is non-empty,
    non-increasing and in (0, 1]."""
    rows = list(accept) if accept is not None else []
    if rows and all(isinstance(r, (int, float, np.integer, np.floating)) for r in rows):
        rows = [rows]
    try:
        table = tuple(tuple(float(a) for a in r) for r in rows)
    except (TypeError, ValueError):
        table = ()
    if (not table or any(not r for r in table) or any(not 0.0 < a <= 1.0 for r in table for a in r)
            or any(b > a for r in table for a, b in zip(r, r[1:]))):
        raise ValueError(f"positional_tree_shape: accept rows must be non-empty and non-increasing in "
                         f"(0, 1], got {accept!r}")
    return table


def positional_tree_shape(nodes: int, accept=DEFAULT_SIBLING_ACCEPT, max_depth: int = 8):
    """``(parent, depth)`` of the ``nodes``-node tree with the most expected accepted tokens
    when the k-th child of a node is on the path with probability ``accept[k]`` whatever
    the context (Sequoia's positional model): a node's value is the product of ``accept``
    along its path, and the best ``nodes`` values form a tree (a child never beats its
    parent, a later sibling never beats an earlier one). ``accept`` is one vector for all
    depths or a table, one row per depth (the last row for deeper levels), each row
    non-increasing. Level order, siblings in rank order (their draw order), so the tree is
    topological and a parent comes before its level's later nodes. The shape is fixed:
    verification is exact for it as for any full tree."""
    import heapq

    nodes, max_depth = int(nodes), int(max_depth)
    if nodes < 1 or max_depth < 1:
        raise ValueError(f"positional_tree_shape: nodes >= 1 and max_depth >= 1, got {nodes}, {max_depth}")
    table = accept_table(accept)

    def row(depth):  # the acceptance row of the children at this depth (1-based)
        return table[min(depth, len(table)) - 1]

    heap = [(-a, (k,)) for k, a in enumerate(row(1))]
    heapq.heapify(heap)
    chosen = []
    while len(chosen) < nodes:
        if not heap:
            raise ValueError(f"positional_tree_shape: a tree of at most {max(map(len, table))} children per "
                             f"node and depth {max_depth} has only {len(chosen)} nodes, not {nodes}")
        v, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < max_depth:
            for k, a in enumerate(row(len(path) + 1)):
                heapq.heappush(heap, (v * a, path + (k,)))
    chosen.sort(key=lambda p: (len(p), p))  # level order; within a level, parent then rank
    index = {p: i for i, p in enumerate(chosen)}
    parent = np.asarray([index[p[:-1]] if len(p) > 1 else ROOT for p in chosen], np.int32)
    return parent, shape_depths(parent)


def shape_depths(parent) -> np.ndarray:
    """Host-side depths of a parent array (checks topological order)."""
    parent = np.asarray(parent)
    if parent.ndim != 1:
        raise ValueError(f"parent must be a 1-D array of parent indices, got shape {parent.shape}")
    if parent.size and not np.issubdtype(parent.dtype, np.integer):
        raise ValueError(f"parent must hold integer node indices, got dtype {parent.dtype}")
    depth = np.zeros(len(parent), np.int32)
    for i, par in enumerate(parent):
        if not -1 <= par < i:
            raise ValueError(f"parent[{i}] = {par}: need -1 <= parent[i] < i")
        depth[i] = 1 if par < 0 else depth[par] + 1
    return depth


def make_tree(tokens, parent, q_root=None, q_node=None, valid=None) -> DraftTree:
    """A :class:`DraftTree` from tokens and a (host) parent array; depths computed."""
    depth = shape_depths(parent)
    parent = np.asarray(parent, np.int32)
    n = len(parent)
    valid = np.ones(n, bool) if valid is None else valid
    for name, x in (("tokens", tokens), ("valid", valid)):
        if np.shape(x) != (n,):
            raise ValueError(f"make_tree: {name} has shape {np.shape(x)}, the parent array {n} nodes")
    if not np.issubdtype(np.asarray(tokens).dtype, np.integer) and np.asarray(tokens).size:
        raise TypeError(f"make_tree: tokens must be integer token ids, got dtype {np.asarray(tokens).dtype}")
    if (q_root is None) != (q_node is None):
        raise ValueError("make_tree: give both q_root and q_node, or neither")
    if q_node is not None and (np.ndim(q_root) != 1 or np.shape(q_node) != (n, np.shape(q_root)[0])):
        raise ValueError(f"make_tree: q_root [V] and q_node [N={n}, V] expected, got {np.shape(q_root)}, "
                         f"{np.shape(q_node)}")
    return DraftTree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parent), jnp.asarray(depth),
                     jnp.asarray(valid, bool),
                     None if q_root is None else jnp.asarray(q_root),
                     None if q_node is None else jnp.asarray(q_node))


def chain_tree(draft_tokens, draft_logprobs=None, num_draft=None) -> DraftTree:
    """A chain of K draft tokens as a tree: node i's parent is i - 1.

    ``draft_logprobs [K, V]`` (row i = law of x_{i+1}) becomes ``q_root = row 0`` and
    ``q_node[i] = row i + 1`` (the last node's row is unused: ``-inf``).  Nodes at or
    beyond ``num_draft`` are invalid.  With the target's ``[K+1, V]`` log-probs split as
    ``p_root = t[0]``, ``p_node = t[1:]``, :func:`iid_tree_verify` draws what
    :func:`specjax.verify.token_verify` draws.  Works under jit / vmap.
    """
    draft_tokens = _verify._int_tokens(draft_tokens)
    k = draft_tokens.shape[0]
    if num_draft is not None and not isinstance(num_draft, jax.core.Tracer):
        nd = np.asarray(num_draft)
        if nd.ndim or not np.issubdtype(nd.dtype, np.integer) or not 0 <= int(nd) <= k:
            raise ValueError(f"chain_tree: num_draft must be an integer in [0, K={k}], got {num_draft!r}")
    n = _verify.resolve_num_draft(num_draft, k)
    idx = jnp.arange(k, dtype=jnp.int32)
    q_root = q_node = None
    if draft_logprobs is not None:
        q = jnp.asarray(draft_logprobs)
        q_root = q[0]
        q_node = jnp.concatenate([q[1:], jnp.full((1, q.shape[-1]), -jnp.inf, q.dtype)])
    return DraftTree(draft_tokens, idx - 1, idx + 1, idx < n, q_root, q_node)


def ancestor_mask(parent, valid=None, max_depth: Optional[int] = None) -> jax.Array:
    """bool[N, N]: ``m[i, j]`` iff node j is node i or one of its ancestors (the tree
    attention mask over the draft nodes; every node also sees the committed prefix).
    ``parent`` must be acyclic (-1: a child of the root); invalid nodes get empty rows.
    ``max_depth`` (static): no node lies deeper (root children: depth 1), so a node has at
    most ``max_depth - 1`` ancestors among the nodes; None: N.

    Every node's ancestors at once, one step up the tree at a time (``max_depth - 1``
    gathers of an [N] vector), not a loop over the nodes: on a GPU that loop ran 3 kernels a
    node every round (18 for the default 6-node tree, 132 for the 44-node one)."""
    if max_depth is not None and int(max_depth) < 1:
        raise ValueError(f"ancestor_mask: max_depth must be >= 1, got {max_depth!r}")
    if not isinstance(parent, jax.core.Tracer) and not isinstance(valid, jax.core.Tracer):
        _check_ancestors(np.asarray(parent), None if valid is None else np.asarray(valid))
    parent = jnp.asarray(parent, jnp.int32)
    n = parent.shape[0]
    steps = n - 1 if max_depth is None else max(0, min(int(max_depth), n) - 1)
    nodes = jnp.arange(n, dtype=jnp.int32)
    up = nodes  # each node's ancestor `step` levels up (-1: above the nodes)
    m = nodes[:, None] == nodes[None, :]
    for _ in range(steps):
        up = jnp.where(up >= 0, parent[jnp.maximum(up, 0)], -1)
        m = m | (up[:, None] == nodes[None, :])
    if valid is not None:
        m = m & jnp.asarray(valid, bool)[:, None]
    return m


def _check_ancestors(parent: np.ndarray, valid) -> None:
    """Concrete (host) inputs of :func:`ancestor_mask` checked: a 1-D integer parent array,
    every valid node's parent in [-1, N), no cycle. Traced inputs are not checked here (the
    verifiers flag a bad tree themselves)."""
    if parent.ndim != 1 or (parent.size and not np.issubdtype(parent.dtype, np.integer)):
        raise ValueError(f"ancestor_mask: parent must be a 1-D integer array, got {parent.dtype} {parent.shape}")
    n = parent.shape[0]
    valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
    if valid.shape != (n,):
        raise ValueError(f"ancestor_mask: valid has shape {valid.shape}, parent {n} nodes")
    bad = valid & ((parent < -1) | (parent >= n))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"ancestor_mask: parent[{i}] = {parent[i]} is not a node index in [-1, {n})")
    up = np.arange(n)
    for _ in range(n):
        up = np.where(up >= 0, parent[np.maximum(up, 0)], -1)
        up = np.where((up >= -1) & (up < n), up, -1)
    if (valid & (up >= 0)).any():
        raise ValueError("ancestor_mask: parent has a cycle (a node is its own ancestor)")


def contexts(root, node):
    """[N+1, V]: row 0 the root's row, row j+1 node j's."""
    return jnp.concatenate([jnp.asarray(root)[None], jnp.asarray(node)], axis=0)


# --------------------------------------------------------------------------------------
# One candidate at one context (dtype-generic; the sampler and the law share it)
# --------------------------------------------------------------------------------------

def _lse(x):
    return logsumexp(x)


def _drop(row, x):
    return jnp.where(jnp.arange(row.shape[-1]) == x, -jnp.inf, row)


def tree_step(candidates: str) -> Callable:
    """The rule for one candidate of a sibling group (see the module docstring).

    ``step(r, lz, qa, x, p) -> (log_accept, r', lz', qa')``: ``r`` [V] the residual's
    unnormalized log weights with log normalizer ``lz`` (``r = p``, ``lz = 0`` at a fresh
    context: rows are trusted to be normalized), ``qa`` [V] the proposal law of this
    candidate, ``x`` the candidate, ``p`` [V] the target's law at the context (the
    fallback).  Returns the log acceptance probability and the state after a rejection.
    """
    if candidates not in CANDIDATES:
        raise ValueError(f"candidates must be one of {CANDIDATES}, got {candidates!r}")

    def step(r, lz, qa, x, p):
        v = r.shape[-1]
        xc = jnp.clip(x, 0, v - 1)
        rx = r[xc] - lz
        if candidates == "point_mass":
            log_a = jnp.minimum(0.0, rx)
            r_new = _drop(r, xc)
            qa_new = qa
        else:
            lq = qa[xc]
            log_a = jnp.where(rx > -jnp.inf, jnp.minimum(0.0, rx - lq), -jnp.inf)
            r_new = _verify.log_residual(r - lz, qa)
            qa_new = qa if candidates == "iid" else _normalize(_drop(qa, xc))
        empty = ~(jnp.max(r_new, axis=-1) > -jnp.inf)
        r_new = jnp.where(empty, p, r_new)
        lz_new = jnp.where(empty, jnp.zeros((), r.dtype), _lse(r_new))
        return log_a, r_new, lz_new, qa_new

    return step


def _normalize(lw):
    m = logsumexp(lw)[..., None]
    return jnp.where(m > -jnp.inf, lw - m, lw)


# --------------------------------------------------------------------------------------
# Dynamic sampled trees: which drawn candidates join (a stopping rule)
# --------------------------------------------------------------------------------------

def select_level(f_score, f_ok, cand_lq, cand_ok, m: int):
    """Which drawn candidates of one level join a dynamic sampled tree, for ONE row.

    ``f_score [n]``: log score of each frontier node (the product of the draft
    probabilities along its path; 0 at the root), ``f_ok [n]``: the node exists;
    ``cand_lq [n, b]``: log q (the node's draft law) of its ``b`` candidates in draw
    order (without replacement), ``cand_ok [n, b]``: the candidate was drawn. A candidate
    is ranked by ``f_score + log(1 - sum of q over its EARLIER siblings)``: the draft's
    chance of reaching the node times the mass its earlier siblings leave uncovered. The
    best ``m`` (ties: the lower flat index, so an earlier sibling first) join.

    Why this is exact: a candidate's rank reads its earlier siblings and other nodes'
    candidates, never its own token or a later sibling's, and ranks fall along a sibling
    list (each sibling removes mass), so the kept children of a node are its first j
    draws where the decision to keep the j-th is made before it is looked at (a
    stopping rule). Each kept child is then still a without-replacement draw from q given
    the earlier ones, which is all ``candidates="without_replacement"`` verification
    needs (this module). Ranking by a candidate's own q (EAGLE-2's rule, exact
    only for point masses) is not, and the audit rejects it.

    Returns ``(sel int32[m], keep bool[m], child_score [m])``: the kept candidates' flat
    indices ``i * b + j`` in increasing order (siblings stay in draw order), whether each
    of the m slots holds a node, and each new node's score ``f_score + log q``."""
    q = jnp.exp(cand_lq)
    before = jnp.cumsum(q, axis=-1) - q  # mass of the earlier siblings
    rank = f_score[:, None] + jnp.log1p(-jnp.minimum(before, 1.0))
    return keep_best(rank, f_score, f_ok, cand_lq, cand_ok, m)


def keep_best(rank, f_score, f_ok, cand_lq, cand_ok, m: int):
    """:func:`select_level`'s selection given a rank [n, b] per candidate: the best ``m``
    existing candidates (ties: the lower flat index), returned as it describes."""
    n, b = cand_lq.shape
    rank = jnp.where(f_ok[:, None] & cand_ok, rank, -jnp.inf).reshape(n * b)
    top, idx = jax.lax.top_k(rank, min(m, n * b))
    order = jnp.argsort(idx)
    sel = idx[order].astype(jnp.int32)
    keep = top[order] > -jnp.inf
    child = f_score[sel // b] + cand_lq.reshape(n * b)[sel]
    return sel, keep, jnp.where(keep, child, -jnp.inf)


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------

def _bad_rows(lp):
    mx = jnp.max(lp, axis=-1)
    return jnp.any(jnp.isnan(lp), axis=-1) | ~((mx > -jnp.inf) & (mx <= _verify.LOGPROB_TOL))


def _structure_error(tree: DraftTree, v: int, max_depth: int):
    """True if the valid part of the tree is not a topological tree of depth <= max_depth
    over tokens in [0, V)."""
    n = tree.tokens.shape[0]
    i = jnp.arange(n)
    par = tree.parent
    pc = jnp.clip(par, 0, n - 1)
    par_ok = (par >= -1) & (par < i) & ((par < 0) | tree.valid[pc])
    depth_ok = tree.depth == jnp.where(par < 0, 0, tree.depth[pc]) + 1
    tok_ok = (tree.tokens >= 0) & (tree.tokens < v)
    ok = par_ok & depth_ok & tok_ok & (tree.depth <= max_depth)
    return jnp.any(tree.valid & ~ok)


def tree_validate(tree: DraftTree, P, Q, candidates: str, max_depth: int):
    """True if the used part of the inputs is not a valid verification problem: bad
    structure (see :func:`_structure_error`), NaN / +inf / empty / non-log-prob rows of
    ``P`` at the root or a valid node, and for ``"iid"`` / ``"without_replacement"``: a
    bad q row at a context with a valid child, or a candidate of probability 0 under its
    proposal (for ``"without_replacement"`` this includes a repeated sibling token)."""
    n, v = tree.tokens.shape[0], P.shape[-1]
    used = jnp.concatenate([jnp.ones((1,), bool), tree.valid])
    err = _structure_error(tree, v, max_depth) | jnp.any(used & _bad_rows(P))
    if candidates != "point_mass":
        ctx = jnp.clip(tree.parent + 1, 0, n)
        has_child = jnp.zeros((n + 1,), jnp.int32).at[ctx].add(tree.valid.astype(jnp.int32)) > 0
        err = err | jnp.any(has_child & _bad_rows(Q))
        tok = jnp.clip(tree.tokens, 0, v - 1)
        q_zero = ~(Q[ctx, tok] > -jnp.inf)
        err = err | jnp.any(tree.valid & q_zero)
        if candidates == "without_replacement":
            i = jnp.arange(n)
            same = ((tree.parent[:, None] == tree.parent[None, :])
                    & (tree.tokens[:, None] == tree.tokens[None, :])
                    & tree.valid[None, :] & (i[None, :] < i[:, None]))
            err = err | jnp.any(tree.valid & jnp.any(same, axis=1))
    return err


def tree_prepare(tree: DraftTree, p_root, p_node, candidates: str, max_depth=None,
                 dtype=jnp.float32):
    """Checked shapes, typed arrays, the context rows ``P``, ``Q`` [N+1, V] (``Q = P`` for
    point masses: never read) and the resolved ``max_depth``."""
    if candidates not in CANDIDATES:
        raise ValueError(f"candidates must be one of {CANDIDATES}, got {candidates!r}")
    tokens = _verify._int_tokens(tree.tokens, "tree.tokens")
    n = tokens.shape[0]
    for name in ("parent", "depth", "valid"):
        x = getattr(tree, name)
        if jnp.shape(x) != (n,):
            raise ValueError(f"tree.{name} has shape {jnp.shape(x)}, tree.tokens {(n,)}: one entry per node")
        dt = jnp.result_type(x)
        if name != "valid" and not jnp.issubdtype(dt, jnp.integer):
            raise TypeError(f"tree.{name} must be integers, got dtype {dt}")
    if jnp.ndim(p_root) != 1 or jnp.shape(p_root)[0] < 1 or jnp.shape(p_node) != (n, jnp.shape(p_root)[0]):
        raise ValueError(f"p_root [V] and p_node [N={n}, V] expected, got {jnp.shape(p_root)}, "
                         f"{jnp.shape(p_node)}")
    P = contexts(jnp.asarray(p_root, dtype), jnp.asarray(p_node, dtype))
    if candidates == "point_mass":
        Q = P  # never read
    else:
        if tree.q_root is None or tree.q_node is None:
            raise ValueError(f"candidates={candidates!r} needs the tree's q_root and q_node")
        if jnp.shape(tree.q_root) != jnp.shape(p_root) or jnp.shape(tree.q_node) != jnp.shape(p_node):
            raise ValueError(f"q_root {jnp.shape(tree.q_root)} / q_node {jnp.shape(tree.q_node)} must match "
                             f"p_root {jnp.shape(p_root)} / p_node {jnp.shape(p_node)}")
        Q = contexts(jnp.asarray(tree.q_root, dtype), jnp.asarray(tree.q_node, dtype))
    max_depth = n if max_depth is None else int(max_depth)
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    tree = tree._replace(tokens=jnp.asarray(tree.tokens, jnp.int32),
                         parent=jnp.asarray(tree.parent, jnp.int32),
                         depth=jnp.asarray(tree.depth, jnp.int32),
                         valid=jnp.asarray(tree.valid, bool))
    return tree, P, Q, max_depth


# --------------------------------------------------------------------------------------
# The sampler: descend from the root, one pass over the nodes in index order
# --------------------------------------------------------------------------------------

def _acceptance_uniforms(key, n):
    ak = _keys.role_key(key, _keys.ACCEPT)
    return jax.vmap(lambda i: _keys.uniform_open(_keys.position_key(ak, i)))(jnp.arange(n))


def max_tries(parent) -> int:
    """The most nodes a descent can try in a tree of this static ``parent`` array (level or
    any topological order): the children of the root, then of one tried child, and so on,
    along the path whose sibling groups add up most. A tree with some of these nodes
    invalid tries no more. The 2x1x1 tree: 4 of its 6 nodes; the 44-node positional tree: 22."""
    parent = np.asarray(parent)
    most = np.zeros(len(parent) + 1, np.int64)  # by context: node j's is j + 1, the root's 0
    for ctx in range(len(parent), -1, -1):
        kids = np.nonzero(parent + 1 == ctx)[0]
        most[ctx] = len(kids) + (max(most[kids + 1]) if len(kids) else 0)
    return int(most[0])


def descend(key, tree: DraftTree, P, Q, step, max_depth: int, tries: Optional[int] = None):
    """Walk the tree: a node is tried when its parent's context is the current one (its
    earlier siblings all rejected), with uniform ``u_i`` from role ACCEPT at position i.
    Returns ``(cur, num_accepted, path int32[max_depth], r, lz, unfinished)``: the context
    where the descent ended and its residual, and whether it needed more steps than
    ``tries`` (below; its caller's error).

    A ``while_loop`` over the nodes actually tried (the first valid child of the current
    context, then its next valid sibling after a rejection), so a round costs the few
    residual updates it makes rather than one per node. The same decisions, in the same
    order, as a pass over all nodes in index order (:func:`law_scan`'s). Where
    :func:`specjax.sampling.sync_free` (a GPU: a ``while`` whose predicate depends on the data
    is a host sync per iteration there) a loop of ``tries`` steps instead (static; default n,
    or :func:`max_tries` of the proposer's static shape), the same decisions."""
    n = tree.tokens.shape[0]
    log_u = jnp.log(_acceptance_uniforms(key, n))
    ctx = tree.parent + 1
    idx = jnp.arange(n, dtype=jnp.int32)
    # first valid child of each context, next valid sibling of each node (n: none)
    first = jnp.min(jnp.where(tree.valid[None, :] & (ctx[None, :] == jnp.arange(n + 1)[:, None]),
                              idx[None, :], n), axis=1).astype(jnp.int32)
    sib = tree.valid[None, :] & (ctx[None, :] == ctx[:, None]) & (idx[None, :] > idx[:, None])
    nxt = jnp.min(jnp.where(sib, idx[None, :], n), axis=1).astype(jnp.int32)

    def body(carry):
        node, cur, r, lz, qa, num, path = carry
        i = jnp.minimum(node, n - 1)
        log_a, r2, lz2, qa2 = step(r, lz, qa, tree.tokens[i], P[cur])
        acc = log_u[i] < log_a
        path = jnp.where(acc, path.at[jnp.minimum(num, max_depth - 1)].set(i), path)
        return (jnp.where(acc, first[i + 1], nxt[i]), jnp.where(acc, i + 1, cur),
                jnp.where(acc, P[i + 1], r2), jnp.where(acc, 0.0, lz2).astype(lz.dtype),
                jnp.where(acc, Q[i + 1], qa2), num + acc.astype(jnp.int32), path)

    init = (first[0], jnp.int32(0), P[0], jnp.zeros((), P.dtype), Q[0], jnp.int32(0),
            jnp.full((max_depth,), -1, jnp.int32))
    if sync_free():
        # no node is tried twice, so n steps try them all (``tries``: all a shape allows);
        # a finished descent keeps its state
        def masked(_, carry):
            return jax.tree.map(lambda a, b: jnp.where(carry[0] < n, b, a), carry, body(carry))
        node, cur, r, lz, _, num, path = jax.lax.fori_loop(0, n if tries is None else min(tries, n), masked, init)
    else:
        node, cur, r, lz, _, num, path = jax.lax.while_loop(lambda c: c[0] < n, body, init)
    return cur, num, path, r, lz, node < n


def tree_finish(key, tree: DraftTree, cur, num, path, weights, error, max_depth: int,
                single: bool = False) -> TreeVerifyResult:
    """Draw the emitted token from ``weights`` (BONUS if ``cur`` has no valid child, else
    RESIDUAL; position ``num``) and assemble the fixed-size result."""
    has_child = jnp.any(tree.valid & (tree.parent + 1 == cur))
    role = jnp.where(has_child, _keys.RESIDUAL, _keys.BONUS)
    y = sample(_keys.position_key(_keys.role_key(key, role), num), weights, single=single)
    return assemble(tree, num, path, y, error, max_depth)


def assemble(tree: DraftTree, num, path, y, error, max_depth: int) -> TreeVerifyResult:
    """tokens = path's tokens, y, PAD_ID...; everything PAD_ID / -1 (0 accepted) on error."""
    pos = jnp.arange(max_depth + 1)
    path_pad = jnp.concatenate([path, jnp.full((1,), -1, jnp.int32)])
    path_tok = tree.tokens[jnp.maximum(path_pad, 0)]
    tokens = jnp.where(pos < num, path_tok, jnp.where(pos == num, y, PAD_ID))
    tokens = jnp.where(error, PAD_ID, tokens).astype(jnp.int32)
    path = jnp.where(error, -1, path).astype(jnp.int32)
    return TreeVerifyResult(tokens, path, jnp.where(error, 0, num).astype(jnp.int32), error)


def tree_verify(key, tree: DraftTree, p_root, p_node, candidates: str = "iid", *,
                max_depth: Optional[int] = None, single: bool = False,
                max_tries: Optional[int] = None) -> TreeVerifyResult:
    """Exact verification of a draft tree (see the module docstring).

    ``p_root [V]``, ``p_node [N, V]``: the target's processed log-probs at the root and
    after each node (``p_node[j]`` = the law of the token after node j's path).
    ``candidates`` (static): how the tree's candidates were drawn.  ``max_depth``
    (static, default N): the size of the result (``tokens [max_depth + 1]``, ``path
    [max_depth]``); a deeper valid node is an error.  ``single``: as in
    :func:`specjax.verify.token_verify`. ``max_tries`` (static, default N): the steps of
    the sync-free descent (:func:`descend`), the :func:`max_tries` of the shape the trees
    are drawn in; a descent that needs more is an error, never a shortened one.
    """
    if max_tries is not None and (isinstance(max_tries, bool) or not isinstance(max_tries, (int, np.integer))
                                  or max_tries < 1):
        raise ValueError(f"max_tries must be an integer >= 1, got {max_tries!r}")
    tree, P, Q, max_depth = tree_prepare(tree, p_root, p_node, candidates, max_depth)
    error = tree_validate(tree, P, Q, candidates, max_depth)
    cur, num, path, r, _, unfinished = descend(key, tree, P, Q, tree_step(candidates), max_depth, max_tries)
    return tree_finish(key, tree, cur, num, path, r, error | unfinished, max_depth, single)


def iid_tree_verify(key, tree, p_root, p_node, *, max_depth=None, single=False):
    """:func:`tree_verify` with candidates drawn i.i.d. from q (SpecInfer)."""
    return tree_verify(key, tree, p_root, p_node, "iid", max_depth=max_depth, single=single)


def without_replacement_tree_verify(key, tree, p_root, p_node, *, max_depth=None,
                                    single=False):
    """:func:`tree_verify` with siblings drawn from q without replacement."""
    return tree_verify(key, tree, p_root, p_node, "without_replacement",
                       max_depth=max_depth, single=single)


def point_mass_tree_verify(key, tree, p_root, p_node, *, max_depth=None, single=False):
    """:func:`tree_verify` with deterministic (e.g. top-k) candidates as point masses."""
    return tree_verify(key, tree, p_root, p_node, "point_mass", max_depth=max_depth,
                       single=single)


def point_mass_target_verify(tree: DraftTree, p_root, p_node, *,
                             max_depth: Optional[int] = None) -> TreeVerifyResult:
    """:func:`tree_verify`'s result, for any ``candidates`` and key, when every used row of
    the target's law is a point mass (greedy rows; the caller checks, e.g. with
    :func:`specjax.sampling.at_most_one_possible`).

    Why: with ``r = p`` a point mass at ``a``, a candidate ``x`` is accepted with
    probability ``min(1, r(x)/q'(x))`` (or ``r(x)``) = 1 if ``x = a`` and 0 otherwise,
    and after a rejection the residual is still the point mass at ``a``; the final draw
    from it (or the bonus from p) is ``a``. So the descent takes the first child equal
    to p's token, as :func:`greedy_tree_verify` does, with no residual pass over the
    vocabulary. The error flag checks the structure and p; the draft law q cannot change
    the result here and is not checked."""
    return greedy_tree_verify(tree, p_root, p_node, max_depth=max_depth)


# --------------------------------------------------------------------------------------
# The law given the tree (dtype-generic)
# --------------------------------------------------------------------------------------

def law_scan(tree: DraftTree, P, Q, step) -> TreeLaw:
    """The law of :func:`descend` + the final draw: the same pass over the nodes, keeping
    every context's residual and the probability of reaching it (``reach``) and of every
    sibling tried there so far being rejected (``rem``)."""
    n = tree.tokens.shape[0]
    ctx = tree.parent + 1
    dtype = P.dtype

    def body(carry, i):
        R, LZ, QA, reach, rem = carry
        c = ctx[i]
        log_a, r2, lz2, qa2 = step(R[c], LZ[c], QA[c], tree.tokens[i], P[c])
        ok = tree.valid[i]
        a = jnp.where(ok, jnp.exp(log_a), 0.0)
        reach = reach.at[i + 1].set(reach[c] * rem[c] * a)
        rem = rem.at[c].set(rem[c] * (1.0 - a))
        R = R.at[c].set(jnp.where(ok, r2, R[c]))
        LZ = LZ.at[c].set(jnp.where(ok, lz2, LZ[c]))
        QA = QA.at[c].set(jnp.where(ok, qa2, QA[c]))
        return (R, LZ, QA, reach, rem), None

    init = (P, jnp.zeros((n + 1,), dtype), Q,
            jnp.zeros((n + 1,), dtype).at[0].set(1.0), jnp.ones((n + 1,), dtype))
    (R, _, _, reach, rem), _ = jax.lax.scan(body, init, jnp.arange(n))
    return TreeLaw(reach * rem, _normalize(R))


def tree_law(tree: DraftTree, p_root, p_node, candidates: str = "iid") -> TreeLaw:
    """Law of :func:`tree_verify` given the tree (any float dtype, no validation)."""
    dtype = jnp.result_type(jnp.asarray(p_root).dtype, jnp.float32)
    tree, P, Q, _ = tree_prepare(tree, p_root, p_node, candidates, None, dtype)
    return law_scan(tree, P, Q, tree_step(candidates))


# --------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------

def greedy_tree_verify(tree: DraftTree, logits_root, logits_node, *,
                       max_depth: Optional[int] = None) -> TreeVerifyResult:
    """Greedy verification of a tree: a DIFFERENT contract from the samplers.

    From the root, descend into the first child (in index order) whose token is the
    target argmax (ties -> lowest id) at the current context, while there is one; then
    emit the argmax at the last context.  The result is the longest path of the tree
    that the greedy target would produce, plus the greedy target's next token.  Logits
    may be raw logits or log-probs; q is not used.
    """
    tree, L, _, max_depth = tree_prepare(tree, logits_root, logits_node, "point_mass",
                                     max_depth)
    n, v = tree.tokens.shape[0], L.shape[-1]
    top_val = jnp.max(L, axis=-1, keepdims=True)
    used = jnp.concatenate([jnp.ones((1,), bool), tree.valid])
    row_bad = jnp.isnan(top_val[:, 0]) | ~(top_val[:, 0] > -jnp.inf)
    error = _structure_error(tree, v, max_depth) | jnp.any(used & row_bad)
    top = jnp.min(jnp.where(L == top_val, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    top = jnp.minimum(top, v - 1)
    ctx = tree.parent + 1

    def body(carry, i):
        cur, num, path = carry
        acc = tree.valid[i] & (ctx[i] == cur) & (tree.tokens[i] == top[cur])
        path = jnp.where(acc, path.at[jnp.minimum(num, max_depth - 1)].set(i), path)
        return (jnp.where(acc, i + 1, cur), num + acc.astype(jnp.int32), path), None

    (cur, num, path), _ = jax.lax.scan(
        body, (jnp.int32(0), jnp.int32(0), jnp.full((max_depth,), -1, jnp.int32)),
        jnp.arange(n))
    return assemble(tree, num, path, top[cur], error, max_depth)
