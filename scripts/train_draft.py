"""Train a draft for a target: ``python scripts/train_draft.py configs/train/eagle_smollm2.yaml``.

See :mod:`specjax.train.distill` for the data, losses, checkpoints and metrics. Options:
``--steps N`` / ``--out-dir DIR`` override the config; ``--time-budget S`` sets the step
count to what fits in S seconds (measured on this run's own steps; rerun with ``--steps N``); ``--stop-after N`` ends after N steps
without a final checkpoint (what a kill looks like; rerun to resume); ``--data-only``
generates (or finds) the cached data and stops.

Paths: the config file and ``--out-dir`` are relative to the current directory; relative
paths INSIDE the config (``data.prompts``, ``data.heldout``, ``data.cache_dir``,
``train.out_dir``) are relative to the repository root, wherever the script runs from.

Rerunning into an out dir resumes its run from the latest checkpoint (``--steps`` may ask
for more steps than before, never fewer than are checkpointed: that is refused). A rerun of
a finished run trains and writes nothing: it prints the recorded summary (evaluation
included) and says that the run is complete; remove the folder or give another
``--out-dir`` to train again. Bad input (config, options, out dir) is a one-line error with
exit status 2, before any work.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

from specjax.cli import OneLineParser


def _parser() -> OneLineParser:
    doc = __doc__.split("\n\n")
    ap = OneLineParser(prog="train_draft.py", description=doc[0].splitlines()[0],
                       epilog=" ".join(" ".join(doc[2:4]).replace("``", "").split()))
    ap.add_argument("config", help="the training config (YAML), relative to the current directory")
    ap.add_argument("--steps", type=int, help="train.steps (at least the out dir's checkpointed step)")
    ap.add_argument("--out-dir", help="train.out_dir, relative to the current directory")
    ap.add_argument("--stop-after", type=int, metavar="N",
                    help="end after step N without a final checkpoint (a kill; rerun to resume)")
    ap.add_argument("--data-only", action="store_true", help="only generate (or find) the cached data")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--time-budget", type=float, metavar="SECONDS",
                    help="set the step count to what fits in SECONDS (data included), from timed steps; "
                         "the log and summary give the count, and --steps N repeats the run")
    return ap


def _check_args(ap, a) -> None:
    """Option errors that need no config (``ap.error``: one line, exit 2)."""
    if a.data_only:
        given = [f for f, v in (("--steps", a.steps), ("--stop-after", a.stop_after),
                                ("--time-budget", a.time_budget)) if v is not None]
        if given:
            ap.error(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to --data-only "
                     "(it trains nothing)")
    if a.time_budget is not None and not (math.isfinite(a.time_budget) and a.time_budget > 0):
        ap.error(f"--time-budget must be a finite number of seconds > 0, got {a.time_budget}")
    if a.stop_after is not None and a.stop_after < 1:
        ap.error(f"--stop-after must be >= 1, got {a.stop_after}")
    if a.out_dir == "":
        ap.error("--out-dir must not be empty")


def main(argv=None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    _check_args(ap, a)
    from specjax.train import distill as T

    try:
        cfg = T.load_config(a.config)
        tc = cfg.train
        changes = {}
        if a.steps is not None:
            changes["steps"] = a.steps
        if a.out_dir is not None:  # the command line's paths are the current directory's
            changes["out_dir"] = os.path.abspath(a.out_dir)
        if a.no_progress:
            changes["progress"] = False
        if changes:
            cfg = dataclasses.replace(cfg, train=T.TrainConfig(**dict(dataclasses.asdict(tc), **changes)))
        if not a.data_only:
            out_dir = T._path(cfg.train.out_dir)
            step = T._check_resume(out_dir, cfg)  # another config's checkpoints, or past --steps
            if a.stop_after is not None and step is not None and a.stop_after <= step:
                raise T.ConfigError(f"--stop-after {a.stop_after}: {out_dir} is already at step {step}")
            done = T.finished_run(cfg)
            if done is not None:  # keep its results: nothing to train, nothing rewritten
                print(f"[train] {out_dir} holds the complete {cfg.train.steps}-step run of this config: its "
                      "results are kept (remove it or give another --out-dir to train again)", file=sys.stderr)
                print(json.dumps(done))
                return 0
            T.make_out_dir(out_dir)
    except (T.ConfigError, T.ResumeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.data_only:
        target, tok = T.load_target(cfg.target)
        for split in ("train", "heldout"):
            T.build_data(cfg, split, target, tok)
        return 0
    try:
        res = T.train(cfg, stop_after=a.stop_after, time_budget=a.time_budget)
    except (T.BudgetError, T.ResumeError, T.ConfigError) as e:  # one line, as for the other bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    res.pop("params", None)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
