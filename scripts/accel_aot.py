"""Compile the engines' programs for an NVIDIA GPU on a machine without one, and read
what a decode step and a speculative round launch there.

    pip install --no-deps jax-cuda12-plugin==$(python -c "import jax; print(jax.__version__)") \\
        jax-cuda12-pjrt==$(python -c "import jax; print(jax.__version__)")   # in a venv of its own
    python scripts/gpu_aot.py [--chip h200] [--target default] [--batches 1,16] [--ks 1,3]

XLA's GPU compiler runs here without a device: the CUDA plugin compiles for a described
chip (``jax.experimental.topologies``, no driver needed), the programs are traced as on a
GPU (``jax.default_backend()`` reads "gpu" while they are built: unrolled layers, XLA's
own matmuls, batch hints, one-kernel reductions), and the optimized HLO is read with
``scripts/bench/hlo.py``: per iteration of the decode loop, the kernels launched, the host
syncs (a ``conditional`` or a ``while`` without a known trip count each copy a predicate to
the host and wait), the bytes the kernels name, copies, and the source of the kernels.

Not a timing: XLA cannot autotune without the device (matmuls keep their default
configurations), may run runs of kernels as one CUDA graph, and a library call may launch
more than one kernel. What it shows for sure is the program's structure on a GPU: how
many launches and syncs a round costs against a step, and what the bytes are.
"""
from __future__ import annotations

import os

import argparse
import contextlib
import importlib.util
import json
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# chips as XLA's GPU compiler sees them (stream_executor.GpuTargetConfigProto): what it
# reads to choose fusions, tiles and launch shapes. Public figures of the SXM parts.
CHIPS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory_bandwidth=3_352_320_000_000,
                 device_memory_size=84_942_979_072),
    "h200": dict(name="NVIDIA H200 141GB HBM3e", memory_bandwidth=4_800_000_000_000,
                 device_memory_size=151_397_597_184),
}
_HOPPER = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
               shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=132,
               fpus_per_core=128, block_dim_limit_x=2147483647, block_dim_limit_y=65535,
               block_dim_limit_z=65535, l2_cache_size=52428800, clock_rate_ghz=1.98,
               shared_memory_per_block_optin=232448, registers_per_core_limit=65536,
               registers_per_block_limit=65536)


def target_config(chip: str) -> str:
    """The text of a GpuTargetConfigProto for ``chip`` (compute capability 9.0)."""
    c = {**_HOPPER, **CHIPS[chip]}
    fields = "\n".join(f"  {k}: {json.dumps(v) if isinstance(v, str) else v}" for k, v in c.items())
    return ("gpu_device_info {\n" + fields + "\n  cuda_compute_capability { major: 9 minor: 0 }\n}\n"
            'platform_name: "CUDA"\ndnn_version_info { major: 9 minor: 1 patch: 0 }\n'
            f'device_description_str: "{c["name"]}"\n')


def _aot_env() -> None:
    """Before JAX starts its backends (it is imported lazily here): the CUDA plugin only
    compiles, nothing runs on a GPU, and there is no CUDA runtime whose version to check."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def gpu_device(chip: str):
    """A compile-only CUDA device for ``chip``; SystemExit(2) with the reason if the CUDA
    plugin is missing or cannot describe one."""
    _aot_env()
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        import jax

        v = jax.__version__
        raise SystemExit(f"error: the CUDA plugin is not installed: pip install --no-deps "
                         f"jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc("aot", "cuda", target_config=target_config(chip),
                                            topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - one line, whatever the plugin raised
        raise SystemExit(f"error: no compile-only CUDA device: {str(e).splitlines()[0]}")
    return topo.devices[0]


@contextlib.contextmanager
def traced_as_gpu():
    """Build and trace the models and programs as they are on a GPU backend."""
    import jax

    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        yield


def abstract_on(tree, device):
    """``tree``'s arrays as ShapeDtypeStructs placed on ``device``."""
    import jax

    s = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                        if hasattr(a, "shape") else a, tree)


