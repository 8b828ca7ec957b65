"""The layers' matmuls on CPU with float32 weights against the GGUF's own blocks (a
benchmark, not a test).

    python scripts/bench_block_weights.py [--ms 1,2,4,8,16] [--rounds 9] [--gguf PATH]
        [--generate 1,4,16] [--new-tokens 48]

The library used to dequantize every GGUF tensor to float32 and stream 4 bytes per weight
per step. SmolLM2-135M's GGUF stores its layers as Q4_1 and its embedding (the tied LM
head) as Q8_0: blocks of 32 weights with a float16 scale (and offset). With
``weight_blocks`` (the GGUF loader's default where the CPU kernels apply) the model keeps
an int8 code per weight plus a float32 scale and offset per block and column (1.25 bytes
per weight), Q4 codes (0..15: the Q4_1 layers) packed two per byte (0.75 bytes per
weight), and the matmul kernel rebuilds each weight in registers with one fma: the
float32 weight, bit for bit, and the float32 kernel's sums. The block side packs the codes
where the model does (``cpu_kernels.packable_q4``); ``--int8`` keeps every code int8 (what
this script timed before 2026-12-07, when only the int8 path was measured here).

The workload: every matmul of one SmolLM2-135M step (30 layers x q, k, v, o, gate, up,
down, then the 576 x 49,152 LM head; the file's real weights) for M rows, in one jitted
call, through the float32 kernel and the block kernel, timed alternately round by round in
one process (a shared machine's slow spells hit both alike). Prints, per M, each one's
median ms and GB/s of weights read, and checks that the two give the same bits for every
matmul. ``--generate B,...``: then whole autoregressive generations of the default model
(``--new-tokens`` tokens of the benchmark prompts at each batch size, prefill included;
the best of 3 after a warm-up), float32 and block weights loaded side by side, with their
tokens compared.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

LAYER_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def matrices(path):
    """[(code [K, N], scale, offset [K / 32, N], float32 w [K, N])] of a step's matmuls, in
    the order of a step, from the GGUF at ``path`` (the loader's blocks, [in, out])."""
    import gguf

    from specjax.models.gguf_loader import _blocks, _dequantize

    by_name = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = sorted((n for n in by_name if n.startswith("blk.") and n.split(".")[2] in LAYER_KINDS),
                   key=lambda s: (int(s.split(".")[1]), LAYER_KINDS.index(s.split(".")[2])))
    names.append("output.weight" if "output.weight" in by_name else "token_embd.weight")
    out = []
    for n in names:
        t = by_name[n]
        if t.tensor_type.name not in ("Q8_0", "Q4_0", "Q4_1"):
            raise SystemExit(f"bench_block_weights: tensor {n} is {t.tensor_type.name}, not Q8_0 / Q4_0 / Q4_1")
        b = _blocks(t)
        out.append(tuple(np.ascontiguousarray(a.T) for a in (b.code, b.scale, b.offset, _dequantize(t))))
    return out


def inputs_for(x, k):
    return x if k == x.shape[1] else jnp.tile(x, (1, k // x.shape[1] + 1))[:, :k]


def step_f32(m, full=False):
    from specjax.models.cpu_kernels import small_matmul

    @jax.jit
    def f(x, ws):
        outs = [small_matmul(inputs_for(x, w.shape[0]), w) for w in ws]
        return outs if full else jnp.concatenate([y[:, :8] for y in outs], axis=1)

    return f


def step_blocks(m, full=False):
    from specjax.models.cpu_kernels import block_matmul

    @jax.jit
    def f(x, bs):
        outs = [block_matmul(inputs_for(x, code.shape[0]), code, scale, off) for code, scale, off in bs]
        return outs if full else jnp.concatenate([y[:, :8] for y in outs], axis=1)

    return f


def main(argv=None):
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,2,4,8,16", help="row counts M")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--gguf", default=None, help="a Q8_0 / Q4_0 / Q4_1 Llama GGUF (default: SmolLM2-135M's)")
    ap.add_argument("--generate", default="", help="batch sizes for whole generations (e.g. 1,4,16)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--int8", action="store_true", help="int8 codes everywhere (no Q4 packing)")
    args = ap.parse_args(argv)
    from scripts.bench_auto_ab import _ints

    ms, gens = _ints(ap, "--ms", args.ms), _ints(ap, "--generate", args.generate, allow_empty=True)
    if args.rounds < 1 or args.new_tokens < 1:
        ap.error("--rounds and --new-tokens take positive numbers")
    from specjax.models.gguf_loader import default_gguf_path

    path = args.gguf or default_gguf_path()
    mats = matrices(path)
    if not args.int8:  # as the loader keeps them
        from specjax.models.cpu_kernels import pack_q4, packable_q4

        mats = [(pack_q4(c) if packable_q4(c) else c, s, o, w) for c, s, o, w in mats]
    wbytes = sum(w.nbytes for *_, w in mats)
    bbytes = sum(c.nbytes + s.nbytes + o.nbytes for c, s, o, _ in mats)
    print(f"{path}: {len(mats)} matrices, float32 weights {wbytes / 1e6:.0f} MB, blocks {bbytes / 1e6:.0f} MB")
    ws = [jnp.asarray(w) for *_, w in mats]
    bs = [tuple(jnp.asarray(a) for a in (c, s, o)) for c, s, o, _ in mats]
    rng = np.random.default_rng(0)
    print("| M | float32 kernel, ms | GB/s | blocks, ms | GB/s | blocks / float32 | bits |")
    print("|---|---|---|---|---|---|---|")
    for m in ms:
        x = jnp.asarray(rng.standard_normal((m, 576), np.float32))
        ya = step_f32(m, full=True)(x, ws)
        yb = step_blocks(m, full=True)(x, bs)
        same = all(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
                   for a, b in zip(ya, yb))
        fa, fb = step_f32(m), step_blocks(m)
        fa(x, ws).block_until_ready()
        fb(x, bs).block_until_ready()
        ta, tb, ratio = [], [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            fa(x, ws).block_until_ready()
            t1 = time.perf_counter()
            fb(x, bs).block_until_ready()
            t2 = time.perf_counter()
            ta.append(t1 - t0)
            tb.append(t2 - t1)
            ratio.append((t2 - t1) / (t1 - t0))
        a, b = np.median(ta), np.median(tb)
        print(f"| {m} | {a * 1e3:.2f} | {wbytes / a / 1e9:.1f} | {b * 1e3:.2f} | {bbytes / b / 1e9:.1f} | "
              f"{np.median(ratio):.2f} | {'same' if same else 'DIFFERENT'} |", flush=True)
        if not same:
            raise SystemExit("bench_block_weights: the block kernel's bits differ from the float32 kernel's")
    if gens:
        generations(gens, args.new_tokens, args.gguf)


def generations(batches, new_tokens, path=None):
    """Autoregressive generations with float32 and with block weights, timed in turn."""
    from scripts.bench.config import read_prompts
    from specjax.build import load_target, make_autoregressive_engine

    spec = path or "default"
    texts = read_prompts("configs/bench/prompts.txt")
    engines, tok = {}, None
    for blocks in (False, True):
        target, t, _ = load_target(spec, weight_blocks=blocks)
        tok = tok or t
        engines[blocks] = make_autoregressive_engine(target)
    print("| batch | float32 s | blocks s | float32 / blocks | same tokens |")
    print("|---|---|---|---|---|")
    for b in batches:
        ids = [tok.encode_user(texts[i % len(texts)]) for i in range(b)]
        times, toks = {False: [], True: []}, {}
        for blocks, e in engines.items():
            toks[blocks] = np.asarray(e.generate(ids, seed=0, max_new_tokens=new_tokens).tokens)
        for _ in range(3):
            for blocks, e in engines.items():
                t0 = time.perf_counter()
                e.generate(ids, seed=0, max_new_tokens=new_tokens)
                times[blocks].append(time.perf_counter() - t0)
        f, q = min(times[False]), min(times[True])
        print(f"| {b} | {f:.3f} | {q:.3f} | {f / q:.2f} | {np.array_equal(toks[False], toks[True])} |", flush=True)


if __name__ == "__main__":
    main()
