"""Compile the engines' programs for an accelerator on a machine without one (an NVIDIA
H100/H200 or a Cloud TPU), and read what a decode step and a speculative round cost there.

    # GPU: JAX's CUDA plugin, in a venv of its own (V = the installed jax version)
    pip install --no-deps jax-cuda12-plugin==$V jax-cuda12-pjrt==$V
    python scripts/accel_aot.py --chip h200 [--target default] [--batches 1,16] [--ks 1,3]
    # TPU: libtpu (the version jax[tpu]==$V names), likewise
    pip install --no-deps "libtpu==0.0.42.*"
    python scripts/accel_aot.py --chip v5e --target llama3-1b-shape

XLA's compiler for the chip runs here without a device (``jax.experimental.topologies``:
compile-only devices, no driver), the models and programs are traced as on that backend
(``jax.default_backend()`` reads "gpu" or "tpu" while they are built: layer mode, XLA's own
matmuls, batch hints, reductions), and the optimized HLO is read with ``scripts/bench/hlo.py``:
per iteration of the decode loop, the operations that run as their own kernel, the host
syncs on a GPU (a ``conditional`` or a ``while`` without a known trip count each copy a
predicate to the host and wait; a TPU runs its control flow on the chip), the bytes the
kernels move, copies, the source of the kernels, and on a TPU the compiler's own estimate
of the cycles, and the arguments the program takes in another layout than the one an array
has by default: JAX copies such an argument to the program's layout on every call (on a
TPU the compiler chooses the weights' layouts; the GPU programs compiled here kept every default).

Not a timing: XLA cannot autotune without the device (GPU matmuls keep their default
configurations), may run runs of kernels as one CUDA graph, and a library call may launch
more than one kernel. What it shows for sure is the program's structure on the chip: how
many kernels and syncs a round costs against a step, and what the bytes are.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# NVIDIA chips as XLA's GPU compiler sees them (stream_executor.GpuTargetConfigProto): what
# it reads to choose fusions, tiles and launch shapes. Public figures of the SXM parts.
_HOPPER = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
               shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=132,
               fpus_per_core=128, block_dim_limit_x=2147483647, block_dim_limit_y=65535,
               block_dim_limit_z=65535, l2_cache_size=52428800, clock_rate_ghz=1.98,
               shared_memory_per_block_optin=232448, registers_per_core_limit=65536,
               registers_per_block_limit=65536)
CHIPS = {
    "h100": dict(platform="gpu", name="NVIDIA H100 80GB HBM3", memory_bandwidth=3_352_320_000_000,
                 device_memory_size=84_942_979_072),
    "h200": dict(platform="gpu", name="NVIDIA H200 141GB HBM3e", memory_bandwidth=4_800_000_000_000,
                 device_memory_size=151_397_597_184),
    # TPUs: libtpu's topology name and accelerator type (one chip of the smallest slice is
    # compiled for) and the public HBM bandwidth per chip
    "v4": dict(platform="tpu", name="TPU v4", topology="v4:2x2x1", accelerator="v4-8",
               memory_bandwidth=1_200_000_000_000),
    "v5e": dict(platform="tpu", name="TPU v5e", topology="v5e:2x2", accelerator="v5litepod-4",
                memory_bandwidth=819_000_000_000),
    "v5p": dict(platform="tpu", name="TPU v5p", topology="v5p:2x2x1", accelerator="v5p-8",
                memory_bandwidth=2_765_000_000_000),
    "v6e": dict(platform="tpu", name="TPU v6e", topology="v6e:2x2", accelerator="v6e-4",
                memory_bandwidth=1_640_000_000_000),
}
_GPU_FIELDS = ("name", "memory_bandwidth", "device_memory_size")


def target_config(chip: str) -> str:
    """The text of a GpuTargetConfigProto for GPU ``chip`` (compute capability 9.0)."""
    c = {**_HOPPER, **{k: CHIPS[chip][k] for k in _GPU_FIELDS}}
    fields = "\n".join(f"  {k}: {json.dumps(v) if isinstance(v, str) else v}" for k, v in c.items())
    return ("gpu_device_info {\n" + fields + "\n  cuda_compute_capability { major: 9 minor: 0 }\n}\n"
            'platform_name: "CUDA"\ndnn_version_info { major: 9 minor: 1 patch: 0 }\n'
            f'device_description_str: "{c["name"]}"\n')


def _aot_env(chip: str = "h200") -> None:
    """Before JAX starts its backends (it is imported lazily here): nothing runs on the
    accelerator, there is no CUDA runtime whose version to check, and libtpu is told which
    TPU it is for instead of asking the (absent) metadata server."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if CHIPS[chip]["platform"] == "tpu":
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several compile-only runs at once
        os.environ["TPU_ACCELERATOR_TYPE"] = CHIPS[chip]["accelerator"]


