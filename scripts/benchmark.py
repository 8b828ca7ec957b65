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
the median of ``repeats`` passes with min / max / IQR; the autoregressive engine runs a
pass beside every repeat of every group of settings (one K, all methods; the order
rotated each repeat), a setting's speedup is taken per repeat over that pass, and the
drift of the autoregressive passes from the first group to the last is reported. Repeat r of a sampled setting uses seed ``seed + r``
(rows keyed by their index), so repeats are distinct samples for the exactness check.

Outputs (``--out``, default ``out/bench``): ``benchmark.json`` (every figure + machine),
``benchmark.md`` (the report section), PNG plots; with ``--markdown PATH`` the section
between ``<!-- benchmark:begin -->`` / ``<!-- benchmark:end -->`` of PATH is rewritten
(``BENCHMARKS.md`` for the default config); ``--publish-dir docs/bench`` copies the plots
there and links them from the section.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: specjax, scripts.bench

from scripts.bench import REPO  # noqa: E402
from scripts.bench.config import build_dataset_prompts, build_prompts, grid_k, load_bench_config  # noqa: E402
from scripts.bench.dataset import run_dataset  # noqa: E402
from scripts.bench.peer import run_peer  # noqa: E402
from scripts.bench.plots import make_plots  # noqa: E402
from scripts.bench.report import (  # noqa: E402
    block_vs_token, loadavg, log, machine_info, render_markdown, replace_marked_section)
from scripts.bench.timing import Runner, StepTimer, drafted_ks, exactness, run_specjax  # noqa: E402
from specjax.build import check_draft_spec, check_layer_settings, load_target, resolve_draft  # noqa: E402
from specjax.cli import OneLineParser  # noqa: E402
from specjax.configs import check_writable  # noqa: E402


def _csv(typ):
    def parse(s):
        try:
            return tuple(typ(x) for x in s.split(",") if x.strip())
        except ValueError as e:  # argparse shows this message, one line
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def parse_args(argv=None):
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="configs/bench/<name>.yaml or a YAML path (default: default)")
    ap.add_argument("--quick", action="store_true", help="the quick config (< 3 min on 2 cores; no peer)")
    ap.add_argument("--model", default=None, help="default | tiny | <model preset> | <file.gguf> | <HF checkpoint dir> (specjax.build.load_target)")
    ap.add_argument("--draft", default=None, help="default | lookup | layers:N | <path: draft .npz, .gguf, preset .yaml, HF dir> "
                    "(specjax.build.resolve_draft)")
    ap.add_argument("--param-dtype", default=None, help="float32 | bfloat16 (weights; compute follows unless --dtype)")
    ap.add_argument("--dtype", default=None, help="compute dtype (activations, KV cache)")
    ap.add_argument("--scan-layers", action="store_const", const=True, default=None,
                    help="lax.scan over layers (faster compiles; unrolled is faster on CPU and GPU). "
                         "Default: the config's scan_layers, 'auto' = the backend's faster mode")
    ap.add_argument("--unrolled-layers", action="store_const", const=False, dest="scan_layers",
                    help="one module per layer, unrolled")
    ap.add_argument("--ks", type=_csv(grid_k), default=None,
                    help="comma-separated K values, 'auto' for the adaptive engine (all batch sizes)")
    ap.add_argument("--batch-sizes", type=_csv(int), default=None)
    ap.add_argument("--temperatures", type=_csv(float), default=None)
    ap.add_argument("--methods", type=_csv(str), default=None, help="token,block,tree")
    ap.add_argument("--tree-topk", type=int, default=None, help="method tree: children per expanded node")
    ap.add_argument("--tree-nodes", type=int, default=None, help="method tree: nodes per tree (K is its depth)")
    ap.add_argument("--tree-branching", type=_csv(int), default=None,
                    help="method tree: a sampled round's children per level, e.g. 2,1,1")
    ap.add_argument("--tree-widths", type=_csv(int), default=None,
                    help="method tree: sampled rounds grow a tree of this many nodes per level, e.g. 3,4,4,3")
    ap.add_argument("--tree-sampled-nodes", type=int, default=None,
                    help="method tree: sampled rounds fill the best tree of this many nodes for drafts "
                         "accepted by sibling rank (Sequoia style)")
    ap.add_argument("--tree-candidates", default=None, choices=["without_replacement", "iid", "point_mass"],
                    help="method tree: how sampled rounds draw (point_mass: the top-k tree every round)")
    ap.add_argument("--prompts-file", default=None, help="one prompt per line (default: the config's, a path in "
                                                         "the checkout; a path given here is the current directory's)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--peer", dest="peer", action="store_true", default=None, help="run the HF peer")
    ap.add_argument("--no-peer", dest="peer", action="store_false")
    ap.add_argument("--peer-dtypes", type=_csv(str), default=None)
    ap.add_argument("--peer-ks", type=_csv(int), default=None)
    ap.add_argument("--dataset", dest="dataset", action="store_true", default=None,
                    help="also run the dataset workload (stop tokens on, fixed vs continuous batches; the "
                         "config's dataset settings, else the defaults of scripts/bench/dataset.py)")
    ap.add_argument("--no-dataset", dest="dataset", action="store_false")
    ap.add_argument("--out", default=None, help="output directory (default out/bench)")
    ap.add_argument("--markdown", default=None, help="rewrite the marked section of this file (e.g. BENCHMARKS.md)")
    ap.add_argument("--no-markdown", action="store_true", help="do not touch any BENCHMARKS.md")
    ap.add_argument("--publish-dir", default=None, help="copy the plots here (e.g. docs/bench) and link them")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache directory")
    return ap.parse_args(argv)


