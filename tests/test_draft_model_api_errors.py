"""Bad input to the public API of the drafts, the models (``LlamaLM``, ``EagleModel``), the key
helpers and the demo fails at once with a one-line ValueError / TypeError naming the problem:
never a silently wrong result (a token id wrapped onto another by the embedding gather, a
cache write past its end dropped, a seed wrapped onto another seed's weights) nor a deep
traceback."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import demo, keys
from specjax.drafts import (DraftModelProposer, EagleProposer, PromptLookupProposer, first_layers_draft,
                            make_proposer)
from specjax.drafts.trees import EagleTreeProposer
from specjax.models.eagle import EagleConfig, EagleModel, random_trainable
from specjax.models.llama import LlamaLM, random_weights, tiny_config

V = 8


@pytest.fixture(scope="module")
def lm():
    return LlamaLM.init(tiny_config(vocab_size=V), seed=0)


@pytest.fixture(scope="module")
def head(lm):
    return EagleModel.for_target(lm, EagleConfig.for_target(lm.config, head_dim=8, ffn_dim=32))


# --- models ---------------------------------------------------------------------------------

def test_apply_refuses_token_ids_outside_the_vocabulary(lm):
    cache = lm.init_cache(1, 8)
    # -1 was read as token V-1 (the gather wraps negative ids), V gave NaN logits
    for bad in (-1, V):
        with pytest.raises(ValueError, match=r"LlamaLM.apply: token ids must lie in \[0, 8\)"):
            lm(jnp.array([[1, bad]]), cache)
    with pytest.raises(ValueError, match="token ids"):
        lm.apply(lm.params, np.array([[V + 3]]), cache)
    assert lm(jnp.array([[0, V - 1]]), cache).logits.shape == (1, 2, V)


def test_apply_refuses_bad_token_shapes_and_dtypes(lm):
    cache = lm.init_cache(1, 8)
    with pytest.raises(TypeError, match="integer token ids"):  # was cut to token 1
        lm(jnp.array([[1.5]]), cache)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, T\]"):
        lm(jnp.array([1, 2]), cache)
    with pytest.raises(ValueError, match="batch 2, the cache 1"):
        lm(jnp.zeros((2, 1), jnp.int32), cache)


def test_apply_refuses_positions_past_the_cache(lm):
    # the write of the 9th position was dropped and the step read a slot it never wrote
    for b in (1, 2):
        cache = lm.init_cache(b, 8).with_lengths(jnp.full((b,), 7, jnp.int32))
        with pytest.raises(ValueError, match="do not fit the cache of 8 slots"):
            lm(jnp.ones((b, 2), jnp.int32), cache)
    with pytest.raises(ValueError, match="do not fit the cache"):
        lm(jnp.ones((1, 9), jnp.int32), lm.init_cache(1, 8))
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        lm(jnp.ones((1, 1), jnp.int32), lm.init_cache(1, 8).with_lengths(jnp.array([-1])))
    # the last slot itself is fine
    out = lm(jnp.ones((1, 1), jnp.int32), lm.init_cache(1, 8).with_lengths(jnp.array([7])))
    assert int(out.cache.lengths[0]) == 8


def test_init_cache_refuses_bad_sizes(lm, head):
    for make in (lm.init_cache, head.init_cache):
        for batch, max_len in ((0, 8), (-1, 8), (1, 0), (1, -3), (1.5, 4), (True, 4)):
            with pytest.raises(ValueError, match="must be an integer >= 1"):
                make(batch, max_len)
    assert lm.init_cache(np.int64(2), 4).k.shape[1] == 2


def test_init_seeds_never_wrap_onto_another_seed():
    cfg = tiny_config(vocab_size=V)
    # jax.random.key keeps 32 bits: seed 2**32 was seed 0's weights, -1 seed 2**32 - 1's
    for bad in (-1, 2 ** 64, 1.5, True, None):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            LlamaLM.init(cfg, seed=bad)
    a, b = random_weights(cfg, 0), random_weights(cfg, 2 ** 32)
    assert not np.array_equal(np.asarray(a["embed"]), np.asarray(b["embed"]))
    # below 2**32 the weights are jax.random.key(seed)'s, as before
    ref = jax.random.split(jax.random.key(7), len(a))
    np.testing.assert_array_equal(np.asarray(random_weights(cfg, 7)["embed"]),
                                  np.asarray(jax.random.normal(ref[sorted(a).index("embed")], (V, cfg.dim))))
    ecfg = EagleConfig(vocab_size=V, dim=16, head_dim=8, ffn_dim=32)
    with pytest.raises(ValueError, match="seed must be"):
        random_trainable(ecfg, -1)
    assert not np.array_equal(random_trainable(ecfg, 0)["wq"], random_trainable(ecfg, 2 ** 32)["wq"])


def test_llama_config_refuses_values_that_break_the_model():
    for bad, msg in ((dict(vocab_size=True), "vocab_size must be a positive int"),
                     (dict(rope_theta=0.0), "rope_theta must be a finite number > 0"),  # NaN angles
                     (dict(rope_theta=float("nan")), "rope_theta"),
                     (dict(rope_local_theta=-1.0), "rope_local_theta"),
                     (dict(norm_eps=-1.0), "norm_eps must be a finite number >= 0"),
                     (dict(attn_chunk=-1), "attn_chunk must be an int >= 0"),
                     (dict(max_position=-5), "max_position must be an int >= 0")):
        with pytest.raises(ValueError, match=msg):
            tiny_config(**bad)
    assert tiny_config(attn_chunk=0, max_position=0).attn_chunk == 0
    with pytest.raises(ValueError, match="vocab_subset must be in"):  # True was a subset of 1 token
        EagleConfig(vocab_size=V, dim=16, vocab_subset=True)
    with pytest.raises(ValueError, match="rope_theta"):  # the head's layers are Llama layers
        EagleConfig(vocab_size=V, dim=16, rope_theta=-1.0)


def test_eagle_apply_checks_tokens_features_and_cache(head):
    cache = head.init_cache(1, 4)
    h = jnp.zeros((1, 1, 16), jnp.float32)
    for bad in (-1, V):
        with pytest.raises(ValueError, match=r"EagleModel.apply: token ids must lie in \[0, 8\)"):
            head.apply(head.params, h, jnp.array([[bad]]), cache)
    with pytest.raises(ValueError, match="hidden must be"):
        head.apply(head.params, jnp.zeros((1, 1, 15)), jnp.array([[1]]), cache)
    with pytest.raises(ValueError, match="do not fit the cache of 4 slots"):
        head.apply(head.params, jnp.zeros((1, 2, 16)), jnp.array([[1, 2]]), cache.with_lengths(jnp.array([3])))
    with pytest.raises(ValueError, match="must have 16 features"):
        head.fuse(head.params, jnp.zeros((1, 1, 32)))


# --- proposers ------------------------------------------------------------------------------

def test_proposers_refuse_bad_k_vocab_and_ngram_sizes(lm, head):
    for k in (0, -1, 1.5, True, "3"):
        for make in (lambda k: PromptLookupProposer(vocab_size=V, k=k), lambda k: DraftModelProposer(lm, k),
                     lambda k: EagleProposer(head, k), lambda k: make_proposer(lm, k, V)):
            with pytest.raises(ValueError, match="k must be an integer >= 1"):
                make(k)
    assert DraftModelProposer(lm, np.int64(3)).k == 3 and type(DraftModelProposer(lm, np.int64(3)).k) is int
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 1"):
        PromptLookupProposer(vocab_size=0, k=2)
    # n = 0 once matched everywhere (it proposed the last token again); min > max never drafted
    for bad, msg in ((dict(min_ngram=0), "min_ngram must be"), (dict(max_ngram=0), "max_ngram must be"),
                     (dict(min_ngram=4, max_ngram=2), "max_ngram=2 is below min_ngram=4"),
                     (dict(max_ngram=33), "max_ngram=33 is above 32")):  # was: tracing without end
        with pytest.raises(ValueError, match=msg):
            PromptLookupProposer(vocab_size=V, k=2, **bad)
    with pytest.raises(ValueError, match="plain_backlog must be an integer >= 0"):
        EagleProposer(head, 2, plain_backlog=-1)
    with pytest.raises(TypeError, match="EagleProposer: model must be"):
        EagleProposer(lm, 2)
    with pytest.raises(TypeError, match="EagleTreeProposer: model must be"):  # was: an error while tracing
        EagleTreeProposer(model=lm)
    assert EagleTreeProposer(model=head).model is head and EagleTreeProposer(model=None).k >= 1  # None: a shape
    with pytest.raises(TypeError, match="use EagleProposer"):
        DraftModelProposer(head, 2)
    with pytest.raises(TypeError, match="DraftModelProposer: model must be"):
        DraftModelProposer("draft.npz", 2)


def test_first_layers_draft_refuses_non_integer_layer_counts():
    target = LlamaLM.init(tiny_config(vocab_size=V, n_layers=2), seed=0)
    for bad in (1.5, True, 0, 3):  # 1.5 failed deep in a slice, True gave one layer
        with pytest.raises(ValueError, match=f"layers:{bad}: the target has 2 layers"):
            first_layers_draft(target, bad)
    assert first_layers_draft(target, np.int64(1)).config.n_layers == 1


def test_make_proposer_checks_the_vocabulary(lm, head):
    # the draft's own vocabulary was used whatever vocab_size said
    for draft in (lm, head, PromptLookupProposer(vocab_size=V, k=2)):
        with pytest.raises(ValueError, match="vocabulary mismatch"):
            make_proposer(draft, 2, 2 * V)
    for v in (0, None):
        with pytest.raises(ValueError, match="vocab_size must be an integer >= 1"):
            make_proposer("lookup", 2, v)
    assert make_proposer(lm, 2, V).vocab_size == V


# --- keys -----------------------------------------------------------------------------------

def test_key_helpers_never_wrap_or_cut_their_inputs():
    k = jax.random.key(0)
    # numpy's 2**32 was folded in as 0 (round 2**32 = round 0), a float position cut to an int
    with pytest.raises(ValueError, match=r"fold_in data must lie in \[0, 2\*\*32\)"):
        keys.round_key(k, np.int64(2 ** 32))
    with pytest.raises(ValueError, match="must lie in"):
        keys.derive(k, 0, -1, 0)
    with pytest.raises(TypeError, match="fold_in data must be an integer"):
        keys.position_key(k, 1.5)
    with pytest.raises(ValueError, match="must be a scalar"):
        keys.fold_in(k, np.arange(3))
    for shape in ((2.5,), (-1,)):
        with pytest.raises(ValueError, match="shape must be a sequence of integers >= 0"):
            keys.random_bits(k, shape)
    with pytest.raises(ValueError, match="row indices must be a flat sequence"):
        keys.row_keys(0, [[0, 1]])
    with pytest.raises(ValueError, match="row indices must be a flat sequence"):
        keys.row_keys(0, 3)
    # valid inputs: JAX's values, bit for bit
    np.testing.assert_array_equal(jax.random.key_data(keys.fold_in(k, np.uint32(2 ** 32 - 1))),
                                  jax.random.key_data(jax.random.fold_in(k, 2 ** 32 - 1)))
    np.testing.assert_array_equal(keys.random_bits(k, (np.int64(3),)), jax.random.bits(k, (3,), jnp.uint32))


# --- demo -----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, msg", [(["--k", "0"], "K must be an integer from 1 to 64"),
                                       (["--k", "65"], "K must be an integer from 1 to 64"),  # was a MemoryError at 10**9
                                       (["--seed", "-1"], "seed must be an integer"),
                                       (["--temperature", "-1"], "temperature")])
def test_demo_refuses_bad_arguments_in_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1] and "Traceback" not in "\n".join(err)