def build_target(spec: str, dtype: str, scan_layers: bool = False):
    """(target, draft or "lookup", name): the GGUF's SmolLM2 with the shipped EAGLE head, or
    a preset's shape with abstract (unallocated) weights and prompt lookup."""
    from specjax.build import abstract_model, load_target, resolve_draft

    if spec == "default":
        target, _, _ = load_target("default", param_dtype=dtype, with_tokenizer=False,
                                   scan_layers=scan_layers)
        draft, _ = resolve_draft("default", target)
        return target, draft, target.config.name
    from specjax.models import LlamaLM
    from specjax.models.config import load_preset

    pre = load_preset(spec, param_dtype=dtype, dtype=dtype, scan_layers=scan_layers)
    graphdef, state = abstract_model(pre.config)
    return LlamaLM(pre.config, graphdef, state), "lookup", pre.name


def compile_program(eng, device, prompts, **kw):
    """The compiled ``generate`` program of ``eng`` for these prompts and settings, for
    ``device`` (its arguments made abstract); returns (compiled, seconds)."""
    args, static = eng._call_args(eng.prepare(prompts, **kw), **(
        {"greedy": kw.pop("greedy")} if "greedy" in kw else {}))
    t0 = time.perf_counter()
    with eng._context():
        exe = eng._run.lower(*abstract_on(args, device), **static).compile()
    return exe, time.perf_counter() - t0


def read(exe, bandwidth: float, top: int) -> dict:
    """The loops of a compiled program (the decode loop first), as a dict for the report."""
    from scripts.bench import hlo

    text = exe.as_text()
    mod = hlo.parse(text)
    lp = hlo.main_loop(mod)
    mem = exe.memory_analysis()
    out = dict(temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0) or 0),
               loops=[dict(name=x.name, depth=x.depth, trip_count=x.trip_count,
                           kernels=x.per_iteration.kernels, kernels_least=x.least.kernels,
                           syncs=x.per_iteration.syncs, syncs_least=x.least.syncs,
                           bytes=x.per_iteration.bytes)
                      for x in hlo.loops(mod)])
    if lp is not None:
        t = lp.per_iteration
        out.update(kernels=t.kernels, kernels_least=lp.least.kernels, syncs=t.syncs,
                   syncs_least=lp.least.syncs, bytes=t.bytes, copies=t.copies,
                   copy_bytes=t.copy_bytes, roofline_us=1e6 * t.bytes / bandwidth,
                   by_kind=dict(t.by_kind.most_common()),
                   by_source=dict(t.by_source.most_common(top)))
    return out, text


def _range(lo, hi) -> str:
    return f"{hi}" if lo == hi else f"{lo}-{hi}"


def print_result(r: dict) -> None:
    print(f"{r['engine']:>14} b={r['batch']:<3} T={r['temperature']:g} hints={int(r['hints'])}: "
          f"{_range(r.get('kernels_least'), r.get('kernels'))} kernels, "
          f"{_range(r.get('syncs_least'), r.get('syncs'))} syncs per iteration, "
          f"{r.get('bytes', 0) / 1e6:.1f} MB ({r.get('roofline_us', 0):.0f} us at the roof), copies "
          f"{r.get('copies')} ({r.get('copy_bytes', 0) / 1e6:.2f} MB); temp {r['temp_bytes'] / 1e6:.1f} MB "
          f"[compiled in {r['compile_s']:.0f} s]")
    for lp in r["loops"][1:] if len(r["loops"]) > 1 else []:
        trips = "?" if lp["trip_count"] is None else lp["trip_count"]
        print(f"{'':16}loop {lp['name']} (depth {lp['depth']}, {trips} trips): "
              f"{_range(lp['kernels_least'], lp['kernels'])} kernels, "
              f"{_range(lp['syncs_least'], lp['syncs'])} syncs per iteration")
    print(f"{'':16}kinds: " + ", ".join(f"{k} {v}" for k, v in r.get("by_kind", {}).items()))
    print(f"{'':16}from: " + ", ".join(f"{k} {v}" for k, v in r.get("by_source", {}).items()), flush=True)


