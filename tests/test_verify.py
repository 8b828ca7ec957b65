"""specjax.verify: contracts of the samplers and of greedy verification, edge cases."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import audit, keys
from specjax import verify as V
from specjax.sampling import sample

K, VOCAB = 3, 5
ROWS = 64  # every batched call uses [ROWS, K, VOCAB], so each sampler compiles once
SAMPLERS = {"token": V.token_verify, "block": V.block_verify}
batched = {name: jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None)))
           for name, f in SAMPLERS.items()}
single = {name: jax.jit(f) for name, f in SAMPLERS.items()}


def _log_normalize(x):
    return (x - jax.nn.logsumexp(x, axis=-1, keepdims=True)).astype(np.float32)


def _problem(seed, rows, k=K, v=VOCAB, scale=1.5):
    """Random (tokens, draft_lp, target_lp) with tokens drawn from the draft."""
    rng = np.random.default_rng(seed)
    dlp = np.array(_log_normalize(rng.normal(size=(rows, k, v)) * scale))
    tlp = np.array(_log_normalize(rng.normal(size=(rows, k + 1, v)) * scale))
    cdf = np.cumsum(np.exp(dlp), -1)
    tokens = np.minimum((cdf < rng.random((rows, k, 1))).sum(-1), v - 1).astype(np.int32)
    return tokens, dlp, tlp


def _keys(seed, rows):
    return keys.row_keys(seed, np.arange(rows))


def _run(name, seed, tokens, dlp, tlp, n=K):
    res = batched[name](_keys(seed, len(tokens)), tokens, dlp, tlp, jnp.int32(n))
    return jax.tree_util.tree_map(np.array, res)


# --- greedy ----------------------------------------------------------------------------

def test_greedy_reproduces_the_greedy_target_chain():
    """Greedy contract: one round + greedy continuation == the target's greedy chain."""
    v, k = 3, 3
    table = np.round(audit.random_logits_table(4, v, k, ties=True))  # with exact ties
    chain = []
    for _ in range(k + 1):
        chain.append(int(np.argmax(table[audit.prefix_index(np.array(chain, int), v)])))
    run = jax.jit(V.greedy_verify)
    for n in range(k + 1):
        for draft in itertools.product(range(v), repeat=k):
            draft = np.array(draft, np.int32)
            logits = np.stack([table[audit.prefix_index(draft[:i], v)] for i in range(k + 1)])
            res = run(draft, logits, jnp.int32(n))
            tau = int(res.num_accepted)
            expect_tau = next((i for i in range(n) if draft[i] != chain[i]), n)
            assert tau == expect_tau and not bool(res.error)
            np.testing.assert_array_equal(np.asarray(res.tokens)[:tau + 1], chain[:tau + 1])
            assert np.all(np.asarray(res.tokens)[tau + 1:] == V.PAD_ID)


def test_greedy_flags_nan_only_in_used_rows():
    logits = np.zeros((K + 1, VOCAB), np.float32)
    logits[:, 2] = 1.0
    logits[2, 0] = np.nan
    tokens = np.array([2, 2, 2], np.int32)
    assert bool(V.greedy_verify(tokens, logits, 3).error)
    res = V.greedy_verify(tokens, logits, 1)  # row 2 is beyond num_draft + 1 rows
    assert not bool(res.error)
    np.testing.assert_array_equal(res.tokens, [2, 2, V.PAD_ID, V.PAD_ID])


# --- samplers: structure -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["token", "block"])
def test_vmap_equals_per_row_and_keys_are_used_per_role(name):
    tokens, dlp, tlp = _problem(1, ROWS)
    rk = _keys(3, ROWS)
    batch = _run(name, 3, tokens, dlp, tlp)
    for i in range(6):
        one = single[name](rk[i], tokens[i], dlp[i], tlp[i])
        np.testing.assert_array_equal(one.tokens, batch.tokens[i])
        # Re-derive the draws from the documented keys: ACCEPT uniforms per position,
        # then RESIDUAL (or BONUS) at position tau.
        tau = int(one.num_accepted)
        u = np.array([keys.uniform_open(keys.position_key(keys.role_key(rk[i], keys.ACCEPT), j))
                      for j in range(K)])
        if name == "token":
            log_a = np.asarray(V.token_log_accept(tokens[i], dlp[i], tlp[i]))
            acc = np.log(u) < log_a
            assert tau == (K if acc.all() else int(np.argmin(acc)))
            lw = 0.0
        else:
            lw = np.asarray(V.block_log_weights(tokens[i], dlp[i], tlp[i]))
            lh = np.asarray(V.block_log_stop(lw, dlp[i], tlp[i], K))
            hits = [t for t in range(1, K + 1) if np.log(u[t - 1]) <= lh[t]]
            assert tau == (max(hits) if hits else 0)
            lw = lw[tau]
        role = keys.BONUS if tau == K else keys.RESIDUAL
        q = dlp[i][min(tau, K - 1)] if tau < K else np.full(VOCAB, -np.inf, np.float32)
        w = V.emission_log_weights(tlp[i][tau], q, lw, tau == K)
        y = sample(keys.position_key(keys.role_key(rk[i], role), tau), w)
        assert int(one.tokens[tau]) == int(y)
        np.testing.assert_array_equal(one.tokens[:tau], tokens[i][:tau])


