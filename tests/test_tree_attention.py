"""Tree attention in the target's forward (models.base.TreeAttention) and moving an
accepted path's KV into contiguous slots (models.base.move_slots); the CPU attention
kernel's tree masks against XLA's tree attention."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import cpu_kernels as ck
from specjax.models.base import TreeAttention, move_slots
from specjax.models.llama import LlamaLM, cached_attention, kernel_attention, tiny_config
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
    tree = TreeAttention.dense(d, m)
    out = lm.apply(lm.params, tokens, cache, tree=tree)
    assert (np.asarray(out.cache.lengths) == c - 1).all()
    if ck.available()[0]:  # the fixtures' default cpu_kernels="auto": the tree goes to the kernel
        assert ck.TREE_ATTENTION_TARGET in _hlo(lm, tokens, cache, tree)
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


def _hlo(lm, tokens, cache, tree):
    f = jax.jit(lambda p, t, c, tr: lm.apply(p, t, c, tree=tr).logits)
    return f.lower(lm.params, tokens, cache, tree).as_text()


def _random_tree(rng, B, T, W, lengths, offset):
    """Random tree-attention inputs: token t of row b in region slot offset[b] + t, which it
    always sees (at its own depth, so in any window); other region slots at random depths,
    visible at random."""
    depth = rng.integers(0, 5, (B, T)).astype(np.int32)
    region_depth = rng.integers(0, 5, (B, W)).astype(np.int32)
    mask = rng.random((B, T, W)) < 0.5
    for b in range(B):
        region_depth[b, offset[b]:offset[b] + T] = depth[b]
        mask[b, np.arange(T), offset[b] + np.arange(T)] = True
    pos = np.asarray(lengths)[:, None] + depth
    tree = (jnp.asarray(lengths, jnp.int32), jnp.asarray(mask), jnp.asarray(region_depth))
    return jnp.asarray(pos, jnp.int32), tree


needs_kernels = pytest.mark.skipif(ck.compiler() is None, reason="no C++ compiler to build the CPU kernels")


# (B, T, Nkv, G, H, W, S): GQA groups, ragged rows, H off the vector paths (8); the last is
# above the kernel's multi-threading threshold with few (b, kv head) pairs (rows split
# into parts)
@needs_kernels
@pytest.mark.parametrize("B,T,Nkv,G,H,W,S", [pytest.param(2, 5, 2, 3, 16, 9, 40, marks=pytest.mark.extended),
                                             pytest.param(3, 7, 1, 4, 8, 7, 30, marks=pytest.mark.extended),
                                             (1, 17, 3, 3, 64, 17, 300)])
def test_tree_attention_kernel_matches_xla(B, T, Nkv, G, H, W, S):
    """The kernel's tree masks (random masks over a region, ragged lengths, one row whose
    region runs past the cache's end, sliding windows that cut prefix and region slots,
    score scale and softcap) give XLA's tree attention (one pass and chunked), slots past
    the region never matter, and the gradient is XLA's."""
    assert ck.available()[0]
    rng = np.random.default_rng(B * 100 + T + H)
    L = 2
    q = jnp.asarray(rng.standard_normal((B, T, Nkv, G, H), dtype=np.float32))
    k_all = jnp.asarray(rng.standard_normal((L, B, Nkv, S, H), dtype=np.float32))
    v_all = jnp.asarray(rng.standard_normal((L, B, Nkv, S, H), dtype=np.float32))
    lengths = rng.integers(0, S - W, B)
    offset = rng.integers(0, W - T + 1, B)
    offset[0], lengths[0] = 0, S - T  # W > T: the region's last slots are past S (dropped)
    if B > 2:
        lengths[2] = 0  # no prefix
    pos, tree = _random_tree(rng, B, T, W, lengths, offset)
    kern = jax.jit(lambda q, k, v, w, sc, cap: kernel_attention(q, k, v, jnp.int32(1), pos, 0, w, sc, cap, tree=tree),
                   static_argnums=(4, 5))
    xla = jax.jit(lambda q, k, v, w, c, sc, cap: cached_attention(q, k, v, 1, pos, c, w, sc, cap, tree=tree),
                  static_argnums=(4, 5, 6))
    for scale, softcap in ((None, 0.0), (0.3, 2.0)):
        for window in (None, 1, 3, 10, 10 ** 4):
            w = None if window is None else jnp.int32(window)
            got = kern(q, k_all, v_all, w, scale, softcap)
            for chunk in (0, 8):
                np.testing.assert_allclose(got, xla(q, k_all, v_all, w, chunk, scale, softcap), rtol=1e-5, atol=1e-5)
    # slots past each row's region (and K/V of other layers) are never read
    end = np.asarray(lengths) + W
    junk = np.arange(S)[None, :] >= end[:, None]  # [B, S]
    k2 = jnp.where(jnp.asarray(junk)[None, :, None, :, None], 1e4, k_all).at[0].set(1e4)
    v2 = jnp.where(jnp.asarray(junk)[None, :, None, :, None], jnp.nan, v_all).at[0].set(jnp.nan)
    np.testing.assert_array_equal(kern(q, k2, v2, None, None, 0.0), kern(q, k_all, v_all, None, None, 0.0))
    # the derivative is XLA's
    f = lambda fn: jax.grad(lambda q: jnp.sum(jnp.sin(fn(q))))
    g1 = f(lambda q: kernel_attention(q, k_all, v_all, jnp.int32(1), pos, 0, jnp.int32(3), 0.3, 2.0, tree=tree))(q)
    g2 = f(lambda q: cached_attention(q, k_all, v_all, 1, pos, 0, jnp.int32(3), 0.3, 2.0, tree=tree))(q)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_tree_attention_kernel_row_that_sees_nothing_is_zero():
    """A query row with no visible slot (empty prefix, empty mask row) gets zeros, not NaN;
    the other rows are unaffected."""
    rng = np.random.default_rng(0)
    B, T, Nkv, G, H, S = 1, 3, 1, 2, 16, 20
    q = jnp.asarray(rng.standard_normal((B, T, Nkv, G, H), dtype=np.float32))
    kv = jnp.asarray(rng.standard_normal((1, B, Nkv, S, H), dtype=np.float32))
    mask = np.eye(T, dtype=bool)[None]
    mask[0, 1] = False
    tree = (jnp.zeros((B,), jnp.int32), jnp.asarray(mask), jnp.zeros((B, T), jnp.int32))
    pos = jnp.zeros((B, T), jnp.int32)
    got = np.asarray(kernel_attention(q, kv, kv, jnp.int32(0), pos, 0, tree=tree))
    assert (got[0, 1] == 0).all()
    want = cached_attention(q, kv, kv, 0, pos, 0, tree=tree)
    np.testing.assert_allclose(got[0, [0, 2]], np.asarray(want)[0, [0, 2]], rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.extended)], ids=["unrolled", "scanned"])
