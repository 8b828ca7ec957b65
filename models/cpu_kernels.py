"""CPU kernels for XLA's CPU backend, called through the XLA FFI: a float32 matmul (fast for
small M), a cached attention and an RMSNorm.

Why they exist: XLA CPU runs a one-row matmul (a decode step) as a streaming
matrix-vector loop at memory bandwidth, but 2..9 rows (a speculative verification step) as a
packed GEMM that reads the weights more slowly, so a verification step cost markedly more than
a 1-token step although its extra FLOPs are small. ``models/kernels/small_matmul.cc`` streams
every weight matrix once for any ``M <= MAX_ROWS`` rows (see the comment at its top), so a
verification step of a few tokens costs little more than a 1-token step, and the 1-token step
itself is no slower than with XLA's dot. Above ``MAX_ROWS`` rows it switches to a path by
64-column panels and row blocks that does the same sums, element by element, so it serves
every M (prefill, large batches) with a row's result independent of M.

Weights may also stay in a GGUF file's blocks (:func:`block_matmul`: an int8 code per weight,
a float32 scale and offset per 32 input rows and column, 1.25 bytes per weight): the kernel
rebuilds each weight in registers with one fma, which for Q8_0, Q4_0 and Q4_1 gives the
float32 weight the loader would have made, bit for bit, and sums as for float32 weights, so
the results are the float32 path's bits at about a third of the bytes streamed. Codes of
0..15 (Q4_1) may be packed two per byte (:func:`pack_q4`, uint8 ``[..., K, N / 2]``; 0.75 bytes
per weight), rebuilt to the same weights.

Scanned layers keep their weights stacked ``[L, K, N]``; XLA would copy a layer's slice out
of the stack before every call of an opaque matmul (a dynamic slice feeding a custom call is
materialized), so the same kernel has a stacked handler (``specjax_small_matmul_stacked``,
:func:`small_matmul_stacked`) that takes the stack and the layer index and reads that
layer where it lies: a scanned decode step then streams each weight once, as an unrolled
one does.

``models/kernels/rms_norm.cc`` sums each row's squares in one fixed order: XLA's reduce
picks its order (and whether a multiply is contracted into its adds) from the whole shape,
so a row's norm, hence every later float, changed with the batch size.

``models/kernels/attention.cc`` does a layer's cached attention (all rows and heads) in
one call: XLA ran it as a loop of small ops per chunk of cache slots, whose dispatch cost,
not FLOPs, made attention a sizeable share of a 1-token step. A second handler of the same
code takes a draft tree's mask (the verification pass over a tree: visibility as
``models/llama.py:_tree_visible``).

Measurements (``scripts/bench_step.py`` with and without ``--cpu-kernels xla``, profiles,
the ``MAX_ROWS`` crossover) are in BENCHMARKS.md; they depend on the machine and go stale.

The kernels are compiled on first use with the system C++ compiler (``$CXX`` or ``g++``,
``-O3 -march=native``) against the FFI headers shipped in jaxlib, cached under
``$SPECJAX_KERNEL_CACHE`` (default ``~/.cache/specjax/kernels``) keyed by the source,
compiler, flags, jaxlib version and CPU flags (processes that need it at once build it once:
the others wait on a lock on that folder; the sources compile in parallel, one compiler
process each), and registered as the FFI targets ``specjax_small_matmul``,
``specjax_attention`` (and ``specjax_tree_attention``) and ``specjax_rms_norm``. Models choose them
at trace time (:func:`use_small_matmul`, :func:`use_attention`, :func:`use_rms_norm`):
``LlamaConfig.cpu_kernels`` =
``"auto"`` (default: a kernel where it applies and builds, else XLA with one warning),
``"kernel"`` (the same, but a failed build is an error) or ``"xla"`` (never). They apply
to float32 on the CPU backend of a single-device process outside any mesh (a custom call
is opaque to SPMD partitioning, so sharded runs keep XLA's ops); the matmul to any 2-D
``x[M, K] @ w[K, N]`` (N not a multiple of 64: zero columns are padded per call and cut).
Gradients go through ``custom_jvp`` rules that use XLA's ops, so training is unaffected.

Vector width: the kernels compute in 16-float vectors (GCC vector extensions), one AVX-512
register each. Where the CPU has no AVX-512 (AVX2: AMD Zen, many desktop Intel CPUs), GCC
keeps a 16-float generic vector on the stack and every operation goes through memory: the
matmul ran 3-6x slower than XLA's dot and a SmolLM2-135M decode step 1.9x slower (69 vs 36
ms on a 2-core AMD EPYC). There the hot loops (the matmul's register blocks, the attention's
scores, softmax and weighted sums, the RMSNorm's sum of squares) run in 8-float vectors,
each 16-float block as two halves with the same products and sums lane for lane, and the
register blocks are split to fit AVX2's 16 registers: the same bits as before, a decode step
in 33 ms (BENCHMARKS.md, "The CPU kernels on an AVX2 CPU"). The GGUF block kernel
(:func:`block_matmul`) rebuilds its weights the same way, 8 at a time with AVX2 and FMA
(before 2026-12-07 one by one there, and ``weight_blocks="auto"`` was off without
AVX-512; now it is on wherever :func:`blocks_vectorized` holds: BENCHMARKS.md, "GGUF block
weights on an AVX2 CPU"); with packed Q4 codes at 2-6 rows it runs one 16-column piece at a
time, each weight rebuilt once for every row, and 7-9 rows take two register groups
instead of one 9-row group, on AVX2 for both kernels (BENCHMARKS.md, "The packed block
kernel on AVX2 at 2-9 rows").

Numerics: each output element accumulates over K in an order that depends only on K, N and
the thread count (never on M or the other rows), so a row's result does not depend on the
batch it sits in (bit for bit, on a given machine); it differs from XLA's dot by float32
rounding only (~1e-6 relative). The same holds for the attention and RMSNorm kernels.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

MAX_ROWS = 64  # up to this M the matmul streams the weights once; above, its many-row path (same sums)
COL_MULTIPLE = 64
KERNEL_MODES = ("auto", "kernel", "xla")
TARGET_NAME = "specjax_small_matmul"
TARGET_F16 = "specjax_small_matmul_f16"  # float16 weights (float32 x and y)
STACKED_TARGET = "specjax_small_matmul_stacked"  # one layer of stacked w[L, K, N], read in place
STACKED_TARGET_F16 = "specjax_small_matmul_stacked_f16"
ATTENTION_TARGET = "specjax_attention"
TREE_ATTENTION_TARGET = "specjax_tree_attention"  # the same kernel with a draft tree's mask
RMS_NORM_TARGET = "specjax_rms_norm"
BLOCK_TARGET = "specjax_block_matmul"  # GGUF blocks: int8 codes, scale and offset per 32 rows
STACKED_BLOCK_TARGET = "specjax_block_matmul_stacked"
BLOCK_Q4_TARGET = "specjax_block_matmul_q4"  # the same with Q4 codes packed two per byte (pack_q4)
STACKED_BLOCK_Q4_TARGET = "specjax_block_matmul_q4_stacked"
BLOCK_ROWS = 32  # input rows per scale / offset
SOURCES = tuple(Path(__file__).resolve().parent / "kernels" / f
                for f in ("small_matmul.cc", "attention.cc", "rms_norm.cc"))
HEADERS = (Path(__file__).resolve().parent / "kernels" / "common.h",)  # part of the cache key
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")

_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.strip()
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def _has_f16c() -> bool:
    """The float16-weight matmul needs the F16C (or AVX-512) conversion instruction."""
    flags = _cpu_flags().split()
    return "f16c" in flags or "avx512f" in flags


def blocks_vectorized() -> bool:
    """Whether the GGUF block kernel rebuilds its weights in vector registers here: with
    AVX-512F (16 at a time: a conversion and an fma) or AVX2 and FMA (8 at a time). Where it
    does not (it then rebuilds them one by one) ``weight_blocks="auto"`` stays off."""
    flags = _cpu_flags().split()
    return "avx512f" in flags or ("avx2" in flags and "fma" in flags)


def compiler() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if c and shutil.which(c):
            return c
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("SPECJAX_KERNEL_CACHE", Path.home() / ".cache" / "specjax" / "kernels"))


@functools.lru_cache(maxsize=None)
def build_id(cxx: str) -> str:
    """What a kernel build is made of (sources, compiler, flags, jaxlib, CPU flags), hashed:
    the name of the cached library, and part of the key of measured round costs (a table
    measured with other kernels is not reused)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), repr(version).encode(), repr(CXX_FLAGS).encode(),
                 jax.__version__.encode(), importlib.metadata.version("jaxlib").encode(),
                 _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def kernels_id() -> str:
    """:func:`build_id` of the kernels this process would build ("" without a compiler);
    builds nothing."""
    cxx = compiler()
    if cxx is None or not all(src.exists() for src in (*SOURCES, *HEADERS)):
        return ""
    return build_id(cxx)


