"""Train a draft for a target: ``python scripts/train_draft.py configs/train/eagle_smollm2.yaml``.

See :mod:`specjax.train.distill` for the data, losses, checkpoints and metrics. Options:
``--steps N`` / ``--out-dir DIR`` override the config; ``--time-budget S`` sets the step
count to what fits in S seconds (measured on this run's own steps; rerun with ``--steps N``); ``--stop-after N`` ends after N steps
without a final checkpoint (what a kill looks like; rerun to resume); ``--data-only``
generates (or finds) the cached data and stops.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv=None) -> int:
    from specjax.train import distill as T

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--out-dir")
    ap.add_argument("--stop-after", type=int)
    ap.add_argument("--data-only", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--time-budget", type=float, metavar="SECONDS",
                    help="set the step count to what fits in SECONDS (data included), from timed steps; "
                         "the log and summary give the count, and --steps N repeats the run")
    a = ap.parse_args(argv)
    try:
        cfg = T.load_config(a.config)
        tc = cfg.train
        changes = {}
        if a.steps is not None:
            changes["steps"] = a.steps
        if a.out_dir:
            changes["out_dir"] = a.out_dir
        if a.no_progress:
            changes["progress"] = False
        if changes:
            cfg = dataclasses.replace(cfg, train=T.TrainConfig(**dict(dataclasses.asdict(tc), **changes)))
    except (T.ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.data_only:
        target, tok = T.load_target(cfg.target)
        for split in ("train", "heldout"):
            T.build_data(cfg, split, target, tok)
        return 0
    if a.time_budget is not None and a.time_budget <= 0:
        print("error: --time-budget must be > 0 seconds", file=sys.stderr)
        return 2
    try:
        res = T.train(cfg, stop_after=a.stop_after, time_budget=a.time_budget)
    except (T.BudgetError, T.ResumeError) as e:  # one line, as for the other bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    res.pop("params", None)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
