"""Adaptive speculation length and continuous batching, measured (issue 15).

    python scripts/bench_schedule.py                       # both parts, SmolLM2 + shipped head
    python scripts/bench_schedule.py --skip-dataset --batches 1,4

Part 1, the grid: for each batch size, plain autoregressive decoding, speculative decoding
with fixed K and with ``k="auto"`` (one engine each, compiled first; ``auto`` measures its
round costs then, once per batch size), then ``--repeats`` interleaved timed passes per
temperature over the rows of ``configs/bench/prompts.txt`` (stop tokens off, every row
makes ``--max-new`` tokens, as in ``scripts/benchmark.py``). Speedup = autoregressive
median time / the setting's median time.

Part 2, a dataset run: the 64 prompts of ``configs/bench/dataset_prompts.txt`` (written
apart from the training prompts, many styles) with stop tokens on (natural lengths, up to
``--dataset-max-new``), ``--dataset-batch`` slots: the same engines in fixed batches
(``generate`` on consecutive chunks, rows keyed by dataset index) and with continuous
batching (``generate_dataset``), once with every slot to the end and once with the tail
compacted (``compact=True``, every tail size built ahead: once no prompt is left, the
running rows move to fewer slots).
Reported: wall time per generated token, loop iterations, slot iterations (slots x
iterations, summed over the batch sizes a run went through), tokens per slot iteration
against the rows' own tokens per round (their ratio), and whether every mode gave the
same tokens (fixed K and autoregressive: they must). ``--dataset-settings`` and
``--dataset-modes`` pick engines and modes; ``--dataset-repeats N`` times every one N times,
interleaved, and reports the median (and the range).

Prints a Markdown report and writes it with every figure to ``--out`` (JSON + .md).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench.config import DATASET_PROMPTS, build_dataset_prompts, read_prompts  # noqa: E402
from scripts.bench.dataset import MODES, SETTINGS, DatasetSpec, markdown, run_dataset  # noqa: E402
from specjax import build, sampling  # noqa: E402
from specjax.engine import cost_file, resolve_batch_hints  # noqa: E402


def _csv(typ):
    return lambda s: tuple(typ(x) for x in s.split(",") if x.strip())


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def grid(a, target, draft, tok, lines):
    rows = []
    prompts_all = [tok.encode_user(t) for t in read_prompts("configs/bench/prompts.txt")]
    for b in a.batches:
        ids = [prompts_all[i % len(prompts_all)] for i in range(b)]
        engines = {"autoregressive": build.make_autoregressive_engine(target)}
        for k in a.ks:
            engines[f"K={k}"] = build.make_engine(target, draft, k)
        engines["K=auto"] = build.make_engine(target, draft, "auto")
        for t in a.temps:
            sp = sampling.SamplingConfig(temperature=t, top_p=a.top_p)
            kw = dict(seed=0, sampling_params=sp, max_new_tokens=a.max_new)
            for name, eng in engines.items():
                t0 = time.perf_counter()
                extra = dict(greedy=t == 0) if name == "autoregressive" else {}
                eng.compile(ids, **kw, **extra)
                if name == "K=auto" and t == a.temps[0]:
                    lines.append(f"batch {b}: K=auto costs (ms per round drafting 0..K tokens): "
                                 + ", ".join(f"{1e3 * c:.1f}" for c in eng.costs_for(b))
                                 + f" (compile + measuring {time.perf_counter() - t0:.0f} s)")
            times = {n: [] for n in engines}
            info = {}
            for r in range(a.repeats):
                for name, eng in engines.items():
                    extra = dict(greedy=t == 0) if name == "autoregressive" else {}
                    out, dt = _timed(lambda: eng.generate(ids, **kw, **extra))
                    times[name].append(dt)
                    if out.stats is not None:
                        n = sum(len(x) for x in out.tokens)
                        info[name] = dict(tokens_per_round=n / sum(s.rounds for s in out.stats),
                                          k_rounds=np.asarray(out.raw["k_rounds"]).tolist(),
                                          switches=int(out.raw["switches"]))
            base = float(np.median(times["autoregressive"]))
            for name in engines:
                med = float(np.median(times[name]))
                rows.append(dict(batch=b, temperature=t, top_p=a.top_p, setting=name, seconds=med,
                                 tok_s=b * a.max_new / med, speedup=base / med, **info.get(name, {})))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=_csv(int), default=(1, 4, 16))
    ap.add_argument("--temps", type=_csv(float), default=(0.0, 1.0))
    ap.add_argument("--ks", type=_csv(int), default=(2, 3))
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="top-p of the grid's sampled rows (1: off; the CLI's default is 0.9)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dataset-prompts", type=int, default=64)
    ap.add_argument("--dataset-batch", type=int, default=16)
    ap.add_argument("--dataset-max-new", type=int, default=128)
    ap.add_argument("--dataset-k", type=int, default=3)
    ap.add_argument("--dataset-ladder", type=_csv(int), default=(),
                    help="also run the dataset with these tail sizes (generate_dataset(compact=[...]))")
    ap.add_argument("--dataset-tail-costs", type=_csv(int), default=(4, 1),
                    help="batch sizes whose k=auto cost table is measured first (if not saved); "
                         "a tail size without one borrows the next larger size's")
    ap.add_argument("--dataset-temperature", type=float, default=0.7)
    ap.add_argument("--dataset-top-p", type=float, default=0.9)
    ap.add_argument("--dataset-settings", type=_csv(str), default=SETTINGS,
                    help="engines of the dataset run: ar (autoregressive), k (--dataset-k), auto")
    ap.add_argument("--dataset-modes", type=_csv(str), default=tuple(MODES),
                    help="fixed (fixed batches), all (continuous, every slot to the end), tail (continuous, "
                         "tail compacted)")
    ap.add_argument("--dataset-repeats", type=int, default=1,
                    help="timed runs of every setting and mode, interleaved (the median is reported)")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--skip-dataset", action="store_true")
    ap.add_argument("--out", default="out/bench_schedule")
    a = ap.parse_args()
    try:
        spec = DatasetSpec(batch=a.dataset_batch, max_new_tokens=a.dataset_max_new, temperature=a.dataset_temperature,
                           top_p=a.dataset_top_p, k=a.dataset_k, settings=a.dataset_settings, modes=a.dataset_modes,
                           repeats=a.dataset_repeats, ladder=a.dataset_ladder, tail_costs=a.dataset_tail_costs)
    except ValueError as e:
        ap.error(str(e))
    if not 0 < a.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {a.top_p}")
    target, tok, _ = build.load_target("default")
    draft, _ = build.resolve_draft("default", target)
    hints = resolve_batch_hints()  # the engines' (build.make_engine leaves it to the backend / env)
    device = jax.devices()[0].device_kind
    lines = [f"command: `python {shlex.join(['scripts/bench_schedule.py'] + sys.argv[1:])}`",
             f"cost file: {cost_file()}", f"device: {device}; batch hints: {'on' if hints else 'off'}; "
             f"sync-free forms: {'on' if sampling.sync_free() else 'off'}"]
    out = {"grid": [], "dataset": [], "device": device, "batch_hints": hints}
    if not a.skip_grid:
        out["grid"] = grid(a, target, draft, tok, lines)
    if not a.skip_dataset:
        ids, stop = build_dataset_prompts(DATASET_PROMPTS, a.dataset_prompts, tok, target.vocab_size)
        out["dataset"] = run_dataset(spec, target, draft, ids, stop)
    md = lines + [""]
    if out["grid"]:
        md += ["| batch | T | setting | s (median) | tok/s | speedup | tok/round | rounds by draft tokens | branches entered |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in out["grid"]:
            md.append(f"| {r['batch']} | {r['temperature']:g} | {r['setting']} | {r['seconds']:.2f} | "
                      f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {r.get('tokens_per_round', float('nan')):.2f} | "
                      f"{r.get('k_rounds', '')} | {r.get('switches', '')} |")
        md.append("")
    md += markdown(out["dataset"])
    text = "\n".join(md)
    print(text)
    p = Path(a.out)
    p.mkdir(parents=True, exist_ok=True)
    (p / "bench_schedule.md").write_text(text + "\n")
    for r in out["dataset"]:
        r.pop("tokens_list", None)
    (p / "bench_schedule.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
