"""Measure a trained draft inside the engine on held-out prompts.

``python scripts/eval_draft.py runs/eagle_smollm2/draft.npz --k 4 --prompts 8``: per-position
acceptance and mean exact alpha at temperature 1 (token verification) and 0 (greedy), and
wall times against autoregressive decoding of the same prompts (after a warm-up call)."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("draft")
    ap.add_argument("--k", type=int, default=None, help="draft tokens per round (default: specjax.build.DEFAULT_K)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--file", default="configs/train/prompts_heldout.txt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=0, help="0: all prompts in one batch")
    ap.add_argument("--no-timing", action="store_true")
    a = ap.parse_args(argv)
    from specjax import build, engine, sampling
    from specjax.drafts import make_proposer

    target, tok, _ = build.load_target("default")
    if a.k is None:
        a.k = build.DEFAULT_K
    with open(a.file, encoding="utf-8") as f:  # '#' lines are comments
        lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")][: a.prompts]
    prompts = [tok.encode_user(ln) for ln in lines]
    prop = make_proposer(build.resolve_draft(a.draft, target)[0], a.k, target.vocab_size)
    res = {}
    for name, temp, method in (("t1", 1.0, "token"), ("t0", 0.0, "greedy")):
        sp = sampling.SamplingConfig(temperature=temp)
        eng = engine.SpeculativeEngine(target, prop, method)
        kw = dict(seed=0, sampling_params=sp, max_new_tokens=a.max_new_tokens, stop_tokens=list(tok.stop_ids))
        eng.generate(prompts[:1], **dict(kw, max_new_tokens=4))
        t0 = time.time()
        out = eng.generate(prompts, **kw)
        t_sp = time.time() - t0
        reached = np.sum([s.reached_per_position for s in out.stats], 0)
        acc = np.sum([np.nan_to_num(np.array(s.accepted_per_position) * np.array(s.reached_per_position))
                      for s in out.stats], 0)
        emitted = sum(s.emitted for s in out.stats)
        rounds = sum(s.rounds for s in out.stats)
        alpha = np.nanmean([s.mean_alpha for s in out.stats])
        r = dict(accept_per_position=[round(float(x), 3) for x in acc / np.maximum(reached, 1)],
                 mean_alpha=round(float(alpha), 3), tokens_per_round=round(emitted / rounds, 3),
                 emitted=emitted, spec_seconds=round(t_sp, 2))
        if not a.no_timing:
            build.generate_autoregressive(target, prompts[:1], greedy=temp == 0, **dict(kw, max_new_tokens=4))
            t0 = time.time()
            ar = build.generate_autoregressive(target, prompts, greedy=temp == 0, **kw)
            r["ar_seconds"] = round(time.time() - t0, 2)
            r["ar_emitted"] = sum(len(t) for t in ar.tokens)
            if temp == 0:
                r["greedy_equal"] = ar.tokens == out.tokens
        res[name] = r
        print(name, json.dumps(r), flush=True)
    return res


if __name__ == "__main__":
    main()
