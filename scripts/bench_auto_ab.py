"""k=auto against autoregressive decoding at one batch size, quickly (issue 15).

    python scripts/bench_auto_ab.py --batches 16,4 [--temps 0,1] [--max-new 48] [--fresh-costs]
        [--ks 2,3] [--groups 1]

For each batch size: the adaptive engine's cost table (measured now with ``--fresh-costs``,
into a temporary cache directory, else read or measured as ``generate`` would), then per
temperature the autoregressive engine, k=auto and the ``--ks`` fixed-K engines (for "within
5% of the best fixed K") on the same rows of ``configs/bench/prompts.txt`` (no stop
tokens): after a warm-up call each, ``--passes`` passes that time every engine once, in
turn; a speedup is the median over passes of the pass's autoregressive time over the
engine's (a slow spell of a shared machine, often seconds long, then hits an engine and its
reference alike; timing each engine's calls in a block moved ratios by up to 25%). Times
printed are medians. ``--groups G``: each timed call runs G batches of different prompts
one after another (at batch 1, one prompt is a poor sample of the text).
``k{K}_table_speedup``: what the cost table predicts for the fixed-K engine (the prefill,
timed as a one-token autoregressive call, plus its loop iterations at the table's cost),
beside what it measured: how far the table k=auto decides by is off.
A smaller, faster check than ``scripts/bench_schedule.py``'s grid.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PROMPTS = os.path.join(REPO, "configs", "bench", "prompts.txt")


def _ints(ap, flag, text, allow_empty=False) -> list:
    """Comma-separated integers >= 1 (``allow_empty``: "" is no values)."""
    parts = [x.strip() for x in text.split(",")] if text.strip() else []
    try:
        out = [int(x) for x in parts]
    except ValueError:
        out = None
    if out is None or any(x < 1 for x in out) or not (out or allow_empty):
        ap.error(f"{flag}: expected comma-separated integers >= 1, got {text!r}")
    return out


def _temps(ap, text) -> list:
    """Comma-separated finite temperatures >= 0."""
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        out = None
    if not out or not all(math.isfinite(t) and t >= 0 for t in out):
        ap.error(f"--temps: expected comma-separated finite temperatures >= 0, got {text!r}")
    from specjax.sampling import SamplingConfig

    for t in out:  # the engines' own checks (e.g. float32's range)
        try:
            SamplingConfig(temperature=t)
        except ValueError as e:
            ap.error(f"--temps {t}: {str(e).splitlines()[0]}")
    return out


def main(argv=None) -> int:
    from specjax.cli import OneLineParser

    ap = OneLineParser(prog="bench_auto_ab.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,4")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--prompts", default=None,
                    help="prompts, one a line, '#' lines comments (default: configs/bench/prompts.txt in the "
                         "repository; a relative path given here is from the current directory)")
    ap.add_argument("--fresh-costs", action="store_true", help="measure the cost tables anew (temporary cache)")
    ap.add_argument("--ks", default="", help="fixed K values to time as well, e.g. 2,3")
    ap.add_argument("--groups", type=int, default=1, help="batches of different prompts per timed call")
    ap.add_argument("--passes", type=int, default=7, help="timed passes over all engines")
    ap.add_argument("--float-weights", action="store_true",
                    help="the target's GGUF blocks dequantized to float32 (weight_blocks=False), as before")
    a = ap.parse_args(argv)
    if a.passes < 1 or a.groups < 1 or a.max_new < 1:
        ap.error("--passes, --groups and --max-new must be >= 1")
    batches, ks, temps = _ints(ap, "--batches", a.batches), _ints(ap, "--ks", a.ks, True), _temps(ap, a.temps)
    a.prompts = DEFAULT_PROMPTS if a.prompts is None else os.path.abspath(a.prompts)
    from specjax.configs import read_prompt_file

    try:
        texts = read_prompt_file(a.prompts)
    except ValueError as e:
        ap.error(f"--prompts {e}")
    from specjax import build
    from specjax.cli import default_target_metadata

    # the longest prompt against the target's context, from its metadata (before loading)
    meta_tok, meta_cfg = default_target_metadata(ap)
    limit = meta_cfg.max_position
    longest = max(len(meta_tok.encode_user(t)) for t in texts[:max(batches) * a.groups])
    kmax = max(ks + [build.AUTO_MAX_K])
    if limit and longest + a.max_new + kmax > limit:
        ap.error(f"a prompt of {longest} tokens with --max-new {a.max_new} and K {kmax} exceeds the "
                 f"model's context of {limit} tokens")
    if a.fresh_costs:
        os.environ["SPECJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-costs-")
    import numpy as np

    from specjax import sampling

    target, tok, _ = build.load_target("default", **({"weight_blocks": False} if a.float_weights else {}))
    print(f"target weights: {'GGUF blocks' if target.config.weight_blocks else 'float32'}", flush=True)
    draft, _ = build.resolve_draft("default", target)
    ar = build.make_autoregressive_engine(target)
    auto = build.make_engine(target, draft, "auto")
    fixed = {k: build.make_engine(target, draft, k) for k in ks}
    for b in batches:
        groups = [[tok.encode_user(texts[(g * b + i) % len(texts)]) for i in range(b)]
                  for g in range(a.groups)]
        ids = groups[0]
        t0 = time.time()
        like = auto.prepare(ids, seed=0, sampling_params=sampling.SamplingConfig(temperature=1.0),
                            max_new_tokens=a.max_new)
        table = auto.costs_for(b, like=like)
        print(f"batch {b}: k=auto cost table (ms per round drafting 0..K tokens): "
              f"{', '.join(f'{1e3 * x:.1f}' for x in table)} ({time.time() - t0:.0f} s)", flush=True)
        for temp in temps:
            sp = sampling.SamplingConfig(temperature=temp)

            def run(eng):
                return [eng.generate(g, seed=0, sampling_params=sp, max_new_tokens=a.max_new) for g in groups]

            def iterations(outs):
                return int(np.sum([int(np.asarray(o.raw["iterations"])) for o in outs]))

            def k_rounds(outs):
                return np.sum([np.asarray(o.raw["k_rounds"]) for o in outs], axis=0).tolist()

            def switches(outs):  # branches entered: one per call and one per change of j
                return int(np.sum([int(o.raw["switches"]) for o in outs]))

            def prefill():  # the autoregressive engine making one token: about its prefill
                return [ar.generate(g, seed=0, sampling_params=sp, max_new_tokens=1) for g in groups]

            engines = {"ar": ar, "auto": auto, **{f"k{k}": eng for k, eng in fixed.items()}}
            outs = {name: run(eng) for name, eng in engines.items()}  # warm-up
            prefill()
            times = {name: [] for name in engines}
            times["prefill"] = []
            for _ in range(a.passes):
                for name, eng in engines.items():
                    t = time.perf_counter()
                    run(eng)
                    times[name].append(time.perf_counter() - t)
                t = time.perf_counter()
                prefill()
                times["prefill"].append(time.perf_counter() - t)
            ts = {name: np.asarray(v) for name, v in times.items()}

            def med(name):
                return round(float(np.median(ts[name])), 3)

            def speedup(name):
                return round(float(np.median(ts["ar"] / ts[name])), 3)

            row = dict(batch=b, temperature=temp, groups=a.groups, passes=a.passes, ar_s=med("ar"),
                       prefill_s=med("prefill"),
                       auto_s=med("auto"), speedup=speedup("auto"),
                       speedup_quartiles=[round(float(x), 3) for x in np.quantile(ts["ar"] / ts["auto"], [0.25, 0.75])],
                       rounds_by_draft_tokens=k_rounds(outs["auto"]), branches_entered=switches(outs["auto"]))
            pre = float(np.median(ts["prefill"]))
            for k in fixed:
                row[f"k{k}_s"], row[f"k{k}_speedup"] = med(f"k{k}"), speedup(f"k{k}")
                # what the cost table predicts for this engine: the prefill (timed) plus its
                # loop iterations at the table's cost of a K-token round, against the
                # prefill plus the autoregressive steps at cost_0 (a table that misjudges
                # drafting shows here)
                if k < len(table):
                    row[f"k{k}_table_speedup"] = round(
                        (pre + iterations(outs["ar"]) * float(table[0]))
                        / (pre + iterations(outs[f"k{k}"]) * float(table[k])), 3)
            if fixed:
                row["auto_vs_best_fixed"] = round(min(float(np.median(ts[f"k{k}"] / ts["auto"])) for k in fixed), 3)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
