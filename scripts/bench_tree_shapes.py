"""Tokens per round by draft-tree shape (issue 17; a benchmark, not a test).

    python scripts/bench_tree_shapes.py [--prompts-file F] [--rows 8] [--max-new-tokens 64]
        [--seeds 4] [--chain 3] [--topk 4/3/16,8/5/32] [--sampled 3x2x1,4x2x2x1]
        [--dynamic 3x4x4x3] [--positional 15,44] [--accept FILE] [--ranks 64]
        [--out out/tree_shapes.json]

How many tokens a round emits is a property of the draft and the tree, not of the hardware:
this measures it without timing, so that a CPU can say which tree a device should verify
(where a verify pass of tens of tokens costs about one step). SmolLM2-135M-Instruct with
the shipped EAGLE head, the first ``--rows`` prompts of the file in one batch, token
verification:

* ``--chain K``: the K-token chain (T = 0 and T = 1), for reference;
* ``--topk a/d/n``: the head's top-``a`` tree of depth ``d`` and ``n`` nodes (EAGLE-2
  growth), greedy rounds (T = 0; point-mass candidates);
* ``--sampled b1xb2x...``: a full tree of that branching drawn from the head's law without
  replacement (T = 1);
* ``--dynamic w1xw2x...``: a sampled tree with ``w_l`` nodes at depth l, shaped as it
  grows (``widths``, :func:`specjax.drafts.trees.grow_dynamic_tree`; T = 1);
* ``--positional N,...``: the best N-node tree for drafts accepted by sibling rank
  (``sampled_nodes``, :func:`specjax.tree.positional_tree_shape`; T = 1), for the
  default acceptance model or the one in ``--accept`` (a JSON file: a vector, a per-depth
  table, or a ``--ranks`` result with its ``"accept"`` table);
* ``--ranks N``: MEASURES that model: T = 1 rounds with the N-node positional tree, the
  accepted path of every active row read out of the compiled loop (``jax.debug.callback``
  on the engine's tree verification), and per depth d and sibling rank k the share of
  rounds whose path took the rank-k child among those whose path reached a depth-(d-1)
  node that has a rank-k child. Printed as a table and written to ``--out`` as
  ``"accept"`` (rows non-increasing, zeros floored), which ``--accept`` reads.

Sampled rounds are random: T = 1 runs use ``--seeds`` seeds and report the pooled rate
(tokens over rounds of all rows and seeds). Nodes per tree are printed beside each shape:
the verify pass reads nodes + 1 tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _shapes(text, sep):
    out = []
    for s in (text or "").split(","):
        if s.strip():
            try:
                shape = tuple(int(x) for x in s.split(sep))
            except ValueError:
                raise ValueError(f"bad tree shape {s.strip()!r}: integers separated by {sep!r}") from None
            if min(shape) < 1:
                raise ValueError(f"bad tree shape {s.strip()!r}: every number must be >= 1")
            out.append(shape)
    return out


def main(argv=None) -> dict:
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-file", default="configs/bench/prompts.txt")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=4, help="seeds of the T = 1 runs")
    ap.add_argument("--chain", type=int, default=3, help="the chain's K (0: none)")
    ap.add_argument("--topk", default="4/3/16,8/5/32,8/6/48,10/6/60", help="top-k trees a/d/n (T = 0)")
    ap.add_argument("--sampled", default="2x1x1,3x2x1,4x2x2x1,6x3x2x1", help="sampled trees' branching (T = 1)")
    ap.add_argument("--dynamic", default="", help="dynamic sampled trees' widths per level (T = 1)")
    ap.add_argument("--positional", default="", help="positional sampled trees' node counts (T = 1)")
    ap.add_argument("--accept", default=None, help="JSON file: the positional trees' acceptance model")
    ap.add_argument("--ranks", type=int, default=0, help="measure sibling-rank acceptance with this positional tree")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    a = ap.parse_args(argv)
    try:
        topk, sampled, dynamic = _shapes(a.topk, "/"), _shapes(a.sampled, "x"), _shapes(a.dynamic, "x")
        positional = [n for (n,) in _shapes(a.positional, "x")]
        if any(len(s) != 3 for s in topk):
            raise ValueError("--topk shapes are a/d/n")
        if a.rows < 1 or a.max_new_tokens < 2 or a.seeds < 1 or a.chain < 0 or a.ranks < 0:
            raise ValueError("--rows, --seeds >= 1, --max-new-tokens >= 2, --chain, --ranks >= 0")
        accept = _read_accept(a.accept)
        from specjax.tree import DEFAULT_SIBLING_ACCEPT, accept_table, positional_tree_shape
        for n in positional + ([a.ranks] if a.ranks else []):
            positional_tree_shape(n, accept or DEFAULT_SIBLING_ACCEPT)
    except ValueError as e:
        ap.error(str(e))

    from scripts.bench.config import BenchConfig, build_prompts
    from specjax import sampling
    from specjax.build import load_target, make_engine, resolve_draft
    from specjax.drafts.trees import make_tree_proposer

    target, tok, _ = load_target("default")
    draft, ddesc = resolve_draft(a.draft, target)
    _, ids = build_prompts(BenchConfig(num_prompts=a.rows, prompts_file=a.prompts_file), tok, target.vocab_size)

    def rate(eng, temperature):
        sp = sampling.SamplingParams.create(len(ids), temperature=temperature)
        toks = rounds = 0
        for seed in range(a.seeds if temperature > 0 else 1):
            out = eng.generate(ids, seed=seed, sampling_params=sp, max_new_tokens=a.max_new_tokens)
            toks += sum(s.emitted for s in out.stats)
            rounds += sum(s.rounds for s in out.stats)
        return toks / rounds, toks

    rows = []

    def record(label, nodes, temperature, eng):
        t0 = time.time()
        r, toks = rate(eng, temperature)
        rows.append(dict(shape=label, nodes=nodes, temperature=temperature, tokens_per_round=r, tokens=toks))
        print(f"{label:28s} nodes {nodes:3d}  T={temperature:g}  {r:.3f} tokens/round  "
              f"({toks} tokens, {time.time() - t0:.0f}s)", flush=True)

    print(f"[tree shapes] {a.prompts_file}: {len(ids)} rows x {a.max_new_tokens} tokens, draft {ddesc}", flush=True)
    if a.chain:
        eng = make_engine(target, draft, a.chain, "token")
        for t in (0.0, 1.0):
            record(f"chain K={a.chain}", a.chain, t, eng)
    for k, d, n in topk:
        prop = make_tree_proposer(draft, k, d, n)
        record(f"top-{k} tree, depth {d}", prop.tree_nodes, 0.0, make_engine(target, prop, None, "tree"))
    for br in sampled:
        prop = make_tree_proposer(draft, 2, len(br), 2, "without_replacement", br)
        record("sampled " + "x".join(map(str, br)), prop.tree_nodes, 1.0, make_engine(target, prop, None, "tree"))
    for wd in dynamic:
        prop = make_tree_proposer(draft, 2, len(wd), 2, "without_replacement", widths=wd)
        record("dynamic " + "x".join(map(str, wd)), prop.tree_nodes, 1.0, make_engine(target, prop, None, "tree"))
    model = accept or DEFAULT_SIBLING_ACCEPT
    for n in positional:
        prop = make_tree_proposer(draft, 2, 1, 2, "without_replacement", sampled_nodes=n, sampled_accept=model)
        label = "positional " + "x".join(map(str, np.bincount(positional_tree_shape(n, model)[1])[1:]))
        record(label, prop.tree_nodes, 1.0, make_engine(target, prop, None, "tree"))
    ranks = None
    if a.ranks:
        ranks = _measure_ranks(a, target, draft, ids, model)

    res = dict(prompts_file=a.prompts_file, rows=len(ids), max_new_tokens=a.max_new_tokens, seeds=a.seeds,
               draft=str(ddesc), results=rows, accept_model=[list(r) for r in accept_table(model)],
               **(ranks or {}), command=" ".join(["python", "scripts/bench_tree_shapes.py"] + (argv or sys.argv[1:])))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


def _read_accept(path):
    """The acceptance model in a JSON file (a vector, a table, or ``{"accept": table}``)."""
    if not path:
        return ()
    try:
        with open(path) as f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"--accept {path}: {e.strerror or e}") from None
    obj = obj.get("accept") if isinstance(obj, dict) else obj
    if not isinstance(obj, list) or not obj:
        raise ValueError(f"--accept {path}: expected a list (a vector or a table) or {{'accept': table}}")
    from specjax.tree import accept_table

    try:
        return accept_table(obj)
    except ValueError as e:
        raise ValueError(f"--accept {path}: {e}") from None


def _measure_ranks(a, target, draft, ids, model) -> dict:
    """Per depth and sibling rank, how often the accepted path takes that child (T = 1)."""
    import jax

    from specjax import sampling
    from specjax.build import make_engine
    from specjax.drafts.trees import make_tree_proposer
    from specjax.drafts.trees import sampled_shape
    from specjax.tree import positional_tree_shape

    parent, depth = positional_tree_shape(a.ranks, model)
    n = len(parent)
    rank = sampled_shape(parent)["rank"]  # a node's number of earlier siblings
    children = np.bincount(parent + 1, minlength=n + 1)  # [0]: the root's, [i + 1]: node i's
    dmax, kmax = int(depth.max()), int(children.max())
    hits = np.zeros((dmax, kmax), np.int64)  # path took the rank-k child at depth d
    seen = np.zeros((dmax, kmax), np.int64)  # path reached a parent at depth d - 1 with a rank-k child
    rounds = [0]

    def record(path, num, active):
        path, num, active = np.asarray(path), np.asarray(num), np.asarray(active)
        for row in np.flatnonzero(active):
            rounds[0] += 1
            at = 0  # the parent: 0 = root, i + 1 = node i
            for d in range(dmax):
                seen[d, :children[at]] += 1
                if d >= num[row]:
                    break
                node = int(path[row, d])
                hits[d, rank[node]] += 1
                at = node + 1

    prop = make_tree_proposer(draft, 2, 1, 2, "without_replacement", sampled_nodes=a.ranks, sampled_accept=model)
    eng = make_engine(target, prop, None, "tree")
    box, verify, round_fn = [], eng._tree_verify, eng._tree_round

    def tree_verify(*args, **kw):
        res = verify(*args, **kw)
        box.append(res)
        return res

    def tree_round(c, *args, **kw):
        out = round_fn(c, *args, **kw)
        res = box.pop()
        jax.debug.callback(record, res.path, res.num_accepted, ~c.state.done & ~res.error)
        return out

    # the instance attributes shadow the methods the compiled loop calls (a measurement only)
    object.__setattr__(eng, "_tree_verify", tree_verify)
    object.__setattr__(eng, "_tree_round", tree_round)
    sp = sampling.SamplingParams.create(len(ids), temperature=1.0)
    t0 = time.time()
    for seed in range(a.seeds):
        eng.generate(ids, seed=seed, sampling_params=sp, max_new_tokens=a.max_new_tokens)
    rate = np.where(seen > 0, hits / np.maximum(seen, 1), np.nan)
    print(f"[ranks] positional tree of {n} nodes ({'x'.join(map(str, np.bincount(depth)[1:]))}), "
          f"{rounds[0]} row-rounds, {time.time() - t0:.0f}s; P(rank-k child on the path | parent on it):")
    for d in range(dmax):
        cells = " ".join(f"{r:6.3f}" if np.isfinite(r) else "     -" for r in rate[d])
        print(f"  depth {d + 1}: {cells}   (parents reached: {seen[d, 0]})", flush=True)
    # a usable model: measured rows where the first rank was seen 200+ times, ranks seen 50+
    # times, made non-increasing and floored at 1e-3; deeper levels repeat the last row
    table = []
    for d in range(dmax):
        if seen[d, 0] < 200:
            break
        r = [max(float(rate[d, k]), 1e-3) for k in range(kmax) if seen[d, k] >= 50]
        table.append([min(r[: k + 1]) for k in range(len(r))])
    return dict(ranks_tree_nodes=n, row_rounds=rounds[0], hits=hits.tolist(), seen=seen.tolist(),
                rank_accept=[[None if not np.isfinite(x) else float(x) for x in r] for r in rate], accept=table)


if __name__ == "__main__":
    main()
