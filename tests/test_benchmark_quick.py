"""Smoke test of scripts/benchmark.py: ``--quick`` on the tiny random model, in a subprocess.

Cheap on purpose (one batch size, K=2, token and block, 32 tokens, 2 prompts, no peer, no
BENCHMARKS.md): it checks that the whole pipeline runs and that the JSON carries every
figure the benchmark promises, not the figures themselves.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def _finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_benchmark_quick_tiny(tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--quick", "--model", "tiny",
           "--draft", "lookup", "--ks", "2", "--methods", "token,block", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "p-value" in proc.stdout  # the exactness check is printed

    res = json.loads((out / "benchmark.json").read_text())
    assert (out / "benchmark.md").is_file()
    for key in ("command", "config", "machine", "model", "draft", "prompts", "step_costs", "autoregressive",
                "speculative", "block_vs_token", "exactness", "peer", "wall_s", "loadavg_end"):
        assert key in res, key
    m = res["machine"]
    for key in ("cpu_model", "cpu_count", "usable_cores", "loadavg_start", "jax", "backend"):
        assert key in m, key
    assert res["config"]["name"] == "quick" and res["model"]["kind"] == "tiny"

    sc = res["step_costs"]["1"]
    assert _finite(sc["t_target_ms"]["1"]) and _finite(sc["v"]["2"]) and _finite(sc["c"]["2"])

    (ar,) = res["autoregressive"]
    assert ar["batch_size"] == 1 and _finite(ar["tokens_per_s"]["median"]) and _finite(ar["compile_s"])
    assert ar["tokens_per_s"]["min"] <= ar["tokens_per_s"]["median"] <= ar["tokens_per_s"]["max"]
    assert ar["groups"] == [0, 0] and _finite(ar["drift_last_over_first"])  # one pass per repeat of the K=2 group

    spec = res["speculative"]
    assert {(r["method"], r["k"]) for r in spec} == {("token", 2), ("block", 2)}
    for r in spec:
        assert r["emitted"] == 2 * 2 * 32  # 2 prompts x 2 repeats x 32 tokens, stop tokens off
        for key in ("tokens_per_s", "speedup"):
            assert _finite(r[key]["median"]) and r[key]["n"] == 2
        assert _finite(r["mean_alpha"]) and 0.0 <= r["mean_alpha"] <= 1.0
        # the speedup is taken per repeat, over the autoregressive pass beside it
        ratios = sorted(x / y for x, y in zip(r["tokens_per_s_passes"], r["ar_tokens_per_s_passes"], strict=True))
        assert math.isclose(r["speedup"]["min"], ratios[0]) and math.isclose(r["speedup"]["max"], ratios[-1])
        assert len(r["acceptance_per_position"]) == 2 and len(r["reached_per_position"]) == 2
        assert r["tokens_per_round"] >= 1.0 and _finite(r["tokens_per_round_batch"])
        assert _finite(r["c"]) and _finite(r["verify_ratio"]) and _finite(r["compile_s"])
        for key in ("basic", "with_verify", "measured_rounds"):
            assert _finite(r["predicted_speedup"][key]) and _finite(r["achieved_over_predicted"][key])

    (bt,) = res["block_vs_token"]
    assert bt["k"] == 2 and _finite(bt["block_over_token_tokens_per_s"])

    methods = {e["method"] for e in res["exactness"]}
    assert methods == {"token", "block", "all"}
    for e in res["exactness"]:
        assert "p_value" in e and "p_value_permutation" in e and e["n_a"] > 0 and e["n_b"] > 0

    assert res["peer"]["available"] is False and res["peer"]["reason"]


def test_bench_configs_load(tmp_path):
    """Every configs/bench/*.yaml loads into a BenchConfig (through specjax.configs), named
    after its file; overrides replace fields (None: kept); unknown keys are refused."""
    from scripts.bench.config import load_bench_config
    from specjax.configs import list_configs

    names = list_configs("bench")
    assert {"default", "quick", "tiny"} <= set(names)
    for name in names:
        cfg = load_bench_config(name)
        assert cfg.name == name and all(cfg.rows_for(b) % b == 0 for b in cfg.batch_sizes)
    cfg = load_bench_config("quick", model="tiny", ks=None, max_new_tokens=8)
    assert (cfg.model, cfg.ks, cfg.max_new_tokens) == ("tiny", (2, 4), 8)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\nkays: [2]\n")
    with pytest.raises(ValueError, match="kays"):
        load_bench_config(str(bad))
    # `dataset: false` is off (it raised a TypeError from deep in the check); another
    # non-mapping is a ValueError that says what is wanted
    off = tmp_path / "off.yaml"
    off.write_text("model: tiny\ndataset: false\n")
    assert load_bench_config(str(off)).dataset is None
    off.write_text("model: tiny\ndataset: 64\n")
    with pytest.raises(ValueError, match="dataset must be a mapping"):
        load_bench_config(str(off))


@pytest.mark.extended
def test_profile_round_tiny(tmp_path):
    """scripts/profile_round.py splits the traced operations into loop-body and per-call
    ones: the loop runs once per round (speculative) or per token (autoregressive)."""
    from specjax.models import cpu_kernels

    out = tmp_path / "prof"
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    cmd = [sys.executable, str(REPO / "scripts" / "profile_round.py"), "--model", "tiny", "--draft", "layers:1",
           "--prompts", "2", "--tokens", "16", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["speculative"]["iterations"] == s["rounds"] > 0
    assert s["autoregressive"]["iterations"] == 2 * 16
    # the trace itself finds the loop: its loop-body operations run once per iteration
    # (within one: the profiler lost one round's events once, on a loaded CI machine)
    assert abs(s["speculative"]["trace_iterations"] - s["rounds"]) <= 1
    assert abs(s["autoregressive"]["trace_iterations"] - 2 * 16) <= 1
    for part in ("speculative", "autoregressive"):
        r = s[part]
        assert _finite(r["per_iteration_ms"]) and r["per_iteration_ms"] > 0
        assert 0 <= r["model_kernels_ms"] < r["per_iteration_ms"]
        if cpu_kernels.available()[0]:  # the tiny model's matmuls and attention use them
            assert r["model_kernels_ms"] > 0
        assert abs(sum(r["by_kind_ms"].values()) - r["per_iteration_ms"]) < 1e-6
    assert "heaviest single operations" in res.stdout


@pytest.mark.extended
def test_bench_step_roofline_on_a_random_preset(capsys):
    """scripts/bench_step.py on a preset with random weights: every time also as GB/s, the
    engine's step, and the decode loop's temporaries against one layer's weights."""
    from scripts import bench_step

    bench_step.main(["--random", "--model", "tiny", "--layers", "scan", "--ts", "1,2", "--repeats", "2",
                     "--decode", "4", "--engine", "16", "--max-len", "64", "--cache-len", "16", "--peak-gbs", "100"])
    out = capsys.readouterr().out
    assert "scan_layers=True" in out and "peak=100 GB/s" in out
    steps = [ln for ln in out.splitlines() if ln.startswith(("T=1:", "T=2:", "decode:"))]
    assert len(steps) == 3 and all("GB/s = " in ln and "% of peak" in ln for ln in steps), steps
    assert "decode loop temporaries:" in out and "one layer's weights:" in out
    assert "engine:" in out
    from specjax.build import init_model
    from specjax.models.config import load_model_config

    r = bench_step.Roofline(init_model(load_model_config("tiny"), seed=0), 2, 10, None)
    assert r.kv_bytes(1) > 0 and r.bytes(1) == r.weight_bytes + r.kv_bytes(1) and bench_step.device_peak("cpu") is None
    assert bench_step.device_peak("NVIDIA H200") == 4.8e12 and bench_step.device_peak("TPU v5 lite") == 0.819e12


def test_accel_slot_refuses_an_unknown_stage(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "accel_slot.py"), "--smoke", "--stages", "roofline,nope",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "unknown stages ['nope']" in r.stderr


def test_bench_tree_shapes_refuses_bad_shapes():
    for bad in (["--topk", "8/5"], ["--sampled", "2xa"], ["--rows", "0"]):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_tree_shapes.py"), *bad],
                           capture_output=True, text=True, cwd=REPO)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "error:" in last and "Traceback" not in r.stderr, (bad, r.stderr)


def test_accel_slot_keeps_work_for_the_next_call(tmp_path):
    """``{work}`` in a stage's command is --work (where a trained head waits for the next
    device call), ``{out}`` is --out; and the train stage copies what comes back to --out."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("accel_slot", REPO / "scripts" / "accel_slot.py")
    slot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slot)
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "eagle3").mkdir(parents=True)
    out.mkdir()
    for f in ("draft.npz", "metrics.jsonl", "summary.json", "config.json"):
        (work / "eagle3" / f).write_text(f)
    keep = [c for c in slot.stages(False)["train"] if c[0] == "eagle3-keep"]
    res = slot.run_stage("t", keep + [("echo", ["bash", "-c", 'echo "$0" > "$1"', "{work}", "{out}/w.txt"], 10)],
                         out, slot.time.time() + 60, work)
    assert [r["rc"] for r in res] == [0, 0], res
    assert (out / "w.txt").read_text().strip() == str(work)
    assert sorted(p.name for p in (out / "eagle3").iterdir()) == ["config.json", "draft.npz", "metrics.jsonl",
                                                                  "summary.json"]
    heads = slot.stages(False)["head"]
    assert all("{work}/eagle3/draft.npz" in argv for label, argv, _ in heads if label.startswith("eagle3")), heads


@pytest.mark.parametrize("layers", [(), (1, 0)], ids=["eagle", "eagle3"])
def test_step_timer_times_an_eagle_head_of_either_kind(layers):
    """The benchmark's cost table times an EAGLE head's propose on stand-in target features
    of the width the head reads (n * dim for an EAGLE-3 head: a run with one failed here)."""
    from scripts.bench.config import load_bench_config
    from scripts.bench.timing import StepTimer
    from specjax.models.eagle import EagleConfig, EagleModel
    from specjax.models.llama import LlamaLM, tiny_config

    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    cfg = EagleConfig.for_target(tgt.config, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32, feature_layers=layers)
    head = EagleModel.for_target(tgt, cfg, seed=1)
    bc = load_bench_config("quick", max_new_tokens=8, step_repeats=2)
    timer = StepTimer(tgt, head, {"kind": "eagle"}, 1, [2], [[1, 2, 3, 4, 5]], bc)
    r = timer.retime()
    assert math.isfinite(r["t_propose_ms"][2]) and r["t_propose_ms"][2] > 0
