"""Measure a trained draft inside the engine on held-out prompts.

``python scripts/eval_draft.py runs/eagle_smollm2/draft.npz --k 4 --prompts 8``: per-position
acceptance and mean exact alpha at temperature 1 (token verification) and 0 (greedy), and
wall times against autoregressive decoding of the same prompts (each program compiled before
it is timed)."""
from __future__ import annotations

import json
import os
import time

import numpy as np


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FILE = os.path.join(REPO, "configs", "train", "prompts_heldout.txt")


def main(argv=None):
    from specjax.cli import OneLineParser, default_target_metadata

    ap = OneLineParser(prog="eval_draft.py", description=__doc__.splitlines()[0])
    ap.add_argument("draft", help="a draft spec or file, as specjax generate --draft takes (not 'none')")
    ap.add_argument("--k", type=int, default=None, help="draft tokens per round (default: specjax.build.DEFAULT_K)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--file", default=DEFAULT_FILE,
                    help="prompts, one a line, '#' lines comments (default: configs/train/prompts_heldout.txt "
                         "in the repository; a relative path given here is from the current directory)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=0, help="prompts per generate call (0: all in one batch)")
    ap.add_argument("--no-timing", action="store_true")
    a = ap.parse_args(argv)
    if a.batch < 0 or a.prompts < 1 or a.max_new_tokens < 1:
        ap.error("--batch must be >= 0, --prompts and --max-new-tokens >= 1")
    if a.k is not None and a.k < 1:
        ap.error(f"--k must be >= 1, got {a.k}")
    if a.draft == "none":
        ap.error("draft 'none' has no draft to measure (give default, lookup, layers:N or a draft file)")
    a.file = os.path.abspath(a.file)
    from specjax.configs import read_prompt_file

    try:  # '#' lines are comments
        lines = read_prompt_file(a.file)[: a.prompts]
    except ValueError as e:
        ap.error(f"--file {e}")
    from specjax import build

    if a.k is None:
        a.k = build.DEFAULT_K
    # the target's tokenizer and config from its metadata, the draft's: before any weights load
    tok, cfg = default_target_metadata(ap)
    try:
        build.check_draft_metadata(a.draft, cfg)
        if build.draft_layers(a.draft) is not None:
            from specjax.drafts.model import check_first_layers

            check_first_layers(build.draft_layers(a.draft), cfg.n_layers)
    except ValueError as e:
        ap.error(str(e).splitlines()[0])
    prompts = [tok.encode_user(ln) for ln in lines]
    limit = cfg.max_position or 1 << 30
    longest = max(len(p) for p in prompts)
    if longest + a.max_new_tokens + a.k > limit:
        ap.error(f"a prompt of {longest} tokens with --max-new-tokens {a.max_new_tokens} and --k {a.k} "
                 f"exceeds the model's context of {limit} tokens")
    from specjax import engine, sampling
    from specjax.drafts import make_proposer

    target, tok, _ = build.load_target("default")
    size = a.batch or len(prompts)
    # (prompts, their rows' indices): every row keeps its own key whatever the grouping
    groups = [(prompts[i:i + size], list(range(i, min(i + size, len(prompts)))))
              for i in range(0, len(prompts), size)]
    prop = make_proposer(build.resolve_draft(a.draft, target)[0], a.k, target.vocab_size)
    res = {}
    for name, temp, method in (("t1", 1.0, "token"), ("t0", 0.0, "greedy")):
        sp = sampling.SamplingConfig(temperature=temp)
        eng = engine.SpeculativeEngine(target, prop, method)
        kw = dict(seed=0, sampling_params=sp, max_new_tokens=a.max_new_tokens, stop_tokens=list(tok.stop_ids))
        for g, rows in groups:  # compiled first: the timed calls decode only
            eng.compile(g, row_indices=rows, **kw)
        t0 = time.time()
        outs = [eng.generate(g, row_indices=rows, **kw) for g, rows in groups]
        t_sp = time.time() - t0
        tokens, stats = [t for o in outs for t in o.tokens], [s for o in outs for s in o.stats]
        reached = np.sum([s.reached_per_position for s in stats], 0)
        acc = np.sum([np.nan_to_num(np.array(s.accepted_per_position) * np.array(s.reached_per_position))
                      for s in stats], 0)
        emitted = sum(s.emitted for s in stats)
        rounds = sum(s.rounds for s in stats)
        alpha = np.nanmean([s.mean_alpha for s in stats])
        r = dict(accept_per_position=[round(float(x), 3) for x in acc / np.maximum(reached, 1)],
                 mean_alpha=round(float(alpha), 3), tokens_per_round=round(emitted / rounds, 3),
                 emitted=emitted, spec_seconds=round(t_sp, 2))
        if not a.no_timing:
            are = build.make_autoregressive_engine(target)
            for g, rows in groups:
                are.compile(g, greedy=temp == 0, row_indices=rows, **kw)
            t0 = time.time()
            ar_tokens = [t for g, rows in groups
                         for t in are.generate(g, greedy=temp == 0, row_indices=rows, **kw).tokens]
            r["ar_seconds"] = round(time.time() - t0, 2)
            r["ar_emitted"] = sum(len(t) for t in ar_tokens)
            if temp == 0:
                r["greedy_equal"] = ar_tokens == tokens
        res[name] = r
        print(name, json.dumps(r), flush=True)
    return res


if __name__ == "__main__":
    main()