@pytest.mark.parametrize("name", ["token", "block"])
def test_num_draft_is_the_same_as_a_shorter_block(name):
    tokens, dlp, tlp = _problem(2, ROWS)
    n = 2
    g_tok, g_d, g_t = tokens.copy(), dlp.copy(), tlp.copy()
    g_tok[:, n:] = -7  # garbage the verifier must ignore
    g_d[:, n:] = np.nan
    g_t[:, n + 1:] = np.nan
    full = _run(name, 5, g_tok, g_d, g_t, n)
    ref = jax.jit(jax.vmap(SAMPLERS[name]))(_keys(5, ROWS), tokens[:, :n], dlp[:, :n],
                                            tlp[:, :n + 1])
    assert not full.error.any()
    np.testing.assert_array_equal(full.tokens[:, :n + 1], ref.tokens)
    np.testing.assert_array_equal(full.num_accepted, ref.num_accepted)
    assert np.all(full.tokens[:, n + 1:] == V.PAD_ID)
    # num_draft = 0: nothing to verify, the emitted token is the bonus from p_1.
    zero = _run(name, 5, g_tok, g_d, g_t, 0)
    assert np.all(zero.num_accepted == 0) and np.all(zero.tokens[:, 1:] == V.PAD_ID)
    assert not zero.error.any()


def test_changed_values_do_not_retrace():
    traces = []

    def f(*args):
        traces.append(1)
        return V.block_verify(*args)

    run = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None)))
    for seed, n in [(0, 3), (1, 1), (2, 0)]:
        tokens, dlp, tlp = _problem(seed, 2)
        run(_keys(seed, 2), tokens, dlp, tlp, jnp.int32(n)).tokens.block_until_ready()
    assert len(traces) == 1


# --- samplers: numerics and invalid input ----------------------------------------------

def _invalid_batch():
    """Row i < len(names) holds invalid case names[i]; the other rows are valid."""
    tokens, dlp, tlp = _problem(3, ROWS)
    n = np.full(ROWS, K)
    names = []

    def case(name):
        names.append(name)
        return len(names) - 1

    dlp[case("nan_draft"), 1, 2] = np.nan
    tlp[case("nan_bonus_row"), K, 0] = np.nan
    tlp[case("inf_target"), 0, 1] = np.inf
    tlp[case("empty_target_row"), 1] = -np.inf
    tlp[case("raw_logits_not_logprobs"), 2] += 3.0
    tokens[case("token_out_of_vocab"), 0] = VOCAB
    i = case("draft_q_zero")
    dlp[i, 0, tokens[i, 0]] = -np.inf
    n[case("num_draft_too_big")] = K + 1
    n[case("num_draft_negative")] = -1
    i = case("garbage_beyond_num_draft_is_fine")
    n[i] = 1
    dlp[i, 1:] = np.nan
    tlp[i, 2:] = np.inf
    tokens[i, 1:] = -5
    return tokens, dlp, tlp, n, names


@pytest.mark.parametrize("name", ["token", "block"])
def test_invalid_input_sets_error(name):
    tokens, dlp, tlp, n, names = _invalid_batch()
    # num_draft is a per-call scalar: run the rows needing another one separately.
    res = _run(name, 0, tokens, dlp, tlp, K)
    for special in sorted(set(n) - {K}):
        other = _run(name, 0, tokens, dlp, tlp, special)
        for f in ("tokens", "num_accepted", "error"):
            getattr(res, f)[n == special] = getattr(other, f)[n == special]
    for i, case in enumerate(names):
        bad = case != "garbage_beyond_num_draft_is_fine"
        assert res.error[i] == bad, case
        if bad:
            assert res.num_accepted[i] == 0 and np.all(res.tokens[i] == V.PAD_ID), case
    assert not res.error[len(names):].any()


@pytest.mark.parametrize("name", ["token", "block"])
def test_zero_residual_falls_back_to_target(name):
    # q = p shifted up inside the normalization tolerance: every acceptance ratio is
    # exp(-9e-4) < 1, so rejections happen, yet max(0, w p - q) is 0 everywhere.
    tlp = np.tile(_log_normalize(np.array([[0.0, 1.0, -2.0, 0.5, -np.inf]] * (K + 1))),
                  (ROWS, 1, 1))
    dlp = tlp[:, :K] + np.float32(9e-4)
    tokens = np.tile(np.array([1, 3, 0], np.int32), (ROWS, 1))
    rejected = 0
    for seed in range(40):
        res = _run(name, seed, tokens, dlp, tlp)
        assert not res.error.any()
        rejected += (res.num_accepted < K).sum()
        last = res.tokens[np.arange(ROWS), res.num_accepted]
        assert np.all((last >= 0) & (last < 4))  # never token 4 (p = 0), never off-vocab
    assert rejected > 3  # the fallback path really ran
    w = np.asarray(V.emission_log_weights(tlp[0, 0], dlp[0, 0], np.float32(-0.3), False))
    np.testing.assert_array_equal(w, tlp[0, 0])
    assert np.all(np.isneginf(np.asarray(V.log_residual(tlp[0, 0], tlp[0, 0]))))
    assert not np.isnan(np.asarray(V.log_residual(tlp[0, 0], np.full(5, -np.inf)))).any()


