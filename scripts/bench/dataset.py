"""The dataset workload (issue 15): a prompt set with stop tokens on (natural lengths), run
in fixed batches and with continuous batching, by the same engines.

:func:`run_dataset` times, for each setting (``ar``: autoregressive decoding, ``k``: a fixed
K, ``auto``: k="auto") and mode (``fixed``: ``generate`` on consecutive chunks of
``batch`` prompts, rows keyed by their dataset index; ``all``: ``generate_dataset`` with
every slot to the end; ``tail``: ``generate_dataset`` with the tail compacted at every
chance, ``compact=True``), with every program compiled first and the timed runs interleaved ``repeats``
times (medians). :func:`markdown` renders the table: wall time per generated token, loop
and slot iterations, tokens per slot iteration against the rows' own tokens per round,
whether every mode gave the fixed batches' tokens (fixed K and autoregressive decoding
must; k=auto need not, its K a round depends on the batch), and continuous against fixed
per setting. Used by ``scripts/benchmark.py`` (config ``dataset: true``) and
``scripts/bench_schedule.py``.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from specjax import build, sampling

SETTINGS = ("ar", "k", "auto")
MODES = {"fixed": "fixed batches", "all": "continuous, all slots", "tail": "continuous, tail compacted"}


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    batch: int = 16
    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 0.9
    k: int = 3  # the fixed-K setting's K
    settings: tuple = SETTINGS
    modes: tuple = ("fixed", "tail")
    repeats: int = 1
    ladder: tuple = ()  # also generate_dataset(compact=list(ladder))
    tail_costs: tuple = (4, 1)  # k=auto: batch sizes whose cost table is measured (or read) first

    def __post_init__(self):
        bad = [x for x in self.settings if x not in SETTINGS] + [x for x in self.modes if x not in MODES]
        if bad or not self.settings or not self.modes:
            raise ValueError(f"dataset settings must be among {','.join(SETTINGS)} and modes among "
                             f"{','.join(MODES)}, at least one of each (got {bad or 'none'})")
        if self.repeats < 1 or self.batch < 1 or self.max_new_tokens < 1 or self.k < 1:
            raise ValueError("dataset repeats, batch, max_new_tokens and k must be >= 1")
        if not 0 < self.top_p <= 1 or self.temperature < 0:
            raise ValueError(f"dataset top_p must be in (0, 1] and temperature >= 0 (got {self.top_p}, "
                             f"{self.temperature})")


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_dataset(spec: DatasetSpec, target, draft, ids: list, stop_tokens: list, log=print) -> list:
    """Every (setting, mode) of ``spec`` over the prompts ``ids``; one row each (see the
    module docstring). ``stop_tokens``: the model's (natural lengths)."""
    sp = sampling.SamplingConfig(temperature=spec.temperature, top_p=spec.top_p)
    kw = dict(seed=0, sampling_params=sp, max_new_tokens=spec.max_new_tokens, stop_tokens=list(stop_tokens))
    b = spec.batch
    chunks = [list(range(i, min(i + b, len(ids)))) for i in range(0, len(ids), b)]
    engines = {}
    if "ar" in spec.settings:
        engines["autoregressive"] = build.make_autoregressive_engine(target)
    if "k" in spec.settings:
        engines[f"K={spec.k}"] = build.make_engine(target, draft, spec.k)
    if "auto" in spec.settings:
        engines["K=auto"] = build.make_engine(target, draft, "auto")
        for m in spec.tail_costs:  # the tail's own tables (others borrow the next larger one)
            if m < b:
                engines["K=auto"].costs_for(m)
    runs = []  # (setting, mode, fn): every program compiled before anything is timed
    for name, eng in engines.items():
        t0 = time.perf_counter()
        for c in chunks:
            eng.compile([ids[i] for i in c], row_indices=c, **kw)
        # every tail size built ahead (compact=True): "tail" mode moves at every chance and
        # times decoding, not building (compact=False runs a subset of these programs)
        eng.compile(ids, dataset_batch=b, compact=True, **kw)

        def fixed(eng=eng):
            outs = [eng.generate([ids[i] for i in c], row_indices=c, **kw) for c in chunks]
            toks = [t for o in outs for t in o.tokens]
            stats = None if outs[0].stats is None else [s for o in outs for s in o.stats]
            iters = sum(int(o.raw["iterations"]) for o in outs)
            slot_iters = sum(len(c) * int(o.raw["iterations"]) for c, o in zip(chunks, outs))
            return toks, stats, iters, slot_iters

        def cont(compact, eng=eng):
            def run():
                o = eng.generate_dataset(ids, batch_size=b, compact=compact, **kw)
                return o.tokens, o.stats, int(o.raw["iterations"]), int(o.raw["slot_iterations"])
            return run

        modes = {"fixed": fixed, "all": cont(False), "tail": cont(True)}
        for m in spec.modes:
            runs.append((name, MODES[m], modes[m]))
        if spec.ladder:
            eng.compile(ids, dataset_batch=b, compact=list(spec.ladder), **kw)
            runs.append((name, f"continuous, tail sizes {','.join(map(str, spec.ladder))}", cont(list(spec.ladder))))
        log(f"dataset: {name} compiled in {time.perf_counter() - t0:.1f}s")
    # repeats rounds over every (setting, mode), interleaved, so that the machine's drift
    # falls on all of them alike; the median time is reported (outputs are the same every
    # time: the keys are fixed)
    first, times = {}, {}
    for _ in range(spec.repeats):
        for name, mode, fn in runs:
            got, dt = _timed(fn)
            first.setdefault((name, mode), got)
            times.setdefault((name, mode), []).append(dt)
    res = []
    for name, mode, _ in runs:
        (toks, stats, iters, slot_iters), dts = first[(name, mode)], times[(name, mode)]
        dt = float(np.median(dts))
        n = sum(len(t) for t in toks)
        row = dict(setting=name, mode=mode, seconds=dt, all_seconds=dts, tokens=n, ms_per_token=1e3 * dt / n,
                   iterations=iters, slot_iterations=slot_iters,
                   tokens_per_iteration_per_slot=n / slot_iters, lengths=[len(t) for t in toks])
        if stats is not None:
            row["rows_tokens_per_round"] = n / sum(s.rounds for s in stats)
        row["tokens_list"] = [list(map(int, t)) for t in toks]
        res.append(row)
        log(f"dataset: {name}, {mode}: {dt:.1f}s, {row['ms_per_token']:.2f} ms/token, "
            f"{row['tokens_per_iteration_per_slot']:.3f} tok/slot iteration")
    same_as_fixed(res)
    return res


