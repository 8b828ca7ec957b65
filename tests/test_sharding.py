"""Sharding: configs and rules (in process), and the multi-device checks (8 fake CPU devices
in subprocesses: ``tests/sharding_worker.py`` and ``scripts/dry_run.py``).

The multi-device subprocesses start together (module fixture) and run concurrently:
worker A = single-device references + mesh 2x4, worker B = mesh 1x8 (only with
``--extended``: the extended tier), plus the dry run of a small pod config. (Pure data parallelism, 8x1, was dropped for CI time: 2x4 pads rows
to its data axis too, and the dry run shards rows over data.) They use
``--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false`` (compile time:
worker A 134 -> 80 s of CPU, the same tokens as at level 0 alone and at level 1); the single-device
reference and the sharded runs compile with the same flags. So these runs check that sharding
changes nothing at equal flags, not the values themselves (the other files do, at the test
run's flags, tests/conftest.py): XLA's CPU backend at level 0 can miscompute (a fused penalty +
filter + log-normalization of 8 logits gave NaN there and the right values at 1 and 2:
docs/xla_cpu_o0.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import pytest
from jax.sharding import PartitionSpec as P

from specjax import build
from specjax import sharding as S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("greedy", "token", "block")
MESHES = ("1x8", "2x4")
# 1x8 (the model axis alone, over all 8 devices) is in the extended tier: 2x4 shards the model
# axis too, and rows over data (the other worker's CPU time, ~60 s, off the default run)
MESH_PARAMS = [pytest.param("1x8", marks=pytest.mark.extended), "2x4"]


# ------------------------------------------------------------------ configs and rules (1 device)


def test_every_mesh_and_pod_config_loads():
    from specjax.configs import list_configs

    assert list_configs("mesh") and list_configs("pods")
    for name in list_configs("mesh"):
        cfg = S.load_sharding_config(name)
        assert cfg.name == name
        assert cfg.target.get("batch") == "data"
    for name in list_configs("pods"):
        pod = build.load_pod_config(name)
        assert pod.devices >= 1 and pod.generate.batch >= 1
        data, model = pod.sharding.mesh.sizes(pod.devices)
        assert data * model == pod.devices
    tp = S.load_sharding_config("tp_draft_sharded")
    assert tp.draft == tp.target


def test_mesh_sizes_fill_and_errors():
    assert S.MeshConfig(data=-1, model=8).sizes(32) == (4, 8)
    assert S.MeshConfig(data=2, model=-1).sizes(8) == (2, 4)
    with pytest.raises(ValueError, match="does not divide"):
        S.MeshConfig(data=-1, model=3).sizes(8)
    with pytest.raises(ValueError, match="needs 16"):
        S.MeshConfig(data=4, model=4).sizes(8)
    with pytest.raises(ValueError, match="at most one"):
        S.MeshConfig(data=-1, model=-1)


def test_rules_validation():
    with pytest.raises(ValueError, match="unknown mesh axis"):
        S.sharding_from_dict({"rules": {"target": {"vocab": "tensor"}}})
    with pytest.raises(ValueError, match="unknown keys"):
        S.sharding_from_dict({"mesh": {}, "rulez": {}})
    with pytest.raises(ValueError, match="unknown rule sets"):
        S.sharding_from_dict({"rules": {"verifier": {}}})
    r = S.AxisRules.from_mapping({"batch": "data", "vocab": ["data", "model"], "embed": None})
    assert r.get("batch") == "data" and r.get("vocab") == ("data", "model")
    assert r.get("embed") is None and r.get("unknown") is None and r.get(None) is None


class _FakeMesh:
    shape = {"data": 2, "model": 4}


def test_spec_rules_fallback_and_axis_reuse():
    cfg = S.load_sharding_config("tp")
    plan = S.MeshPlan(_FakeMesh(), cfg)
    assert plan.spec(("embed", "vocab"), (32, 4096)) == P(None, "model")
    assert plan.spec(("layers", "batch", "cache_seq", "kv_heads", "head_dim"), (2, 8, 64, 8, 16)) == \
        P(None, "data", None, "model")
    # 3 kv heads on 4 devices: replicated, and recorded
    assert plan.spec(S.CACHE_NAMES, (2, 8, 3, 64, 16)) == P(None, "data")
    assert any("kv_heads" in m for m in plan.fallbacks.values())
    # a mesh axis serves one dimension only (the first that asks)
    assert plan.spec(("heads", "kv_heads"), (8, 8)) == P("model")
    # the draft's rules in tp.yaml: batch only
    assert plan.spec(("embed", "vocab"), (32, 4096), role="draft") == P()
    strict = S.MeshPlan(_FakeMesh(), dataclasses.replace(cfg, indivisible="error"))
    with pytest.raises(ValueError, match="not divisible"):
        strict.spec(S.CACHE_NAMES, (2, 8, 3, 64, 16))


def test_distributed_helpers_are_noops_on_one_host(monkeypatch, capsys):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert S.initialize_distributed() is False
    assert S.initialize_distributed(multihost=False) is False
    S.log("hello from", jax.process_index())
    assert capsys.readouterr().out == "hello from 0\n"
    monkeypatch.setattr(jax, "process_index", lambda: 3)
    S.log("not printed")
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ multi-device (subprocesses)


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                        "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def multi(tmp_path_factory, request):
    """Run the subprocesses concurrently; returns their parsed JSON (or the error). Worker B
    (mesh 1x8) only in a run with the extended tier."""
    from tests.conftest import extended

    d = tmp_path_factory.mktemp("sharding")
    jobs = {
        "a": [sys.executable, "-m", "tests.sharding_worker", str(d / "a.json"), "--meshes", "2x4",
              "--refs"],
        "b": [sys.executable, "-m", "tests.sharding_worker", str(d / "b.json"), "--meshes", "1x8"],
        "dry": [sys.executable, "scripts/dry_run.py", "ci-small_cpu-8", "--json"],
    }
    if not extended(request.config):
        del jobs["b"]
    t0 = time.time()
    procs = {k: subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, cmd in jobs.items()}
    out = {}
    for k, p in procs.items():
        try:
            so, se = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        out[k] = {"rc": p.returncode, "stdout": so, "stderr": se[-6000:]}
    for k in ("a", "b"):
        if k in out and out[k]["rc"] == 0:
            with open(d / f"{k}.json") as f:
                out[k]["json"] = json.load(f)
    if out["dry"]["rc"] == 0:
        out["dry"]["json"] = json.loads(out["dry"]["stdout"].strip().splitlines()[-1])
    out["wall"] = time.time() - t0
    return out


def _need(multi, k):
    r = multi[k]
    assert r["rc"] == 0, f"subprocess {k} failed (rc={r['rc']}):\n{r['stderr']}"
    return r["json"]


def _case(multi, mesh):
    return _need(multi, "a" if mesh == "2x4" else "b")["cases"][mesh]


def _show(ref, got):
    rows = [i for i in range(len(ref)) if ref[i] != got[i]]
    lines = []
    for i in rows:
        j = next((t for t, (x, y) in enumerate(zip(ref[i], got[i])) if x != y),
                 min(len(ref[i]), len(got[i])))
        lines.append(f"  row {i}: first difference at token {j}\n    single : {ref[i]}\n"
                     f"    sharded: {got[i]}")
    return "\n".join(lines)


@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", MESH_PARAMS)
@pytest.mark.parametrize("method", METHODS)
def test_generate_identical_to_single_device(multi, mesh, method):
    """Same keys -> same tokens: greedy and sampled (token, block) on every mesh. A flip
    caused by float reduction order would be shown here, row by row, not tolerated."""
    ref = _need(multi, "a")["refs"][method]
    got = _case(multi, mesh)[method]
    assert got["tokens"] == ref["tokens"], \
        f"{mesh} {method}: sharded output differs from one device\n" + _show(ref["tokens"], got["tokens"])
    assert got["stopped"] == ref["stopped"]
    assert got["accepted"] == ref["accepted"]  # the same rounds, not only the same text
    assert sum(map(len, got["tokens"])) > 0


@pytest.mark.multidevice
def test_build_on_a_mesh_gives_the_single_device_tokens(multi):
    """build.build(RunSpec(mesh="tp")) places the models on the 8 devices and runs both
    engines there: the same tokens as the same run on one device."""
    runs = _need(multi, "a")["build_runs"]
    assert runs["tp"]["devices"] == 8 and runs["one"]["devices"] == 1
    for kind in ("spec", "ar"):
        ref, got = runs["one"][kind]["tokens"], runs["tp"][kind]["tokens"]
        assert got == ref, f"build on tp, {kind}\n" + _show(ref, got)


@pytest.mark.multidevice
def test_autoregressive_identical_to_single_device(multi):
    ref = _need(multi, "a")["refs"]["ar"]["tokens"]
    got = _case(multi, "2x4")["ar"]["tokens"]
    assert got == ref, "2x4 autoregressive differs\n" + _show(ref, got)


@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", MESH_PARAMS)
def test_logits_and_cache_shardings(multi, mesh):
    c = _case(multi, mesh)
    assert c["logits_max_abs_diff"] < 1e-5, c["logits_max_abs_diff"]
    assert c["hidden_max_abs_diff"] < 1e-5, c["hidden_max_abs_diff"]  # several layers' hidden states
    # the TPU layouts, w_gate_up [layers, 2, D, F], wqkv [layers, Nkv, G+2, H, D] and wo
    # [layers, N*H, D]: F, the KV groups and the heads split over "model", the same logits
    assert c["tpu_layouts_logits_max_abs_diff"] < 1e-5, c["tpu_layouts_logits_max_abs_diff"]
    spec = {k: v + [None] * (n - len(v)) for (k, v), n in zip(c["tpu_layouts_specs"].items(), (4, 5, 3))}
    assert spec == {"w_gate_up": [None, None, None, "model"], "wqkv": [None, "model", None, None, None],
                    "wo": [None, "model", None]}, spec
    assert c["logits_sharding_ok"], f"logits {c['logits_spec']}, want (data, None, model)"
    assert c["target_cache_sharding_ok"], f"target cache {c['target_cache_spec']}"
    for m in METHODS:
        assert c[m]["draft_cache_sharding_ok"], (m, c[m]["draft_cache_spec"], c["config"])


# the rules of configs/mesh/tp.yaml, restated: the test does not reuse MeshPlan.spec
_TP = {"batch": "data", "vocab": "model", "heads": "model", "kv_heads": "model", "mlp": "model"}


@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", MESH_PARAMS)
def test_parameter_shardings_follow_rules(multi, mesh):
    c = _case(multi, mesh)
    assert not c["param_mismatch"], c["param_mismatch"]
    assert not c["fallbacks"], c["fallbacks"]
    model = int(mesh.split("x")[1])
    for role, params in c["param_specs"].items():
        rules = _TP if (role == "target" or c["config"] == "tp_draft_sharded") else {"batch": "data"}
        for name, p in params.items():
            want = [rules.get(n) if n else None for n in p["logical"]]
            got = p["mesh"] + [None] * (len(want) - len(p["mesh"]))
            assert got == want, f"{mesh} {role}{name} {p['logical']}: {p['mesh']}"
        if role == "target" or c["config"] == "tp_draft_sharded":
            # vocabulary-sharded embedding / head: each device holds V / model columns
            emb = params["['embed'].value"]
            assert "vocab" in emb["logical"] and "model" in emb["mesh"]
    tgt = c["param_specs"]["target"]
    assert any("model" in p["mesh"] for p in tgt.values()) or model == 1


@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", MESH_PARAMS)
@pytest.mark.parametrize("method", ("token", "block"))
def test_verification_never_gathers_the_vocabulary(multi, mesh, method):
    """Compiled HLO of the whole sharded program: no all-gather produces a [.., V] array;
    the normalisers, maxima and sums of sampling/verification are all-reduces of small
    arrays."""
    h = _case(multi, mesh)[method]["hlo"]
    assert not h["full_vocab"], "\n".join(h["full_vocab"])
    for op in ("reduce_max", "reduce_sum", "reduce_min"):
        assert op in h["all_reduce_ops"], (op, h["all_reduce_ops"])


@pytest.mark.multidevice
def test_params_initialized_directly_in_their_shardings(multi):
    c = _case(multi, "2x4")
    assert c["init_shardings_equal"]
    # jit(init) vs eager LlamaLM.init: the same law, rounding may differ (fused 1 + 0.1 x)
    assert c["init_max_abs_diff"] < 1e-6


@pytest.mark.multidevice
def test_dry_run_reports_memory_per_device(multi):
    r = _need(multi, "dry")
    assert r["devices"] == 8 and r["mesh"] == {"data": 2, "model": 4}
    mem = r["per_device_bytes"]
    total = r["num_params"]["target"] * 2  # bf16
    # tensor-parallel over 4: about a quarter of the target on each device (norms replicated)
    assert total / 4 <= mem["target_params"] <= total / 4 * 1.05, (mem, total)
    assert mem["draft_params"] == r["num_params"]["draft"] * 2  # replicated by tp.yaml
    assert mem["target_kv_cache"] > 0 and mem["draft_kv_cache"] > 0
    cm = r["compiled_memory_per_device"]
    assert cm and cm.get("argument_size_in_bytes", 0) > 0, cm
    assert r["seconds"]["compile"] is not None


_TINY_POD = """
name: tiny-multihost
hardware: {accelerator: cpu, devices: 8, hosts: 2}
target:
  family: llama
  config: {vocab_size: 512, dim: 32, n_layers: 1, n_heads: 4, n_kv_heads: 4, head_dim: 8,
           ffn_dim: 64, tie_embeddings: false}