def compute_id(mode: str) -> str:
    """What of this module a model with ``cpu_kernels=mode`` runs through, for the key of
    measured costs: :func:`kernels_id` where the kernels may run (mode not "xla", CPU
    backend), else ""."""
    if mode == "xla" or jax.default_backend() != "cpu":
        return ""
    return kernels_id()


def build(force: bool = False) -> Path:
    """Compile the kernels (or find them in the cache) into one shared library; return its
    path. Raises RuntimeError with the compiler's output if they cannot be built."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++ or clang++) to build the CPU kernels")
    for src in (*SOURCES, *HEADERS):
        if not src.exists():
            raise RuntimeError(f"kernel source missing: {src}")
    include = jax.ffi.include_dir()
    out = cache_dir() / f"specjax_kernels-{build_id(cxx)}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _cache_locked(out.parent):
        # another process may have built it while this one waited (processes that start
        # together, such as the test suite's workers, build once, not once each)
        if out.exists() and not force:
            return out
        _compile(cxx, include, out)
    return out


@contextlib.contextmanager
def _cache_locked(folder: Path):
    """Hold an exclusive lock on the kernel cache folder (``flock`` on the folder itself, so
    no lock file is left behind) while one process builds; a no-op where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: concurrent builds stay possible (each atomic)
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _compile(cxx: str, include: str, out: Path) -> None:
    """Compile each source to an object file, all at once (one compiler process per
    source: on a 2-core AMD EPYC small_matmul.cc takes 10.9 s, the other two 7.7 s, so the
    build takes ~11 s of wall time instead of ~19 s), then link them into ``out``. The
    objects and the library are built in a temporary folder beside ``out`` and the
    library moved there whole, so that a failed or interrupted build (Ctrl-C while
    compiling) leaves nothing behind and stops every compiler it started."""
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=".build-"))
    flags = [f for f in CXX_FLAGS if f != "-shared"]
    procs = []
    try:
        objects = []
        for i, src in enumerate(SOURCES):
            obj = work / f"{i}-{src.stem}.o"
            cmd = [cxx, *flags, f"-I{include}", "-c", str(src), "-o", str(obj)]
            procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
            objects.append(str(obj))
        for cmd, p in procs:  # a failure stops the others (below)
            err = p.communicate()[1]
            if p.returncode != 0:
                raise RuntimeError(f"building the CPU kernels failed: {' '.join(cmd)}\n{err[-4000:]}")
        tmp = work / out.name
        cmd = [cxx, *CXX_FLAGS, *objects, "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"building the CPU kernels failed: {' '.join(cmd)}\n{r.stderr[-4000:]}")
        os.replace(tmp, out)  # atomic: concurrent processes see either nothing or the whole file
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _build_and_register() -> tuple:
    """Build, load and register the kernels once per process (memoized, failures too):
    ``(ok, reason, library)``; the library stays loaded through the cache."""
    try:
        path = build()
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(lib.SpecjaxSmallMatmul), platform="cpu")
        jax.ffi.register_ffi_target(TARGET_F16, jax.ffi.pycapsule(lib.SpecjaxSmallMatmulF16), platform="cpu")
        jax.ffi.register_ffi_target(STACKED_TARGET, jax.ffi.pycapsule(lib.SpecjaxSmallMatmulStacked), platform="cpu")
        jax.ffi.register_ffi_target(STACKED_TARGET_F16, jax.ffi.pycapsule(lib.SpecjaxSmallMatmulStackedF16),
                                    platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.SpecjaxAttention), platform="cpu")
        jax.ffi.register_ffi_target(TREE_ATTENTION_TARGET, jax.ffi.pycapsule(lib.SpecjaxTreeAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(RMS_NORM_TARGET, jax.ffi.pycapsule(lib.SpecjaxRmsNorm), platform="cpu")
        jax.ffi.register_ffi_target(BLOCK_TARGET, jax.ffi.pycapsule(lib.SpecjaxBlockMatmul), platform="cpu")
        jax.ffi.register_ffi_target(STACKED_BLOCK_TARGET, jax.ffi.pycapsule(lib.SpecjaxBlockMatmulStacked),
                                    platform="cpu")
        jax.ffi.register_ffi_target(BLOCK_Q4_TARGET, jax.ffi.pycapsule(lib.SpecjaxBlockMatmulQ4), platform="cpu")
        jax.ffi.register_ffi_target(STACKED_BLOCK_Q4_TARGET, jax.ffi.pycapsule(lib.SpecjaxBlockMatmulQ4Stacked),
                                    platform="cpu")
        return True, "", lib
    except Exception as e:  # reported by available() / the "kernel" mode, warned once in "auto"
        return False, f"{type(e).__name__}: {e}", None


def _ensure() -> tuple[bool, str]:
    with _lock:  # one build even when several threads trace at once
        ok, reason, _lib = _build_and_register()
    return ok, reason


def available() -> tuple[bool, str]:
    """(True, "") when the kernels are built and registered, else (False, why)."""
    return _ensure()


def _require():
    ok, reason = _ensure()
    if not ok:
        raise RuntimeError(f"specjax CPU kernels unavailable: {reason}")


def _raw(x: jax.Array, w: jax.Array) -> jax.Array:
    _require()
    target = TARGET_F16 if w.dtype == jnp.float16 else TARGET_NAME
    n = w.shape[1]
    pad = -n % COL_MULTIPLE  # the kernel takes whole 64-column units: zero columns, cut below
    if pad:
        w = jnp.pad(w, ((0, 0), (0, pad)))
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n + pad), jnp.float32),
                         vmap_method="sequential")(x, w)
    return y[:, :n] if pad else y


