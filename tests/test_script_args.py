"""scripts/eval_heldout.py, eval_draft.py and bench_auto_ab.py: bad input gets one line on
stderr and exit status 2 before any model loads; relative paths on the command line are
from the current directory, not the checkout."""
from __future__ import annotations

import json
import os

import pytest

from specjax import build, cli
from specjax.train import distill as T

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_load(monkeypatch):
    fail = lambda *a, **k: pytest.fail("a model was loaded before checking input")  # noqa: E731
    monkeypatch.setattr(build, "load_target", fail)
    monkeypatch.setattr(T, "load_target", fail)


def _memo_metadata(monkeypatch):
    """The target's tokenizer and config read from the GGUF once for the whole test."""
    for name in ("tokenizer", "config"):
        real, memo = getattr(cli.ModelSource, name), {}

        def once(self, real=real, memo=memo):
            if self.path not in memo:
                memo[self.path] = real(self)
            return memo[self.path]
        monkeypatch.setattr(cli.ModelSource, name, once)


def _expect_usage_errors(cases, capsys):
    for main, argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
        assert message in err, (argv, message, err)


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "comments.txt").write_text("# only\n\n   # comments\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    (tmp_path / "p2.txt").write_text("# a prompt in the current directory\nhello there\n")
    (tmp_path / "afile").write_text("")
    return tmp_path


def test_bad_arguments_exit_2_without_model_metadata(files, capsys, monkeypatch):
    from scripts import bench_auto_ab, eval_draft, eval_heldout

    _no_load(monkeypatch)
    fail = lambda *a, **k: pytest.fail("model metadata read before the argument checks")  # noqa: E731
    monkeypatch.setattr(cli.ModelSource, "config", fail)
    monkeypatch.setattr(cli.ModelSource, "tokenizer", fail)
    h, d, b = eval_heldout.main, eval_draft.main, bench_auto_ab.main
    _expect_usage_errors([
        (h, ["--prompts", "p2.txt", "--max-prompts", "-1"], "--max-prompts must be >= 0"),
        (h, ["--prompts", "p2.txt", "--seed", "-1"], "--seed must be >= 0"),
        (h, ["--prompts", "p2.txt", "--positions", "0"], "--positions must be >= 1"),
        (h, ["--prompts", "p2.txt", "--max-new", "x"], "invalid int value"),
        (h, ["--prompts", "comments.txt"], "no prompts (only blank or '#' comment lines)"),
        (h, ["--prompts", "p2.txt", "latin1.txt"], f"{files / 'latin1.txt'}: not UTF-8 text"),
        (h, ["--prompts", "missing.txt"], f"{files / 'missing.txt'}: cannot read it"),
        (d, ["none"], "draft 'none' has no draft to measure"),
        (d, ["default", "--k", "0"], "--k must be >= 1"),
        (d, ["default", "--k", "-1"], "--k must be >= 1"),
        (d, ["default", "--file", "comments.txt"], "no prompts (only blank or '#' comment lines)"),
        (d, ["default", "--file", "latin1.txt"], "not UTF-8 text"),
        (d, ["default", "--file", "missing.txt"], f"{files / 'missing.txt'}: cannot read it"),
        (d, ["default", "--max-new-tokens", "0"], "--max-new-tokens >= 1"),
        (b, ["--batches", "abc"], "--batches: expected comma-separated integers >= 1, got 'abc'"),
        (b, ["--batches", ""], "--batches: expected comma-separated integers >= 1, got ''"),
        (b, ["--batches", "0"], "--batches: expected comma-separated integers >= 1"),
        (b, ["--batches", "-1"], "--batches: expected comma-separated integers >= 1"),
        (b, ["--batches", "4,"], "--batches: expected comma-separated integers >= 1"),
        (b, ["--ks", "x"], "--ks: expected comma-separated integers >= 1"),
        (b, ["--ks", "0"], "--ks: expected comma-separated integers >= 1"),
        (b, ["--temps", "nan"], "--temps: expected comma-separated finite temperatures >= 0"),
        (b, ["--temps", "0,-1"], "--temps: expected comma-separated finite temperatures >= 0"),
        (b, ["--temps", "1e300"], "outside float32's range"),
        (b, ["--prompts", "comments.txt"], "no prompts (only blank or '#' comment lines)"),
        (b, ["--prompts", "latin1.txt"], "not UTF-8 text"),
        (b, ["--passes", "0"], "--passes, --groups and --max-new must be >= 1"),
        (b, ["--bogus"], "unrecognized arguments: --bogus"),
    ], capsys)


@pytest.mark.real_model  # the prompts are checked against the target's context (its metadata)
def test_bench_prompts_are_read_from_the_current_directory(files, monkeypatch):
    from scripts import bench_auto_ab
    from specjax import configs

    _memo_metadata(monkeypatch)
    class Loaded(Exception):
        pass

    read, real = [], configs.read_prompt_file
    monkeypatch.setattr(configs, "read_prompt_file", lambda p: read.append((p, real(p))) or read[-1][1])
    monkeypatch.setattr(build, "load_target", lambda *a, **k: (_ for _ in ()).throw(Loaded()))
    os.makedirs("configs/bench")
    (files / "configs/bench/prompts.txt").write_text("not the checkout's prompts\n")
    for argv, path in ((["--prompts", "configs/bench/prompts.txt"], files / "configs/bench/prompts.txt"),
                       (["--prompts", "p2.txt"], files / "p2.txt"),
                       ([], os.path.join(REPO, "configs", "bench", "prompts.txt"))):  # the default
        with pytest.raises(Loaded):
            bench_auto_ab.main(argv)
        assert read and read[-1][0] == str(path)
    assert [r[1] for r in read[:2]] == [["not the checkout's prompts"], ["hello there"]]
    assert len(read[-1][1]) > 1  # the checkout's set


@pytest.mark.real_model
def test_bad_drafts_lengths_and_outputs_exit_2_before_loading(files, capsys, monkeypatch):
    """Checks that read the target's metadata (vocabulary, context) and the draft's alone."""
    import numpy as np

    from scripts import bench_auto_ab, eval_draft, eval_heldout

    _no_load(monkeypatch)
    _memo_metadata(monkeypatch)
    meta = json.dumps({"kind": "eagle", "config": {"vocab_size": 64}}).encode()
    np.savez(files / "small.npz", meta=np.frombuffer(meta, np.uint8))
    tiny = os.path.join(REPO, "configs", "models", "tiny.yaml")  # a vocabulary of 8
    h, d = eval_heldout.main, eval_draft.main
    p = ["--prompts", "p2.txt"]
    _expect_usage_errors([
        (h, p + ["--draft", "missing.npz"], "draft 'missing.npz': expected default, lookup, none"),
        (h, p + ["--draft", "small.npz"], "draft 'small.npz' has vocabulary 64, the target 49152"),
        (h, p + ["--draft", tiny], "has vocabulary 8, the target 49152"),
        (h, p + ["--draft", "none"], "teacher-forced evaluation needs an EAGLE head"),
        (h, p + ["--draft", "lookup"], "teacher-forced evaluation needs an EAGLE head"),
        (h, p + ["--max-new", "100000"], "exceeds the model's context of 8192 tokens"),
        (h, p + ["--cache-dir", "afile"], f"--cache-dir {files / 'afile'}: not a folder"),
        (h, p + ["--cache-dir", "afile/sub"], "not a usable folder"),
        (h, p + ["--json", "."], f"--json {files}: cannot write it"),
        (h, p + ["--json", "/proc/x/out.json"], "--json /proc/x/out.json: cannot write it"),
        (d, ["missing.npz"], "draft 'missing.npz': expected default, lookup, none"),
        (d, ["small.npz"], "draft 'small.npz' has vocabulary 64, the target 49152"),
        (d, [tiny], "has vocabulary 8, the target 49152"),
        (d, ["layers:99"], "layers:99: the target has 30 layers"),
        (d, ["default", "--max-new-tokens", "9000"], "exceeds the model's context of 8192 tokens"),
        (bench_auto_ab.main, p + ["--max-new", "8190", "--ks", "1"], "with --max-new 8190 and K 3 exceeds the "
                                                                      "model's context of 8192 tokens"),
    ], capsys)
    assert not os.path.exists(files / "cache")  # nothing made on the way to an error


@pytest.mark.real_model
def test_heldout_paths_are_from_the_current_directory(files, capsys, monkeypatch):
    """A prompt file of the checkout's name in the current directory is that one, not the
    checkout's; --cache-dir and --json likewise; eval_draft's --file too."""
    from scripts import eval_draft, eval_heldout
    from specjax.drafts import files as draft_files

    _memo_metadata(monkeypatch)
    os.makedirs("configs/train")
    (files / "configs/train/prompts_heldout.txt").write_text("a held-out prompt of this directory\n")
    seen = []

    def fake_eval(target, tok, model, path, **kw):
        seen.append((path, kw["cache_dir"], open(path).read()))
        return dict(file=path, rows=1, generated_tokens=5, alpha=[0.5], greedy=[0.25])

    monkeypatch.setattr(T, "load_target", lambda spec: (None, None))
    monkeypatch.setattr(build, "resolve_draft", lambda spec, target: (None, {"kind": "eagle", "path": "d.npz"}))
    monkeypatch.setattr(draft_files, "load_draft_model", lambda *a, **k: None)
    monkeypatch.setattr(eval_heldout, "heldout_eval", fake_eval)
    assert eval_heldout.main(["--prompts", "configs/train/prompts_heldout.txt", "p2.txt",
                              "--cache-dir", "cache", "--json", "out.json"]) == 0
    assert seen == [(str(files / "configs/train/prompts_heldout.txt"), str(files / "cache"),
                     "a held-out prompt of this directory\n"),
                    (str(files / "p2.txt"), str(files / "cache"), (files / "p2.txt").read_text())]
    out = json.loads((files / "out.json").read_text())
    assert [r["file"] for r in out["results"]] == ["configs/train/prompts_heldout.txt", "p2.txt"]
    assert "| `p2.txt` | 1 | 5 | 0.500 | 0.250 |" in capsys.readouterr().out

    class Loaded(Exception):
        pass

    monkeypatch.setattr(build, "load_target", lambda *a, **k: (_ for _ in ()).throw(Loaded()))
    with pytest.raises(Loaded):  # p2.txt of this directory passed the checks
        eval_draft.main(["default", "--file", "p2.txt", "--no-timing"])


def test_prompt_files_lose_a_byte_order_mark(tmp_path):
    """Some editors start a UTF-8 file with a byte-order mark: it was part of prompt 0 in
    the eval scripts' files (the CLI already dropped it)."""
    from specjax import configs

    (tmp_path / "bom.txt").write_bytes("\ufeffhello\n# note\nwörld\n".encode("utf-8"))
    assert configs.read_prompt_file(tmp_path / "bom.txt") == ["hello", "wörld"]
    (tmp_path / "bom_comment.txt").write_bytes("\ufeff# a comment first\nhi\n".encode("utf-8"))
    assert configs.read_prompt_file(tmp_path / "bom_comment.txt") == ["hi"]


def test_sim_auto_rule_checks_its_lists_before_simulating(capsys, monkeypatch):
    from scripts import sim_auto_rule

    monkeypatch.setattr(sim_auto_rule, "simulator", lambda *a, **k: pytest.fail("simulated"))
    m = sim_auto_rule.main
    _expect_usage_errors([
        (m, ["--rates", "0.5"], "--rates mean:sd"),
        (m, ["--rates", "1.5:0.1"], "--rates mean:sd"),
        (m, ["--tables", "amd,arm"], "bad list"),
        (m, ["--budgets", "0"], "--budgets must be >= 1"),
        (m, ["--calls", "x"], "invalid int value"),
    ], capsys)


def test_kernel_benchmarks_refuse_bad_arguments(capsys, monkeypatch):
    """The kernel tools (bench_matmul_builds.py, bench_block_weights.py): one line and exit 2
    before building a kernel or reading the GGUF."""
    from scripts import bench_block_weights, bench_matmul_builds

    _no_load(monkeypatch)
    m, b = bench_matmul_builds.main, bench_block_weights.main
    monkeypatch.setattr(bench_matmul_builds, "build", lambda *a, **k: pytest.fail("a kernel was built"))
    monkeypatch.setattr(bench_block_weights, "matrices", lambda *a, **k: pytest.fail("the GGUF was read"))
    _expect_usage_errors([
        (m, ["--f16", "--blocks"], "--f16 and --blocks exclude each other"),
        (m, ["--packed"], "--packed needs --blocks"),
        (m, ["--ms", "a"], "--ms: expected comma-separated integers >= 1, got 'a'"),
        (m, ["--ms", "1,0"], "--ms: expected comma-separated integers >= 1, got '1,0'"),
        (m, ["--rounds", "0"], "--rounds takes a positive number"),
        (b, ["--ms", "x"], "--ms: expected comma-separated integers >= 1, got 'x'"),
        (b, ["--generate", "1,y"], "--generate: expected comma-separated integers >= 1, got '1,y'"),
        (b, ["--ms", "0"], "--ms: expected comma-separated integers >= 1, got '0'"),
        (b, ["--generate", "0"], "--generate: expected comma-separated integers >= 1, got '0'"),
        (b, ["--new-tokens", "0"], "--rounds and --new-tokens take positive numbers"),
    ], capsys)
