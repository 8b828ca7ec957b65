"""Compare builds of the matmul kernel in one process (a benchmark, not a test).

    python scripts/bench_matmul_builds.py --rev HEAD~1 [--rev HEAD] [--ms 1,7,10,12,16,17,32] [--rounds 9] [--blocks]

Each ``--rev`` is a git revision of ``models/kernels/small_matmul.cc`` (``.`` for the working
tree, or the path of a ``.cc`` file: a variant; the default compares HEAD with the working
tree). Every source is built with the
project's flags (``cpu_kernels.CXX_FLAGS``, the ``common.h`` of the working tree) into a
temporary folder and registered as its own FFI target, so all builds run in the same
process and are timed alternately, round by round: a shared machine's slow spells then
hit every build alike (timing them in separate processes on 2 shared cores moved the
numbers by up to 30%).

The workload: the matmuls of one float32 SmolLM2-135M step as the model runs them (30
layers of fused qkv, o, fused gate-up and down with their shapes, then the 576 x 49,152 LM
head; random weights, distinct per layer, so they stream from memory as in a real step) for
M rows, in one jitted call. (Until 2026-12-05 the script timed q, k, v, gate and up apart:
``--unfused``.)
Prints, per M, each build's median ms and its median ratio to the first build's time in
the same round, and checks that every build gives the first one's bits. ``--blocks``: the
same matmuls from GGUF blocks (``SpecjaxBlockMatmul``: random Q4_1-like codes 0..15 with
float16-valued scales and offsets per 32 inputs, as the loader keeps the default model's
layers), the block kernel's builds compared instead. ``--packed``: with ``--blocks``, each
build twice, the layer matrices' codes as int8 and packed two per byte (``pack_q4``, as the
loader keeps Q4_1 layers; the Q8_0 head stays int8), e.g. ``--rev . --blocks --packed``.
``--f16``: the same matmuls with float16 weights (``SpecjaxSmallMatmulF16``, as the shipped
draft head keeps its weights).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "models/kernels/small_matmul.cc"
# SmolLM2-135M's layer matrices ([in, out]) and its tied LM head
LAYER_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # wqkv, wo, w_gate_up, w_down
UNFUSED_SHAPES = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))
HEAD_SHAPE = (576, 49152)


def source_at(rev: str) -> str:
    if rev == ".":
        return (ROOT / SOURCE).read_text()
    if rev.endswith(".cc") and os.path.isfile(rev):  # a variant kept outside the repository
        return Path(rev).read_text()
    r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{SOURCE}"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_matmul_builds: no {SOURCE} at {rev!r}: {r.stderr.strip()}")
    return r.stdout


def build(rev: str, i: int, out: Path, handler: str = "SpecjaxSmallMatmul", packed: bool = False) -> str:
    """Build the kernel at ``rev`` and register its ``handler`` as target ``bench_mm_<i>``
    (``packed``: also its packed Q4 handler, ``handler + "Q4"``, as ``bench_mm_<i>_q4``)."""
    from specjax.models import cpu_kernels as ck

    cxx = ck.compiler()
    if cxx is None:
        raise SystemExit("bench_matmul_builds: no C++ compiler")
    src = out / f"small_matmul_{i}.cc"
    src.write_text(source_at(rev))
    (out / "common.h").write_text((ROOT / "models/kernels/common.h").read_text())
    lib = out / f"small_matmul_{i}.so"
    r = subprocess.run([cxx, *ck.CXX_FLAGS, f"-I{jax.ffi.include_dir()}", str(src), "-o", str(lib)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_matmul_builds: building {rev} failed:\n{r.stderr[-3000:]}")
    name = f"bench_mm_{i}"
    handle = ctypes.cdll.LoadLibrary(str(lib))
    handlers = {name: handler, **({f"{name}_q4": handler + "Q4"} if packed else {})}
    for target, h in handlers.items():
        if not hasattr(handle, h):
            raise SystemExit(f"bench_matmul_builds: the kernel at {rev} has no {h}")
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, h)), platform="cpu")
    return name


def step_matmuls(target: str, m: int):
    """One jitted call: every matmul of a step for ``m`` rows through FFI target ``target``
    (blocks whose codes are packed Q4, uint8, through the same build's ``target + "_q4"``)."""

    @jax.jit
    def f(x, ws):
        outs = []
        for w in ws:  # a float32 matrix, or GGUF blocks (code, scale, offset)
            k, n = (w[0] if isinstance(w, tuple) else w).shape
            t = target
            if isinstance(w, tuple) and w[0].dtype == jnp.uint8:
                n, t = 2 * n, target + "_q4"
            xi = x if k == x.shape[1] else jnp.tile(x, (1, k // x.shape[1] + 1))[:, :k]
            args = w if isinstance(w, tuple) else (w,)
            y = jax.ffi.ffi_call(t, jax.ShapeDtypeStruct((m, n), jnp.float32))(xi, *args)
            outs.append(y[:, :8])
        return jnp.concatenate(outs, axis=1)

    return f


def main(argv=None):
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", action="append", help="git revision of the kernel source, or '.' (repeatable)")
    ap.add_argument("--ms", default="1,7,10,12,16,17,32", help="row counts M")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--blocks", action="store_true", help="the GGUF block kernel (Q4_1-like blocks)")
    ap.add_argument("--unfused", action="store_true", help="q, k, v, gate, up as separate matmuls")
    ap.add_argument("--packed", action="store_true",
                    help="with --blocks: each build with int8 and with packed Q4 layer codes")
    ap.add_argument("--f16", action="store_true", help="float16 weights (the float16 kernel)")
    args = ap.parse_args(argv)
    revs = args.rev or ["HEAD", "."]
    if args.packed and not args.blocks:
        ap.error("--packed needs --blocks")
    if args.f16 and args.blocks:
        ap.error("--f16 and --blocks exclude each other")
    from scripts.bench_auto_ab import _ints

    ms = _ints(ap, "--ms", args.ms)
    if args.rounds < 1:
        ap.error("--rounds takes a positive number")
    if jax.default_backend() != "cpu":
        raise SystemExit("bench_matmul_builds: the kernels are for the CPU backend")

    rng = np.random.default_rng(0)

    def weights(shape):
        if not args.blocks:
            w = rng.standard_normal(shape, dtype=np.float32) * 0.02
            return jnp.asarray(w.astype(np.float16) if args.f16 else w)
        k, n = shape
        code = rng.integers(0, 16, shape).astype(np.int8)
        scale, offset = (rng.standard_normal((2, k // 32, n)) * 0.002).astype(np.float16).astype(np.float32)
        return jnp.asarray(code), jnp.asarray(scale), jnp.asarray(offset)

    ws = [weights(s) for _ in range(30) for s in (UNFUSED_SHAPES if args.unfused else LAYER_SHAPES)]
    head = weights(HEAD_SHAPE)
    handler = "SpecjaxBlockMatmul" if args.blocks else "SpecjaxSmallMatmulF16" if args.f16 else "SpecjaxSmallMatmul"
    layer_sets = {"": ws}  # the runs of each build: its weights (by name suffix)
    if args.packed:
        from specjax.models.cpu_kernels import pack_q4

        layer_sets[" packed"] = [(jnp.asarray(pack_q4(np.asarray(c))), s, o) for c, s, o in ws]
    with tempfile.TemporaryDirectory(prefix="specjax-mm-builds-") as tmp:
        targets = [build(rev, i, Path(tmp), handler, args.packed) for i, rev in enumerate(revs)]
        # (name, target, weights) timed side by side
        runs = [(rev + sfx, t, w + [head]) for rev, t in zip(revs, targets) for sfx, w in layer_sets.items()]
        names = [r[0] for r in runs]
        print(f"builds: {', '.join(names)} (ratios to {names[0]}, same round)", flush=True)
        for m in ms:
            x = jnp.asarray(rng.standard_normal((m, 576), dtype=np.float32))
            fs = [step_matmuls(t, m) for _, t, _ in runs]
            wl = [w for _, _, w in runs]
            ref = np.asarray(fs[0](x, wl[0]))
            for rev, f, w in zip(names[1:], fs[1:], wl[1:]):
                if not np.array_equal(np.asarray(f(x, w)), ref):
                    raise SystemExit(f"bench_matmul_builds: {rev} gives other bits than {names[0]} at M={m}")
            times = np.zeros((args.rounds, len(fs)))
            for r in range(args.rounds):
                for j, (f, w) in enumerate(zip(fs, wl)):
                    t0 = time.perf_counter()
                    f(x, w).block_until_ready()
                    times[r, j] = time.perf_counter() - t0
            cells = [f"{rev}: {np.median(times[:, j]) * 1e3:7.2f} ms (x{np.median(times[:, j] / times[:, 0]):.2f})"
                     for j, rev in enumerate(names)]
            print(f"M={m:3d}  " + "  ".join(cells) + ("  (same bits)" if len(fs) > 1 else ""), flush=True)


if __name__ == "__main__":
    main()
