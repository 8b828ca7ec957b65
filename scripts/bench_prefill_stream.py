"""Long-prompt prefill time and the cost of streaming, on the default model (issue 16).

    python scripts/bench_prefill_stream.py                      # 3,000-token prompt, 128-token streams
    python scripts/bench_prefill_stream.py --prompt-tokens 6000 --repeats 5

Prints (and with --out writes as JSON):
* prefill: the compiled autoregressive engine on a prompt of --prompt-tokens tokens
  (README.md + ARCHITECTURE.md in the chat template, cut to that length) with one new
  token, and the speculative engine (default draft) with one round; best and all runs;
* streaming: ``generate`` against ``stream(chunk=4)`` and ``stream(chunk=1)`` on a short
  prompt, --new-tokens tokens (min_new_tokens = the same, so every pass generates them
  all), alternating passes; the tokens must be identical in every pass.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def long_prompt(tok, n_tokens: int) -> list:
    text = "Summarize this:\n" + (REPO / "README.md").read_text() + (REPO / "ARCHITECTURE.md").read_text()
    while len(tok.encode_user(text)) < n_tokens:
        text += text
    lo, hi = 0, len(text)
    while lo < hi:  # the longest cut whose chat prompt has at most n_tokens tokens
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tok.encode_user(text[:mid])) <= n_tokens else (lo, mid - 1)
    return tok.encode_user(text[:lo])


def timed(fn, repeats: int) -> list:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)

    from specjax import build, models, sampling

    tok = models.load_default_tokenizer()
    target, _, _ = build.load_target("default", with_tokenizer=False)
    draft, _ = build.resolve_draft("default", target)
    ar, spec = build.make_autoregressive_engine(target), build.make_engine(target, draft)
    res = {"command": "python scripts/bench_prefill_stream.py", "args": vars(a)}

    ids = [long_prompt(tok, a.prompt_tokens)]
    kw = dict(seed=0, sampling_params=sampling.SamplingConfig(temperature=0.0), max_new_tokens=1)
    for name, eng in (("autoregressive", ar), ("speculative", spec)):
        eng.compile(ids, **kw)
        ts = timed(lambda: eng.generate(ids, **kw), a.repeats)
        res[f"prefill_{name}_s"] = ts
        print(f"prefill {len(ids[0])} tokens, {name} engine: best {min(ts):.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in ts)})", flush=True)

    ids = [tok.encode_user("Write a short poem about the sea.")]
    n = a.new_tokens
    kw = dict(seed=0, sampling_params=sampling.SamplingConfig(temperature=0.7, top_p=0.9), max_new_tokens=n,
              min_new_tokens=n, stop_tokens=list(tok.stop_ids))
    spec.compile(ids, **kw)
    spec.compile(ids, stream=True, **kw)
    ref = spec.generate(ids, **kw).tokens
    runs = {"generate": [], "stream_chunk4": [], "stream_chunk1": []}
    for _ in range(a.repeats):
        for name in runs:
            t0 = time.perf_counter()
            out = (spec.generate(ids, **kw) if name == "generate"
                   else spec.stream(ids, chunk=int(name[-1]), **kw).run())
            runs[name].append(n / (time.perf_counter() - t0))
            if out.tokens != ref:
                raise SystemExit(f"{name}: the tokens differ from generate's")
    res["stream_tok_per_s"] = runs
    for name, v in runs.items():
        print(f"{name}: median {statistics.median(v):.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in v)})")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