@jax.custom_jvp
def small_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x[M, K] @ w[K, N]`` in float32 with the FFI kernel (built and registered on first use);
    ``w`` float32, or float16 (widened to float32 in registers: the product of the float16
    values, accumulated in float32)."""
    return _raw(x, w)


@small_matmul.defjvp
def _small_matmul_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents  # instantiated (zeros where a primal has no tangent)
    return small_matmul(x, w), jnp.dot(dx, w) + jnp.dot(x, dw)


@jax.custom_jvp
def small_matmul_stacked(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
    """``x[M, K] @ w[layer]`` for stacked weights ``w[L, K, N]`` (scanned layers; N a multiple
    of 64) with the FFI kernel reading that layer where it lies, so the layer's slice is never
    copied out of the stack; the same sums as :func:`small_matmul` of the slice."""
    _require()
    target = STACKED_TARGET_F16 if w.dtype == jnp.float16 else STACKED_TARGET
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32),
                            vmap_method="sequential")(x, w, jnp.asarray(layer, jnp.int32))


@small_matmul_stacked.defjvp
def _small_matmul_stacked_jvp(primals, tangents):
    x, w, layer = primals
    dx, dw, _ = tangents  # the layer index is an integer: no tangent
    wl = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
    dwl = jax.lax.dynamic_index_in_dim(dw, layer, 0, keepdims=False)
    return small_matmul_stacked(x, w, layer), jnp.dot(dx, wl) + jnp.dot(x, dwl)


def use_small_matmul_stacked(mode: str, x: jax.Array, w: jax.Array) -> bool:
    """Trace-time choice for ``x[M, K] @ w[layer]`` with stacked ``w[L, K, N]``: as
    :func:`use_small_matmul`, and N a multiple of 64 (padding would copy the stack)."""
    return (w.ndim == 3 and w.shape[2] % COL_MULTIPLE == 0
            and use_small_matmul(mode, x, jax.ShapeDtypeStruct(w.shape[1:], w.dtype)))


PACK_GROUP = 32  # packed Q4 codes: columns per group (byte j: column j low, j + 16 high)


def packable_q4(code) -> bool:
    """Whether int8 codes ``[..., N]`` can be packed by :func:`pack_q4` (all in 0..15, N a
    multiple of 32)."""
    code = np.asarray(code)
    return (code.dtype == np.int8 and code.ndim >= 1 and code.size > 0 and code.shape[-1] % PACK_GROUP == 0
            and int(code.min()) >= 0 and int(code.max()) <= 15)


def pack_q4(code) -> np.ndarray:
    """int8 codes ``[..., N]`` of 0..15 (N a multiple of 32) as uint8 ``[..., N / 2]``: byte j
    of each 32-column group holds column j in its low and column j + 16 in its high nibble,
    so the kernel gets two weight vectors from one 16-byte load (numpy; see
    :func:`unpack_q4`)."""
    code = np.asarray(code)
    if not packable_q4(code):
        raise ValueError("pack_q4: expected int8 codes of 0..15 with the last axis a multiple of 32")
    g = code.reshape(code.shape[:-1] + (-1, 2, PACK_GROUP // 2)).astype(np.uint8)
    return np.ascontiguousarray(g[..., 0, :] | (g[..., 1, :] << 4)).reshape(code.shape[:-1] + (-1,))


def unpack_q4(packed):
    """The int8 codes ``[..., N]`` of :func:`pack_q4`'s uint8 ``[..., N / 2]`` (numpy in, numpy
    out; else a jax array)."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    g = packed.reshape(packed.shape[:-1] + (-1, PACK_GROUP // 2))
    both = xp.stack([g & 15, g >> 4], axis=-2)
    return both.astype(xp.int8).reshape(packed.shape[:-1] + (-1,))


