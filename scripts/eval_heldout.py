"""Teacher-forced held-out alpha of an EAGLE draft on one or more prompt files.

``python scripts/eval_heldout.py --prompts configs/train/prompts_heldout.txt
configs/train/prompts_heldout_b.txt --draft default --max-new 96 --positions 4``

Per file, the same machinery as a training run's held-out evaluation
(:mod:`specjax.train.distill`): the target's own continuations of the prompts (sampled at
temperature 1 with ``--seed``, the held-out split's row keys; ``build_data``, cached under
``--cache-dir``), then along the head's own feature chain at draft positions 1..positions
(``make_eval`` / ``evaluate``): the exact overlap alpha = sum_x min(p, q) at temperature 1
and the greedy agreement argmax q == argmax p, over the generated positions only (the chat
template and the prompt are not counted). The draft is loaded through the draft-file API
(``specjax.build.resolve_draft``; weights upcast to float32, as training evaluates).

Prompt files: one user message per line (the chat template is applied); blank lines and lines
starting with ``#`` are skipped.
"""
from __future__ import annotations

import json
import os
import sys
import time


def eval_draft_of(model, target):
    """A :class:`specjax.train.distill.Draft` (what ``make_eval`` scores) of a loaded
    :class:`specjax.models.eagle.EagleModel` bound to ``target``."""
    from flax import nnx

    from specjax.models.eagle import EagleModel, Frozen, target_head
    from specjax.train import distill as T

    if not isinstance(model, EagleModel):
        raise ValueError(f"teacher-forced evaluation needs an EAGLE head, got {type(model).__name__}")
    graphdef, frozen, params = nnx.split(model.module(), Frozen, nnx.Param)
    return T.Draft("eagle", graphdef, frozen, params, model.config, target_head(target), None, model.token_map())


def heldout_eval(target, tok, model, path, *, target_spec=None, prompt_format="chat", max_new=96, positions=4,
                 samples=1, max_prompts=0, seed=0, cache_dir="data_cache/eval_heldout", gen_batch=40,
                 teacher_batch=8, eval_batch=4, log=lambda s: None) -> dict:
    """Held-out alpha / greedy agreement of the EAGLE head ``model`` on the prompts of ``path``.

    ``target_spec`` (a :class:`specjax.train.distill.TargetSpec`, default: the default target)
    names the target in the data cache key; ``prompt_format`` as ``data.prompt_format``."""
    from specjax.train import distill as T

    spec = target_spec or T.TargetSpec()
    dc = T.DataConfig(prompts=path, heldout=path, prompt_format=prompt_format, max_heldout=max_prompts,
                      samples_per_prompt=samples, max_new_tokens=max_new, gen_batch=gen_batch,
                      teacher_batch=teacher_batch, temperature=1.0, cache_dir=cache_dir)
    # an EAGLE-3 head reads several layers: the data then holds them (its own cache key)
    layers = tuple(getattr(getattr(model, "config", None), "feature_layers", ()) or ())
    cfg = T.RunConfig(seed=seed, target=spec, data=dc, draft=T.DraftConfig(feature_layers=list(layers) or None),
                      train=T.TrainConfig())
    data = T.build_data(cfg, "heldout", target, tok, log)
    draft = eval_draft_of(model, target)
    res = T.evaluate(T.make_eval(draft, positions), draft.trainable, data, eval_batch)
    gen = int((data["lengths"] - data["prompt_lens"]).sum())
    return dict(file=path, rows=int(data["tokens"].shape[0]), generated_tokens=gen, **res)


def table(results) -> str:
    n = len(results[0]["alpha"])
    pos = " / ".join(str(j + 1) for j in range(n))
    lines = [f"| prompts | rows | generated tokens | alpha, positions {pos} | greedy agreement, positions {pos} |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| `{r['file']}` | {r['rows']} | {r['generated_tokens']} | "
                     f"{' / '.join(f'{x:.3f}' for x in r['alpha'])} | "
                     f"{' / '.join(f'{x:.3f}' for x in r['greedy'])} |")
    return "\n".join(lines)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CACHE = os.path.join(REPO, "data_cache", "eval_heldout")


