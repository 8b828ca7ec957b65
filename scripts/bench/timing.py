"""The timed part of the benchmark: model step costs, timed passes, the grid of settings
and the exactness check.

* :class:`StepTimer`: per-step costs at one batch size in jitted loops (c, v_K);
* :class:`Runner`: warm-up and timed passes of an engine over a batch size's prompt rows
  (keeps the token samples for the exactness check);
* :func:`run_specjax`: every K / method / temperature of every batch size, each pass beside
  an autoregressive pass of the same group and repeat, with speedups and the analytic
  predictions;
* :func:`exactness`: speculative vs autoregressive token samples (``specjax.audit``).
"""
from __future__ import annotations

import collections
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import audit, sampling
from specjax.drafts import ProposeContext, make_proposer
from specjax.build import AUTO_MAX_K, TreeSpec, make_engine
from specjax.engine import AutoregressiveEngine, bucket, cache_len_for

from scripts.bench.report import fmt, loadavg, log
from scripts.bench.stats import predicted_speedup, summarize


def _loop_fn(fn, n: int):
    """A jitted ``fori_loop`` running ``fn(i, carry) -> carry`` n times."""
    return jax.jit(lambda c: jax.lax.fori_loop(0, n, fn, c))


def _time_call(run, init) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(run(init))
    return time.perf_counter() - t0


def drafted_ks(ks) -> list:
    """A grid's Ks as draft lengths, sorted: the fixed ones, and k=auto's widest round
    (:data:`AUTO_MAX_K`) for "auto"."""
    return sorted({k for k in ks if k != "auto"} | ({AUTO_MAX_K} if "auto" in ks else set()))


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
        # the grid's fixed Ks, and k=auto's widest round (its draft and verify costs)
        ks = drafted_ks(ks)
        self.batch, self.ks, self.cfg = batch, tuple(ks), cfg
        n = self.n = cfg.step_repeats
        v = target.vocab_size
        plen = int(np.mean([len(p) for p in prompt_ids]))
        longest = max(len(p) for p in prompt_ids)
        self.pbucket = pbucket = bucket(longest)
        kmax = max(ks)
        # the engine's cache for these prompts at the largest K
        self.cache_len = cache_len = cache_len_for(longest, cfg.max_new_tokens, kmax)
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
        controls = sampling.make_controls(batch, v)  # as the engine passes them (min_new 0)
        keys = jax.random.split(jax.random.key(0), batch)
        for k in ks:
            prop = make_proposer(draft, k, v)
            hidden = None
            if getattr(prop, "needs_target_hidden", False):  # EAGLE: stand-in target features
                width = prop.model.config.feature_dim  # n * dim for an EAGLE-3 head's layers
                hidden = jnp.asarray(rng.standard_normal((batch, pbucket, width)), jnp.float32)
            state = prop.init(prop.params, seq[:, :pbucket], jnp.full((batch,), min(plen, pbucket), jnp.int32),
                              cache_len, hidden)

            def body(i, carry, prop=prop):
                st, acc = carry
                ctx = ProposeContext(seq=seq, seq_len=jnp.full((batch,), fill, jnp.int32) + (i % 2), params=sp,
                                     counts=counts, round_keys=jax.vmap(lambda kk: jax.random.fold_in(kk, i))(keys),
                                     use_penalties=jnp.asarray(False),
                                     gen_len=jnp.zeros((batch,), jnp.int32), controls=controls)
                out = prop.propose(prop.params, st, ctx)
                # every output the engine reads (all K tokens, the draft's log-probs over the
                # vocabulary): what is left unread, XLA drops (K=2 was timed at ~1/4 its cost)
                used = jnp.sum(out.tokens, axis=1) + (jnp.max(out.logprobs, axis=(1, 2)) > 0).astype(jnp.int32)
                return out.state, acc + used + out.num_draft

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
             "loadavg": loadavg()}
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
    """Runs an engine over the prompt rows of a batch size (warm-up, timed passes) and keeps
    the tokens sampled at ``chi_square_temperature`` for :func:`exactness`."""

    def __init__(self, cfg, target, draft, draft_desc, prompt_ids):
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
            key = bucket(max(len(self.ids[r % len(self.ids)]) for r in rows))
            if key not in seen:
                seen.add(key)
                out.append(rows)
        return out

    def _call(self, eng, rows, seed, temperature):
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
        kk = eng.stat_positions if spec else 1  # a tree: its depth; k=auto: its widest round
        p = {"seed": seed, "wall_s": 0.0, "tokens": 0, "calls": 0, "first_call_s": None, "loop_iters": 0,
             "rounds": 0, "row_slots": 0, "drafted": 0, "accepted": 0, "emitted": 0, "alpha_sum": 0.0,
             "alpha_n": 0, "reached": np.zeros(kk, np.int64), "accepted_pos": np.zeros(kk, np.int64),
             "k_rounds": np.zeros(kk + 1, np.int64), "switches": 0}
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
                if "k_rounds" in raw:  # k=auto: loop iterations by draft tokens, branch changes
                    p["k_rounds"] += np.asarray(raw["k_rounds"])
                    p["switches"] += int(raw["switches"])
            else:
                p["loop_iters"] += self.cfg.max_new_tokens
        p["tokens_per_s"] = p["tokens"] / p["wall_s"]
        p["loadavg"] = loadavg()
        return p