def code_columns(code) -> int:
    """N of block codes ``[..., K, N]`` (int8) or ``[..., K, N / 2]`` (packed Q4, uint8)."""
    return code.shape[-1] * (2 if code.dtype == jnp.uint8 else 1)


def dequantize_blocks(code, scale, offset) -> jax.Array:
    """The float32 weights ``[..., K, N]`` of GGUF blocks (``code`` int8 ``[..., K, N]`` or
    packed Q4 uint8 ``[..., K, N / 2]``, ``scale`` and ``offset`` float32 ``[..., K / 32, N]``):
    ``code * scale + offset``, whose product is exact for Q8_0 / Q4_0 / Q4_1 blocks, so
    XLA's result (fused or not) is gguf's dequantized weight, bit for bit."""
    if code.dtype == jnp.uint8:
        code = unpack_q4(code)
    s = jnp.repeat(scale, BLOCK_ROWS, axis=-2)
    o = jnp.repeat(offset, BLOCK_ROWS, axis=-2)
    return code.astype(jnp.float32) * s + o


@jax.custom_jvp
def block_matmul(x: jax.Array, code: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
    """``x[M, K] @ W`` for GGUF block weights ``W = dequantize_blocks(code, scale, offset)``
    (``code[K, N]`` int8 or packed Q4 ``[K, N / 2]`` uint8, ``scale`` / ``offset`` ``[K / 32, N]``
    float32) with the FFI kernel, which rebuilds W in registers: the bits of
    :func:`small_matmul` with W in float32."""
    _require()
    packed = code.dtype == jnp.uint8
    n = code_columns(code)
    pad = -n % COL_MULTIPLE  # packed: N is a multiple of 32, so pad is too
    if pad:
        code = jnp.pad(code, ((0, 0), (0, pad // 2 if packed else pad)))
        scale, offset = (jnp.pad(a, ((0, 0), (0, pad))) for a in (scale, offset))
    y = jax.ffi.ffi_call(BLOCK_Q4_TARGET if packed else BLOCK_TARGET,
                         jax.ShapeDtypeStruct((x.shape[0], n + pad), jnp.float32),
                         vmap_method="sequential")(x, code, scale, offset)
    return y[:, :n] if pad else y


@block_matmul.defjvp
def _block_matmul_jvp(primals, tangents):
    x, code, scale, offset = primals
    dx = tangents[0]  # the weights are constants (integer codes)
    return block_matmul(x, code, scale, offset), jnp.dot(dx, dequantize_blocks(code, scale, offset))


@jax.custom_jvp
def block_matmul_stacked(x: jax.Array, code: jax.Array, scale: jax.Array, offset: jax.Array,
                         layer: jax.Array) -> jax.Array:
    """:func:`block_matmul` with layer ``layer`` of stacked blocks (``code[L, K, N]``, or
    packed ``[L, K, N / 2]``; ``scale`` / ``offset`` ``[L, K / 32, N]``; N a multiple of 64),
    read where it lies."""
    _require()
    target = STACKED_BLOCK_Q4_TARGET if code.dtype == jnp.uint8 else STACKED_BLOCK_TARGET
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], code_columns(code)), jnp.float32),
                            vmap_method="sequential")(x, code, scale, offset, jnp.asarray(layer, jnp.int32))


