"""The engine on the real SmolLM2-135M-Instruct: speculative greedy == autoregressive greedy."""
from __future__ import annotations

import numpy as np
import pytest

from specjax import build, sampling
from specjax.drafts import first_layers_draft

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def real():
    from specjax import models
    target, _ = models.load_default_target()
    tok = models.load_default_tokenizer()
    return target, tok


def test_real_model_speculative_greedy_equals_autoregressive(real):
    target, tok = real
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "List the first five prime numbers."}],
                                tokenize=True),
        tok.encode("The capital of France is Paris. The capital of Italy is"),
    ]
    cfg = sampling.SamplingConfig(temperature=0.0)
    n = 32
    ar = build.generate_autoregressive(target, prompts, seed=0, sampling_params=cfg, max_new_tokens=n,
                                        greedy=True)
    assert all(len(t) == n for t in ar.tokens)
    # (prompt lookup's greedy exactness: tests/test_engine.py, on small models)
    draft = first_layers_draft(target, 2)
    spec = build.generate(target, draft, prompts, k=3, method="greedy", seed=0, sampling_params=cfg,
                           max_new_tokens=n)
    assert spec.tokens == ar.tokens, [tok.decode(t) for t in spec.tokens + ar.tokens]
    assert np.mean([s.tokens_per_round for s in spec.stats]) >= 1.0


def test_shipped_default_draft_is_the_trained_eagle_head_and_keeps_greedy_exact(real):
    """`specjax generate`'s default draft for this target: the EAGLE head shipped in specjax/drafts/data/
    (a complete training run), greedy-exact, and trained: it gets well over one token per
    round on prompts it was not trained on (an untrained head gets ~1.0)."""
    from specjax.models.eagle import EagleModel
    from specjax.drafts.files import default_draft_for, shipped_draft_path
    from specjax.drafts.files import read_draft

    target, tok = real
    meta, _ = read_draft(shipped_draft_path(target))
    assert meta["kind"] == "eagle" and meta["info"]["complete"] and meta["info"]["steps"] > 0
    draft = default_draft_for(target)
    assert isinstance(draft, EagleModel) and draft.config.vocab_subset > 0
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True) for p in
               ("Write a haiku about autumn leaves.", "Explain in two sentences what a hash table is.")]
    cfg = sampling.SamplingConfig(temperature=0.0)
    n = 32
    ar = build.generate_autoregressive(target, prompts, seed=0, sampling_params=cfg, max_new_tokens=n,
                                        greedy=True)
    spec = build.generate(target, draft, prompts, k=3, method="greedy", seed=0, sampling_params=cfg,
                           max_new_tokens=n)
    assert spec.tokens == ar.tokens, [tok.decode(t) for t in spec.tokens + ar.tokens]
    assert np.mean([s.tokens_per_round for s in spec.stats]) > 1.5, [s.tokens_per_round for s in spec.stats]
