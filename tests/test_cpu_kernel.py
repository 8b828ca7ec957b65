"""The small-M FFI matmul (models/cpu_kernels.py): exact up to float32 rounding against a
float64 reference, row results independent of the batch, differentiable, usable under
jit/vmap/while_loop, chosen only where it applies, and really used by the model."""
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import cpu_kernels as ck
from specjax.models.llama import LlamaLM, cached_attention, kernel_attention, tiny_config

pytestmark = pytest.mark.skipif(ck.compiler() is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module", autouse=True)
def built():
    ok, why = ck.available()
    assert ok, why  # a compiler is present, so a failed build is a real failure


def _ref(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 9, 10, 12, 13, 16, 37, 64, 80])
@pytest.mark.parametrize("k,n", [(1, 64), (7, 192), (70, 128), (576, 960), (300, 4160), (40, 100)])
def test_matches_float64_reference(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    y = np.asarray(jax.jit(ck.small_matmul)(x, w))
    ref = _ref(x, w)
    scale = np.sqrt(k)  # typical magnitude of a sum of k unit products
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.max(np.abs(y - ref)) < 2e-6 * scale * np.sqrt(k), np.max(np.abs(y - ref))


@pytest.mark.parametrize("m", [1, 3, 6, 8, 9, 16])
@pytest.mark.parametrize("k,n", [(7, 192), (576, 960), (300, 8192)])
def test_float16_weights_match_the_float64_product_of_their_values(m, k, n):
    """float16 weights (the shipped draft head): the kernel multiplies their exact values in
    float32; checked against float64 on the widened values, and equal to the float32 kernel
    given the same values widened."""
    rng = np.random.default_rng(m * 7 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w16 = rng.standard_normal((k, n)).astype(np.float16)
    assert ck.use_small_matmul("auto", jnp.asarray(x), jnp.asarray(w16))
    y = np.asarray(jax.jit(ck.small_matmul)(x, w16))
    ref = _ref(x, w16.astype(np.float32))
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.max(np.abs(y - ref)) < 2e-6 * k, np.max(np.abs(y - ref))
    np.testing.assert_array_equal(y, np.asarray(jax.jit(ck.small_matmul)(x, w16.astype(np.float32))))
    # gradients of a float16-weight matmul are XLA's (training never sees the kernel)
    g = jax.grad(lambda a: jnp.sum(ck.small_matmul(a, w16) ** 2))(x)
    gx = jax.grad(lambda a: jnp.sum((a @ w16.astype(np.float32)) ** 2))(x)
    np.testing.assert_allclose(g, gx, rtol=0, atol=1e-5 * float(np.abs(gx).max()))


def test_row_results_do_not_depend_on_the_batch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ck.MAX_ROWS + 11, 576), dtype=np.float32)
    w = rng.standard_normal((576, 1536), dtype=np.float32)
    f = jax.jit(ck.small_matmul)
    full = np.asarray(f(x, w))  # more than MAX_ROWS rows: the many-row path
    small = np.asarray(f(x[:13], w))  # the small-M path (3 register groups, 64-row tiles)
    np.testing.assert_array_equal(small, full[:13])
    np.testing.assert_array_equal(np.asarray(f(x[:ck.MAX_ROWS], w)), full[:ck.MAX_ROWS])
    for i in (0, 5, 6, 12, 17, ck.MAX_ROWS + 10):  # first / inside / start of a second register group / last
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w))[0], full[i])
    np.testing.assert_array_equal(np.asarray(f(x[3:9], w)), full[3:9])


def test_gradients_and_jvp_match_xla():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, 96), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((96, 128), dtype=np.float32))
    c = jnp.asarray(rng.standard_normal((5, 128), dtype=np.float32))
    gk = jax.grad(lambda x, w: jnp.sum(ck.small_matmul(x, w) * c), argnums=(0, 1))(x, w)
    gx = jax.grad(lambda x, w: jnp.sum((x @ w) * c), argnums=(0, 1))(x, w)
    for a, b in zip(gk, gx):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    dx, dw = jnp.ones_like(x), jnp.zeros_like(w)
    _, t = jax.jvp(ck.small_matmul, (x, w), (dx, dw))
    np.testing.assert_allclose(t, dx @ w, rtol=1e-5, atol=1e-4)