@block_matmul_stacked.defjvp
def _block_matmul_stacked_jvp(primals, tangents):
    x, code, scale, offset, layer = primals
    dx = tangents[0]
    w = dequantize_blocks(*(jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False) for a in (code, scale, offset)))
    return block_matmul_stacked(x, code, scale, offset, layer), jnp.dot(dx, w)


def use_block_matmul(mode: str, x: jax.Array, code: jax.Array) -> bool:
    """Trace-time choice for ``x[M, K]`` times GGUF blocks ``code[K, N]`` (or stacked
    ``code[L, K, N]``, then N a multiple of 64; packed Q4 codes: N / 2 columns): float32 ``x``,
    K a multiple of 32, and the kernels usable (else :func:`dequantize_blocks` and XLA's dot)."""
    _check_mode(mode)
    if (x.ndim != 2 or code.ndim not in (2, 3) or x.dtype != jnp.float32 or code.dtype not in (jnp.int8, jnp.uint8)
            or x.shape[1] != code.shape[-2] or code.shape[-2] % BLOCK_ROWS or x.shape[0] < 1):
        return False
    if code.ndim == 3 and code_columns(code) % COL_MULTIPLE:
        return False
    return _usable(mode)


@functools.lru_cache(maxsize=None)
def _warn_unavailable(reason: str) -> None:
    """Warn once per reason (memoized) that XLA's ops are used instead of the kernels."""
    warnings.warn(f"specjax: CPU kernels unavailable, using XLA's ops ({reason})", stacklevel=4)