def test_tree_forward_with_kernels_equals_xla(scan):
    """``LlamaLM.apply(..., tree=)`` with the CPU kernels (the tree attention kernel in every
    layer, unrolled or scanned, a sliding and a full layer, GQA, softcap) gives the logits
    and cache of ``cpu_kernels="xla"``, for two rows at different lengths; with the kernels
    a row's logits are bit-identical alone and in the batch."""
    cfg = tiny_config(vocab_size=V, n_layers=2, dim=32, n_heads=6, n_kv_heads=2, head_dim=16, sliding_window=3,
                      layer_types=("sliding", "full"), attn_softcap=3.0, attn_chunk=4, scan_layers=scan,
                      cpu_kernels="kernel")
    lm = LlamaLM.init(cfg, seed=3)
    lmx = lm.with_config(cpu_kernels="xla")
    parent, depth, toks, m = _tree_inputs()
    rows, n = toks.shape
    tokens = jnp.concatenate([jnp.asarray([[PREFIX[-1]], [PREFIX[2]]], jnp.int32), jnp.asarray(toks)], axis=1)
    d = jnp.broadcast_to(jnp.asarray(np.concatenate([[0], depth]), jnp.int32), (rows, n + 1))
    tree = TreeAttention.dense(d, m)
    outs, caches = [], []
    for model in (lm, lmx):
        cache = model.apply(model.params, jnp.asarray([PREFIX[:-1]] * rows), model.init_cache(rows, 24)).cache
        cache = cache.with_lengths(jnp.asarray([len(PREFIX) - 1, 2], jnp.int32))  # ragged
        hlo = _hlo(model, tokens, cache, tree)
        assert (ck.TREE_ATTENTION_TARGET in hlo) == (model is lm)
        outs.append(jax.jit(lambda p, t, c, tr: model.apply(p, t, c, tree=tr))(model.params, tokens, cache, tree))
        caches.append(cache)
    np.testing.assert_allclose(outs[0].logits, outs[1].logits, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(outs[0].cache.k, outs[1].cache.k, rtol=2e-5, atol=2e-5)
    c = caches[0]
    for r in range(rows):
        one = c.replace(k=c.k[:, r:r + 1], v=c.v[:, r:r + 1], lengths=c.lengths[r:r + 1])
        alone = jax.jit(lambda p, t, c, tr: lm.apply(p, t, c, tree=tr).logits)(
            lm.params, tokens[r:r + 1], one, TreeAttention.dense(d[r:r + 1], m))
        np.testing.assert_array_equal(alone[0], outs[0].logits[r])
