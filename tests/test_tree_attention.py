"""Tree attention in the target's forward (models.base.TreeAttention) and moving an
accepted path's KV into contiguous slots (models.base.move_slots)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.base import TreeAttention, move_slots
from specjax.models.llama import LlamaLM, tiny_config
from specjax.tree import ancestor_mask, full_tree_shape

V = 16
PREFIX = [3, 1, 4, 1, 5, 9, 2]


def _paths(parent):
    out = []
    for i in range(len(parent)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parent[j]
        out.append(path[::-1])
    return out


@pytest.fixture(scope="module", params=["window-chunked", "scan-onepass"])
def lm(request):
    if request.param == "scan-onepass":  # scanned layers, one attention pass over all slots
        cfg = tiny_config(vocab_size=V, n_layers=2, scan_layers=True, attn_chunk=0)
    else:  # a sliding window of 3 positions on the first layer, attention in 2-slot chunks
        cfg = tiny_config(vocab_size=V, n_layers=2, sliding_window=3, layer_types=("sliding", "full"),
                          attn_chunk=2)
    return LlamaLM.init(cfg, seed=5)


def _tree_inputs(rows=2):
    parent, depth = full_tree_shape((2, 2, 1))
    n = len(parent)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, V, size=(rows, n)).astype(np.int32)
    # root token (the last committed token) at depth 0, then the nodes
    anc = np.asarray(ancestor_mask(parent))
    m = np.zeros((n + 1, n + 1), bool)
    m[:, 0] = True
    m[1:, 1:] = anc
    return parent, depth, toks, m


def test_tree_forward_equals_each_path_alone(lm):
    parent, depth, toks, m = _tree_inputs()
    rows, n = toks.shape
    c = len(PREFIX)
    cache = lm.init_cache(rows, 40)
    pre = jnp.asarray([PREFIX[:-1]] * rows, jnp.int32)
    cache = lm.apply(lm.params, pre, cache).cache
    tokens = jnp.concatenate([jnp.full((rows, 1), PREFIX[-1], jnp.int32), jnp.asarray(toks)], axis=1)
    d = jnp.broadcast_to(jnp.asarray(np.concatenate([[0], depth]), jnp.int32), (rows, n + 1))
    out = lm.apply(lm.params, tokens, cache, tree=TreeAttention.dense(d, m))
    assert (np.asarray(out.cache.lengths) == c - 1).all()
    # every path alone, right-padded into one causal forward (read at the path's end)
    paths = [[]] + _paths(parent)
    dmax = max(map(len, paths))
    seqs = np.zeros((rows, len(paths), c + dmax), np.int32)
    for i, path in enumerate(paths):
        seqs[:, i, :c] = PREFIX
        seqs[:, i, c:c + len(path)] = toks[:, path]
    ref = lm.apply(lm.params, jnp.asarray(seqs.reshape(-1, c + dmax)),
                   lm.init_cache(rows * len(paths), 40)).logits.reshape(rows, len(paths), c + dmax, V)
    ends = np.array([c - 1 + len(p) for p in paths])
    np.testing.assert_allclose(out.logits, ref[:, np.arange(len(paths)), ends], rtol=2e-5, atol=2e-5)


def test_incremental_region_equals_one_call(lm):
    """Growing the tree level by level (each call sees the earlier levels' slots through
    the mask) gives the logits of one call over the whole tree."""
    parent, depth, toks, m = _tree_inputs(rows=1)
    n = toks.shape[1]
    cache = lm.apply(lm.params, jnp.asarray([PREFIX]), lm.init_cache(1, 40)).cache  # prefix incl. root
    dm = m[1:, 1:]  # nodes only: the root token is now in the prefix
    d1 = jnp.asarray(depth[None] - 1, jnp.int32)
    one = lm.apply(lm.params, jnp.asarray(toks), cache, tree=TreeAttention.dense(d1, dm)).logits
    got, c = [], cache
    for lev in range(1, depth.max() + 1):
        idx = np.nonzero(depth == lev)[0]
        t = TreeAttention(depth=d1[:, idx], offset=jnp.asarray([idx[0]], jnp.int32),
                          mask=jnp.asarray(dm[idx][None]), region_depth=d1)
        o = lm.apply(lm.params, jnp.asarray(toks[:, idx]), c, tree=t)
        c = o.cache
        got.append(o.logits)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), one, rtol=2e-5, atol=2e-5)


def test_moved_path_continues_like_the_sequence(lm):
    """After a tree pass, moving a path's KV to contiguous slots and setting the length
    continues exactly like a cache that was fed the path's tokens in order."""
    parent, depth, toks, m = _tree_inputs(rows=2)
    rows, n = toks.shape
    c = len(PREFIX)
    cache = lm.apply(lm.params, jnp.asarray([PREFIX[:-1]] * rows), lm.init_cache(rows, 40)).cache
    tokens = jnp.concatenate([jnp.full((rows, 1), PREFIX[-1], jnp.int32), jnp.asarray(toks)], axis=1)
    d = jnp.broadcast_to(jnp.asarray(np.concatenate([[0], depth]), jnp.int32), (rows, n + 1))
    tc = lm.apply(lm.params, tokens, cache, tree=TreeAttention.dense(d, m)).cache
    paths = [_paths(parent)[n - 1], _paths(parent)[3][:2]]  # a depth-3 path, a depth-2 prefix of one
    D = 3
    src = np.array([p + [0] * (D - len(p)) for p in paths], np.int32)  # node i sits at slot c + i
    num = np.array([len(p) for p in paths], np.int32)
    start = np.full((rows,), c, np.int32)
    moved = move_slots(tc, jnp.asarray(start), jnp.asarray(src), jnp.asarray(num))
    moved = moved.with_lengths(jnp.asarray(c + num))
    nxt = jnp.asarray([[7], [2]], jnp.int32)
    got = lm.apply(lm.params, nxt, moved).logits[:, 0]
    seqs = np.zeros((rows, c + D + 1), np.int32)
    for r in range(rows):
        seqs[r, :c + num[r] + 1] = np.concatenate([PREFIX, toks[r, paths[r]], [int(nxt[r, 0])]])
    ref = lm.apply(lm.params, jnp.asarray(seqs), lm.init_cache(rows, 40)).logits
    np.testing.assert_allclose(got, ref[np.arange(rows), c + num], rtol=2e-5, atol=2e-5)