def _fail(message: str):
    """One line on stderr and exit status 2, before any work."""
    print(f"accel_aot.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def compile_device(chip: str):
    """A compile-only device of ``chip``; exits 2 with the reason if its compiler (JAX's
    CUDA plugin, libtpu) is missing or cannot describe one."""
    _aot_env(chip)
    import jax

    v = jax.__version__
    tpu = CHIPS[chip]["platform"] == "tpu"
    if tpu and importlib.util.find_spec("libtpu") is None:
        _fail(f'libtpu is not installed: pip install --no-deps "libtpu==<the version jax[tpu]=={v} names>"')
    if not tpu and (importlib.util.find_spec("jax_plugins") is None
                    or importlib.util.find_spec("jax_plugins.xla_cuda12") is None):
        _fail(f"the CUDA plugin is not installed: pip install --no-deps jax-cuda12-plugin=={v} "
              f"jax-cuda12-pjrt=={v}")
    from jax.experimental import topologies

    try:
        if tpu:
            topo = topologies.get_topology_desc(CHIPS[chip]["topology"], "tpu")
        else:
            topo = topologies.get_topology_desc("aot", "cuda", target_config=target_config(chip),
                                                topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - one line, whatever the plugin raised
        _fail(f"no compile-only {chip} device: {str(e).splitlines()[0]}")
    return topo.devices[0]


@contextlib.contextmanager
def traced_as(platform: str):
    """Build and trace the models and programs as they are on a ``platform`` backend."""
    import jax

    with mock.patch.object(jax, "default_backend", lambda: platform):
        yield


GATE_UP = {"auto": "auto", "first": True, "fused": False}  # --gate-up -> LlamaConfig.gate_up_first
QKV = {"auto": "auto", "last": True, "fused": False}  # --qkv -> LlamaConfig.qkv_input_last
WO = {"auto": "auto", "flat": True, "heads": False}  # --wo -> LlamaConfig.wo_flat


def abstract_on(tree, device):
    """``tree``'s arrays as ShapeDtypeStructs placed on ``device``."""
    import jax

    s = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                        if hasattr(a, "shape") else a, tree)


def build_target(spec: str, dtype: str, scan_layers="auto", **layouts):
    """(target, draft or "lookup", name): the GGUF's SmolLM2 with the shipped EAGLE head, or
    a preset's shape with abstract (unallocated) weights and prompt lookup. ``layouts``: the
    LlamaConfig fields of the weights' layouts (``gate_up_first``, ``qkv_input_last``,
    ``wo_flat``; "auto" where not given)."""
    from specjax.build import abstract_model, load_target, resolve_draft

    if spec == "default":
        target, _, _ = load_target("default", param_dtype=dtype, with_tokenizer=False,
                                   scan_layers=scan_layers, **layouts)
        draft, _ = resolve_draft("default", target)
        return target, draft, target.config.name
    from specjax.models import LlamaLM
    from specjax.models.config import load_preset

    layers = {} if scan_layers == "auto" else dict(scan_layers=scan_layers)  # the preset's own
    pre = load_preset(spec, param_dtype=dtype, dtype=dtype, **layouts, **layers)
    graphdef, state = abstract_model(pre.config)
    return LlamaLM(pre.config, graphdef, state), "lookup", pre.name


def compile_program(eng, device, prompts, **kw):
    """The compiled ``generate`` program of ``eng`` for these prompts and settings, for
    ``device`` (its arguments made abstract; else as ``eng.lower``); returns (compiled,
    seconds)."""
    args, static = eng._call_args(eng.prepare(prompts, **kw))
    t0 = time.perf_counter()
    with eng._context():
        exe = eng._run.lower(*abstract_on(args, device), **static).compile()
    return exe, time.perf_counter() - t0


def read(exe, bandwidth: float, top: int) -> tuple[dict, str]:
    """The loops of a compiled program (the decode loop first) as a dict for the report,
    and the program's text."""
    from scripts.bench import hlo

    text = exe.as_text()
    mod = hlo.parse(text)
    lp = hlo.main_loop(mod)
    mem = exe.memory_analysis()
    out = dict(temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0) or 0), relayout_bytes=relaid_out(exe),
               loops=[dict(name=x.name, depth=x.depth, trip_count=x.trip_count,
                           kernels=x.per_iteration.kernels, kernels_least=x.least.kernels,
                           syncs=x.per_iteration.syncs, syncs_least=x.least.syncs,
                           bytes=x.per_iteration.bytes, cycles=x.per_iteration.cycles)
                      for x in hlo.loops(mod)])
    if lp is not None:
        t = lp.per_iteration
        out.update(kernels=t.kernels, kernels_least=lp.least.kernels, syncs=t.syncs,
                   syncs_least=lp.least.syncs, bytes=t.bytes, copies=t.copies,
                   copy_bytes=t.copy_bytes, roofline_us=1e6 * t.bytes / bandwidth,
                   cycles=t.cycles, cycles_least=lp.least.cycles,
                   by_kind=dict(t.by_kind.most_common()),
                   by_source=dict(t.by_source.most_common(top)))
    return out, text


