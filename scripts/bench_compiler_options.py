"""XLA compile options for the engines against XLA's defaults, in one process.

    python scripts/bench_compiler_options.py --options xla_cpu_use_fusion_emitters=false
        [--batches 1,4,16] [--temps 0,1] [--ks 2] [--auto] [--max-new 48] [--groups 1] [--passes 5]

Two sets of engines on the default target and draft: one compiled with ``--options``
(``NAME=VALUE`` pairs, comma-separated; true / false / integers / floats as such, else
strings) and one with XLA's defaults: the autoregressive engine, the fixed-K
engines of ``--ks`` and, with ``--auto``, k=auto (its cost tables measured fresh, in a
temporary directory, once per set). Per batch size: each program's compile time (wall and
CPU, JAX's compilation cache off), whether both sets give the same tokens, then per
temperature ``--passes`` passes that time every engine of both sets once, in turn (the order
of the two sets alternating from pass to pass) on the same rows of
``configs/bench/prompts.txt`` (no stop tokens). ``ratio``: the median over passes of the
``--options`` set's time over XLA's defaults' (below 1: the options decode faster).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from scripts.bench_auto_ab import DEFAULT_PROMPTS, _ints, _temps  # noqa: E402


def _options(ap, text) -> dict:
    """``NAME=VALUE[,NAME=VALUE...]`` -> a dict of XLA options."""
    out = {}
    for part in [x.strip() for x in text.split(",") if x.strip()]:
        name, eq, value = part.partition("=")
        if not eq or not name.strip() or not value.strip():
            ap.error(f"--options: expected NAME=VALUE pairs, got {part!r}")
        value = value.strip()
        if value.lower() in ("true", "false"):
            out[name.strip()] = value.lower() == "true"
            continue
        for kind in (int, float):
            try:
                out[name.strip()] = kind(value)
                break
            except ValueError:
                pass
        else:
            out[name.strip()] = value
    if not out:
        ap.error("--options: at least one NAME=VALUE")
    return out


def main(argv=None) -> int:
    from specjax.cli import OneLineParser

    ap = OneLineParser(prog="bench_compiler_options.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--options", required=True, help="XLA options, NAME=VALUE[,NAME=VALUE...]")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--ks", default="2", help="fixed K values, e.g. 1,2 ('' for none)")
    ap.add_argument("--auto", action="store_true", help="k=auto engines too (cost tables measured fresh)")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--groups", type=int, default=1, help="batches of different prompts per timed call")
    ap.add_argument("--passes", type=int, default=5)
    a = ap.parse_args(argv)
    if a.passes < 1 or a.groups < 1 or a.max_new < 1:
        ap.error("--passes, --groups and --max-new must be >= 1")
    batches, ks, temps = _ints(ap, "--batches", a.batches), _ints(ap, "--ks", a.ks, True), _temps(ap, a.temps)
    options = _options(ap, a.options)
    from specjax.configs import read_prompt_file

    texts = read_prompt_file(DEFAULT_PROMPTS)
    os.environ["SPECJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-costs-")
    import jax
    import numpy as np

    try:  # an option this XLA does not know: one line, before any work
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.zeros(1, np.float32)).compile()
    except Exception as e:
        ap.error(f"--options: {str(e).splitlines()[0]}")
    jax.config.update("jax_enable_compilation_cache", False)  # every compile timed is a compile
    from specjax import build, engine, sampling
    from specjax.drafts import make_proposer

    target, tok, _ = build.load_target("default")
    draft, _ = build.resolve_draft("default", target)
    sets = {"options": options, "xla": {}}
    print(f"compile options: {json.dumps(sets)}", flush=True)

    def engines(opts):
        out = {"ar": engine.AutoregressiveEngine(target, compiler_options=opts)}
        for k in ks:
            out[f"k{k}"] = engine.SpeculativeEngine(target, make_proposer(draft, k, target.vocab_size), "token",
                                                    compiler_options=opts)
        if a.auto:
            out["auto"] = engine.SpeculativeEngine(
                target, make_proposer(draft, build.AUTO_MAX_K, target.vocab_size), "token", adaptive=True,
                compiler_options=opts)
        return out

    engs = {name: engines(opts) for name, opts in sets.items()}
    kinds = list(engs["options"])
    for b in batches:
        groups = [[tok.encode_user(texts[(g * b + i) % len(texts)]) for i in range(b)] for g in range(a.groups)]
        kw = dict(seed=0, max_new_tokens=a.max_new)
        compile_s = {}
        for kind in kinds:
            for name in sets:
                eng = engs[name][kind]
                if kind == "auto":  # its cost table: measured with the streamed programs
                    t = time.perf_counter()
                    table = eng.costs_for(b, like=eng.prepare(groups[0], **kw))
                    print(f"batch {b}: {name} k=auto cost table (ms, drafting 0..K): "
                          f"{', '.join(f'{1e3 * x:.1f}' for x in table)} ({time.perf_counter() - t:.0f} s)",
                          flush=True)
                t, c = time.perf_counter(), time.process_time()
                eng.compile(groups[0], **kw)
                compile_s[f"{kind}/{name}"] = (round(time.perf_counter() - t, 2), round(time.process_time() - c, 2))
        print(json.dumps(dict(batch=b, compile_wall_cpu_s=compile_s)), flush=True)
        for temp in temps:
            sp = sampling.SamplingConfig(temperature=temp)

            def run(eng):
                return [eng.generate(g, sampling_params=sp, **kw) for g in groups]

            same = {}
            for kind in kinds:  # warm-up calls, and the tokens of both sets
                outs = {name: run(engs[name][kind]) for name in sets}
                same[kind] = all(x.tokens == y.tokens for x, y in zip(outs["options"], outs["xla"]))
            times = {f"{kind}/{name}": [] for kind in kinds for name in sets}
            for p in range(a.passes):
                order = list(sets) if p % 2 == 0 else list(sets)[::-1]
                for kind in kinds:
                    for name in order:
                        t = time.perf_counter()
                        run(engs[name][kind])
                        times[f"{kind}/{name}"].append(time.perf_counter() - t)
            ts = {k: np.asarray(v) for k, v in times.items()}
            row = dict(batch=b, temperature=temp, groups=a.groups, passes=a.passes, same_tokens=same)
            for kind in kinds:
                row[kind] = dict(options_s=round(float(np.median(ts[f"{kind}/options"])), 3),
                                 xla_s=round(float(np.median(ts[f"{kind}/xla"])), 3),
                                 ratio=round(float(np.median(ts[f"{kind}/options"] / ts[f"{kind}/xla"])), 3))
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
