"""Where does the time of a speculative round go? (a profiling tool, not a test)

    python scripts/profile_round.py [--k 2] [--temperature 0] [--draft default] [--prompts 4]

Runs speculative decoding (and, for comparison, plain autoregressive decoding) of the
benchmark prompts at batch 1 under ``jax.profiler.trace``, reads the trace back, and prints
the time per loop iteration (a round / a decode step) by kind of XLA operation, using
self time (a thunk's duration minus the thunks nested in it):

* ``model kernels``: the FFI custom calls (``models/cpu_kernels.py``: matmuls, attention),
  i.e. the target's (K+1)-token step and the draft's steps;
* everything else, by HLO kind, with the heaviest single operations and the source
  operation they come from (``op_name`` of the compiled HLO).

Operations that run once per generate call (prefill, set-up) are reported apart. The
profiler adds some overhead; compare the two engines within one run, not across runs.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from scripts.bench.config import BenchConfig, build_prompts  # noqa: E402
from specjax.build import generate_autoregressive, load_target, make_engine, resolve_draft  # noqa: E402

# events inside the executor that are not the work of one operation (nested executors,
# thread-pool waits, end markers of asynchronous custom calls)
_SKIP = ("ThunkExecutor::Execute", "SlinkyThreadPool", "end: ")


def self_times(trace_path: str) -> tuple[collections.Counter, collections.Counter]:
    """``(self time in microseconds, count)`` per event name of a perfetto trace, for the
    events that run inside XLA's thunk executor (the compiled program's operations)."""
    with gzip.open(trace_path) as f:
        tr = json.load(f)
    by_thread = collections.defaultdict(list)
    for e in tr["traceEvents"]:
        if e.get("ph") == "X":
            by_thread[(e["pid"], e["tid"])].append(e)
    self_t, cnt = collections.Counter(), collections.Counter()
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # (event, counted, its children run inside the executor)
        for e in events:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                stack.pop()
            counted = bool(stack) and stack[-1][2]
            if counted:
                self_t[e["name"]] += e["dur"]
                cnt[e["name"]] += 1
                if stack[-1][1]:
                    self_t[stack[-1][0]["name"]] -= e["dur"]
            stack.append((e, counted, counted or e["name"].startswith("ThunkExecutor::Execute")))
    return self_t, cnt


def hlo_op_names(hlo_text: str) -> dict:
    """HLO instruction name -> (result shape, op_name metadata)."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([^\n]*)$", hlo_text, flags=re.M):
        op = re.search(r'op_name="([^"]*)"', m.group(3))
        out[m.group(1)] = (m.group(2), op.group(1) if op else "")
    return out


def breakdown(self_t, cnt, n_calls: int, iterations: int) -> dict:
    """Split the operations into loop-body ones (run more than once per call) and the rest.
    ``iterations`` is the loop's iteration count as the engine reports it (times are divided
    by it); ``trace_iterations``, the most common count among loop-body operations, is the
    trace's own view of it (a check: the profiler may lose a few events on a loaded machine)."""
    ops = {n: (d, cnt[n]) for n, d in self_t.items() if not n.startswith(_SKIP)}
    loop = {n: v for n, v in ops.items() if v[1] > n_calls}
    counts = collections.Counter(c for _, c in loop.values())
    seen = counts.most_common(1)[0][0] if counts else 0
    once = {n: v for n, v in ops.items() if v[1] <= n_calls}
    return dict(loop=loop, once=once, iterations=max(int(iterations), 1), trace_iterations=seen)


def _kind(name: str) -> str:
    return re.sub(r"(\.clone|\.\d+)+$", "", name)


def report(title: str, b: dict, hlo: dict, n_calls: int, top: int, unit: str) -> dict:
    it = b["iterations"]
    kinds = collections.Counter()
    n_ops = collections.Counter()
    for n, (d, c) in b["loop"].items():
        k = "model kernels (ffi_call)" if n.startswith("ffi_call") else _kind(n)
        kinds[k] += d
        n_ops[k] += c
    total = sum(kinds.values()) / 1e3 / it
    model = kinds.get("model kernels (ffi_call)", 0) / 1e3 / it
    once = sum(d for d, _ in b["once"].values()) / 1e3 / n_calls
    # conditionals run per iteration: on a GPU each is a device-to-host copy of its predicate
    # and a wait for the stream (XLA's ConditionalThunk), see specjax.sampling.BatchHints
    conds = sum(c for k, c in n_ops.items() if k.split(".")[0] in ("cond", "conditional")) / it
    print(f"\n== {title}: {it} {unit}s in {n_calls} calls; per {unit}: {total:.2f} ms "
          f"(model kernels {model:.2f} ms, other {total - model:.2f} ms in "
          f"{sum(c for k, c in n_ops.items() if not k.startswith('model')) / it:.0f} ops, "
          f"{conds:.1f} conditionals); once per call: {once:.1f} ms")
    for k, d in kinds.most_common(12):
        print(f"  {d / 1e3 / it:8.3f} ms  {n_ops[k] / it:6.1f} ops  {k}")
    print(f"  heaviest single operations outside the model kernels (ms per {unit}):")
    rows = sorted(((d, n, c) for n, (d, c) in b["loop"].items() if not n.startswith("ffi_call")), reverse=True)
    for d, n, c in rows[:top]:
        shape, op = hlo.get(n, ("?", ""))
        print(f"  {d / 1e3 / it:8.3f}  x{c / it:4.1f}  {n:36s} {shape[:34]:34s} {op[-70:]}")
    return dict(iterations=it, trace_iterations=b["trace_iterations"], per_iteration_ms=total, model_kernels_ms=model, other_ms=total - model,
                conditionals=conds,
                once_per_call_ms=once, by_kind_ms={k: d / 1e3 / it for k, d in kinds.most_common()})