def test_vmap_and_while_loop():
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((4, 3, 64), dtype=np.float32)
    w = rng.standard_normal((64, 64), dtype=np.float32) / 8
    got = jax.jit(jax.vmap(ck.small_matmul, in_axes=(0, None)))(xs, w)
    np.testing.assert_allclose(got, np.einsum("bmk,kn->bmn", xs, w), rtol=1e-5, atol=1e-5)

    def loop(x):
        return jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(ck.small_matmul(x, w)), x)

    want = xs[0]
    for _ in range(5):
        want = np.tanh(want @ w)
    np.testing.assert_allclose(jax.jit(loop)(xs[0]), want, rtol=1e-5, atol=1e-5)


def test_choice_only_where_it_applies():
    f32 = lambda *s: jnp.zeros(s, jnp.float32)
    assert ck.use_small_matmul("auto", f32(5, 64), f32(64, 128))
    assert ck.use_small_matmul("kernel", f32(ck.MAX_ROWS, 8), f32(8, 64))
    assert not ck.use_small_matmul("xla", f32(5, 64), f32(64, 128))
    # any M (above MAX_ROWS the kernel's many-row path, same sums) and any N (zero-padded)
    assert ck.use_small_matmul("auto", f32(ck.MAX_ROWS + 1, 64), f32(64, 128))
    assert ck.use_small_matmul("auto", f32(5, 64), f32(64, 100))
    assert not ck.use_small_matmul("auto", jnp.zeros((5, 64), jnp.bfloat16), jnp.zeros((64, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="cpu_kernels mode"):
        ck.use_small_matmul("fast", f32(5, 64), f32(64, 128))


def test_kernel_mode_fails_loudly_when_unavailable(monkeypatch):
    monkeypatch.setattr(ck, "_ensure", lambda: (False, "simulated build failure"))
    f32 = lambda *s: jnp.zeros(s, jnp.float32)
    with pytest.raises(RuntimeError, match="simulated build failure"):
        ck.use_small_matmul("kernel", f32(5, 64), f32(64, 128))
    ck._warn_unavailable.cache_clear()  # the warning is given once per reason
    with pytest.warns(UserWarning, match="simulated build failure"):
        assert not ck.use_small_matmul("auto", f32(5, 64), f32(64, 128))


def test_build_error_shows_the_compiler_output(monkeypatch, tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(ck, "SOURCES", (bad,))
    monkeypatch.setenv("SPECJAX_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="building the CPU kernels failed"):
        ck.build()
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-written library left behind


def test_config_rejects_unknown_mode():
    with pytest.raises(ValueError, match="cpu_kernels"):
        tiny_config(cpu_kernels="fastest")


def test_model_uses_the_kernel_and_matches_xla():
    cfg = tiny_config(vocab_size=128, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)
    lm = LlamaLM.init(cfg, seed=0)
    assert lm.config.cpu_kernels == "auto"
    lmx = lm.with_config(cpu_kernels="xla")
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 7)), jnp.int32)
    hlo = jax.jit(lm.apply).lower(lm.params, toks, lm.init_cache(2, 16)).as_text()
    assert ck.TARGET_NAME in hlo and ck.ATTENTION_TARGET in hlo  # the kernels really serve the model
    hlo_x = jax.jit(lmx.apply).lower(lmx.params, toks, lmx.init_cache(2, 16)).as_text()
    assert ck.TARGET_NAME not in hlo_x and ck.ATTENTION_TARGET not in hlo_x
    # prefill, then a 3-token verify-like step and a 1-token decode step
    outs = []
    for m in (lm, lmx):
        c = m.init_cache(2, 16)
        a = m.apply(m.params, toks[:, :4], c)
        b = m.apply(m.params, toks[:, 4:7], a.cache)
        outs.append((a.logits, b.logits))
    for u, v in zip(*outs):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=2e-5)