def _parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chip", choices=sorted(CHIPS), default="h200")
    ap.add_argument("--target", default="default",
                    help="'default' (SmolLM2-135M + the shipped EAGLE head) or a model preset "
                         "(e.g. llama3-8b-shape: abstract weights, prompt lookup)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--scan-layers", action="store_true",
                    help="layers in a scan (as on TPU) instead of unrolled (the GPU default)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--ks", default="1,3", help="fixed K of the speculative engines ('' for none)")
    ap.add_argument("--auto", action="store_true", help="also k=auto")
    ap.add_argument("--tree", action="store_true", help="also the default draft tree (method 'tree')")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--hints", default="on", choices=["on", "off", "both"],
                    help="batch hints (the GPU default is on)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=12, help="sources listed per program")
    ap.add_argument("--json", default=None, help="write every result here")
    ap.add_argument("--hlo-dir", default=None, help="write each compiled HLO text here")
    return ap


def main(argv=None) -> int:
    _aot_env()
    a = _parser().parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",")]
        ks = [int(x) for x in a.ks.split(",") if x.strip()]
        temps = [float(x) for x in a.temperatures.split(",")]
    except ValueError as e:
        raise SystemExit(f"error: bad list: {e}")
    if any(b < 1 for b in batches) or any(k < 1 for k in ks):
        raise SystemExit("error: batches and K must be >= 1")
    device = gpu_device(a.chip)
    bw = CHIPS[a.chip]["memory_bandwidth"]
    import numpy as np

    from specjax import sampling
    from specjax.build import make_autoregressive_engine, make_engine

    results = []
    hints = {"on": ["1"], "off": ["0"], "both": ["0", "1"]}[a.hints]
    with traced_as_gpu():
        target, draft, name = build_target(a.target, a.dtype, a.scan_layers)
        print(f"# {name} ({a.dtype}, {'scanned' if a.scan_layers else 'unrolled'}) on {CHIPS[a.chip]['name']} (compile-only), "
              f"prompt {a.prompt_len} tokens, {a.max_new_tokens} new", flush=True)
        rng = np.random.default_rng(0)
        engines = [("autoregressive", lambda: make_autoregressive_engine(target))]
        engines += [(f"K={k}", lambda k=k: make_engine(target, draft, k)) for k in ks]
        if a.auto:
            engines.append(("k=auto", lambda: make_engine(target, draft, "auto")))
        if a.tree:
            engines.append(("tree", lambda: make_engine(target, draft, method="tree")))
        for h in hints:
            os.environ["SPECJAX_BATCH_HINTS"] = h
            for b in batches:
                prompts = [list(map(int, rng.integers(3, target.vocab_size, a.prompt_len)))
                           for _ in range(b)]
                for t in temps:
                    sp = sampling.SamplingParams.create(b, temperature=t)
                    for label, make in engines:
                        eng = make()
                        exe, secs = compile_program(eng, device, prompts, seed=0, sampling_params=sp,
                                                    max_new_tokens=a.max_new_tokens)
                        info, text = read(exe, bw, a.top)
                        r = dict(engine=label, batch=b, temperature=t, hints=h == "1",
                                 compile_s=round(secs, 1), **info)
                        results.append(r)
                        print_result(r)
                        if a.hlo_dir:
                            os.makedirs(a.hlo_dir, exist_ok=True)
                            fn = f"{label.replace('=', '')}_b{b}_t{t:g}_h{h}.hlo"
                            with open(os.path.join(a.hlo_dir, fn), "w") as f:
                                f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(chip=a.chip, target=name, dtype=a.dtype, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