def _profile(fn, calls: int, out_dir: str) -> str:
    shutil.rmtree(out_dir, ignore_errors=True)
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for i in range(calls):
            fn(i)
    found = glob.glob(os.path.join(out_dir, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise RuntimeError(f"the profiler wrote no perfetto trace under {out_dir}")
    return found[0]


def main(argv=None) -> dict:
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default (SmolLM2-135M), tiny, a .gguf or a preset")
    ap.add_argument("--draft", default="default", help="as scripts/benchmark.py --draft")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--method", default="token", choices=["token", "block", "greedy", "tree"])
    ap.add_argument("--tree-topk", type=int, default=4, help="method tree: children per expanded node")
    ap.add_argument("--tree-nodes", type=int, default=16, help="method tree: nodes per tree (K is its depth)")
    ap.add_argument("--tree-candidates", default="point_mass", choices=["point_mass", "iid", "without_replacement"],
                    help="method tree: sampled rounds' candidates (point_mass: the top-k tree every round)")
    ap.add_argument("--tree-branching", default="2,1,1", help="method tree: a sampled tree's branching per level")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=4, help="generate calls profiled")
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate call (rows)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--no-hlo", action="store_true", help="skip compiling again for the op names")
    ap.add_argument("--out", default="out/profile", help="trace directory (and summary.json)")
    a = ap.parse_args(argv)
    if a.k < 1 or a.prompts < 1 or a.tokens < 2 or a.batch < 1:
        ap.error("--k, --prompts and --batch must be >= 1 and --tokens >= 2")

    from specjax import sampling

    target, tok, _ = load_target(a.model)
    draft, ddesc = resolve_draft(a.draft, target)
    cfg = BenchConfig(num_prompts=max(a.prompts, a.batch))
    _, ids = build_prompts(cfg, tok, target.vocab_size)
    rows = lambda i: [ids[(i + j) % len(ids)] for j in range(a.batch)]  # noqa: E731
    sp = sampling.SamplingParams.create(a.batch, temperature=a.temperature)
    if a.method == "tree":
        from specjax.drafts.trees import make_tree_proposer

        br = tuple(int(x) for x in a.tree_branching.split(","))
        eng = make_engine(target, make_tree_proposer(draft, a.tree_topk, a.k, a.tree_nodes, a.tree_candidates, br),
                          None, "tree")
    else:
        eng = make_engine(target, draft, a.k, a.method)
    rounds = []

    def spec(i):
        out = eng.generate(rows(i), seed=i, sampling_params=sp, max_new_tokens=a.tokens)
        rounds.append(int(out.raw["iterations"]))

    steps = []

    def ar(i):
        out = generate_autoregressive(target, rows(i), seed=i, sampling_params=sp, max_new_tokens=a.tokens)
        steps.append(int(out.raw["iterations"]))

    t0 = time.time()
    for i in range(a.prompts):  # compile (every prompt bucket) and warm up
        spec(i), ar(i)
    print(f"[profile] compiled in {time.time() - t0:.1f}s; draft {ddesc}")
    rounds.clear(), steps.clear()
    t0 = time.time()
    spec_trace = _profile(spec, a.prompts, os.path.join(a.out, "speculative"))
    spec_wall = time.time() - t0
    t0 = time.time()
    ar_trace = _profile(ar, a.prompts, os.path.join(a.out, "autoregressive"))
    ar_wall = time.time() - t0
    hlo = {}
    if not a.no_hlo:
        hlo = hlo_op_names(eng.lower(rows(0), seed=0, sampling_params=sp, max_new_tokens=a.tokens)
                           .compile().as_text())
    print(f"[profile] speculative K={a.k} T={a.temperature} batch {a.batch}: {sum(rounds)} rounds for "
          f"{a.prompts} x {a.tokens} tokens per row ({a.prompts * a.tokens / sum(rounds):.2f} tokens/round per row); "
          f"wall with the profiler on: speculative {spec_wall:.2f}s, autoregressive {ar_wall:.2f}s")
    b = breakdown(*self_times(spec_trace), a.prompts, sum(rounds))
    summary = dict(args=vars(a), rounds=sum(rounds),
                   speculative=report(f"speculative, K={a.k}", b, hlo, a.prompts, a.top, "round"))
    b_ar = breakdown(*self_times(ar_trace), a.prompts, sum(steps))
    summary["autoregressive"] = report("autoregressive", b_ar, {}, a.prompts, min(a.top, 5), "step")
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