def _check_mode(mode: str) -> None:
    if mode not in KERNEL_MODES:
        raise ValueError(f"cpu_kernels mode {mode!r}; expected one of {KERNEL_MODES}")


def _usable(mode: str) -> bool:
    """The checks shared by every kernel (after :func:`_check_mode`): the mode, backend,
    device count, mesh and build."""
    if mode == "xla":
        return False
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        return False
    ok, reason = _ensure()
    if not ok:
        if mode == "kernel":
            raise RuntimeError(f"LlamaConfig.cpu_kernels='kernel' but the kernels are unavailable: {reason}")
        _warn_unavailable(reason)
        return False
    return True


def use_small_matmul(mode: str, x: jax.Array, w: jax.Array) -> bool:
    """Trace-time choice for one 2-D matmul ``x[M, K] @ w[K, N]`` (see the module docs)."""
    _check_mode(mode)
    if (x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.float32 or w.dtype not in (jnp.float32, jnp.float16)
            or x.shape[1] != w.shape[0] or x.shape[0] < 1):
        return False
    if w.dtype == jnp.float16 and not _has_f16c():
        return False
    return _usable(mode)


def use_attention(mode: str, q: jax.Array, k_all: jax.Array) -> bool:
    """Trace-time choice for a layer's cached attention (float32 query and cache), causal or
    over a draft tree (the same conditions)."""
    _check_mode(mode)
    if q.dtype != jnp.float32 or k_all.dtype != jnp.float32 or q.ndim != 5 or k_all.ndim != 5:
        return False
    return _usable(mode)


