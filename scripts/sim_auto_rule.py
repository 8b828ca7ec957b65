"""k="auto"'s rule simulated at batch 1: its choices against fixed K, no model, no clock.

    python scripts/sim_auto_rule.py [--calls 4000] [--budgets 48,128] [--out sim.json]

Each simulated call is one row with a token budget; its draft positions are accepted
independently with a rate drawn per call around a mean (``--rates mean:sd``, the spread
between prompts), optionally moved up or down by ``--burst`` in runs (a two-state chain
that flips with probability 0.1 a round: easy and hard stretches of text). Each round
chooses j by the engine's own :func:`specjax.engine.choose_k` from the engine's own
:class:`specjax.engine.AutoState` (its prior, decay and probes), pays the cost table's
``costs[j]`` and commits min(accepted + 1, budget left) tokens. The result is tokens per
unit cost of k=auto and of every fixed K (0 = autoregressive decoding), over all calls.

What it leaves out: the adaptive engine's own per-round overhead, the EAGLE head's catch-up
after plain rounds, a cost table that differs from the machine's real costs, and
acceptance that depends on which tokens were drafted. So it measures only whether the
rule's decisions are good, given the costs it believes; wall-clock comparisons are
``scripts/bench_auto_ab.py``'s.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax import engine  # noqa: E402
from specjax.cli import OneLineParser  # noqa: E402

K = 3  # build.AUTO_MAX_K
TABLES = {  # ms per round drafting 0..3 tokens, batch 1, measured (BENCHMARKS.md)
    "amd": [8.1, 10.0, 11.7, 13.4],  # 2 AMD EPYC cores, block weights (2026-12-05)
    "xeon": [8.5, 11.5, 15.0, 18.5],  # 2 Intel Xeon cores (2026-12-06)
}


def simulator(policy, costs, budget: int, burst: float):
    """A jitted function (keys[n], rates[n]) -> (tokens, cost, plain rounds, rounds), each [n]."""
    costs = jnp.asarray(costs, jnp.float32)

    def one(key, rate):
        def body(carry, _):
            auto, made, spent, easy, key = carry
            key, k_acc, k_flip = jax.random.split(key, 3)
            left = jnp.maximum(budget - made, 0)
            active = left > 0
            j = engine.choose_k(auto, costs, left[None], True) if policy == "auto" else jnp.int32(policy)
            easy = jnp.where(jax.random.uniform(k_flip) < 0.1, ~easy, easy)
            a = jnp.clip(rate + jnp.where(easy, burst, -burst), 0.0, 1.0)
            ok = (jax.random.uniform(k_acc, (K,)) < a) & (jnp.arange(K) < j)
            n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
            nd = jnp.where(active, j, 0)
            new = jax.lax.cond(j > 0, lambda: auto.drafted(0, active[None], nd[None], n_acc[None]),
                               lambda: auto.plain())
            auto = jax.tree.map(lambda n, o: jnp.where(active, n, o), new, auto)
            return (auto, made + jnp.minimum(n_acc + 1, left), spent + jnp.where(active, costs[j], 0.0),
                    easy, key), (active & (j == 0), active)

        init = (engine.AutoState.zeros(K), jnp.int32(0), jnp.float32(0), jnp.bool_(True), key)
        (_, made, spent, _, _), (plain, active) = jax.lax.scan(body, init, None, length=budget)
        return made, spent, jnp.sum(plain), jnp.sum(active)

    return jax.jit(jax.vmap(one))


def main(argv=None) -> int:
    ap = OneLineParser(prog="sim_auto_rule.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--budgets", default="48,128", help="new tokens per call")
    ap.add_argument("--rates", default="0.49:0.10,0.44:0.05,0.30:0.05,0.12:0.03",
                    help="acceptance mean:sd between calls (T=0 and T=1 of the shipped head, weaker drafts)")
    ap.add_argument("--bursts", default="0,0.2")
    ap.add_argument("--tables", default="amd,xeon", help=f"cost tables: {', '.join(TABLES)}")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    a = ap.parse_args(argv)
    try:
        budgets = [int(x) for x in a.budgets.split(",")]
        rates = [tuple(float(y) for y in x.split(":")) for x in a.rates.split(",")]
        bursts = [float(x) for x in a.bursts.split(",")]
        tables = {t: TABLES[t] for t in a.tables.split(",")}
    except (ValueError, KeyError) as e:
        ap.error(f"bad list: {e}")
    if a.calls < 1 or min(budgets) < 1 or any(len(r) != 2 or not 0 <= r[0] <= 1 or r[1] < 0 for r in rates):
        ap.error("--calls and --budgets must be >= 1, --rates mean:sd with mean in [0, 1], sd >= 0")
    rows = []
    for (tn, costs), budget, (mean, sd), burst in itertools.product(tables.items(), budgets, rates, bursts):
        rng = np.random.default_rng(0)
        rate = jnp.asarray(np.clip(rng.normal(mean, sd, a.calls), 0.02, 0.98), jnp.float32)
        keys = jax.random.split(jax.random.key(0), a.calls)
        rate_of, plain = {}, None
        for p in (0, 1, 2, 3, "auto"):
            made, spent, n0, n = simulator(p, costs, budget, burst)(keys, rate)
            rate_of[p] = float(np.sum(made) / np.sum(spent))
            if p == "auto":
                plain = float(np.sum(n0)) / float(np.sum(n))  # k=auto's share of plain rounds
        best = max((0, 1, 2, 3), key=lambda p: rate_of[p])
        row = dict(table=tn, budget=budget, mean=mean, sd=sd, burst=burst,
                   speedup={str(p): rate_of[p] / rate_of[0] for p in rate_of}, best_fixed=best,
                   auto_over_best=rate_of["auto"] / rate_of[best], auto_plain_share=plain)
        rows.append(row)
        print(f"{tn:5s} budget {budget:4d} rate {mean:.2f}+-{sd:.2f} burst {burst:.1f}: "
              + " ".join(f"K={p}: {row['speedup'][str(p)]:.3f}" for p in (1, 2, 3))
              + f"  auto: {row['speedup']['auto']:.3f} ({plain:.0%} plain)  auto / best fixed (K={best}): "
                f"{row['auto_over_best']:.3f}",
              flush=True)
    worst = min(rows, key=lambda r: r["auto_over_best"])
    print(f"lowest auto / best fixed: {worst['auto_over_best']:.3f} ({worst['table']}, budget {worst['budget']}, "
          f"rate {worst['mean']}, burst {worst['burst']})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
