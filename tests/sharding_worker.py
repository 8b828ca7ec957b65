"""Multi-device checks for tests/test_sharding.py, run in a SUBPROCESS with 8 fake CPU
devices (XLA_FLAGS must be set before jax is imported, and pytest already imported it):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python -m tests.sharding_worker OUT.json --meshes 2x4 [--refs]

It writes one JSON object: the tokens of the speculative engine (greedy, token, block)
and of the autoregressive baseline on each mesh (``--refs``: also on one device), the
logits of one forward pass compared with one device, the shardings of parameters, KV
caches and logits, and a scan of each compiled sharded program for collectives that
move a full-vocabulary array. The test compares the tokens across processes.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np

V = 4096  # > 256 * 8: the top-m candidates of 8 vocabulary shards are fewer than V
K = 3
MAX_NEW = 16
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [3, 3, 3, 3],
           [7, 1, 2]]  # 5 rows: padded to 6 on the 2x4 mesh (data axis 2)
# mesh -> sharding config (the draft replicated over `model` or sharded like the target)
MESHES = {"1x8": "tp_draft_sharded", "2x4": "tp"}
METHODS = ("greedy", "token", "block")
AR_MESH = "2x4"

# collectives whose result has a vocabulary-sized axis (or [.., s, V/s]: V split in two)
_COLL = re.compile(r"=\s*(.*?)\s+(all-gather|all-reduce|all-to-all|collective-permute)"
                   r"(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_OPNAME = re.compile(r'op_name="([^"]*)"')


def _axis(entry):
    """A PartitionSpec entry as JSON: None, a mesh axis name, or a list of them."""
    return list(entry) if isinstance(entry, tuple) else entry


def scan_hlo(text: str, v: int) -> dict:
    bad, counts, reduce_ops = [], {}, []
    for line in text.splitlines():
        m = _COLL.search(line)
        if not m:
            continue
        kind = m.group(2)
        counts[kind] = counts.get(kind, 0) + 1
        op = _OPNAME.search(line)
        op = op.group(1) if op else "?"
        for dt, dims in _SHAPE.findall(m.group(1)):
            shape = [int(d) for d in dims.split(",") if d]
            if v in shape or (len(shape) >= 2 and shape[-1] * shape[-2] == v):
                bad.append(f"{kind} {dt}{shape} ({op})")
        if kind == "all-reduce":
            reduce_ops.append(op.rsplit("/", 1)[-1])
    return {"counts": counts, "full_vocab": bad,
            "all_reduce_ops": sorted(set(reduce_ops))}


def main(out_path: str, meshes: list, refs: bool) -> None:
    t_start = time.time()
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax.models.llama import LlamaLM, tiny_config
    from specjax import build, engine, sampling
    from specjax import sharding as S
    from specjax.drafts import DraftModelProposer

    assert len(jax.devices()) == 8, jax.devices()
    res: dict = {"devices": len(jax.devices()), "cases": {}, "timings": {}}
    # GQA target (16 query heads, 8 kv heads), layers stacked (scan), untied LM head
    tcfg = tiny_config(vocab_size=V, n_layers=2, dim=32, n_heads=16, n_kv_heads=8, head_dim=8,
                       ffn_dim=64, tie_embeddings=False, scan_layers=True)
    dcfg = tiny_config(vocab_size=V, n_layers=1, dim=16, n_heads=8, n_kv_heads=8, head_dim=8,
                       ffn_dim=32, tie_embeddings=True)
    target = LlamaLM.init(tcfg, seed=3)
    draft = LlamaLM.init(dcfg, seed=4)
    tw, dw = target.canonical_weights(), draft.canonical_weights()
    b = len(PROMPTS)
    sp = {
        "greedy": sampling.SamplingParams.create(b),
        "token": sampling.SamplingParams.create(
            b, temperature=[1.0, 0.8, 0.0, 1.3, 0.7], top_k=[0, 40, 0, 0, 300],
            top_p=[1.0, 1.0, 1.0, 1.0, 0.95], min_p=[0, 0, 0, 0.02, 0]),
        "block": sampling.SamplingParams.create(
            b, temperature=[1.0, 0.9, 1.0, 0.0, 1.0], top_p=[1.0, 0.9, 1.0, 1.0, 0.8],
            repetition_penalty=[1.0, 1.0, 1.3, 1.0, 1.0]),
    }
    keys = jax.random.split(jax.random.key(1234), b)

    def run(eng, method):
        return eng.generate(PROMPTS, keys=keys, sampling_params=sp[method], max_new_tokens=MAX_NEW)

    def summary(out):
        return {"tokens": out.tokens, "stopped": out.finished_by_stop,
                "accepted": None if out.stats is None else [s.accepted for s in out.stats]}

    toks8 = np.array([(p * 4)[:8] for p in PROMPTS] + [[j + 1] * 8 for j in range(8 - len(PROMPTS))], np.int32)
    fwd = jax.jit(lambda p, t: target.apply(p, t, target.init_cache(8, 16)).logits)
    ref_logits = np.asarray(fwd(target.params, toks8))
    # hidden states of several layers from the same forward (an EAGLE-3 head's features)
    fwd_h = jax.jit(lambda p, t: target.apply(p, t, target.init_cache(8, 16), return_hidden=(0, 1, 2)).hidden)
    ref_hidden = np.asarray(fwd_h(target.params, toks8))

    # ---- single-device references (device 0) ---------------------------------------------
    if refs:
        t0 = time.time()
        res["refs"] = {m: summary(run(engine.SpeculativeEngine(
            target, DraftModelProposer(draft, K), m), m)) for m in METHODS}
        res["refs"]["ar"] = summary(engine.AutoregressiveEngine(target).generate(
            PROMPTS, keys=keys, sampling_params=sp["token"], max_new_tokens=MAX_NEW))
        res["timings"]["single_device"] = round(time.time() - t0, 1)
        # build(): a whole run from names, on one device and on the 8-device "tp" mesh
        # (a draft model from the target's first layer; 5 rows padded to the data axis)
        runs = {}
        for mesh in (None, "tp"):
            spec = build.RunSpec(target="tiny", draft="layers:1", k=2, mesh=mesh,
                                 sampling=sampling.SamplingConfig(temperature=1.0, top_p=0.9))
            r = build.build(spec)
            runs[mesh or "one"] = {"spec": summary(r.generate(PROMPTS, seed=5, max_new_tokens=MAX_NEW)),
                                   "ar": summary(r.generate_autoregressive(PROMPTS, seed=5,
                                                                           max_new_tokens=MAX_NEW)),
                                   "devices": len(jax.tree.leaves(r.target.params)[0].devices())}
        res["build_runs"] = runs

    for mesh_name in meshes:
        t0 = time.time()
        cfg_name = MESHES[mesh_name]
        data, model = map(int, mesh_name.split("x"))
        plan = S.make_plan(cfg_name, data=data, model=model)
        tg = build.load_model(tcfg, tw, plan, "target")
        dr = build.load_model(dcfg, dw, plan, "draft")
        info: dict = {"config": cfg_name}
        # parameter shardings: what the rules say (all of them), a few spelled out by the test
        specs = {"target": {}, "draft": {}}
        mismatch = []
        for role, lm in (("target", tg), ("draft", dr)):
            want = S.param_shardings(lm.params, plan, role)
            logical = jax.tree.leaves(nnx.get_partition_spec(lm.params),
                                      is_leaf=lambda x: isinstance(x, P))
            for (path, a), sh, names in zip(jax.tree_util.tree_leaves_with_path(lm.params),
                                            jax.tree.leaves(want), logical):
                name = jax.tree_util.keystr(path)
                specs[role][name] = {"mesh": [_axis(e) for e in a.sharding.spec],
                                     "logical": list(names), "shape": list(a.shape)}
                if a.sharding != sh:
                    mismatch.append(f"{role}{name}: {a.sharding.spec} != {sh.spec}")
        info["param_specs"] = specs
        info["param_mismatch"] = mismatch
        info["fallbacks"] = sorted(plan.fallbacks.values())

        def equivalent(arr, spec):
            return arr.sharding.is_equivalent_to(NamedSharding(plan.mesh, spec), arr.ndim)

        # logits of one forward: values and sharding (propagated from the rules, no constraint)
        with plan.context():
            lg = jax.jit(lambda p, t: tg.apply(p, t, tg.init_cache(8, 16)).logits)(
                tg.params, plan.put(toks8))
        info["logits_spec"] = str(lg.sharding.spec)
        info["logits_sharding_ok"] = bool(equivalent(lg, P("data", None, "model")))
        info["logits_max_abs_diff"] = float(np.max(np.abs(np.asarray(lg) - ref_logits)))
        # the TPU layouts on the mesh: w_gate_up [2, D, F] (LlamaConfig.gate_up_first), wqkv
        # [Nkv, G+2, H, D] (qkv_input_last) and wo [N*H, D] (wo_flat)
        tg2 = build.load_model(tcfg.replace(gate_up_first=True, qkv_input_last=True, wo_flat=True), tw, plan,
                               "target")
        with plan.context():
            lg2 = jax.jit(lambda p, t: tg2.apply(p, t, tg2.init_cache(8, 16)).logits)(
                tg2.params, plan.put(toks8))
        info["tpu_layouts_logits_max_abs_diff"] = float(np.max(np.abs(np.asarray(lg2) - ref_logits)))
        info["tpu_layouts_specs"] = {k: [_axis(e) for e in tg2.params["layers"][k][...].sharding.spec]
                                     for k in ("w_gate_up", "wqkv", "wo")}
        with plan.context():
            hd = jax.jit(lambda p, t: tg.apply(p, t, tg.init_cache(8, 16), return_hidden=(0, 1, 2)).hidden)(
                tg.params, plan.put(toks8))
        info["hidden_max_abs_diff"] = float(np.max(np.abs(np.asarray(hd) - ref_hidden)))
        # the target KV cache as the engine constrains it (after a prefill)
        with plan.context():
            cache = jax.jit(lambda p, t: plan.constrain_cache(
                tg.apply(p, t, tg.init_cache(8, 16)).cache))(tg.params, plan.put(toks8))
        info["target_cache_spec"] = str(cache.k.sharding.spec)
        info["target_cache_sharding_ok"] = bool(equivalent(cache.k, P(None, "data", "model")))

        for m in METHODS:
            eng = engine.SpeculativeEngine(tg, DraftModelProposer(dr, K), m, sharding=plan)
            out = run(eng, m)
            case = summary(out)
            dc = out.raw["proposer_state"].k  # the draft's KV cache, as the loop left it
            want = P(None, "data", "model") if cfg_name == "tp_draft_sharded" else P(None, "data")
            case["draft_cache_spec"] = str(dc.sharding.spec)
            case["draft_cache_sharding_ok"] = bool(equivalent(dc, want))
            if m != "greedy":  # the compiled program generate just ran (cached: no recompile)
                case["hlo"] = scan_hlo(eng.lower(PROMPTS, keys=keys, sampling_params=sp[m],
                                                 max_new_tokens=MAX_NEW).compile().as_text(), V)
            info[m] = case
        if mesh_name == AR_MESH:
            info["ar"] = summary(engine.AutoregressiveEngine(tg, sharding=plan).generate(
                PROMPTS, keys=keys, sampling_params=sp["token"], max_new_tokens=MAX_NEW))
            # random weights created directly in their shardings (jit out_shardings)
            ti = build.init_model(tcfg, 3, plan, "target")
            info["init_shardings_equal"] = all(
                a.sharding == c.sharding for a, c in zip(jax.tree.leaves(ti.params),
                                                          jax.tree.leaves(tg.params)))
            info["init_max_abs_diff"] = max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(c))))
                for a, c in zip(jax.tree.leaves(ti.params), jax.tree.leaves(target.params)))
        res["cases"][mesh_name] = info
        res["timings"][mesh_name] = round(time.time() - t_start, 1)

    res["timings"]["total"] = round(time.time() - t_start, 1)
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        sys.exit("run with XLA_FLAGS=--xla_force_host_platform_device_count=8")
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--meshes", default=",".join(MESHES))
    ap.add_argument("--refs", action="store_true", help="also the single-device references")
    a = ap.parse_args()
    main(a.out, [m for m in a.meshes.split(",") if m], a.refs)