def check_lengths(cfg, target, ids, ds_prompts) -> None:
    """ValueError (one line) where the grid's or the dataset workload's longest prompt, its
    new tokens and the largest K exceed the target's context, or where the largest batch's
    KV cache alone exceeds the devices' memory: the step timer allocates its caches before
    any engine could check them."""
    from specjax.build import AUTO_MAX_K
    from specjax.engine import cache_len_for, check_cache_memory, context_limit

    limit = context_limit(target)
    runs = [("the grid", ids, cfg.max_new_tokens, max(max(drafted_ks(cfg.ks_for(b))) for b in cfg.batch_sizes),
             max(cfg.batch_sizes))]
    if ds_prompts is not None:
        spec, _, ds_ids, _ = ds_prompts
        runs.append(("the dataset workload", ds_ids, spec.max_new_tokens,
                     max(spec.k, AUTO_MAX_K) if "auto" in spec.settings else spec.k, spec.batch))
    for what, prompts, max_new, kmax, batch in runs:
        longest = max(len(p) for p in prompts)
        if limit is not None and longest + max_new + kmax > limit:
            raise ValueError(f"{what}: a prompt of {longest} tokens + max_new_tokens {max_new} + K {kmax} "
                             f"exceeds the model's context of {limit} tokens")
        check_cache_memory(target, batch, cache_len_for(longest, max_new, kmax))


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    name = args.config or ("quick" if args.quick else "default")
    over = dict(model=args.model, draft=args.draft, param_dtype=args.param_dtype, dtype=args.dtype, scan_layers=args.scan_layers,
                max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts, repeats=args.repeats,
                prompts_file=args.prompts_file,
                seed=args.seed, peer=args.peer, peer_dtypes=args.peer_dtypes, peer_ks=args.peer_ks,
                out_dir=args.out, temperatures=args.temperatures, methods=args.methods, publish_dir=args.publish_dir)
    if args.ks is not None:
        over.update(ks=args.ks, ks_by_batch=())
    if args.num_prompts is not None:  # the rows of every timed pass (a config's per-batch rows give way)
        over.update(rows_by_batch=())
    for name_ in ("tree_topk", "tree_nodes", "tree_branching", "tree_candidates", "tree_widths", "tree_sampled_nodes"):
        if getattr(args, name_) is not None:
            over[name_] = getattr(args, name_)
    if args.batch_sizes is not None:
        over["batch_sizes"] = args.batch_sizes
    if args.markdown is not None:  # a path given here is the caller's (a config's is the repository's)
        over["markdown"] = str(Path(args.markdown).resolve())
    if args.prompts_file is not None:  # likewise
        over["prompts_file"] = str(Path(args.prompts_file).resolve())
    if args.no_plots:
        over["plots"] = False
    try:
        cfg = load_bench_config(name, **over)
        if args.dataset is False:
            cfg = cfg.replace(dataset=None)
        elif args.dataset and cfg.dataset is None:
            cfg = cfg.replace(dataset={})
        if args.no_markdown and args.markdown is not None:
            raise ValueError("--markdown and --no-markdown: give one")
        tree_flags = [f"--{n.replace('_', '-')}" for n in ("tree_topk", "tree_nodes", "tree_branching", "tree_candidates",
                                                          "tree_widths", "tree_sampled_nodes") if getattr(args, n) is not None]
        if tree_flags and "tree" not in cfg.methods:
            raise ValueError(f"{', '.join(tree_flags)} {'applies' if len(tree_flags) == 1 else 'apply'} to "
                             "method tree only (--methods ...,tree)")
        if args.prompts_file is not None and not Path(cfg.prompts_file).is_file():
            raise ValueError(f"--prompts-file {args.prompts_file}: no such file")
        check_draft_spec(cfg.draft)
        check_layer_settings(cfg.param_dtype, cfg.dtype, cfg.scan_layers)
        out_dir = Path(cfg.out_dir)
        if not out_dir.is_absolute():
            out_dir = Path.cwd() / out_dir
        try:  # where the results go, before any work: a run's results are never lost at the end
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the output folder {out_dir}: {e.strerror}") from None
        if not os.access(out_dir, os.W_OK):
            raise ValueError(f"cannot write to the output folder {out_dir}")
        md = Path(cfg.markdown) if cfg.markdown and not args.no_markdown else None
        if md is not None:
            md = md if md.is_absolute() else REPO / md
            try:  # tried now (a probe), so that a whole run's results are not lost at its end
                check_writable(md)
            except ValueError as e:
                raise ValueError(f"the markdown file {e}") from None
    except (ValueError, FileNotFoundError) as e:  # a bad config or override: one line, exit 2
        print(f"benchmark.py: error: {e}", file=sys.stderr)
        return 2
    if args.no_markdown:
        cfg = cfg.replace(markdown=None)
    if cfg.chi_square_temperature not in cfg.temperatures:
        log(f"note: temperature {cfg.chi_square_temperature} not in the grid: no exactness check")
    if args.compile_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    command = " ".join(["python scripts/benchmark.py"] + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])

    machine = machine_info()
    log(f"config {cfg.name}: {json.dumps(cfg.as_dict())}")
    log(f"machine: {machine['cpu_model']}, {machine['usable_cores']} cores, backend {machine['backend']}")
    t0 = time.perf_counter()
    target, tok, model_desc = load_target(cfg.model, cfg.param_dtype, cfg.dtype, cfg.scan_layers)
    draft, draft_desc = resolve_draft(cfg.draft, target)
    if draft_desc["kind"] == "eagle":  # trained weights (the target's embedding / head are shared)
        draft_desc["params"] = int(sum(w.size for w in draft.trainable_weights().values()))
    elif draft_desc["kind"] != "lookup":
        draft_desc["params"] = draft.config.num_params()
    model_desc["load_s"] = time.perf_counter() - t0
    texts, ids = build_prompts(cfg, tok, target.vocab_size)
    ds_prompts = None
    if cfg.dataset is not None:
        spec, prompts_file, n = cfg.dataset_spec()
        ds_prompts = (spec, prompts_file, *build_dataset_prompts(prompts_file, n, tok, target.vocab_size))
    try:  # the prompts against the model's context and the devices' memory, before any compile
        check_lengths(cfg, target, ids, ds_prompts)
    except ValueError as e:
        print(f"benchmark.py: error: {e}", file=sys.stderr)
        return 2
    log(f"target {model_desc['name']} ({model_desc['load_s']:.1f}s), draft {draft_desc}, "
        f"prompt lengths {[len(p) for p in ids]}")

    runner = Runner(cfg, target, draft, draft_desc, ids)
    res = run_specjax(cfg, runner, lambda b: StepTimer(target, draft, draft_desc, b, cfg.ks_for(b), ids, cfg))
    step_costs = res["step_costs"]
    exact = exactness(cfg, runner)
    dataset = None
    if ds_prompts is not None:
        spec, prompts_file, ds_ids, ds_stop = ds_prompts
        log(f"dataset workload: {len(ds_ids)} prompts, {spec}")
        t0 = time.perf_counter()
        rows = run_dataset(spec, target, draft, ds_ids, ds_stop, log=log)
        for r in rows:
            r.pop("tokens_list")
        dataset = {"spec": dataclasses.asdict(spec), "prompts_file": prompts_file, "num_prompts": len(ds_ids),
                   "stop_tokens": len(ds_stop), "rows": rows, "wall_s": time.perf_counter() - t0}
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
        "dataset": dataset,
        "peer": peer,
    }
    json_path = out_dir / "benchmark.json"
    result["json_path"] = os.path.relpath(json_path, REPO) if str(json_path).startswith(str(REPO)) else str(json_path)
    plots = make_plots(cfg, result, out_dir) if cfg.plots else []
    result["plots"] = plots
    links = []
    md_path = Path(cfg.markdown) if cfg.markdown else None
    if md_path is not None and not md_path.is_absolute():
        md_path = REPO / md_path
    if plots and cfg.publish_dir:
        pub = Path(cfg.publish_dir)
        pub = pub if pub.is_absolute() else REPO / pub
        pub.mkdir(parents=True, exist_ok=True)
        for p in plots:
            shutil.copy(p, pub / Path(p).name)
        base = md_path.parent if md_path else REPO
        links = [os.path.relpath(pub / Path(p).name, base) for p in plots]
    elif plots:
        base = md_path.parent if md_path else out_dir
        links = [os.path.relpath(p, base) for p in plots]
    result["loadavg_end"] = loadavg()
    result["finished_at"] = time.strftime("%Y-%m-%d %H:%M %Z")
    result["wall_s"] = time.time() - t_start
    with open(json_path, "w") as f:  # the results first: nothing after this can lose them
        json.dump(result, f, indent=1, default=_json_default)
    log(f"wrote {json_path} ({result['wall_s']:.0f}s total)")
    md = render_markdown(cfg, result, links)
    (out_dir / "benchmark.md").write_text(md + "\n", encoding="utf-8")
    if md_path is not None:
        replace_marked_section(str(md_path), md)
        log(f"updated the benchmark section of {md_path}")
    for r in exact:
        if r["method"] in ("all",) or len(cfg.methods) == 1:
            pn, pp = r["p_value"], r.get("p_value_permutation")
            print(f"exactness (T={r['temperature']:g}, batch {r['batch_size']}): two-sample chi-square "
                  f"p-value = {'n/a' if pn is None else format(pn, '.4g')} (nominal), "
                  f"{'n/a' if pp is None else format(pp, '.4g')} (sequence permutation)", flush=True)
    return 0


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
