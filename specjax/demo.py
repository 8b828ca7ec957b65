"""Verify one block with a toy draft and target: ``python -m specjax.demo``.

Prints the draft tokens, the exact per-position overlap alpha = sum_x min(p, q), the
token-level acceptance probabilities min(1, p/q), block verification's w_i / h_i, and
what token and block verification accept and emit for the same round key.  (Laws of the
full round: :func:`specjax.verify.token_law` / :func:`specjax.verify.block_law`.)
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from specjax import keys, verify
from specjax.sampling import SamplingConfig, process_logits, sample

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "."]


def _toy_logits(seed: int, k: int):
    """Target logits for positions 1..K+1 and a draft that is a noisy copy of them."""
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(k + 1, len(WORDS))) * 2.0
    draft = target[:k] + rng.normal(size=(k, len(WORDS))) * 1.0
    return jnp.asarray(target, jnp.float32), jnp.asarray(draft, jnp.float32)


MAX_DEMO_K = 64  # a toy of K + 1 positions, one printed line each


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=4, help="draft length K")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.k <= MAX_DEMO_K:
        ap.error(f"argument --k: K must be an integer from 1 to {MAX_DEMO_K} (one line per position), got {args.k}")
    try:
        keys.check_seed(args.seed)
        cfg = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    except ValueError as e:
        ap.error(str(e))
    target_logits, draft_logits = _toy_logits(args.seed, args.k)
    # One pipeline, one call, for both sides (target rows first, then the draft rows).
    both = process_logits(jnp.concatenate([target_logits, draft_logits]),
                          cfg.to_params(2 * args.k + 1))
    tlp, dlp = both[:args.k + 1], both[args.k + 1:]

    row = keys.row_keys(args.seed, [0])[0]
    rk = keys.round_key(row, 0)
    draft_keys = jax.vmap(lambda i: keys.position_key(keys.role_key(rk, keys.DRAFT), i))(
        jnp.arange(args.k))
    draft = jax.vmap(sample)(draft_keys, dlp)  # toy draft: independent of the prefix

    alpha = np.asarray(verify.overlap_alpha(dlp, tlp[:-1]))
    accept = np.exp(np.asarray(verify.token_log_accept(draft, dlp, tlp)))
    log_w = verify.block_log_weights(draft, dlp, tlp)
    h = np.exp(np.asarray(verify.block_log_stop(log_w, dlp, tlp, args.k)))
    w = np.exp(np.asarray(log_w))

    print(f"settings: {cfg}")
    print(f"{'pos':>3} {'draft':>6} {'q(x)':>6} {'p(x)':>6} {'alpha':>6} "
          f"{'min(1,p/q)':>10} {'w_i':>6} {'h_i':>6}")
    for i in range(args.k):
        x = int(draft[i])
        print(f"{i + 1:>3} {WORDS[x]:>6} {np.exp(float(dlp[i, x])):6.3f} "
              f"{np.exp(float(tlp[i, x])):6.3f} {alpha[i]:6.3f} {accept[i]:10.3f} "
              f"{w[i + 1]:6.3f} {h[i + 1]:6.3f}")
    print(f"expected tokens/round from alphas (i.i.d.-position formula): "
          f"{float(verify.expected_tokens_per_round(alpha)):.3f}")

    for name, fn in (("token", verify.token_verify), ("block", verify.block_verify)):
        res = fn(rk, draft, dlp, tlp)
        n = int(res.num_accepted)
        emitted = [WORDS[int(t)] for t in np.asarray(res.tokens) if t != verify.PAD_ID]
        print(f"\n{name} verification: accepted {n}/{args.k} draft tokens "
              f"{[WORDS[int(t)] for t in np.asarray(draft)[:n]]}, then "
              f"{'bonus' if n == args.k else 'correction'} {emitted[-1]!r}")
        print(f"  emitted: {' '.join(emitted)}   (error={bool(res.error)})")


if __name__ == "__main__":
    main()