def relaid_out(exe) -> int:
    """Bytes of the arguments that the compiled program takes in another layout than an
    array's default (major-to-minor): JAX copies each of them to that layout on every call
    (``jax._src.array._array_shard_arg``), outside the program and its loop."""
    import jax

    total = 0
    for fmt, aval in zip(jax.tree.leaves(exe.input_formats), jax.tree.leaves(exe.in_avals)):
        layout = getattr(fmt, "layout", None)
        if layout is not None and tuple(layout.major_to_minor) != tuple(range(len(aval.shape))):
            total += aval.size * aval.dtype.itemsize
    return total


def _range(lo, hi) -> str:
    return f"{hi}" if lo == hi else f"{lo}-{hi}"


def print_result(r: dict, platform: str) -> None:
    tpu = platform == "tpu"
    cost = (f"{_range(r.get('cycles_least'), r.get('cycles'))} estimated cycles" if tpu else
            f"{_range(r.get('syncs_least'), r.get('syncs'))} syncs")
    top_p = f" top-p={r['top_p']:g}" if r.get("top_p", 1.0) < 1 else ""
    print(f"{r['engine']:>14} b={r['batch']:<3} T={r['temperature']:g}{top_p} hints={int(r['hints'])}: "
          f"{_range(r.get('kernels_least'), r.get('kernels'))} {'ops' if tpu else 'kernels'}, {cost} "
          f"per iteration, {r.get('bytes', 0) / 1e6:.1f} MB ({r.get('roofline_us', 0):.0f} us at the roof), "
          f"copies {r.get('copies')} ({r.get('copy_bytes', 0) / 1e6:.2f} MB); temp "
          f"{r['temp_bytes'] / 1e6:.1f} MB, relaid out per call {r['relayout_bytes'] / 1e6:.1f} MB [compiled in {r['compile_s']:.0f} s]")
    for lp in r["loops"][1:] if len(r["loops"]) > 1 else []:
        trips = "?" if lp["trip_count"] is None else lp["trip_count"]
        extra = f"{lp['cycles']} cycles" if tpu else f"{_range(lp['syncs_least'], lp['syncs'])} syncs"
        print(f"{'':16}loop {lp['name']} (depth {lp['depth']}, {trips} trips): "
              f"{_range(lp['kernels_least'], lp['kernels'])} {'ops' if tpu else 'kernels'}, {extra} per iteration")
    print(f"{'':16}kinds: " + ", ".join(f"{k} {v}" for k, v in r.get("by_kind", {}).items()))
    print(f"{'':16}from: " + ", ".join(f"{k} {v}" for k, v in r.get("by_source", {}).items()), flush=True)


