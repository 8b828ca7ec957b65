"""The benchmark's k=auto rows and its dataset workload (issue 15): one run of
scripts/benchmark.py on the tiny random model, and the K grid's parsing. Its own file, so
that pytest-xdist can run it beside test_benchmark_quick.py (k=auto measures its round
costs first). The run (~3 minutes on 2 cores) is in the extended tier (``--extended``): k=auto's
engine is tested in test_adaptive.py, the benchmark's grid by test_benchmark_quick.py."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specjax.build import AUTO_MAX_K

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "scripts" / "benchmark.py"


def _finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


# One benchmark run for both tests below (a process, a model and a grid fewer): the quick config
# (configs/bench/quick.yaml) on the tiny model with the prompt-lookup draft and K = 2 and auto,
# plus a dataset block
_DATASET = {"num_prompts": 10, "batch": 4, "max_new_tokens": 12, "settings": ["ar", "k"], "k": 2,
            "modes": ["fixed", "all", "tail"], "repeats": 2}


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """(benchmark.json, the output folder) of the run; the run's output if it fails."""
    import yaml

    tmp = tmp_path_factory.mktemp("bench_auto")
    cfg = yaml.safe_load((REPO / "configs" / "bench" / "quick.yaml").read_text())
    cfg.update(model="tiny", draft="lookup", ks=["auto", 2], dataset=_DATASET)
    (tmp / "auto.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp / "bench"
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               SPECJAX_CACHE_DIR=str(tmp / "cache"))  # its round costs measured here
    proc = subprocess.run([sys.executable, str(BENCH), "--config", str(tmp / "auto.yaml"), "--out", str(out)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "benchmark.json").read_text()), out


@pytest.mark.slow
@pytest.mark.extended
def test_benchmark_times_k_auto(auto_run):
    res, out = auto_run
    spec = {r["k"]: r for r in res["speculative"]}
    assert set(spec) == {2, "auto"}
    r = spec["auto"]
    assert spec[2]["group"] == 0 and r["group"] == 1  # fixed Ks first, then auto (its own group, last)
    assert r["emitted"] == 2 * 2 * 32
    # every loop iteration drafted 0..AUTO_MAX_K tokens
    assert len(r["iterations_by_draft_tokens"]) == AUTO_MAX_K + 1
    assert sum(r["iterations_by_draft_tokens"]) == r["loop_iterations"]
    # a round of j draft tokens proposes at most j: prompt lookup fewer where nothing matched
    # (equality held only while this tiny model's cost table, timings of ~0.05 ms, had k=auto
    # never draft: a run where it drafted 3 a round failed it, 213 against 75)
    assert sum(j * n for j, n in enumerate(r["iterations_by_draft_tokens"])) >= r["drafted"]
    assert len(r["round_costs_ms"]) == AUTO_MAX_K + 1 and all(_finite(c) and c > 0 for c in r["round_costs_ms"])
    assert r["predicted_speedup"] == {} and r["c"] is None  # no closed form for a changing K
    assert _finite(r["speedup"]["median"]) and r["speedup"]["n"] == 2
    # the cost table also times k=auto's widest round
    assert set(res["step_costs"]["1"]["v"]) == {"2", str(AUTO_MAX_K)}
    md = (out / "benchmark.md").read_text()
    assert "### k=auto against autoregressive decoding and the best fixed K" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| 1 | 1 | token | "))
    assert "K=2: " in row and str(r["iterations_by_draft_tokens"]) in row
    if importlib.util.find_spec("matplotlib") is not None:  # k=auto: a point of the speedup plot
        assert (out / "speedup_vs_k.png").is_file() and res["plots"]
    # its tokens are in the exactness check with the fixed K's
    (ex,) = res["exactness"]
    assert ex["n_seq_a"] == 2 * (2 * 2)  # 2 settings x 2 repeats x 2 rows


def test_grid_ks_parse_and_order():
    from scripts.bench.config import BenchConfig, grid_k

    assert [grid_k(x) for x in (3, "3", "auto", " AUTO ", 2.0)] == [3, 3, "auto", "auto", 2]
    cfg = BenchConfig(ks=["auto", 4, 1], ks_by_batch={4: [2, "auto"], 16: 2})
    assert cfg.ks_for(1) == (1, 4, "auto") and cfg.ks_for(4) == (2, "auto") and cfg.ks_for(16) == (2,)
    for bad, msg in ((dict(ks=[0]), ">= 1"), (dict(ks=["x"]), "'x'"), (dict(ks=[1.5]), "1.5"),
                     (dict(ks_by_batch={4: ["autox"]}), "autox"), (dict(ks_by_batch={4: [0]}), ">= 1")):
        with pytest.raises(ValueError, match=msg):
            BenchConfig(**bad)


@pytest.mark.parametrize("argv, msg", [(["--ks", "2,x"], "argument --ks: K must be an integer or 'auto', got 'x'"),
                                       (["--ks", "0"], "K and batch sizes must be >= 1"),
                                       (["--config", "nope"], "unknown benchmark config 'nope'")])
def test_benchmark_refuses_a_bad_grid_in_one_line(argv, msg, tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--model", "tiny", "--no-markdown",
                           "--out", str(tmp_path), *argv], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and msg in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "benchmark.json").exists()


