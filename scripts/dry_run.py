"""Dry run of a pod config on FAKE devices: mesh, abstract params, AOT compile, memory.

    python scripts/dry_run.py llama3-70b_v5p-64            # configs/pods/<name>.yaml
    python scripts/dry_run.py path/to/pod.yaml --devices 32 --batch 16 --no-compile

Nothing is allocated for the models: parameters are ``jax.eval_shape`` structures with
the shardings the rules give; the whole speculative ``generate`` program (prefill + the
``lax.while_loop`` of rounds) is lowered and compiled for the mesh on N fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set here before jax is
imported). The report gives, per device: parameters, KV caches, and XLA's memory
analysis of the compiled program (arguments, outputs, temporaries). CPU-compiled
temporaries are indicative only: the TPU compiler fuses and schedules differently.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path



def _parser():
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("pod", help="configs/pods/<name>.yaml stem or a path")
    ap.add_argument("--devices", type=int, default=None, help="fake devices (default: the pod's)")
    ap.add_argument("--data", type=int, default=None, help="override mesh.data")
    ap.add_argument("--model", type=int, default=None, help="override mesh.model")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--method", choices=["token", "block", "greedy"], default=None)
    ap.add_argument("--no-compile", action="store_true", help="lower only (no XLA compile)")
    ap.add_argument("--hlo-out", default=None, help="write the compiled (or lowered) HLO here")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def _gib(n):
    return n / 2 ** 30


def _human(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:9.2f} {unit}"
    return f"{n:9d} B"


def _cpu_upcast_bytes(hlo_text: str, param_trees) -> int:
    """Bytes of f32 arrays in the compiled program shaped like a bf16 weight's shard.

    XLA:CPU has no bf16 matmul: it converts bf16 weights to f32 and hoists the converts
    out of the loops, so the CPU temporaries hold an f32 copy of (most) weights that a TPU
    program does not. A heuristic: each bf16 parameter shard whose f32 twin appears in the
    HLO is counted once."""
    import re

    import jax
    import numpy as np

    shapes = set(re.findall(r"\bf32\[([0-9,]+)\]", hlo_text))
    total = 0
    for tree in param_trees:
        for x in jax.tree.leaves(tree):
            if np.dtype(x.dtype).name != "bfloat16":
                continue
            shard = x.sharding.shard_shape(tuple(x.shape))
            if ",".join(map(str, shard)) in shapes:
                total += int(np.prod(shard)) * 4
    return total


def main(argv=None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    from specjax.cli import check_counts

    check_counts(ap, a, ("devices", "data", "model", "batch", "prompt_len", "max_new_tokens", "k"))
    if a.hlo_out is not None and (Path(a.hlo_out).is_dir() or not Path(a.hlo_out).resolve().parent.is_dir()):
        ap.error(f"--hlo-out {a.hlo_out}: not a file in an existing folder")
    from specjax.configs import load_config  # imports no jax: the device count must be fixed first

    raw, path = load_config(a.pod, "pods", what="pod config")
    n_dev = a.devices or int((raw.get("hardware") or {}).get("devices", 8))
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n_dev}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import dataclasses

    import jax
    import numpy as np

    from specjax.models.llama import LlamaLM
    from specjax import build, engine, sampling
    from specjax import sharding as S
    from specjax.drafts import DraftModelProposer, PromptLookupProposer

    if len(jax.devices()) < n_dev:
        raise SystemExit(f"jax sees {len(jax.devices())} devices, wanted {n_dev} (was jax imported "
                         "before XLA_FLAGS was set?)")
    pod = build.load_pod_config(path)
    g = pod.generate
    g = dataclasses.replace(g, **{k: v for k, v in dict(
        batch=a.batch, prompt_len=a.prompt_len, max_new_tokens=a.max_new_tokens, k=a.k,
        method=a.method).items() if v is not None})
    over = {k: v for k, v in dict(data=a.data, model=a.model).items() if v is not None}
    plan = S.make_plan(pod.sharding, devices=jax.devices()[:n_dev], **over)
    t0 = time.time()

    def abstract(preset, role):
        graphdef, state = build.abstract_model(preset.config)
        shardings = S.param_shardings(state, plan, role)
        state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                             state, shardings)
        return LlamaLM(preset.config, graphdef, state)

    target = abstract(pod.target, "target")
    if pod.draft == "lookup":
        draft, proposer = None, PromptLookupProposer(vocab_size=target.vocab_size, k=g.k)
    else:
        draft = abstract(pod.draft, "draft")
        proposer = DraftModelProposer(draft, g.k)
    t_abstract = time.time() - t0

    eng = engine.SpeculativeEngine(target, proposer, g.method, sharding=plan)
    prompts = np.ones((g.batch, g.prompt_len), np.int32)
    sp = sampling.SamplingConfig(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
    t0 = time.time()
    lowered = eng.lower(prompts, seed=0, sampling_params=sp, max_new_tokens=g.max_new_tokens)
    t_lower = time.time() - t0
    # the buffers the engine sizes
    b_pad = -(-g.batch // plan.data_size) * plan.data_size
    cache_len = engine.cache_len_for(g.prompt_len, g.max_new_tokens, g.k)

    mem = {
        "target_params": S.tree_bytes_per_device(target.params),
        "draft_params": 0 if draft is None else S.tree_bytes_per_device(draft.params),
        "target_kv_cache": S.cache_bytes_per_device(pod.target.config, b_pad, cache_len, plan, "target"),
        "draft_kv_cache": 0 if draft is None else S.cache_bytes_per_device(
            pod.draft.config, b_pad, cache_len, plan, "draft"),
    }
    mem["total_params_and_caches"] = sum(mem.values())
    compiled_mem = None
    t_compile = None
    hlo = None
    if not a.no_compile:
        t0 = time.time()
        compiled = lowered.compile()
        t_compile = time.time() - t0
        try:
            ma = compiled.memory_analysis()
        except Exception as e:  # not every backend reports it
            ma = None
            compiled_mem = {"error": repr(e)}
        if ma is not None:
            compiled_mem = {k: int(getattr(ma, k)) for k in (
                "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                "temp_size_in_bytes", "generated_code_size_in_bytes") if hasattr(ma, k)}
            compiled_mem["peak_estimate_in_bytes"] = (
                compiled_mem.get("argument_size_in_bytes", 0) + compiled_mem.get("output_size_in_bytes", 0)
                - compiled_mem.get("alias_size_in_bytes", 0) + compiled_mem.get("temp_size_in_bytes", 0))
        hlo = compiled.as_text()
        if compiled_mem is not None and "temp_size_in_bytes" in compiled_mem:
            up = _cpu_upcast_bytes(hlo, [m.params for m in (target, draft) if m is not None])
            compiled_mem["cpu_f32_copies_of_bf16_weights_in_bytes"] = up
            compiled_mem["peak_estimate_without_cpu_upcasts_in_bytes"] = (
                compiled_mem["peak_estimate_in_bytes"] - up)
        if not a.hlo_out:
            hlo = None
    elif a.hlo_out:
        hlo = lowered.as_text()
    if hlo is not None:
        Path(a.hlo_out).write_text(hlo)

    n_params = {"target": pod.target.config.num_params(),
                "draft": 0 if draft is None else pod.draft.config.num_params()}
    report = {
        "pod": pod.name,
        "accelerator": pod.accelerator,
        "devices": n_dev,
        "mesh": dict(plan.mesh.shape),
        "rules": {"target": plan.config.target.as_dict(), "draft": plan.config.draft.as_dict()},
        "generate": dataclasses.asdict(g),
        "cache_len": cache_len,
        "batch_padded": b_pad,
        "num_params": n_params,
        "per_device_bytes": mem,
        "compiled_memory_per_device": compiled_mem,
        "hbm_gib_per_device": pod.hbm_gib_per_device,
        "replicated_fallbacks": sorted(plan.fallbacks.values()),
        "seconds": {"abstract": round(t_abstract, 2), "lower": round(t_lower, 2),
                    "compile": None if t_compile is None else round(t_compile, 2)},
    }
    if a.json:
        print(json.dumps(report))
        return 0
    print(f"pod {pod.name} ({pod.accelerator}): {n_dev} fake devices, mesh "
          f"data={plan.data_size} x model={plan.model_size}")
    print(f"  target {n_params['target'] / 1e9:.2f} B params, draft {n_params['draft'] / 1e9:.2f} B; "
          f"batch {g.batch} (padded {b_pad}), prompt {g.prompt_len}, max_new {g.max_new_tokens}, "
          f"K={g.k}, {g.method}; cache slots {cache_len}")
    for f in report["replicated_fallbacks"]:
        print(f"  note: {f}")
    print("  per device:")
    for k, v in mem.items():
        print(f"    {k:44s} {_human(v)}")
    if compiled_mem:
        print("  compiled program, per device (XLA memory analysis, CPU compiler):")
        for k, v in compiled_mem.items():
            print(f"    {k:44s} {_human(v)}" if isinstance(v, int) else f"    {k}: {v}")
    if pod.hbm_gib_per_device:
        cm = compiled_mem or {}
        peak = max(mem["total_params_and_caches"],
                   cm.get("peak_estimate_without_cpu_upcasts_in_bytes",
                          cm.get("peak_estimate_in_bytes", 0)) or 0)
        print(f"  HBM per device {pod.hbm_gib_per_device} GiB; estimated use {_gib(peak):.2f} GiB "
              f"({100 * _gib(peak) / pod.hbm_gib_per_device:.0f}%)")
    print(f"  time: abstract params {t_abstract:.1f}s, lower {t_lower:.1f}s, "
          f"compile {'-' if t_compile is None else f'{t_compile:.1f}s'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