def _check_eagle_draft(ap, spec, cfg) -> None:
    """--draft names an EAGLE head that fits the target: checked from metadata alone."""
    from specjax import build
    from specjax.drafts import LOOKUP_NAMES
    from specjax.drafts.files import SHIPPED, read_draft_meta

    try:
        build.check_draft_metadata(spec, cfg)
        if spec == "default":
            why = None if cfg.name in SHIPPED else f"the default draft of {cfg.name!r} is prompt lookup"
        elif spec == "none" or spec in LOOKUP_NAMES or build.draft_layers(spec) is not None:
            why = f"{spec!r} is none"
        elif spec.endswith(".npz"):
            kind = read_draft_meta(spec).get("kind")
            why = None if kind == "eagle" else f"the file holds a {kind!r} draft"
        else:
            why = "a draft model is not one"
    except ValueError as e:
        ap.error(f"--draft: {str(e).splitlines()[0]}")
    if why:
        ap.error(f"--draft {spec}: teacher-forced evaluation needs an EAGLE head ({why})")


def main(argv=None) -> int:
    from specjax.cli import OneLineParser

    ap = OneLineParser(prog="eval_heldout.py", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                    help="prompt files (one message a line; relative paths: from the current directory)")
    ap.add_argument("--draft", default="default", help="default (the shipped head) or a draft file (.npz)")
    ap.add_argument("--max-new", type=int, default=96, help="new tokens per continuation (default 96)")
    ap.add_argument("--positions", type=int, default=4, help="draft positions scored (default 4)")
    ap.add_argument("--samples", type=int, default=1, help="continuations per prompt (default 1)")
    ap.add_argument("--max-prompts", type=int, default=0, help="first N prompts of each file (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None,
                    help="data cache folder (default: data_cache/eval_heldout in the repository; a "
                         "relative path given here is from the current directory)")
    ap.add_argument("--eval-batch", type=int, default=4)
    ap.add_argument("--json", metavar="OUT", help="also write the results here")
    a = ap.parse_args(argv)
    for name in ("max_new", "positions", "samples", "eval_batch"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_prompts", "seed"):
        if getattr(a, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    from specjax.configs import read_prompt_file

    names = list(a.prompts)  # as given (the table shows these)
    a.prompts = [os.path.abspath(f) for f in a.prompts]  # from the current directory, not the repo
    texts = []
    for f in a.prompts:
        try:
            texts.append(read_prompt_file(f)[:a.max_prompts or None])
        except ValueError as e:
            ap.error(f"--prompts {e}")
    from specjax.cli import default_target_metadata

    tok, cfg = default_target_metadata(ap)
    _check_eagle_draft(ap, a.draft, cfg)
    limit = cfg.max_position or 1 << 30
    for f, lines in zip(names, texts):
        longest = max(len(tok.encode_user(ln)) for ln in lines)
        if longest + a.max_new > limit:
            ap.error(f"--prompts {f}: a prompt of {longest} tokens with --max-new {a.max_new} exceeds the "
                     f"model's context of {limit} tokens")
    a.cache_dir = DEFAULT_CACHE if a.cache_dir is None else os.path.abspath(a.cache_dir)
    if os.path.exists(a.cache_dir) and not os.path.isdir(a.cache_dir):
        ap.error(f"--cache-dir {a.cache_dir}: not a folder")
    try:
        os.makedirs(a.cache_dir, exist_ok=True)
    except OSError as e:
        ap.error(f"--cache-dir {a.cache_dir}: not a usable folder ({e.strerror or type(e).__name__})")
    if a.json:
        a.json = os.path.abspath(a.json)
        from specjax.configs import check_writable

        try:
            check_writable(a.json)
        except ValueError as e:
            ap.error(f"--json {e}")

    from specjax import build
    from specjax.drafts.files import load_draft_model
    from specjax.train import distill as T

    spec = T.TargetSpec()
    target, tok = T.load_target(spec)
    d, desc = build.resolve_draft(a.draft, target)
    if desc.get("kind") != "eagle":
        ap.error(f"--draft {a.draft}: not an EAGLE head ({desc.get('kind')})")
    model = load_draft_model(desc["path"], target, param_dtype="float32")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(f"draft: {desc['path']}")
    results = []
    for name, f in zip(names, a.prompts):
        t0 = time.time()
        r = heldout_eval(target, tok, model, f, target_spec=spec, max_new=a.max_new, positions=a.positions,
                         samples=a.samples, max_prompts=a.max_prompts, seed=a.seed, cache_dir=a.cache_dir,
                         eval_batch=a.eval_batch, log=log)
        r["file"], r["seconds"] = name, round(time.time() - t0, 1)
        log(json.dumps(r))
        results.append(r)
    print(table(results))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(draft=desc["path"], max_new=a.max_new, samples=a.samples, seed=a.seed,
                           results=results), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