def same_as_fixed(rows: list) -> None:
    """Set each continuous row's ``same_as_fixed``: its tokens equal the fixed batches' of
    the same setting (None where that setting has no fixed run)."""
    ref = {r["setting"]: r["tokens_list"] for r in rows if r["mode"] == MODES["fixed"]}
    for r in rows:
        if r["mode"] != MODES["fixed"]:
            r["same_as_fixed"] = (ref[r["setting"]] == r["tokens_list"]) if r["setting"] in ref else None


def markdown(rows: list) -> list:
    """The dataset table (and continuous against fixed per setting) as markdown lines."""
    if not rows:
        return []
    L = ["| setting | mode | s | tokens | ms/token | loop iterations | slot iterations | tok/iteration/slot | "
         "rows' tok/round | ratio | same tokens as fixed |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = {True: "yes", False: "no", None: ""}[r.get("same_as_fixed")]
        per_row = r.get("rows_tokens_per_round", 1.0)  # autoregressive: 1 token per step
        spread = r.get("all_seconds", [])
        secs = f"{r['seconds']:.1f}" + (f" ({min(spread):.1f}-{max(spread):.1f})" if len(spread) > 1 else "")
        own = f"{r['rows_tokens_per_round']:.3f}" if "rows_tokens_per_round" in r else "1 (a step)"
        L.append(f"| {r['setting']} | {r['mode']} | {secs} | {r['tokens']} | {r['ms_per_token']:.2f} | "
                 f"{r['iterations']} | {r['slot_iterations']} | {r['tokens_per_iteration_per_slot']:.3f} | "
                 f"{own} | {r['tokens_per_iteration_per_slot'] / per_row:.3f} | {same} |")
    by = {(r["setting"], r["mode"]): r for r in rows}
    notes = []
    for (name, mode), r in by.items():
        f = by.get((name, MODES["fixed"]))
        if mode != MODES["fixed"] and f is not None:
            x = r["ms_per_token"] / f["ms_per_token"]
            notes.append(f"{name} {mode}: {x:.3f}x the fixed batches' time per token "
                         f"({100 * abs(1 - x):.1f}% {'lower' if x <= 1 else 'higher'})")
    if notes:
        L += ["", "Continuous against fixed batches, per generated token: " + "; ".join(notes) + "."]
    lens = rows[0]["lengths"]
    L.append(f"\nNatural lengths ({rows[0]['setting']}, {rows[0]['mode']}): min {min(lens)}, median "
             f"{int(np.median(lens))}, max {max(lens)} of {len(lens)} rows.")
    return L