def test_stacked_weights_are_read_in_place_with_the_slices_bits():
    """Scanned layers: the stacked kernel reads layer l of w[L, K, N] where it lies and gives
    the 2-D kernel's bits for the slice; its gradient is XLA's; a whole scanned model takes it
    for every layer matmul, gives the unrolled model's logits (to float32 rounding: the
    elementwise ops fuse differently inside the scan) and its gradient matches XLA's ops."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 96), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((3, 96, 128), dtype=np.float32))
    for layer in range(3):
        got = jax.jit(ck.small_matmul_stacked)(x, w, jnp.int32(layer))
        np.testing.assert_array_equal(got, ck.small_matmul(x, w[layer]))
    c = jnp.asarray(rng.standard_normal((5, 128), dtype=np.float32))
    gk = jax.grad(lambda x, w: jnp.sum(ck.small_matmul_stacked(x, w, jnp.int32(1)) * c), argnums=(0, 1))(x, w)
    gx = jax.grad(lambda x, w: jnp.sum((x @ w[1]) * c), argnums=(0, 1))(x, w)
    for a, b in zip(gk, gx):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    assert ck.use_small_matmul_stacked("auto", x, w) and not ck.use_small_matmul_stacked("auto", x, w[:, :, :100])

    # every weight's N a multiple of 64, so every matmul of a scanned layer takes the stacked kernel
    cfg = tiny_config(vocab_size=128, n_layers=3, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)
    unrolled = LlamaLM.init(cfg, seed=0)
    scanned = unrolled.with_config(scan_layers=True)
    toks = jnp.asarray(rng.integers(0, 128, (2, 7)), jnp.int32)
    hlo = jax.jit(scanned.apply).lower(scanned.params, toks, scanned.init_cache(2, 16)).as_text()
    assert hlo.count(ck.STACKED_TARGET) == 4  # wqkv, wo, w_gate_up, w_down in the scanned body
    for T in (7, 1):
        lu = unrolled.apply(unrolled.params, toks[:, :T], unrolled.init_cache(2, 16)).logits
        ls = scanned.apply(scanned.params, toks[:, :T], scanned.init_cache(2, 16)).logits
        np.testing.assert_allclose(ls, lu, rtol=1e-5, atol=1e-5)
    xla = scanned.with_config(cpu_kernels="xla")

    def loss(m):
        return lambda p: jnp.sum(m.apply(p, toks, m.init_cache(2, 16)).logits ** 2)

    for a, b in zip(jax.tree.leaves(jax.grad(loss(scanned))(scanned.params)),
                    jax.tree.leaves(jax.grad(loss(xla))(xla.params))):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5 * float(jnp.max(jnp.abs(b))))


def _stand_in_compiler(tmp_path, monkeypatch, seconds=0.0):
    """$CXX set to a stand-in that answers ``--version``, logs every other call and writes
    its ``-o`` file after ``seconds`` (the real build takes ~20 s of CPU here). Its path
    is new, so the build ids it gets (``build_id`` is memoized per compiler) are never the
    real one's. Returns the number of builds it has run so far (its links: one per build,
    after one compile per source), as a function."""
    calls = tmp_path / "calls.log"
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        "args = sys.argv[1:]\n"
        "if args == ['--version']:\n"
        "    print('fake-cxx 1.0'); sys.exit(0)\n"
        f"time.sleep({seconds})\n"
        f"open({str(calls)!r}, 'a').write(' '.join(args) + '\\n')\n"
        "open(args[args.index('-o') + 1], 'wb').write(b'not a library')\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    return lambda: sum("-shared" in line.split() for line in calls.read_text().splitlines()) if calls.exists() else 0


def test_cache_dir_is_reused(tmp_path, monkeypatch):
    """A build lands in $SPECJAX_KERNEL_CACHE under its build id and is found there, not
    rebuilt; changed sources or ``force`` build again (the real build runs on first use:
    every kernel test goes through it)."""
    built = _stand_in_compiler(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECJAX_KERNEL_CACHE", str(cache))

    p1 = ck.build()
    assert built() == 1 and p1.parent == cache and p1.name == f"specjax_kernels-{ck.build_id(ck.compiler())}.so"
    t1 = p1.stat().st_mtime_ns
    p2 = ck.build()
    assert p1 == p2 and p2.stat().st_mtime_ns == t1 and built() == 1  # found in the cache, not rebuilt
    assert ck.build(force=True) == p1 and built() == 2
    assert [f.name for f in cache.iterdir()] == [p1.name]  # no temporary file left behind

    changed = tmp_path / "small_matmul.cc"  # another source: another build id, another build
    changed.write_text(ck.SOURCES[0].read_text() + "\n// changed\n")
    monkeypatch.setattr(ck, "SOURCES", (changed, *ck.SOURCES[1:]))
    ck.build_id.cache_clear()  # memoized per compiler: this one's id with the old sources
    p3 = ck.build()
    assert p3 != p1 and p3.parent == cache and built() == 3


def test_processes_that_build_at_once_build_once(tmp_path, monkeypatch):
    """Two builds started together (the suite's two workers, several processes of a pod
    host) compile once: the second waits for the first's lock on the cache folder and
    finds its library. (Threads here: each takes its own lock, as processes do.)"""
    import threading

    built = _stand_in_compiler(tmp_path, monkeypatch, seconds=0.75)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECJAX_KERNEL_CACHE", str(cache))
    ck.build_id(ck.compiler())  # memoized before the threads start
    got = []
    threads = [threading.Thread(target=lambda: got.append(ck.build())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] == got[1] and built() == 1
    assert [f.name for f in cache.iterdir()] == [got[0].name]  # no lock file left behind
    assert ck.build(force=True) == got[0] and built() == 2  # force still builds


@pytest.mark.parametrize("phase", ["compile", "link"])
def test_an_interrupted_build_leaves_nothing_in_the_cache(tmp_path, monkeypatch, phase):
    """Ctrl-C while the compilers run (the CLI's interrupt test hit it: an empty temporary
    library stayed in ~/.cache/specjax/kernels), or while the objects are linked: the
    interrupt propagates, the compilers started are stopped, no file stays."""
    built = _stand_in_compiler(tmp_path, monkeypatch, seconds=30.0 if phase == "compile" else 0.0)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECJAX_KERNEL_CACHE", str(cache))
    run, popen = subprocess.run, subprocess.Popen
    started = []

    class Interrupted(popen):  # the compilers start; waiting for the first is interrupted
        def __init__(self, cmd, **kwargs):
            super().__init__(cmd, **kwargs)
            self.compiler = "-c" in cmd  # (subprocess.run asks for --version through Popen too)
            if self.compiler:
                started.append(self)

        def communicate(self, *a, **k):
            if not self.compiler:
                return super().communicate(*a, **k)
            assert len(started) == len(ck.SOURCES)  # all started before any is waited for
            raise KeyboardInterrupt

    def interrupted(cmd, **kwargs):
        if cmd[1:] == ["--version"]:
            return run(cmd, **kwargs)
        assert cache in Path(cmd[cmd.index("-o") + 1]).parents  # its temporary files exist by now
        raise KeyboardInterrupt

    if phase == "compile":
        monkeypatch.setattr(ck.subprocess, "Popen", Interrupted)
    monkeypatch.setattr(ck.subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.build()
    assert list(cache.iterdir()) == [] and built() == 0
    assert all(p.returncode is not None for p in started)  # stopped, not left running


# the last four run multi-threaded (above the kernel's kMinParallelFlops), the first of
# them with each head's rows split into parts; H = 128 / 32 / 48 reach the other PV paths
@pytest.mark.parametrize("B,T,G,H,S", [(1, 1, 3, 64, 300), (1, 5, 3, 64, 300), (3, 4, 2, 16, 40), (2, 9, 1, 8, 17),
                                       (1, 3, 2, 128, 100), (1, 2, 2, 32, 50), (1, 3, 1, 48, 70),
                                       (1, 8, 4, 64, 700), (2, 6, 3, 64, 600), (1, 9, 3, 128, 500),
                                       (4, 2, 2, 64, 900)])
def test_attention_kernel_matches_xla(B, T, G, H, S):
    rng = np.random.default_rng(B * 100 + T)
    L, Nkv = 2, 3
    q = jnp.asarray(rng.standard_normal((B, T, Nkv, G, H), dtype=np.float32))
    k_all = jnp.asarray(rng.standard_normal((L, B, Nkv, S, H), dtype=np.float32))
    v_all = jnp.asarray(rng.standard_normal((L, B, Nkv, S, H), dtype=np.float32))
    # rows at different lengths; the last row runs past the end of the cache (sees all S slots)
    starts = [min(int(x), S - 1) for x in rng.integers(0, S - T, B)]
    if B > 1:
        starts[-1] = S - 2
    pos = jnp.asarray(np.asarray(starts)[:, None] + np.arange(T)[None], jnp.int32)
    for layer in (0, 1):
        for chunk in (0, 8):
            want = cached_attention(q, k_all, v_all, layer, pos, chunk)
            got = jax.jit(kernel_attention, static_argnums=5)(q, k_all, v_all, jnp.int32(layer), pos, chunk)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # slots beyond a row's position never matter
    k2 = k_all.at[:, :, :, int(pos.max()) + 1:].set(1e4) if int(pos.max()) + 1 < S else k_all
    np.testing.assert_allclose(kernel_attention(q, k2, v_all, jnp.int32(1), pos, 0),
                               kernel_attention(q, k_all, v_all, jnp.int32(1), pos, 0), rtol=0, atol=0)


def test_attention_kernel_rows_do_not_depend_on_the_other_rows():
    """A multi-threaded call with each head's rows split into parts gives every row bitwise
    the result of a one-row call at the same position."""
    rng = np.random.default_rng(7)
    L, B, T, Nkv, G, H, S = 2, 2, 8, 3, 4, 64, 700
    q = jnp.asarray(rng.standard_normal((B, T, Nkv, G, H), dtype=np.float32))
    k_all = jnp.asarray(rng.standard_normal((L, B, Nkv, S, H), dtype=np.float32))
    v_all = jnp.asarray(rng.standard_normal((L, B, Nkv, S, H), dtype=np.float32))
    pos = jnp.asarray(np.array([[600], [650]]) + np.arange(T)[None], jnp.int32)
    f = jax.jit(kernel_attention, static_argnums=5)
    full = np.asarray(f(q, k_all, v_all, jnp.int32(1), pos, 0))
    for b in range(B):
        for t in (0, 3, 7):
            one = f(q[b:b + 1, t:t + 1], k_all[:, b:b + 1], v_all[:, b:b + 1], jnp.int32(1), pos[b:b + 1, t:t + 1], 0)
            np.testing.assert_array_equal(np.asarray(one)[0, 0], full[b, t])


def test_attention_kernel_gradient_is_xlas():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, 3, 2, 2, 16), dtype=np.float32))
    kv = jnp.asarray(rng.standard_normal((1, 1, 2, 12, 16), dtype=np.float32))
    pos = jnp.asarray([[4, 5, 6]], jnp.int32)
    f = lambda q, k: jnp.sum(jnp.sin(kernel_attention(q, k, k, jnp.int32(0), pos, 0)))
    g = lambda q, k: jnp.sum(jnp.sin(cached_attention(q, k, k, 0, pos, 0)))
    for a, b in zip(jax.grad(f, argnums=(0, 1))(q, kv), jax.grad(g, argnums=(0, 1))(q, kv)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _naive_attention(q, k_all, v_all, layer, pos, window, scale, softcap):
    """float64 numpy: query at p sees slots p - window < s <= p."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k_all[layer], v_all[layer]))
    B, T, Nkv, G, H = q.shape
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            p = int(pos[b, t])
            vis = np.arange(k.shape[2])
            vis = vis[(vis <= p) & (vis > p - window)]
            s = np.einsum("kgh,ksh->kgs", q[b, t], k[b][:, vis]) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            e = np.exp(s - s.max(-1, keepdims=True))
            out[b, t] = np.einsum("kgs,ksh->kgh", e / e.sum(-1, keepdims=True), v[b][:, vis])
    return out


