"""Speculative generation on a device mesh, single- or multi-host (TPU slices, GPU nodes).

    # one host (all local devices), random weights of the pod's shapes:
    python scripts/generate_sharded.py --pod llama3-70b_v5p-64 --random-weights --batch 8
    # every host of a TPU slice runs the same command (see docs/TPU.md):
    python scripts/generate_sharded.py --pod llama3-70b_v5p-64 --multihost \\
        --target-ckpt /mnt/ckpt/Llama-3.1-70B --draft-ckpt /mnt/ckpt/Llama-3.1-8B \\
        --prompts-file prompts.jsonl

* ``--multihost`` (or ``JAX_COORDINATOR_ADDRESS`` in the environment) calls
  ``jax.distributed.initialize()`` first; on Cloud TPU it needs no arguments.
* Every host reads the same checkpoint (HF folder on shared storage) and the same prompts
  file, and fills only its own devices: parameters with ``jax.make_array_from_callback``
  per shard (``specjax.build.place_model``), prompts/keys/settings with ``plan.put``.
  Random weights are created directly in their shardings (``specjax.build.init_model``).
* Only process 0 prints. Outputs are replicated, so every host could read them.

Prompts: a JSON-lines file, one list of token ids per line (or ``{"tokens": [...]}``);
without a file, ``--batch`` rows of ``--prompt-len`` pseudo-random ids.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _parser():
    from specjax.cli import OneLineParser  # one-line usage errors, exit 2
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pod", required=True, help="configs/pods/<name>.yaml stem or a path")
    ap.add_argument("--multihost", action="store_true",
                    help="call jax.distributed.initialize() (also implied by JAX_COORDINATOR_ADDRESS)")
    ap.add_argument("--data", type=int, default=None, help="override mesh.data")
    ap.add_argument("--model", type=int, default=None, help="override mesh.model")
    ap.add_argument("--target-ckpt", default=None, help="HF folder (overrides the pod's)")
    ap.add_argument("--draft-ckpt", default=None, help="HF folder (overrides the pod's)")
    ap.add_argument("--random-weights", action="store_true", help="ignore checkpoints")
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--method", choices=["token", "block", "greedy"], default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", action="store_true", help="also run the autoregressive baseline")
    ap.add_argument("--json", action="store_true", help="process 0 prints one JSON object")
    ap.add_argument("--print-tokens", action="store_true", help="include every row's tokens")
    return ap


def _read_prompts(path):
    """One JSON list of token ids (or ``{"tokens": [...]}``) per line; ValueError naming the
    line otherwise (checked before any model is built)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
                row = obj["tokens"] if isinstance(obj, dict) else obj
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path} line {n}: expected a JSON list of token ids or "
                                 f"{{\"tokens\": [...]}} ({type(e).__name__}: {e})") from None
            if not isinstance(row, list) or not row or not all(isinstance(t, int) and t >= 0 for t in row):
                raise ValueError(f"{path} line {n}: expected a non-empty list of token ids >= 0")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def main(argv=None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    import math

    from specjax.cli import check_counts
    from specjax.keys import check_seed

    check_counts(ap, a, ("data", "model", "batch", "prompt_len", "max_new_tokens", "k"))
    if a.temperature is not None and not (math.isfinite(a.temperature) and a.temperature >= 0):
        ap.error(f"--temperature must be a finite number >= 0, got {a.temperature}")
    try:
        check_seed(a.seed)
    except ValueError as e:
        ap.error(f"--seed: {e}")
    if a.random_weights and (a.target_ckpt or a.draft_ckpt):
        ap.error("--random-weights ignores checkpoints: --target-ckpt / --draft-ckpt do not apply")
    if a.prompts_file is not None and (a.batch is not None or a.prompt_len is not None):
        ap.error("--prompts-file gives the prompts: --batch / --prompt-len do not apply")
    prompts = None
    if a.prompts_file is not None:  # every host reads the same file
        try:
            prompts = _read_prompts(a.prompts_file)
        except (OSError, ValueError) as e:
            ap.error(f"--prompts-file: {e}")
    from specjax import sharding as S

    S.initialize_distributed(True if a.multihost else None)  # before any other JAX call

    import dataclasses

    import jax
    import numpy as np

    from specjax import build, engine, sampling
    from specjax.drafts import DraftModelProposer, PromptLookupProposer

    pod = build.load_pod_config(a.pod)
    g = dataclasses.replace(pod.generate, **{k: v for k, v in dict(
        batch=a.batch, prompt_len=a.prompt_len, max_new_tokens=a.max_new_tokens, k=a.k,
        method=a.method, temperature=a.temperature).items() if v is not None})
    over = {k: v for k, v in dict(data=a.data, model=a.model).items() if v is not None}
    n = len(jax.devices())
    plan = S.make_plan(pod.sharding, **over)
    S.log(f"[specjax] {jax.process_count()} process(es), {n} devices ({jax.devices()[0].device_kind}); "
          f"mesh data={plan.data_size} x model={plan.model_size}; pod {pod.name}")

    def make_model(preset, role, ckpt):
        t0 = time.time()
        if ckpt and not a.random_weights:
            from specjax.models.hf_checkpoint import load_hf

            runtime = dict(dtype=preset.config.dtype, param_dtype=preset.config.param_dtype,
                           scan_layers=preset.config.scan_layers)
            with jax.default_device(jax.devices("cpu")[0]):  # host memory, not device 0
                host = load_hf(ckpt, **runtime)
            lm = build.place_model(host, plan, role)
            del host
        else:
            lm = build.init_model(preset.config, seed=1 if role == "target" else 2, plan=plan, role=role)
        S.log(f"[specjax] {role}: {preset.config.num_params() / 1e9:.2f} B params placed in "
              f"{time.time() - t0:.1f}s; {S.tree_bytes_per_device(lm.params) / 2 ** 30:.2f} GiB per device")
        return lm

    target = make_model(pod.target, "target", a.target_ckpt or pod.checkpoint("target"))
    if pod.draft == "lookup":
        proposer = PromptLookupProposer(vocab_size=target.vocab_size, k=g.k)
    else:
        draft = make_model(pod.draft, "draft", a.draft_ckpt or pod.checkpoint("draft"))
        proposer = DraftModelProposer(draft, g.k)

    if prompts is not None:  # (ids beyond the vocabulary: the engine's check, before any compile)
        pass
    else:
        rng = np.random.default_rng(a.seed)  # the same on every host
        prompts = rng.integers(0, target.vocab_size, (g.batch, g.prompt_len)).tolist()
    sp = sampling.SamplingConfig(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)

    eng = engine.SpeculativeEngine(target, proposer, g.method, sharding=plan)
    t0 = time.time()
    out = eng.generate(prompts, seed=a.seed, sampling_params=sp, max_new_tokens=g.max_new_tokens)
    t_first = time.time() - t0
    t0 = time.time()
    out = eng.generate(prompts, seed=a.seed, sampling_params=sp, max_new_tokens=g.max_new_tokens)
    t_spec = time.time() - t0
    n_tok = sum(len(t) for t in out.tokens)
    rounds = sum(s.rounds for s in out.stats)
    result = {"pod": pod.name, "processes": jax.process_count(), "devices": n,
              "mesh": dict(plan.mesh.shape), "rows": len(prompts), "tokens": n_tok,
              "seconds_first_call": round(t_first, 2), "seconds": round(t_spec, 3),
              "tokens_per_second": round(n_tok / t_spec, 1),
              "tokens_per_round": round(n_tok / max(rounds, 1), 3)}
    if a.compare:
        ar = engine.AutoregressiveEngine(target, sharding=plan)
        greedy = g.method == "greedy"  # the argmax chain's baseline is greedy decoding
        ar.generate(prompts, seed=a.seed, sampling_params=sp, max_new_tokens=g.max_new_tokens, greedy=greedy)
        t0 = time.time()
        base = ar.generate(prompts, seed=a.seed, sampling_params=sp, max_new_tokens=g.max_new_tokens,
                           greedy=greedy)
        t_ar = time.time() - t0
        result["autoregressive_tokens_per_second"] = round(sum(map(len, base.tokens)) / t_ar, 1)
        result["speedup"] = round(t_ar / t_spec * n_tok / max(sum(map(len, base.tokens)), 1), 3)
    if a.print_tokens:
        result["all_tokens"] = out.tokens
    if a.json:
        S.log(json.dumps(result))
    else:
        for k, v in result.items():
            S.log(f"  {k}: {v}")
        S.log(f"  row 0: {out.tokens[0][:32]}{' ...' if len(out.tokens[0]) > 32 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