def _parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chip", choices=sorted(CHIPS) + ["local"], default="h200",
                    help="the chip to compile for ('local': this machine's first device, compiled "
                         "as it runs, autotuned)")
    ap.add_argument("--target", default="default",
                    help="'default' (SmolLM2-135M + the shipped EAGLE head) or a model preset "
                         "(e.g. llama3-8b-shape: abstract weights, prompt lookup)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", default="auto", choices=["auto", "scan", "unroll"],
                    help="layer mode (auto: what the library picks on the chip's backend)")
    ap.add_argument("--gate-up", default="auto", choices=sorted(GATE_UP),
                    help="the gate/up weight's layout: [2, D, F] (first), [D, 2, F] (fused) or "
                         "the backend's (auto: first on TPU)")
    ap.add_argument("--qkv", default="auto", choices=sorted(QKV),
                    help="the q/k/v weight's layout: [Nkv, G+2, H, D] (last), [D, Nkv, G+2, H] "
                         "(fused) or the backend's (auto: last on TPU)")
    ap.add_argument("--wo", default="auto", choices=sorted(WO),
                    help="the output projection's layout: [N*H, D] (flat), [N, H, D] (heads) or "
                         "the backend's (auto: flat on TPU)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--ks", default="1,3", help="fixed K of the speculative engines ('' for none)")
    ap.add_argument("--auto", action="store_true", help="also k=auto")
    ap.add_argument("--tree", action="store_true", help="also the default draft tree (method 'tree')")
    ap.add_argument("--tree-nodes", type=int, default=0,
                    help="with --tree: sampled rounds draw the N-node positional tree (TreeSpec.sampled_nodes)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="top-p of the sampled rows (the CLI's default is 0.9; 1: off)")
    ap.add_argument("--hints", default="auto", choices=["auto", "on", "off", "both"],
                    help="batch hints (auto: the backend's default, on for a GPU)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=12, help="sources listed per program")
    ap.add_argument("--json", default=None, help="write every result here")
    ap.add_argument("--hlo-dir", default=None, help="write each compiled HLO text here")
    return ap


def local_chip():
    """(the first local device, its entry of CHIPS or a stand-in): ``--chip local`` reads the
    programs as this machine's accelerator compiles them (with autotuning), to check what the
    compile-only reading says against the device's own compile and a profile."""
    import jax

    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "") or ""
    names = {"H200": "h200", "H100": "h100", "v5 lite": "v5e", "v6 lite": "v6e", "TPU v5": "v5p", "TPU v4": "v4"}
    chip = next((CHIPS[c] for k, c in names.items() if k in kind), None)
    return dev, dict(chip or dict(name=kind or dev.platform, memory_bandwidth=0),
                     platform=dev.platform, name=f"{kind or dev.platform} (this machine)")


def main(argv=None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",")]
        ks = [int(x) for x in a.ks.split(",") if x.strip()]
        temps = [float(x) for x in a.temperatures.split(",")]
    except ValueError as e:
        ap.error(f"bad list: {e}")
    if any(b < 1 for b in batches) or any(k < 1 for k in ks):
        ap.error("batches and K must be >= 1")
    if not 0 < a.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.chip == "local":
        device, chip = local_chip()
    else:
        chip = CHIPS[a.chip]
        device = compile_device(a.chip)
    import numpy as np

    from specjax import sampling
    from specjax.build import TreeSpec, clear_engines, make_autoregressive_engine, make_engine
    from specjax.engine import resolve_batch_hints

    results = []
    layers = {"auto": "auto", "scan": True, "unroll": False}[a.layers]
    traced = contextlib.nullcontext() if a.chip == "local" else traced_as(chip["platform"])
    with traced:
        hints = {"auto": ["1" if resolve_batch_hints(None) else "0"], "on": ["1"], "off": ["0"],
                 "both": ["0", "1"]}[a.hints]
        target, draft, name = build_target(a.target, a.dtype, layers, gate_up_first=GATE_UP[a.gate_up],
                                           qkv_input_last=QKV[a.qkv], wo_flat=WO[a.wo])
        mode = "scanned" if target.config.scan_layers else "unrolled"
        gate_up = "[2, D, F]" if target.config.gate_up_first else "[D, 2, F]"
        qkv = "[Nkv, G+2, H, D]" if target.config.qkv_input_last else "[D, Nkv, G+2, H]"
        wo = "[N*H, D]" if target.config.wo_flat else "[N, H, D]"
        how = "" if a.chip == "local" else " (compile-only)"
        print(f"# {name} ({a.dtype}, {mode} layers, gate/up {gate_up}, q/k/v {qkv}, o {wo}) on {chip['name']}{how}, "
              f"prompt {a.prompt_len} tokens, {a.max_new_tokens} new", flush=True)
        rng = np.random.default_rng(0)
        engines = [("autoregressive", lambda: make_autoregressive_engine(target))]
        engines += [(f"K={k}", lambda k=k: make_engine(target, draft, k)) for k in ks]
        if a.auto:
            engines.append(("k=auto", lambda: make_engine(target, draft, "auto")))
        if a.tree:
            spec = TreeSpec(sampled_nodes=a.tree_nodes) if a.tree_nodes else None
            name = f"tree-{a.tree_nodes}" if a.tree_nodes else "tree"
            engines.append((name, lambda: make_engine(target, draft, method="tree", tree=spec)))
        for h in hints:
            os.environ["SPECJAX_BATCH_HINTS"] = h
            clear_engines()  # an engine reads the switch when it is made
            for b in batches:
                prompts = [list(map(int, rng.integers(3, target.vocab_size, a.prompt_len)))
                           for _ in range(b)]
                for t in temps:
                    top_p = a.top_p if t else 1.0
                    sp = sampling.SamplingParams.create(b, temperature=t, top_p=top_p)
                    for label, make in engines:
                        eng = make()
                        exe, secs = compile_program(eng, device, prompts, seed=0, sampling_params=sp,
                                                    max_new_tokens=a.max_new_tokens)
                        info, text = read(exe, chip["memory_bandwidth"] or float("inf"), a.top)
                        r = dict(engine=label, batch=b, temperature=t, top_p=top_p, hints=h == "1",
                                 compile_s=round(secs, 1), **info)
                        results.append(r)
                        print_result(r, chip["platform"])
                        if a.hlo_dir:
                            os.makedirs(a.hlo_dir, exist_ok=True)
                            fn = f"{label.replace('=', '')}_b{b}_t{t:g}_h{h}.hlo"
                            with open(os.path.join(a.hlo_dir, fn), "w") as f:
                                f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(chip=a.chip, target=name, dtype=a.dtype, layers=mode, gate_up=gate_up, qkv=qkv, wo=wo, results=results), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
