"""scripts/eval_heldout.py on a tiny target: a draft file read back scores on held-out prompts
what training's own evaluation gives for the same head (same cached data, same numbers), for
EAGLE-1 and EAGLE-3 heads (the latter's data holds the layers it reads), and '#' lines of a
prompt file are comments."""
from __future__ import annotations

import numpy as np
import pytest

from specjax.drafts.files import load_draft_model
from specjax.models.llama import LlamaLM, tiny_config
from specjax.train import distill as T

TINY = dict(vocab_size=64, n_layers=2, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("heldout")
    rng = np.random.default_rng(5)
    ho = d / "heldout.txt"
    ho.write_text("# a comment line, not a prompt\n"
                  + "\n".join(" ".join(map(str, rng.integers(0, 64, rng.integers(3, 8)))) for _ in range(6)))
    return None, str(ho), str(d / "cache")


@pytest.mark.parametrize("layers", [None, pytest.param([0, 2, 1], marks=pytest.mark.extended)], ids=["eagle", "eagle3"])
def test_draft_file_scores_what_training_evaluation_scores(files, tmp_path, layers):
    from scripts.eval_heldout import heldout_eval, table

    _, ho, cache = files
    target = LlamaLM.init(tiny_config(**TINY), seed=3)
    spec = T.TargetSpec(kind="tiny", config=TINY, seed=3)
    cfg = T.RunConfig(seed=2, target=spec,
                      data=T.DataConfig(prompts=ho, heldout=ho, prompt_format="ids", max_new_tokens=12,
                                        gen_batch=16, teacher_batch=16, cache_dir=cache),
                      draft=T.DraftConfig(kind="eagle", vocab_subset=48, init="target_last", feature_layers=layers),
                      train=T.TrainConfig(export_dtype="float32"))
    held = T.build_data(cfg, "heldout", target, None, log=lambda s: None)
    assert held["tokens"].shape[0] == 6  # the '#' line is a comment
    draft = T.build_draft(cfg, target, held)
    want = T.evaluate(T.make_eval(draft, 3), draft.trainable, held, 4)
    assert want["alpha"][0] > 0.1
    path = str(tmp_path / "draft.npz")
    T.export_draft(cfg, draft, path, {})
    model = load_draft_model(path, target, param_dtype="float32")
    assert tuple(model.config.feature_layers) == tuple(layers or ())
    logs = []
    got = heldout_eval(target, None, model, ho, target_spec=spec, prompt_format="ids", max_new=12, positions=3,
                       seed=2, cache_dir=cache, eval_batch=3, log=logs.append)
    assert any("loaded" in s for s in logs), logs  # the same data: the training split's cache key
    assert got["rows"] == 6 and got["generated_tokens"] == int((held["lengths"] - held["prompt_lens"]).sum())
    np.testing.assert_allclose(got["alpha"], want["alpha"], atol=2e-4)
    np.testing.assert_allclose(got["greedy"], want["greedy"], atol=2e-4)
    assert "| 6 |" in table([got])