def use_rms_norm(mode: str, x: jax.Array) -> bool:
    """Trace-time choice for an RMSNorm of float32 ``x`` over its last axis."""
    _check_mode(mode)
    if x.dtype != jnp.float32 or x.ndim < 1 or x.size == 0:
        return False
    return _usable(mode)


def rms_norm_raw(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """The RMSNorm kernel (no autodiff rule: models/llama.py wraps it in a custom_jvp):
    ``x / sqrt(mean(x ** 2, -1) + eps) * (offset + w)`` for float32 ``x`` [..., D] and
    ``w`` [D], each row summed in one fixed order (models/kernels/rms_norm.cc)."""
    _require()
    d = x.shape[-1]
    y = jax.ffi.ffi_call(RMS_NORM_TARGET, jax.ShapeDtypeStruct((x.size // d, d), jnp.float32),
                         vmap_method="sequential")(
        x.reshape(-1, d), jnp.asarray(w, jnp.float32), eps=np.float32(eps), offset=np.float32(offset))
    return y.reshape(x.shape)


def attention_raw(q, k_all, v_all, layer, positions, window=None, scale=None, softcap: float = 0.0,
                  tree=None) -> jax.Array:
    """The attention kernel (no autodiff rule: models/llama.py wraps it in a custom_jvp).
    q [B,T,Nkv,G,H], k_all/v_all [L,B,Nkv,S,H], layer int32[], positions int32[B,T];
    ``window`` int32[] (a query at p sees slots p - window < s <= p; None: no window),
    ``scale`` the score scale (None: H ** -0.5), ``softcap`` Gemma 2's score cap (0: off).
    ``tree``: ``(lengths int32[B], mask bool[B,T,W], region_depth int32[B,W])`` for tree
    attention instead of causal (visibility of ``models/llama.py:_tree_visible``: the prefix
    slots ``< lengths`` and the region slots ``lengths + w`` the mask names, each in the
    window by its position); None: causal."""
    _require()
    window = jnp.asarray(2 ** 30 if window is None else window, jnp.int32)
    attrs = dict(scale=np.float32(0.0 if scale is None else scale), softcap=np.float32(softcap))
    if tree is not None:
        lengths, mask, region_depth = tree
        return jax.ffi.ffi_call(TREE_ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                vmap_method="sequential")(
            q, k_all, v_all, jnp.asarray(layer, jnp.int32), jnp.asarray(positions, jnp.int32), window,
            jnp.asarray(lengths, jnp.int32), jnp.asarray(mask, bool), jnp.asarray(region_depth, jnp.int32), **attrs)
    return jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")(
        q, k_all, v_all, jnp.asarray(layer, jnp.int32), jnp.asarray(positions, jnp.int32), window, **attrs)
