"""Draft training on a tiny target: configs fail early, losses go down and held-out alpha goes
up (independent and EAGLE drafts), a killed run resumes to the same parameters, cached data
is reused, and a trained draft file loads as a proposer that keeps greedy decoding exact."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from specjax.models.llama import LlamaLM, tiny_config
from specjax import build, sampling
from specjax.train import distill as T
from specjax.drafts import make_proposer
from specjax.drafts.files import load_draft_model

TINY = dict(vocab_size=64, n_layers=2, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    rng = np.random.default_rng(0)
    tr, ho = d / "train.txt", d / "heldout.txt"
    tr.write_text("\n".join(" ".join(map(str, rng.integers(0, 64, rng.integers(3, 8)))) for _ in range(48)))
    ho.write_text("\n".join(" ".join(map(str, rng.integers(0, 64, rng.integers(3, 8)))) for _ in range(8)))
    return str(tr), str(ho), str(d / "cache")


@pytest.fixture(scope="module")
def target():
    return LlamaLM.init(tiny_config(**TINY), seed=3)


def _cfg(prompt_files, out_dir, draft, **train):
    tr, ho, cache = prompt_files
    t = dict(steps=40, batch_size=8, lr=1e-2, warmup=4, eval_every=40, ckpt_every=20, log_every=10,
             eval_positions=3, eval_batch=8, unroll=2, out_dir=str(out_dir), progress=False,
             losses={"fkl": 1.0})
    t.update(train)
    return dict(seed=1, target=dict(kind="tiny", config=TINY, seed=3),
                # hot sampling: a random tiny target otherwise loops and any draft scores ~0.95
                data=dict(prompts=tr, heldout=ho, prompt_format="ids", max_new_tokens=24, gen_batch=16, temperature=2.0,
                          teacher_batch=16, topk=16, cache_dir=cache),
                draft=draft, train=t)


def _curve(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        recs = [json.loads(ln) for ln in f]
    return [r["loss"] for r in recs if "loss" in r], [r["eval"] for r in recs if "eval" in r]


def test_bad_configs_fail_before_work(prompt_files, tmp_path):
    base = _cfg(prompt_files, tmp_path / "x", dict(kind="eagle"))
    T.load_config(base)
    bad = [
        (dict(base, train=dict(base["train"], lr=-1.0)), "train.lr"),
        (dict(base, train=dict(base["train"], warmup=40)), "warmup"),
        (dict(base, train=dict(base["train"], losses={"kl": 1.0})), "unknown losses"),
        (dict(base, draft=dict(kind="medusa")), "draft.kind"),
        (dict(base, draft=dict(kind="independent", config=dict(TINY, vocab_size=65))), "vocabulary mismatch"),
        (dict(base, draft=dict(kind="independent", config=dict(TINY, n_heads=3))), "draft.config"),
        (dict(base, data=dict(base["data"], prompts="/nonexistent")), "no such file"),
        (dict(base, data=dict(base["data"], topk=0)), "data.topk"),
        (dict(base, extra=1), "unknown top-level"),
        (dict(base, train=dict(base["train"], stepz=3)), "unknown keys"),
        (dict(base, draft=dict(kind="independent", config=TINY), train=dict(base["train"], losses={"fkl": 1, "hidden": 1})),
         "hidden-state loss"),
        (dict(base, target=dict(base["target"], overrides={"dim": 64})), "target.overrides"),
        (dict(base, target=dict(base["target"], overrides=[1])), "target.overrides"),
        (dict(base, train=dict(base["train"], export_dtype="bfloat16")), "export_dtype"),
        (dict(base, draft=dict(kind="eagle", feature_layers=[1, 3])), "exceed the target"),
        (dict(base, draft=dict(kind="eagle", feature_layers=[1, 1])), "repeated"),
        (dict(base, draft=dict(kind="eagle", feature_layers=[0, 2]), train=dict(base["train"], losses={"fkl": 1, "hidden": 1})),
         "EAGLE-3"),
        (dict(base, draft=dict(kind="independent", config=TINY, feature_layers=[0, 2])), "only for eagle"),
        (dict(base, draft=dict(kind="eagle", config={"feature_layers": [0, 2]})), "draft.feature_layers"),
        (dict(base, data=dict(base["data"], prompts=[])), "data.prompts"),
        (dict(base, data=dict(base["data"], prompts=[base["data"]["prompts"], "/nonexistent"])), "no such file"),
        (dict(base, data=dict(base["data"], prompts=[base["data"]["prompts"], base["data"]["heldout"]])),
         "must be different files"),
    ]
    for d, msg in bad:
        with pytest.raises(T.ConfigError, match=msg):
            T.load_config(d)
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("draft, losses", [
    pytest.param(dict(kind="independent", config=dict(TINY, n_layers=1, dim=16, head_dim=4, ffn_dim=32)), {"fkl": 1.0},
                 marks=pytest.mark.extended),
    (dict(kind="eagle", n_layers=1, config=dict(ffn_dim=64), vocab_subset=48, init="random_fc"), {"fkl": 1.0, "tv": 0.5, "hidden": 0.1}),
    # EAGLE-3: the embeddings, after layer 1, after the final norm; the target's last layer as
    # the start (its feature half)
    pytest.param(dict(kind="eagle", n_layers=1, config=dict(ffn_dim=64), vocab_subset=48, init="target_last",
                      feature_layers=[0, 1, 2]), {"fkl": 1.0}, marks=pytest.mark.extended),
], ids=["independent", "eagle", "eagle3"])
def test_loss_goes_down_and_alpha_goes_up(prompt_files, tmp_path, target, draft, losses):
    out = tmp_path / draft["kind"]
    res = T.train(_cfg(prompt_files, out, draft, losses=losses), target=target)
    loss, evals = _curve(out)
    assert len(loss) == 40
    assert np.mean(loss[-5:]) < 0.8 * np.mean(loss[:5]), (loss[:5], loss[-5:])
    first, last = evals[0], evals[-1]
    # the draft's rejection rate 1 - alpha falls by a fifth or more
    assert 1 - last["alpha"][0] < 0.8 * (1 - first["alpha"][0]), (first, last)
    if draft["kind"] == "eagle":
        assert len(last["alpha"]) == 3  # per draft position
        assert last["alpha"][1] > first["alpha"][1]
    assert res["eval"] == last
    # the exported draft drives the engine exactly (greedy equality)
    prop = make_proposer(load_draft_model(str(out / "draft.npz"), target), 3, target.vocab_size)
    if draft.get("feature_layers"):  # EAGLE-3: the file records the layers the head reads
        assert prop.hidden_layers == tuple(draft["feature_layers"])
        cached = T.build_data(T.load_config(_cfg(prompt_files, out, draft)), "train", target, None, log=lambda s: None)
        assert cached["cached"] and cached["features"].shape[-1] == 3 * TINY["dim"] and "hidden" not in cached
    prompts = [[1, 2, 3, 4], [9, 8]]
    g = sampling.SamplingConfig(temperature=0.0)
    ar = build.generate_autoregressive(target, prompts, seed=0, sampling_params=g, max_new_tokens=16)
    sp = build.generate(target, prop, prompts, k=3, method="greedy", seed=0, sampling_params=g,
                         max_new_tokens=16)
    assert sp.tokens == ar.tokens


def test_shipped_training_configs_load():
    import glob

    paths = sorted(glob.glob(os.path.join(T.REPO, "configs", "train", "*.yaml")))
    assert any("eagle3" in p for p in paths)
    for p in paths:
        T.load_config(p)


@pytest.mark.parametrize("draft", [
    pytest.param(dict(kind="target_init", n_layers=1, freeze_embed=True), marks=pytest.mark.extended),
    # EAGLE-3 with training-time test over 2 positions: its optimizer, data order and the
    # unrolled steps' keys all come back from the checkpoint
    dict(kind="eagle", n_layers=1, config=dict(ffn_dim=64), vocab_subset=48, init="target_last",
         feature_layers=[0, 1, 2]),
], ids=["target_init", "eagle3"])
def test_resume_after_kill_matches_uninterrupted_and_data_is_cached(prompt_files, tmp_path, target, draft, capsys):
    kw = dict(steps=12, ckpt_every=4, eval_every=12, warmup=2)
    first = _cfg(prompt_files, tmp_path / "full", draft, **kw)
    for split in ("train", "heldout"):  # generated here unless an earlier test did it
        T.build_data(T.load_config(first), split, target, None, log=lambda s: None)
    full = T.train(first, target=target)
    assert full["data_cached"] == {"train": True, "heldout": True}
    cfg = _cfg(prompt_files, tmp_path / "killed", draft, **kw)
    assert T.train(cfg, stop_after=6, target=target) == {"stopped": 6}  # last checkpoint: step 4
    resumed = T.train(cfg, target=target)
    for a, b in zip(jax.tree.leaves(full["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    la, _ = _curve(tmp_path / "full")
    lb, _ = _curve(tmp_path / "killed")
    assert la == lb  # same config -> same loss curve
    # a resume under another config is refused before any work (it mixed two runs, or failed
    # inside orbax on other shapes); more steps may be asked for
    with pytest.raises(T.ResumeError, match=r"another config \(train.lr differs\)"):
        T.train(_cfg(prompt_files, tmp_path / "killed", draft, **dict(kw, lr=5e-3)), target=target)
    T._check_resume(str(tmp_path / "killed"), T.load_config(_cfg(prompt_files, tmp_path / "killed", draft,
                                                                 **dict(kw, steps=20))))
    _rerun_of_a_finished_run(prompt_files, tmp_path, target, draft, kw, full, capsys)
    if draft["kind"] == "eagle":
        prop = make_proposer(load_draft_model(str(tmp_path / "killed" / "draft.npz"), target), 2, target.vocab_size)
        assert prop.hidden_layers == (0, 1, 2)
        return
    # frozen embedding: the exported file holds no embedding and loads from the target
    prop = make_proposer(load_draft_model(str(tmp_path / "killed" / "draft.npz"), target), 2, target.vocab_size)
    np.testing.assert_array_equal(prop.model.canonical_weights()["embed"], target.canonical_weights()["embed"])


def _train_draft_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_draft", os.path.join(T.REPO, "scripts", "train_draft.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _script(argv, capsys):
    """scripts/train_draft.py's main in this process: (exit status, stdout, stderr)."""
    try:
        rc = _train_draft_script().main(argv)
    except SystemExit as e:  # the parser's usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _yaml(path, d):
    import yaml

    path.write_text(yaml.safe_dump(d))
    return str(path)