def merge_spec_passes(passes: list) -> dict:
    """Summed statistics of a speculative setting's passes."""
    s = {key: sum(p[key] for p in passes) for key in
         ("rounds", "loop_iters", "row_slots", "drafted", "accepted", "emitted", "alpha_sum", "alpha_n")}
    reached = np.sum([p["reached"] for p in passes], axis=0)
    k_rounds = np.sum([p["k_rounds"] for p in passes], axis=0)
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
        # k=auto: the batch's loop iterations by draft tokens 0..K, and branch changes
        "iterations_by_draft_tokens": k_rounds.tolist() if k_rounds.any() else None,
        "switches": sum(p["switches"] for p in passes),
    }


def run_specjax(cfg, runner: Runner, make_timer) -> dict:
    """All settings of all batch sizes. Per batch size, in time order, one group per K::

        group K_1: compile its engines | retime the model steps | passes | group K_2: ...

    In a group the passes run ``for T: for repeat: for engine``, the engines being the
    autoregressive one and the group's methods, their order rotated by one each repeat
    (each takes every place in turn). A setting's speedup is taken per repeat, over the
    autoregressive pass of the same T and repeat (seconds apart), then summarized: the
    machine's drift over the minutes between groups, or between repeats, cancels."""
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
        ar = AutoregressiveEngine(target)
        t0 = time.perf_counter()
        ar_first = runner.warm(ar, batch)
        log(f"B={batch} autoregressive compiled+warm in {time.perf_counter() - t0:.1f}s")
        ar_passes = collections.defaultdict(list)  # temp -> [(group, repeat, pass)]
        group_rt = {}  # group -> the model steps retimed before its passes
        settings = {}

        def ar_pass(gi, rep, temp):  # every autoregressive pass has its own seed
            n = sum(len(v) for v in ar_passes.values())
            ar_passes[temp].append((gi, rep, runner.one_pass(ar, batch, temp, cfg.seed + n, False, "ar")))

        for gi, k in enumerate(ks):
            engines = {}
            for mi, method in enumerate(cfg.methods):
                if k == "auto" and method == "tree":
                    log(f"B={batch} tree: no k=auto (a tree has its own shape)")
                    continue
                # the tree of the draft's kind (EAGLE head, draft model, lookup), K its depth
                tree = TreeSpec(topk=cfg.tree_topk, depth=k, nodes=cfg.tree_nodes,
                                branching=tuple(cfg.tree_branching), candidates=cfg.tree_candidates,
                                widths=tuple(cfg.tree_widths),
                                sampled_nodes=cfg.tree_sampled_nodes) if method == "tree" else None
                # k="auto": adaptive, 0..AUTO_MAX_K draft tokens a round; not memoized (the
                # group's engines and their programs are dropped after it)
                eng = make_engine(target, runner.draft, None if tree else k, method, tree=tree, memo=False)
                t0 = time.perf_counter()
                first = runner.warm(eng, batch)  # k=auto: its round costs are measured (or read) here
                engines[method] = (eng, first, time.perf_counter() - t0, mi)
                if k == "auto":
                    log(f"B={batch} {method} k=auto round costs (ms, drafting 0..{AUTO_MAX_K} tokens): "
                        + ", ".join(f"{1e3 * c:.1f}" for c in eng.costs_for(batch)))
            if not engines:
                continue
            group_rt[gi] = timer.retime()
            order = [None, *engines]  # None: the autoregressive engine
            for temp in cfg.temperatures:
                for rep in range(cfg.repeats):
                    for name in order[rep % len(order):] + order[:rep % len(order)]:
                        if name is None:
                            ar_pass(gi, rep, temp)
                            continue
                        eng, _, _, mi = engines[name]
                        # every (method, K, repeat) has its own seed: independent sequences
                        seed = cfg.seed + 1000 * (1 + 100 * mi + gi) + rep
                        p = runner.one_pass(eng, batch, temp, seed, True, name, k)
                        settings.setdefault((name, k, temp), {"group": gi, "passes": []})["passes"].append(p)
            for method, (eng, first, wt, _) in engines.items():
                for temp in cfg.temperatures:
                    st = settings[(method, k, temp)]
                    r = merge_spec_passes(st["passes"])
                    compile_s = None
                    if temp == cfg.temperatures[0]:
                        compile_s = max(first - statistics.median(p["first_call_s"] for p in st["passes"]), 0.0)
                    r.update(batch_size=batch, method=method, k=k, temperature=temp, group=gi, warmup_s=wt,
                             compile_s=compile_s)
                    if k == "auto":
                        r["round_costs_ms"] = [1e3 * float(c) for c in eng.costs_for(batch)]
                    st["row"] = r
                    log(f"B={batch} {method:5s} K={k} T={temp}: {statistics.median(r['tokens_per_s_passes']):7.1f} tok/s"
                        f"  alpha={fmt(r['mean_alpha'], 3)}  tok/round={r['tokens_per_round']:.2f}")
            del engines
        if not group_rt:  # no group had an engine: the autoregressive passes alone
            group_rt[0] = timer.retime()
            for temp in cfg.temperatures:
                for rep in range(cfg.repeats):
                    ar_pass(0, rep, temp)
        del ar

        sc = timer.summary()
        groups = sorted(group_rt)
        # autoregressive rows: all passes of all groups
        for temp in cfg.temperatures:
            ps = [p for _, _, p in ar_passes[temp]]
            tps = [p["tokens_per_s"] for p in ps]
            first_g = [p["tokens_per_s"] for g, _, p in ar_passes[temp] if g == groups[0]]
            last_g = [p["tokens_per_s"] for g, _, p in ar_passes[temp] if g == groups[-1]]
            # decode only: minus one bare prefill per call, the prefill of the group's retime
            dec_walls, dec_tps, eng_ratio = [], [], []
            for g, _, p in ar_passes[temp]:
                grt = group_rt[g]
                w = max(p["wall_s"] - p["calls"] * grt["t_prefill_ms"] / 1e3, 1e-9)
                dec_walls.append(w)
                dec_tps.append(p["tokens"] / w)
                eng_ratio.append(1e3 * w / p["loop_iters"] / grt["t_target_ms"][1])
            steps = ps[0]["loop_iters"]
            row = {
                "batch_size": batch, "temperature": temp,
                "tokens_per_s": summarize(tps),
                "decode_tokens_per_s": summarize(dec_tps),
                "tokens_per_s_first_group": summarize(first_g),
                "tokens_per_s_last_group": summarize(last_g),
                "drift_last_over_first": statistics.median(last_g) / statistics.median(first_g),
                "walls_s": [p["wall_s"] for p in ps], "tokens": [p["tokens"] for p in ps],
                "groups": [g for g, _, _ in ar_passes[temp]],
                "ms_per_step": 1e3 * statistics.median(p["wall_s"] for p in ps) / steps,
                "decode_ms_per_step": 1e3 * statistics.median(dec_walls) / steps,
                # engine decode time per step over the bare jitted 1-token target step (per group)
                "engine_over_bare_step": statistics.median(eng_ratio),
                "compile_s": max(ar_first - statistics.median(p["first_call_s"] for p in ps), 0.0)
                if temp == cfg.temperatures[0] else None,
                "loadavg": [p["loadavg"] for p in ps],
            }
            ar_rows.append(row)
            log(f"B={batch} autoregressive T={temp}: {row['tokens_per_s']['median']:.1f} tok/s "
                f"(drift last/first group {row['drift_last_over_first']:.2f}, engine/bare step "
                f"{row['engine_over_bare_step']:.2f})")

        # speedups: each pass over the autoregressive pass of its group, T and repeat
        for (method, k, temp), st in settings.items():
            r = st["row"]
            gi = st["group"]
            base_ps = [p for g, _, p in sorted(((g, rep, p) for g, rep, p in ar_passes[temp] if g == gi),
                                                key=lambda x: x[1])]
            grt = group_rt[gi]
            pre = (grt["t_prefill_ms"] + grt.get("t_draft_prefill_ms", 0.0)) / 1e3
            pre_ar = grt["t_prefill_ms"] / 1e3
            tps = r["tokens_per_s_passes"]
            dtps = [n / max(w - r["calls_per_pass"] * pre, 1e-9) for n, w in zip(r["tokens"], r["walls_s"])]
            base = [p["tokens_per_s"] for p in base_ps]
            dbase = [p["tokens"] / max(p["wall_s"] - p["calls"] * pre_ar, 1e-9) for p in base_ps]
            r["ar_baseline_tokens_per_s"] = statistics.median(base)
            r["ar_tokens_per_s_passes"] = base
            r["tokens_per_s"] = summarize(tps)
            r["speedup"] = summarize([x / y for x, y in zip(tps, base, strict=True)])
            r["decode_tokens_per_s"] = summarize(dtps)
            r["decode_speedup"] = summarize([x / y for x, y in zip(dtps, dbase, strict=True)])
            a = r["mean_alpha"]
            if k == "auto":  # K changes from round to round: no closed-form prediction
                r.update(c=None, c_propose=None, verify_ratio=None, predicted_speedup={},
                         achieved_over_predicted={})
                spec_rows.append(r)
                continue
            c, vk, cp = sc["c"][k], sc["v"][k], sc["c_propose"][k]
            r.update(c=c, c_propose=cp, verify_ratio=vk)
            pred = {
                "basic": predicted_speedup(a, k, c) if a is not None else None,
                "with_verify": predicted_speedup(a, k, c, vk) if a is not None else None,
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
            res = audit.sequence_permutation_test(sp, ar, cfg.chi_square_min_expected, seed=cfg.seed)
            out.append({"batch_size": batch, "method": method, "temperature": cfg.chi_square_temperature, **res})
    for r in out:
        p, pp = r["p_value"], r.get("p_value_permutation")
        log(f"exactness B={r['batch_size']} {r['method']}: {r['n_a']} vs {r['n_b']} tokens, chi2={fmt(r['chi2'])} "
            f"dof={r['dof']} nominal p={'n/a (' + r.get('reason', '') + ')' if p is None else f'{p:.4g}'}"
            f" permutation p={'n/a' if pp is None else f'{pp:.4g}'}")
    return out