def test_draft_equal_to_target_accepts_everything():
    tokens, _, tlp = _problem(4, ROWS)
    dlp = tlp[:, :K].copy()
    for name in SAMPLERS:
        res = _run(name, 1, tokens, dlp, tlp)
        assert np.all(res.num_accepted == K) and not res.error.any()


def test_point_mass_draft_acceptance_is_target_probability():
    tokens, _, tlp = _problem(6, 1)
    tokens, tlp = tokens[0], tlp[0]
    dlp = np.full((K, VOCAB), -np.inf, np.float32)
    dlp[np.arange(K), tokens] = 0.0
    p = np.exp(tlp[np.arange(K), tokens].astype(np.float64))
    law = V.token_law(tokens, dlp, tlp)
    expect = [1 - p[0], p[0] * (1 - p[1]), p[0] * p[1] * (1 - p[2]), p.prod()]
    np.testing.assert_allclose(law.stop_probs, expect, rtol=1e-5)
    np.testing.assert_allclose(np.exp(V.token_log_accept(tokens, dlp, tlp)), p, rtol=1e-5)
    res = single["token"](jax.random.key(0), tokens, dlp, tlp)
    assert not bool(res.error)


# --- statistics ----------------------------------------------------------------------------

def test_overlap_alpha_and_expected_tokens():
    _, dlp, tlp = _problem(5, 4)
    alpha = np.asarray(V.overlap_alpha(dlp, tlp[:, :K]))
    ref = np.minimum(np.exp(dlp.astype(np.float64)), np.exp(tlp[:, :K].astype(np.float64)))
    np.testing.assert_allclose(alpha, ref.sum(-1), rtol=1e-5)
    assert alpha.dtype == np.float32
    e = np.asarray(V.expected_tokens_per_round(alpha))
    np.testing.assert_allclose(e, 1 + np.cumprod(alpha, -1).sum(-1), rtol=1e-6)
    for a in (0.0, 0.3, 0.9, 1.0):
        closed = K + 1 if a == 1 else (1 - a ** (K + 1)) / (1 - a)
        np.testing.assert_allclose(V.expected_tokens_per_round(a, k=K), closed, rtol=1e-6)
        np.testing.assert_allclose(V.expected_tokens_per_round(np.full(K, a)), closed, rtol=1e-6)


def test_overlap_alpha_of_a_row_is_the_same_in_any_batch():
    """On CPU the overlap statistic sums in an order fixed by the vocabulary's length (odd
    lengths included), so a row's value has the same bits alone and among other rows."""
    rng = np.random.default_rng(7)
    for v in (49152, 1001):
        lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(9, 3, v)), jnp.float32))
        lq = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(9, 3, v)), jnp.float32))
        many = np.asarray(jax.jit(V.overlap_alpha)(lq, lp))
        ref = np.minimum(np.exp(np.asarray(lq, np.float64)), np.exp(np.asarray(lp, np.float64))).sum(-1)
        np.testing.assert_allclose(many, ref, rtol=1e-5)
        if jax.default_backend() == "cpu":
            for b in (0, 4, 8):
                one = np.asarray(jax.jit(V.overlap_alpha)(lq[b:b + 1], lp[b:b + 1]))
                assert np.array_equal(one[0], many[b])


@pytest.mark.parametrize("name", ["token", "block"])
def test_single_draws_for_greedy_targets_change_nothing(name):
    """``single=True`` (every target row greedy: each emission law has one token) draws that
    token without noise: the same results as the Gumbel draw under every key; and it is
    really taken (for a target with two possible tokens the noise-free draw differs)."""
    tokens, dlp, _ = _problem(11, ROWS)
    rng = np.random.default_rng(12)
    top = rng.integers(0, VOCAB, size=(ROWS, K + 1))
    tlp = np.where(np.arange(VOCAB) == top[..., None], 0.0, -np.inf).astype(np.float32)
    fast = jax.jit(jax.vmap(lambda *a: SAMPLERS[name](*a, single=True), in_axes=(0, 0, 0, 0, None)))
    for seed in range(3):
        rk = _keys(seed, ROWS)
        a = batched[name](rk, tokens, dlp, tlp, jnp.int32(K))
        b = fast(rk, tokens, dlp, tlp, jnp.int32(K))
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        np.testing.assert_array_equal(np.asarray(a.num_accepted), np.asarray(b.num_accepted))
    two = np.log(np.full((ROWS, K + 1, VOCAB), 1e-30, np.float32))
    two[..., 0] = two[..., 1] = np.log(0.5)
    rk = _keys(0, ROWS)
    a = np.asarray(batched[name](rk, tokens, dlp, two, jnp.int32(K)).tokens)
    b = np.asarray(fast(rk, tokens, dlp, two, jnp.int32(K)).tokens)
    assert not np.array_equal(a, b)