def _files_of(d):
    return {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in os.listdir(d) if os.path.isfile(os.path.join(d, f))}


def _rerun_of_a_finished_run(prompt_files, tmp_path, target, draft, kw, full, capsys):
    """A finished run's folder: fewer steps than checkpointed, or a --stop-after at or
    below them, is refused (exit 2, one line, before the target loads, nothing written); a
    plain rerun keeps its recorded results (script and library); a run killed before its
    summary gets its evaluation redone."""
    out = tmp_path / "full"
    cfg_path = _yaml(tmp_path / "full.yaml", _cfg(prompt_files, out, draft, **kw))
    before = _files_of(out)
    for argv, msg in [(["--steps", "6"], "holds a checkpoint at step 12, past train.steps=6"),
                      (["--stop-after", "6"], "already at step 12")]:
        rc, _, err = _script([cfg_path, *argv], capsys)
        assert rc == 2 and err.count("\n") == 1 and msg in err, (argv, rc, err)
    rc, stdout, err = _script([cfg_path], capsys)
    assert rc == 0 and "complete 12-step run" in err, err
    assert json.loads(stdout)["eval"] == full["eval"] is not None
    again = T.train(_cfg(prompt_files, out, draft, **kw), target=target)
    assert again["eval"] == full["eval"]
    for a, b in zip(jax.tree.leaves(full["params"]), jax.tree.leaves(again["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _files_of(out) == before  # nothing rewritten
    os.remove(out / "summary.json")  # killed after the last checkpoint: evaluated again
    redone = T.train(_cfg(prompt_files, out, draft, **kw), target=target)
    assert redone["eval"] == full["eval"]
    with open(out / "summary.json") as f:
        assert json.load(f)["eval"] == full["eval"]


def test_script_refuses_bad_input_before_work(prompt_files, tmp_path, monkeypatch, capsys):
    """scripts/train_draft.py: bad options and configs are one-line errors with exit status 2
    before the target loads, and nothing is written to the out dir."""
    def no_work(*a, **k):
        raise AssertionError("started work")

    monkeypatch.setattr(T, "load_target", no_work)
    monkeypatch.setattr(T, "train", no_work)
    out = tmp_path / "out"
    base = _cfg(prompt_files, out, dict(kind="target_init", n_layers=1))
    good = _yaml(tmp_path / "good.yaml", base)
    (tmp_path / "file").write_text("x")
    cases = [
        ([good, "--time-budget", "nan"], "--time-budget must be a finite number"),
        ([good, "--time-budget", "inf"], "--time-budget must be a finite number"),
        ([good, "--time-budget", "0"], "--time-budget must be a finite number"),
        ([good, "--stop-after", "-1"], "--stop-after must be >= 1"),
        ([good, "--out-dir", ""], "--out-dir must not be empty"),
        ([good, "--data-only", "--steps", "5"], "--steps does not apply to --data-only"),
        ([good, "--data-only", "--stop-after", "3"], "--stop-after does not apply to --data-only"),
        ([good, "--data-only", "--time-budget", "9"], "--time-budget does not apply to --data-only"),
        ([good, "--steps", "x"], "invalid int value"),
        ([good, "--steps", "0"], "train.steps must be >= 1"),
        ([good, "--out-dir", str(tmp_path / "file")], "cannot create the folder"),
        ([good, "--out-dir", str(tmp_path / "file" / "sub")], "cannot create the folder"),
        ([_yaml(tmp_path / "seed.yaml", dict(base, seed=99999999999999999999))], "seed must be < 2**32"),
        ([_yaml(tmp_path / "ts.yaml", dict(base, target=dict(base["target"], seed=2 ** 32)))], "target.seed"),
        ([_yaml(tmp_path / "t5.yaml", dict(base, train=5))], "train must be a mapping"),
        ([_yaml(tmp_path / "tg.yaml", dict(base, target=5))], "target must be a mapping"),
        ([_yaml(tmp_path / "l5.yaml", dict(base, train=dict(base["train"], losses=5)))], "train.losses must be"),
        ([_yaml(tmp_path / "tc.yaml", dict(base, target=dict(base["target"], config=dict(TINY, x=1))))], "target.config"),
        ([_yaml(tmp_path / "od.yaml", dict(base, train=dict(base["train"], out_dir=5)))], "train.out_dir"),
        ([_yaml(tmp_path / "pg.yaml", dict(base, train=dict(base["train"], progress="yes")))], "train.progress"),
        ([str(tmp_path / "missing.yaml")], "No such file"),
    ]
    if os.path.isdir("/proc/self"):  # Linux: no folder can be made there
        cases.append(([good, "--out-dir", "/proc/x"], "cannot create the folder"))
    for argv, msg in cases:
        rc, stdout, err = _script(argv, capsys)
        assert rc == 2 and err.count("\n") == 1 and msg in err and not stdout, (argv, rc, err)
    assert not out.exists() and not os.path.exists("/proc/x")


def test_script_paths_are_the_current_directory(prompt_files, tmp_path, monkeypatch, capsys):
    """The config path and --out-dir of scripts/train_draft.py are the current directory's."""
    got = []
    monkeypatch.setattr(T, "train", lambda cfg, **kw: got.append(cfg) or {"steps": cfg.train.steps})
    _yaml(tmp_path / "cfg.yaml", _cfg(prompt_files, tmp_path / "unused", dict(kind="target_init", n_layers=1)))
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    rc, _, err = _script(["../../cfg.yaml", "--out-dir", "../../x"], capsys)
    assert rc == 0, err
    assert got[0].train.out_dir == str(tmp_path / "x") and (tmp_path / "x").is_dir()


def test_time_budget_picks_steps_and_equals_a_fixed_step_run(prompt_files, tmp_path, target):
    """--time-budget times the run's own steps on a COPY of the state: the budgeted run ends
    with the same parameters as a run told that step count, which is how it is repeated."""
    draft = dict(kind="target_init", n_layers=1, freeze_embed=True)
    kw = dict(steps=100000, ckpt_every=100000, eval_every=100000, warmup=2)
    cfg = _cfg(prompt_files, tmp_path / "budget", draft, **kw)
    for split in ("train", "heldout"):
        T.build_data(T.load_config(cfg), split, target, None, log=lambda s: None)
    logs = []
    # A clock that advances 10 ms per reading, so the result does not depend on this machine's
    # speed: t_call = 0; 12 probe steps of 10 ms each (compile 10 ms, step 11.5 ms with the
    # 15% margin); the evaluation 10 ms; "now" is the 28th reading (0.27 s). Steps =
    # (4.0 - 0.27 - 0.01 - 0.01) / (0.0115 + 0.01 / 100000) = 322.6 -> 320 (multiple of 10).
    res = T.train(cfg, target=target, time_budget=4.0, reserve_s=0.0, log=logs.append, clock=_Ticks(0.01))
    n = res["steps"]
    assert n == 320, n
    assert any(f"--steps {n}" in ln for ln in logs)
    with open(tmp_path / "budget" / "config.json") as f:
        assert json.load(f)["train"]["steps"] == n
    fixed = T.train(_cfg(prompt_files, tmp_path / "fixed", draft, **dict(kw, steps=n)), target=target)
    for a, b in zip(jax.tree.leaves(res["params"]), jax.tree.leaves(fixed["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(RuntimeError, match="time budget"):
        T.train(_cfg(prompt_files, tmp_path / "tiny", draft, **kw), target=target, time_budget=0.2,
                clock=_Ticks(0.01))


class _Ticks:
    """A fake clock: each reading is ``dt`` later than the one before."""

    def __init__(self, dt: float):
        self.dt, self.n = dt, -1

    def __call__(self) -> float:
        self.n += 1
        return self.n * self.dt


def test_float16_draft_files(tmp_path, target):
    from specjax.drafts.files import read_draft, save_draft

    w = {"a": np.linspace(-3, 3, 50, dtype=np.float32).reshape(5, 10), "token_map": np.arange(7, dtype=np.int32)}
    save_draft(str(tmp_path / "h.npz"), "eagle", {}, w, dtype="float16")
    save_draft(str(tmp_path / "f.npz"), "eagle", {}, w)
    _, h = read_draft(str(tmp_path / "h.npz"))
    _, f = read_draft(str(tmp_path / "f.npz"))
    assert h["a"].dtype == np.float32 and h["token_map"].dtype == np.int32
    np.testing.assert_array_equal(f["a"], w["a"])
    np.testing.assert_allclose(h["a"], w["a"], rtol=1e-3)
    assert not np.array_equal(h["a"], w["a"])  # really rounded to float16
    np.testing.assert_array_equal(h["token_map"], w["token_map"])
    with pytest.raises(ValueError, match="float16"):
        save_draft(str(tmp_path / "x.npz"), "eagle", {}, {"a": np.array([1e6], np.float32)}, dtype="float16")


def test_several_prompt_files_and_held_out_prompts_left_out(prompt_files, tmp_path):
    """data.prompts may list files (read in order); a training prompt that is also a
    held-out one (ignoring case and spacing) is left out, and the data key says so."""
    tr, ho, _ = prompt_files
    extra = tmp_path / "extra.txt"
    held = [ln for ln in open(ho).read().splitlines() if ln.strip()]
    extra.write_text("# a comment line\n1 2 3\n" + "  " + held[0].replace(" ", "  ") + "\n4 5\n")
    base = _cfg(prompt_files, tmp_path / "x", dict(kind="eagle"))
    one = T.load_config(base)
    two = T.load_config(dict(base, data=dict(base["data"], prompts=[tr, str(extra)])))
    lines, dropped = T.training_lines(two.data)
    assert dropped == 1 and lines == T.prompt_lines(tr) + ["1 2 3", "4 5"]
    assert T.training_lines(one.data) == (T.prompt_lines(tr), 0)
    assert T._data_key(one, "train") != T._data_key(two, "train")


def test_another_feature_set_reuses_the_generated_text(prompt_files, tmp_path, target, monkeypatch):
    """An EAGLE-1 run after an EAGLE-3 run on the same data settings (or the other way round)
    pays only the teacher forward: the on-policy text is cached apart from the features."""
    tr, ho, _ = prompt_files
    files = (tr, ho, str(tmp_path / "cache"))
    e3 = T.load_config(_cfg(files, tmp_path / "e3", dict(kind="eagle", n_layers=1, feature_layers=[0, 1, 2])))
    e1 = T.load_config(_cfg(files, tmp_path / "e1", dict(kind="eagle", n_layers=1)))
    assert T._data_key(e3, "train") != T._data_key(e1, "train")
    assert T._data_key(e3, "train", text_only=True) == T._data_key(e1, "train", text_only=True)
    first = T.build_data(e3, "train", target, None, log=lambda s: None)

    def no_generation(*a, **k):
        raise AssertionError("generated the text again")

    monkeypatch.setattr(T, "_generate", no_generation)
    logs = []
    second = T.build_data(e1, "train", target, None, log=logs.append)
    assert not second["cached"] and any("generated rows from" in ln for ln in logs), logs
    for k in ("tokens", "lengths", "prompt_lens", "topk_idx"):
        np.testing.assert_array_equal(first[k], second[k])
    np.testing.assert_allclose(first["topk_p"], second["topk_p"], rtol=1e-5, atol=1e-7)
    assert "features" in first and "hidden" in second and "features" not in second


def test_independent_draft_file_leaves_the_backend_layouts_to_the_loading_machine(tmp_path):
    """A draft exported where the TPU layouts are on (here set by hand) stores them as
    "auto", so the machine that loads it picks its own; the weights are the same."""
    from types import SimpleNamespace

    from specjax.drafts.files import load_draft_model, read_draft
    from specjax.models.llama import LAYOUT_FIELDS

    on = tiny_config(vocab_size=32, n_layers=2, scan_layers=True, **dict.fromkeys(LAYOUT_FIELDS, True))
    lm = LlamaLM.init(on, seed=4)
    draft = SimpleNamespace(kind="independent", config=on, module=lm.module)
    cfg = SimpleNamespace(train=SimpleNamespace(export_dtype="float32"), draft=SimpleNamespace(freeze_embed=False))
    path = str(tmp_path / "d.npz")
    T.export_draft(cfg, draft, path, {})
    meta, _ = read_draft(path)
    assert all(meta["config"][f] == "auto" for f in LAYOUT_FIELDS), meta["config"]
    target = LlamaLM.init(tiny_config(vocab_size=32, n_layers=2), seed=1)
    got = load_draft_model(path, target, param_dtype="float32")
    want = {f: getattr(tiny_config(scan_layers=True, **dict.fromkeys(LAYOUT_FIELDS, "auto")), f) for f in LAYOUT_FIELDS}
    assert {f: getattr(got.config, f) for f in LAYOUT_FIELDS} == want  # this machine's (False on CPU)
    a, b = lm.canonical_weights(), got.canonical_weights()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