@pytest.mark.slow
@pytest.mark.extended
def test_benchmark_dataset_workload(auto_run):
    """A config's ``dataset`` block runs the dataset workload after the grid: fixed batches
    and continuous batching by the same engines, with the same tokens (autoregressive and
    fixed K must give them), ragged natural lengths, and its table in the report."""
    res, out = auto_run
    ds = res["dataset"]
    assert ds["num_prompts"] == 10 and ds["spec"]["batch"] == 4
    rows = {(r["setting"], r["mode"]): r for r in ds["rows"]}
    assert set(rows) == {(s, m) for s in ("autoregressive", "K=2")
                         for m in ("fixed batches", "continuous, all slots", "continuous, tail compacted")}
    lengths = rows[("autoregressive", "fixed batches")]["lengths"]
    assert len(lengths) == 10 and min(lengths) < max(lengths) and max(lengths) <= 12  # natural, ragged
    for (s, m), r in rows.items():  # (a speculative setting draws its own tokens: same law, other draws)
        own = rows[(s, "fixed batches")]["lengths"]
        assert r["lengths"] == own and r["tokens"] == sum(own) and len(r["all_seconds"]) == 2
        assert r["slot_iterations"] >= r["iterations"] > 0 and _finite(r["ms_per_token"])
        if m != "fixed batches":
            assert r["same_as_fixed"] is True, (s, m)
    # fixed batches of 4 over 10 prompts: 3 calls, every slot to its chunk's slowest row
    assert rows[("autoregressive", "fixed batches")]["iterations"] <= 3 * 12
    md = (out / "benchmark.md").read_text()
    assert "### Dataset run: stop tokens on, fixed batches vs continuous batching" in md
    assert "Continuous against fixed batches, per generated token: autoregressive continuous" in md


def test_benchmark_checks_its_grid_and_outputs_before_any_work(tmp_path, capsys, monkeypatch):
    """In process (no model is loaded: load_target fails the test). A bug hunt found each
    of these running (an empty grid wrote an empty benchmark.json over the last one; a
    markdown path that cannot be written lost the run's results at its end) or failing
    with a traceback after the model loaded."""
    import scripts.benchmark as bench

    monkeypatch.setattr(bench, "load_target", lambda *a, **k: pytest.fail("loaded a model"))
    (tmp_path / "file").write_text("x")
    for argv, msg in ((["--batch-sizes", ","], "batch_sizes must not be empty"),
                      (["--ks", ","], "no K to time at batch"),
                      (["--temperatures", "nan"], "temperatures must be finite"),
                      (["--seed", "-1"], "seed must be >= 0"),
                      (["--markdown", "x.md", "--no-markdown"], "--markdown and --no-markdown"),
                      (["--tree-topk", "2"], "--tree-topk applies to method tree only"),
                      (["--prompts-file", "nope.txt"], "--prompts-file nope.txt: no such file"),
                      (["--draft", "garbage"], "draft 'garbage'"),
                      (["--param-dtype", "float64x"], "param_dtype must be one of"),
                      (["--out", str(tmp_path / "file" / "sub")], "cannot create the output folder"),
                      (["--markdown", str(tmp_path / "no" / "x.md")], "the markdown file")):
        assert bench.main(["--quick", "--model", "tiny", "--out", str(tmp_path / "o"), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, (argv, err)
    bad = tmp_path / "bad.yaml"
    bad.write_text("ks: [1, 2\nrepeats: 3\n")
    assert bench.main(["--config", str(bad)]) == 2
    assert "not valid YAML (line 2" in capsys.readouterr().err
    bad.write_text("repeats: '3'\n")
    assert bench.main(["--config", str(bad)]) == 2
    assert "repeats must be an integer" in capsys.readouterr().err


def test_benchmark_checks_lengths_against_the_context_before_timing(tmp_path, capsys, monkeypatch):
    """A length past the model's context was caught by no one before the step timer
    allocated its caches (``--max-new-tokens 100000000`` on the tiny model: killed for
    memory); now one error line and exit 2, before anything is timed or compiled, for the
    grid and the dataset workload alike."""
    import scripts.benchmark as bench

    monkeypatch.setattr(bench, "StepTimer", lambda *a, **k: pytest.fail("timed"))
    monkeypatch.setattr(bench, "run_specjax", lambda *a, **k: pytest.fail("ran"))
    ds = tmp_path / "ds.yaml"
    ds.write_text("model: tiny\nbatch_sizes: [1]\nks: [2]\nmax_new_tokens: 8\n"
                  "dataset: {max_new_tokens: 8190, k: 1, settings: [ar, auto]}\n")
    out = ["--no-markdown", "--out", str(tmp_path / "o")]
    for argv, msg in ((["--quick", "--model", "tiny", "--max-new-tokens", "100000000"],
                       "the grid: a prompt of 20 tokens + max_new_tokens 100000000 + K 4 exceeds"),
                      (["--quick", "--model", "tiny", "--max-new-tokens", "8171", "--ks", "2"],
                       "+ max_new_tokens 8171 + K 2 exceeds"),
                      (["--config", str(ds)], "the dataset workload: a prompt of 20 tokens + max_new_tokens "
                                              "8190 + K 3 exceeds")):  # k=auto drafts up to 3
        assert bench.main(argv + out) == 2, argv
        last = capsys.readouterr().err.splitlines()[-1]
        assert last == f"benchmark.py: error: {last.split('error: ', 1)[1]}" and msg in last, (argv, last)
        assert last.endswith("exceeds the model's context of 8192 tokens"), last


def test_dataset_config_refuses_unknown_keys_and_values(tmp_path):
    from scripts.bench.config import BenchConfig

    for bad, msg in (({"batchsize": 4}, "unknown dataset keys"), ({"settings": ["ar", "kk"]}, "kk"),
                     ({"num_prompts": 0}, "num_prompts"), ({"top_p": 0}, "top_p")):
        with pytest.raises(ValueError, match=msg):
            BenchConfig(dataset=bad)
    spec, prompts, n = BenchConfig(dataset={"modes": "tail", "repeats": 2}).dataset_spec()
    assert spec.modes == ("tail",) and spec.repeats == 2 and n == 64 and prompts.endswith("dataset_prompts.txt")
