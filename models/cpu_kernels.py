"""A small-M float32 matmul for XLA's CPU backend, called through the XLA FFI.

Why it exists (measured with ``scripts/bench_step.py``): XLA CPU runs a one-row matmul
(a decode step) as a streaming matrix-vector loop at memory bandwidth, but 2..9 rows (a
speculative verification step) as a packed GEMM that reads the weights much slower, so a
5-token step of SmolLM2-135M cost ~1.5x a 1-token step although its extra FLOPs are
small. ``models/kernels/small_matmul.cc`` streams every weight matrix once for any
``M <= MAX_ROWS`` rows (see the comment at its top), which brings the 5-token step to
~1.2x of the 1-token step and makes the 1-token step itself no slower.

The kernel is compiled on first use with the system C++ compiler (``$CXX`` or ``g++``,
``-O3 -march=native``) against the FFI headers shipped in jaxlib, cached under
``$SPECJAX_KERNEL_CACHE`` (default ``~/.cache/specjax/kernels``) keyed by the source,
compiler, flags, jaxlib version and CPU flags, and registered as the FFI target
``specjax_small_matmul``. Models choose it per matmul at trace time
(:func:`use_small_matmul`): ``LlamaConfig.matmul`` = ``"auto"`` (default: the kernel where
it applies and builds, else XLA with one warning), ``"kernel"`` (the same, but a failed
build is an error) or ``"xla"`` (never). It applies to float32 ``x[M, K] @ w[K, N]`` with
``M <= MAX_ROWS`` and ``N % 64 == 0`` on the CPU backend of a single-device process
outside any mesh (a custom call is opaque to SPMD partitioning, so sharded runs keep
XLA's dot). Gradients go through :func:`small_matmul`'s ``custom_jvp`` rule, which uses
XLA's dot, so training is unaffected.

Numerics: each output element accumulates over K in an order that depends only on K and
the thread count (never on M or the other rows), so a row's result does not depend on the
batch it sits in; it differs from XLA's dot by float32 rounding only (~1e-6 relative).
"""
from __future__ import annotations

import ctypes
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

MAX_ROWS = 64  # the kernel serves x[M, K] with M <= MAX_ROWS (measured crossover: BENCHMARKS.md)
COL_MULTIPLE = 64
MATMUL_MODES = ("auto", "kernel", "xla")
TARGET_NAME = "specjax_small_matmul"
SOURCE = Path(__file__).resolve().parent / "kernels" / "small_matmul.cc"
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "reason": str, "path": str


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


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if c and shutil.which(c):
            return c
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("SPECJAX_KERNEL_CACHE", Path.home() / ".cache" / "specjax" / "kernels"))


def build(force: bool = False) -> Path:
    """Compile the kernel (or find it in the cache) and return the shared library's path.
    Raises RuntimeError with the compiler's output if it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++ or clang++) to build the small-M matmul kernel")
    if not SOURCE.exists():
        raise RuntimeError(f"kernel source missing: {SOURCE}")
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr(version).encode(), repr(CXX_FLAGS).encode(),
                 jax.__version__.encode(), importlib.metadata.version("jaxlib").encode(),
                 _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    out = cache_dir() / f"small_matmul-{h.hexdigest()[:16]}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *CXX_FLAGS, f"-I{include}", str(SOURCE), "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building the small-M matmul kernel failed: {' '.join(cmd)}\n{r.stderr[-4000:]}")
    os.replace(tmp, out)  # atomic: concurrent processes see either nothing or the whole file
    return out


def _ensure() -> tuple[bool, str]:
    with _lock:
        if "ok" in _state:
            return _state["ok"], _state["reason"]
        try:
            path = build()
            lib = ctypes.cdll.LoadLibrary(str(path))
            jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(lib.SpecjaxSmallMatmul), platform="cpu")
            _state.update(ok=True, reason="", path=str(path), lib=lib)
        except Exception as e:  # reported by available() / the "kernel" mode, warned once in "auto"
            _state.update(ok=False, reason=f"{type(e).__name__}: {e}")
        return _state["ok"], _state["reason"]


def available() -> tuple[bool, str]:
    """(True, "") when the kernel is built and registered, else (False, why)."""
    return _ensure()


def _raw(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
                            vmap_method="sequential")(x, w)


@jax.custom_jvp
def small_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x[M, K] @ w[K, N]`` in float32 with the FFI kernel (call :func:`available` first)."""
    return _raw(x, w)


@small_matmul.defjvp
def _small_matmul_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    y = small_matmul(x, w)
    dy = jnp.zeros_like(y)
    if not isinstance(dx, jax.custom_derivatives.SymbolicZero) and dx is not None:
        dy = dy + jnp.dot(dx, w)
    if not isinstance(dw, jax.custom_derivatives.SymbolicZero) and dw is not None:
        dy = dy + jnp.dot(x, dw)
    return y, dy


_warned = False


def use_small_matmul(mode: str, x: jax.Array, w: jax.Array) -> bool:
    """Trace-time choice for one 2-D matmul ``x[M, K] @ w[K, N]`` (see the module docs)."""
    global _warned
    if mode == "xla":
        return False
    if mode not in MATMUL_MODES:
        raise ValueError(f"matmul mode {mode!r}; expected one of {MATMUL_MODES}")
    if (x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.float32 or w.dtype != jnp.float32
            or x.shape[0] > MAX_ROWS or w.shape[1] % COL_MULTIPLE or x.shape[1] != w.shape[0]):
        return False
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        return False
    ok, reason = _ensure()
    if not ok:
        if mode == "kernel":
            raise RuntimeError(f"LlamaConfig.matmul='kernel' but the kernel is unavailable: {reason}")
        if not _warned:
            _warned = True
            warnings.warn(f"specjax: small-M matmul kernel unavailable, using XLA's dot ({reason})", stacklevel=2)
        return False
    return True


def describe() -> str:
    ok, reason = _ensure()
    return f"small_matmul kernel: {'ok ' + _state.get('path', '') if ok else 'unavailable: ' + reason}"
