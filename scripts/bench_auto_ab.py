"""k=auto against autoregressive decoding at one batch size, quickly (issue 15).

    python scripts/bench_auto_ab.py --batches 16,4 [--temps 0,1] [--max-new 48] [--fresh-costs]
        [--ks 2,3] [--groups 1]

For each batch size: the adaptive engine's cost table (measured now with ``--fresh-costs``,
into a temporary cache directory, else read or measured as ``generate`` would), then per
temperature the autoregressive engine, k=auto and the autoregressive engine again on the
same rows of ``configs/bench/prompts.txt`` (no stop tokens), each the median of 3 timed
calls after a warm-up; the speedup uses the mean of the two autoregressive timings.
``--ks``: fixed-K engines timed the same way, after k=auto (for "within 5% of the best
fixed K"); ``--groups G``: each timed call runs G batches of different prompts one after
another (at batch 1, one prompt is a poor sample of the text).
A smaller, faster check than ``scripts/bench_schedule.py``'s grid.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,4")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--prompts", default="configs/bench/prompts.txt")
    ap.add_argument("--fresh-costs", action="store_true", help="measure the cost tables anew (temporary cache)")
    ap.add_argument("--ks", default="", help="fixed K values to time as well, e.g. 2,3")
    ap.add_argument("--groups", type=int, default=1, help="batches of different prompts per timed call")
    a = ap.parse_args(argv)
    if a.fresh_costs:
        os.environ["SPECJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-costs-")
    import numpy as np

    from scripts.bench.config import read_prompts
    from specjax import build, sampling

    target, tok, _ = build.load_target("default")
    draft, _ = build.resolve_draft("default", target)
    ar = build.make_autoregressive_engine(target)
    auto = build.make_engine(target, draft, "auto")
    fixed = {int(k): build.make_engine(target, draft, int(k)) for k in a.ks.split(",") if k}
    texts = read_prompts(a.prompts)
    for b in (int(x) for x in a.batches.split(",")):
        groups = [[tok.encode_user(texts[(g * b + i) % len(texts)]) for i in range(b)]
                  for g in range(a.groups)]
        ids = groups[0]
        t0 = time.time()
        like = auto.prepare(ids, seed=0, sampling_params=sampling.SamplingConfig(temperature=1.0),
                            max_new_tokens=a.max_new)
        table = auto.costs_for(b, like=like)
        print(f"batch {b}: k=auto cost table (ms per round drafting 0..K tokens): "
              f"{', '.join(f'{1e3 * x:.1f}' for x in table)} ({time.time() - t0:.0f} s)", flush=True)
        for temp in (float(x) for x in a.temps.split(",")):
            sp = sampling.SamplingConfig(temperature=temp)

            def run(eng):
                return [eng.generate(g, seed=0, sampling_params=sp, max_new_tokens=a.max_new) for g in groups]

            def timed(eng):
                run(eng)
                ts, outs = [], None
                for _ in range(3):
                    t = time.perf_counter()
                    outs = run(eng)
                    ts.append(time.perf_counter() - t)
                return float(np.median(ts)), outs

            def k_rounds(outs):
                return np.sum([np.asarray(o.raw["k_rounds"]) for o in outs], axis=0).tolist()

            t_ar, _ = timed(ar)
            t_auto, outs = timed(auto)
            fixed_s = {k: timed(eng)[0] for k, eng in fixed.items()}
            t_ar2, _ = timed(ar)
            ar_s = (t_ar + t_ar2) / 2
            row = dict(batch=b, temperature=temp, groups=a.groups, ar_s=round(t_ar, 3),
                       ar_again_s=round(t_ar2, 3), auto_s=round(t_auto, 3),
                       speedup=round(ar_s / t_auto, 3), rounds_by_draft_tokens=k_rounds(outs))
            for k, t in fixed_s.items():
                row[f"k{k}_s"], row[f"k{k}_speedup"] = round(t, 3), round(ar_s / t, 3)
            if fixed_s:
                row["auto_vs_best_fixed"] = round(min(fixed_s.values()) / t_auto, 3)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