draft: lookup
sharding: tp
mesh: {data: 2, model: 4}
generate: {batch: 4, prompt_len: 8, max_new_tokens: 8, k: 2, method: token}
"""


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.multidevice
def test_two_processes_give_the_single_process_tokens(tmp_path):
    """scripts/generate_sharded.py as 2 hosts x 4 CPU devices (jax.distributed + gloo):
    each process fills its own shards; process 0 alone prints; the tokens are those of
    one process with 8 devices."""
    pod = tmp_path / "tiny.yaml"
    pod.write_text(_TINY_POD)
    cmd = [sys.executable, "scripts/generate_sharded.py", "--pod", str(pod), "--json",
           "--print-tokens"]
    single_env = _env()
    env = dict(_env(), JAX_COORDINATOR_ADDRESS=f"localhost:{_free_port()}", JAX_NUM_PROCESSES="2",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("device_count=8", "device_count=4")
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=single_env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)]
    procs += [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, JAX_PROCESS_ID=str(i)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for i in range(2)]
    outs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        assert p.returncode == 0, se[-4000:]
        outs.append(so)

    def result(text):
        lines = [ln for ln in text.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    single, host0, host1 = (result(o) for o in outs)
    assert single["processes"] == 1 and host0["processes"] == 2
    assert host0["devices"] == 8 and host0["mesh"] == {"data": 2, "model": 4}
    assert host1 is None and "[specjax]" not in outs[2]  # only process 0 prints
    assert host0["all_tokens"] == single["all_tokens"]


def test_pod_scripts_check_their_arguments_before_any_work(tmp_path, capsys):
    """scripts/dry_run.py and scripts/generate_sharded.py, in process: bad counts, values,
    conflicting options and prompts files end with one line and status 2 before JAX is
    set up (a bug hunt found tracebacks after the models were built, and options ignored)."""
    import scripts.dry_run as dry
    import scripts.generate_sharded as gen

    bad = tmp_path / "p.jsonl"
    bad.write_text('[1, 2]\n{"tok": [3]}\n')
    cases = [(dry.main, ["ci-small_cpu-8", "--devices", "-1"], "--devices must be >= 1"),
             (dry.main, ["ci-small_cpu-8", "--k", "0"], "--k must be >= 1"),
             (dry.main, ["ci-small_cpu-8", "--hlo-out", str(tmp_path)], "not a file in an existing folder"),
             (gen.main, ["--pod", "ci-small_cpu-8", "--batch", "0"], "--batch must be >= 1"),
             (gen.main, ["--pod", "ci-small_cpu-8", "--temperature", "nan"], "--temperature must be a finite"),
             (gen.main, ["--pod", "ci-small_cpu-8", "--seed", "-1"], "--seed: seed must be"),
             (gen.main, ["--pod", "ci-small_cpu-8", "--random-weights", "--target-ckpt", "x"], "do not apply"),
             (gen.main, ["--pod", "ci-small_cpu-8", "--prompts-file", str(bad)], "line 2: expected a JSON list"),
             (gen.main, ["--pod", "ci-small_cpu-8", "--prompts-file", str(bad), "--batch", "2"], "do not apply")]
    for main, argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and err.count("\n") == 1, (argv, err)


def test_a_rule_no_array_has_is_reported_not_silent():
    """A rule whose logical name no parameter of the model and no engine array has (a typo:
    ``vocabb``) used to shard nothing without a word: param_shardings warns, naming it; the
    shipped configs with the shipped kinds of model (unrolled and scanned layers, an EAGLE
    head as draft) warn about nothing."""
    import warnings

    from specjax import engine
    from specjax.models.eagle import EagleConfig, EagleModel
    from specjax.models.llama import LlamaLM, tiny_config

    unrolled = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=1)
    scanned = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32, scan_layers=True), seed=1)
    head = EagleModel.for_target(unrolled, EagleConfig.for_target(unrolled.config, n_heads=4, n_kv_heads=2,
                                                                  head_dim=8, ffn_dim=32), seed=1)
    # the engine names its logits itself (it may not import specjax.sharding): the same names
    assert engine._LOGITS == S.LOGITS_NAMES
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("dp", "tp", "tp_draft_sharded"):
            plan = S.make_plan(name, data=1, model=1)
            for m in (unrolled, scanned):
                S.param_shardings(m.params, plan, "target")
            for m in (unrolled, head):
                S.param_shardings(m.params, plan, "draft")
    cfg = S.sharding_from_dict({"name": "typo", "rules": {"target": {"batch": "data", "vocabb": "model",
                                                                     "experts": None}}})
    assert S.unused_rules(cfg.target, ["embed", "vocab"]) == ["vocabb"]  # None maps nothing
    plan = S.make_plan(cfg, data=1, model=1)
    with pytest.warns(UserWarning, match=r"rules.target map \['vocabb'\] to mesh axes"):
        S.param_shardings(unrolled.params, plan, "target")