def test_attention_window_scale_softcap():
    """Sliding window (traced, as in the scanned layers), score scale and soft-capping: the
    kernel, the one-pass and the chunked XLA attention all equal a float64 reference, for
    rows at different positions; the kernel's gradient is XLA's."""
    rng = np.random.default_rng(3)
    L, B, T, Nkv, G, H, S = 2, 3, 4, 2, 2, 32, 60
    q = jnp.asarray(rng.standard_normal((B, T, Nkv, G, H), dtype=np.float32))
    k_all = jnp.asarray(rng.standard_normal((L, B, Nkv, S, H), dtype=np.float32))
    v_all = jnp.asarray(rng.standard_normal((L, B, Nkv, S, H), dtype=np.float32))
    pos = jnp.asarray(np.array([[0], [19], [50]]) + np.arange(T)[None], jnp.int32)
    for scale, softcap in ((None, 0.0), (0.3, 2.0)):
        run = jax.jit(lambda w: [cached_attention(q, k_all, v_all, 1, pos, c, w, scale, softcap) for c in (0, 8)]
                      + [kernel_attention(q, k_all, v_all, jnp.int32(1), pos, 0, w, scale, softcap)])
        for window in (1, 5, 16, 70):
            want = _naive_attention(q, k_all, v_all, 1, np.asarray(pos), window, scale or H ** -0.5, softcap)
            for got in run(jnp.int32(window)):
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    kw = dict(window=jnp.int32(5), scale=0.3, softcap=2.0)
    g1 = jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(kernel_attention(q, k_all, v_all, jnp.int32(1), pos, 0, **kw)))))
    g2 = jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(cached_attention(q, k_all, v_all, 1, pos, 0, **kw)))))
    np.testing.assert_allclose(g1(q), g2(q), rtol=1e-5, atol=1e-5)
