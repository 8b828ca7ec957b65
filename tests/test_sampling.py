"""specjax.sampling: the pipeline against a plain numpy reference, parameters, sample()."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import audit, keys
from specjax.sampling import (SamplingConfig, SamplingParams, batch_hints, gumbel, hints_for,
                              make_controls, process_logits, process_rows, sample)

process = jax.jit(process_logits)


def reference_row(logits, temperature, top_k, top_p, min_p, rep=1.0, pres=0.0,
                  counts=None, allowed=None):
    """The documented pipeline, written plainly in float64 (sorting is fine here)."""
    x = np.asarray(logits, np.float64).copy()
    v = len(x)
    if allowed is not None:
        x[~allowed] = -np.inf
    if counts is not None:
        seen = counts > 0
        x = np.where(seen, np.where(x > 0, x / rep, x * rep) - pres, x)
    if temperature == 0:
        out = np.full(v, -np.inf)
        out[np.argmax(x)] = 0.0
        return out
    z = (x - x.max()) / temperature
    keep = np.isfinite(z)
    if 0 < top_k < v:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1:
        zz = np.where(keep, z, -np.inf)
        p = np.exp(zz - zz.max())
        p /= p.sum()
        above = (p[None, :] * (p[None, :] > p[:, None])).sum(axis=1)
        keep &= above < top_p
    if min_p > 0:
        p = np.exp(np.where(keep, z, -np.inf))
        keep &= p >= min_p * p.max()
    zz = np.where(keep, z, -np.inf)
    return zz - zz.max() - np.log(np.sum(np.exp(zz - zz.max())))


def _random_batch(rng, b, v, scale):
    logits = (rng.normal(size=(b, v)) * scale).astype(np.float32)
    logits[:, :6] = np.round(logits[:, :6])  # exact ties
    logits[0] = 0.5  # a row that is all ties
    logits[1, 3] = -np.inf
    return logits


def _assert_matches(out, logits, t, k, p, m, **kw):
    for b in range(logits.shape[0]):
        ref = reference_row(logits[b], t[b], k[b], p[b], m[b],
                            **{n: (a[b] if isinstance(a, np.ndarray) else a)
                               for n, a in kw.items()})
        np.testing.assert_array_equal(np.isneginf(out[b]), np.isneginf(ref),
                                      err_msg=f"kept set differs in row {b}")
        fin = np.isfinite(ref)
        np.testing.assert_allclose(out[b][fin], ref[fin], atol=2e-5, err_msg=f"row {b}")


@pytest.mark.parametrize("v,scale", [(50, 2.0), (700, 1.0), (700, 6.0)])
def test_process_logits_matches_reference(v, scale):
    # V = 700 > the 256 candidates: flat rows (scale 1) with top_p 0.99 / top_k 300 take
    # the bisection fallback, peaked rows the candidate path; both in one batch.
    rng = np.random.default_rng(v + int(scale))
    b = 48
    logits = _random_batch(rng, b, v, scale)
    t = rng.choice([0.0, 0.3, 1.0, 1.7], b).astype(np.float32)
    k = rng.choice([0, 1, 3, 40, 300, v], b).astype(np.int32)
    p = rng.choice([1.0, 0.3, 0.9, 0.99], b).astype(np.float32)
    m = rng.choice([0.0, 0.02, 0.3], b).astype(np.float32)
    out = np.asarray(process(logits, SamplingParams.create(b, t, k, p, m)))
    _assert_matches(out, logits, t, k, p, m)
    np.testing.assert_allclose(np.log(np.exp(out).sum(-1)), 0.0, atol=1e-5)


def test_penalties_and_mask_match_reference():
    rng = np.random.default_rng(3)
    b, v = 12, 40
    logits = _random_batch(rng, b, v, 2.0)
    counts = rng.integers(0, 3, size=(b, v)).astype(np.int32)
    allowed = rng.random((b, v)) < 0.8
    allowed[:, 7] = True
    t = np.full(b, 0.8, np.float32)
    t[2] = 0.0
    k, p, m = np.full(b, 5, np.int32), np.full(b, 0.9, np.float32), np.zeros(b, np.float32)
    rep = rng.choice([1.0, 1.3, 0.7], b).astype(np.float32)
    pres = rng.choice([0.0, 0.5, -0.4], b).astype(np.float32)
    prm = SamplingParams.create(b, t, k, p, m, repetition_penalty=rep, presence_penalty=pres)
    out = np.asarray(process(logits, prm, counts, allowed))
    _assert_matches(out, logits, t, k, p, m, rep=rep, pres=pres, counts=counts,
                    allowed=allowed)


def test_filters_are_order_independent_and_tie_inclusive():
    rng = np.random.default_rng(5)
    b, v = 16, 300
    logits = np.round(rng.normal(size=(b, v)) * 2).astype(np.float32)  # many ties
    prm = SamplingParams.create(b, rng.choice([0.5, 1.0], b), rng.choice([0, 3, 10], b),
                                rng.choice([1.0, 0.5, 0.9], b), rng.choice([0.0, 0.1], b))
    perm = rng.permutation(v)
    out = np.asarray(process(logits, prm))
    out_perm = np.asarray(process(logits[:, perm], prm))
    np.testing.assert_allclose(out_perm, out[:, perm], atol=1e-6)
    # top_k = 1 keeps every token tied with the maximum.
    one = np.asarray(process(logits, SamplingParams.create(b, top_k=1)))
    np.testing.assert_array_equal(np.isfinite(one), logits == logits.max(-1, keepdims=True))


def test_greedy_is_point_mass_at_lowest_argmax():
    logits = np.array([[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    allowed = np.array([False, True, True, True])  # a [V] mask applies to every row
    out = np.asarray(process(logits, SamplingParams.create(2, temperature=0.0, top_p=0.5,
                                                           top_k=3, min_p=0.5), None, allowed))
    np.testing.assert_array_equal(out, [[-np.inf, 0, -np.inf, -np.inf],
                                        [-np.inf, 0, -np.inf, -np.inf]])


def test_leading_axis_alignment_masks_and_dtypes():
    # [B] parameters, [B, V] counts and mask with [B, T, V] bf16 logits: row b's values
    # apply to all T positions of row b.
    rng = np.random.default_rng(7)
    b, t, v = 3, 4, 30
    logits = jnp.asarray(rng.normal(size=(b, t, v)) * 2, jnp.bfloat16)
    counts = rng.integers(0, 2, size=(b, v)).astype(np.int32)
    allowed = rng.random((b, v)) < 0.7
    allowed[:, 0] = True
    temp, top_k = np.array([0.5, 1.0, 2.0]), np.array([0, 5, 2])
    rep, pres = np.array([1.0, 1.5, 0.8]), np.array([0.0, 0.3, -0.2])
    prm = SamplingParams.create(b, temp, top_k, 0.9, repetition_penalty=rep,
                                presence_penalty=pres)
    out = process(logits, prm, counts, allowed)
    assert out.dtype == jnp.float32
    out = np.asarray(out)
    as_f32 = np.asarray(logits.astype(jnp.float32))
    for i in range(b):
        for j in range(t):
            ref = reference_row(as_f32[i, j], temp[i], top_k[i], 0.9, 0.0, rep[i], pres[i],
                                counts[i], allowed[i])
            np.testing.assert_array_equal(np.isneginf(out[i, j]), np.isneginf(ref))
            fin = np.isfinite(ref)
            np.testing.assert_allclose(out[i, j][fin], ref[fin], atol=2e-5)


def test_empty_mask_gives_neg_inf_and_nan_propagates():
    logits = np.zeros((3, 6), np.float32)
    logits[2, 1] = np.nan
    allowed = np.ones((3, 6), bool)
    allowed[0] = False
    prm = SamplingParams.create(3, top_p=0.9, top_k=2)
    out = np.asarray(process(logits, prm, allowed=allowed))
    assert np.all(np.isneginf(out[0]))
    assert np.all(np.isfinite(out[1]) | np.isneginf(out[1]))
    assert np.all(np.isnan(out[2]))
    assert int(sample(jax.random.key(0), out[0])) == -1


@pytest.mark.parametrize("field,value,msg", [
    ("temperature", [1.0, -0.5], r"temperature\[1\]"),
    ("temperature", [float("nan"), 1.0], r"temperature\[0\]"),
    ("temperature", [1.0, float("inf")], r"temperature\[1\]"),
    ("top_p", [0.0, 1.0], r"top_p\[0\]"),
    ("top_p", [1.0, 1.5], r"top_p\[1\]"),
    ("min_p", [0.2, 1.0], r"min_p\[1\]"),
    ("min_p", [-0.1, 0.0], r"min_p\[0\]"),
    ("repetition_penalty", [0.0, 1.0], r"repetition_penalty\[0\]"),
    ("repetition_penalty", [1.0, float("nan")], r"repetition_penalty\[1\]"),
    ("presence_penalty", [float("inf"), 0.0], r"presence_penalty\[0\]"),
    ("top_k", [1.5, 2], r"top_k\[0\]"),
    ("top_p", [0.5, 0.5, 0.5], r"top_p must be a scalar or have length"),
    ("temperature", [1e300, 1.0], r"temperature\[0\].*float32's range"),
    ("presence_penalty", [0.0, -1e39], r"presence_penalty\[1\].*float32's range"),
    ("top_k", ["5", 2], r"top_k must be numeric"),  # never read from text or bools
    ("top_k", [True, False], r"top_k must be numeric"),
    ("temperature", ["0.5", "1"], r"temperature must be numeric"),
])
def test_invalid_params_raise_before_tracing(field, value, msg):
    traces = []

    @jax.jit
    def f(params):
        traces.append(1)
        return process_logits(jnp.zeros((2, 5)), params)

    with pytest.raises(ValueError, match=msg):
        f(SamplingParams.create(2, **{field: value}))
    assert not traces


def test_a_logit_pushed_past_float32_by_bias_or_penalty_is_the_largest_not_nan():
    """A finite bias, then a penalty, that overflow a logit leave it at float32's largest
    value: the limit law (that token, or those tied there, certain), where +inf made the
    normalization NaN (inf - inf) and the engine raised. Raw +inf logits stay NaN (flagged)."""
    x = jnp.asarray([[1.0, 2.0, 3.0, 0.5]])
    seen = jnp.asarray([[0, 1, 1, 0]])
    p = SamplingParams.create(1, repetition_penalty=0.5)
    got = np.exp(np.asarray(process_logits(x, p, counts=seen, bias=jnp.asarray([[0, 3e38, 0, 0]]))))
    np.testing.assert_allclose(got, [[0, 1, 0, 0]])
    p = SamplingParams.create(1, presence_penalty=-3e38)
    got = np.exp(np.asarray(process_logits(x, p, counts=seen, bias=jnp.asarray([[0, 3e38, 3e38, 0]]))))
    np.testing.assert_allclose(got, [[0, 0.5, 0.5, 0]])
    big = float(np.finfo(np.float32).max)
    got = np.asarray(process_logits(jnp.asarray([[1e33, 2e33, 3.0, 0.5]]), SamplingParams.create(1),
                                    bias=jnp.asarray([[big, big, 0, 0]])))
    np.testing.assert_allclose(np.exp(got), [[0.5, 0.5, 0, 0]])
    assert np.isnan(np.asarray(process_logits(jnp.asarray([[1.0, np.inf]]), SamplingParams.create(1)))).all()


def test_subnormal_values_are_read_as_the_device_reads_them():
    """XLA flushes float32 subnormals to zero; the host reads them the same way, or a
    temperature of 1e-40 was greedy on the device but sampled for the batch hints (their
    argmax left out: token 0 certain, though banned) and a top-p of 1e-40 left no token
    (NaN rows). A bug hunt found both."""
    tiny = np.finfo(np.float32).tiny
    prm = SamplingParams.create(2, temperature=[1e-40, 0.5], top_p=[1e-40, 1.0], min_p=[1e-40, 0.1],
                                repetition_penalty=[1e-40, 1.0], presence_penalty=[-1e-40, 0.5])
    assert prm.temperature.tolist() == [0.0, 0.5] and prm.min_p.tolist() == [0.0, np.float32(0.1)]
    assert prm.top_p.tolist() == [tiny, 1.0] and prm.repetition_penalty.tolist() == [tiny, 1.0]
    assert prm.presence_penalty.tolist() == [0.0, 0.5]
    x = jnp.asarray([[-np.inf, 2.0, 1.0, 0.0], [1.0, 2.0, 2.0, 0.0]])
    hinted = jax.jit(lambda x, p: process_rows(x, p, None, False))
    want = np.asarray(process_logits(x, prm))
    np.testing.assert_array_equal(want[0], [-np.inf, 0, -np.inf, -np.inf])  # greedy: the argmax
    with batch_hints(hints_for(prm, 4, False)):
        np.testing.assert_array_equal(np.asarray(hinted(x, prm)), want)
    top = np.asarray(process_logits(x[1:], SamplingParams.create(1, top_p=1e-40)))
    np.testing.assert_allclose(np.exp(top), [[0, 0.5, 0.5, 0]])  # the top tokens, not NaN


def test_only_stop_tokens_with_min_new_tokens_is_refused():
    with pytest.raises(ValueError, match="only stop tokens"):
        make_controls(1, 4, stop_tokens=[0, 1, 2, 3], min_new_tokens=2)
    with pytest.raises(ValueError, match="only stop tokens"):
        make_controls(2, 4, stop_tokens=[0, 1], min_new_tokens=[0, 1], allowed_tokens=[0, 1])
    make_controls(1, 4, stop_tokens=[0, 1, 2, 3], min_new_tokens=0)  # stopping at once is fine


def test_top_k_past_int32_is_clipped_not_wrapped():
    """A top-k past int32 is off (>= V) as it says, never wrapped around (2**32 + 1 once
    became top-k 1: greedy text at any temperature)."""
    prm = SamplingParams.create(3, top_k=[2 ** 32 + 1, 2 ** 40, -2 ** 40])
    assert prm.top_k.tolist() == [2 ** 31 - 1, 2 ** 31 - 1, -2 ** 31]
    x = jnp.asarray([[0.0, 1.0, 2.0]] * 3)
    assert np.isfinite(np.asarray(process_logits(x, prm))).all()  # every row: no filter


def test_sampling_config_validates_and_converts():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    cfg = SamplingConfig(temperature=0.7, top_k=20, top_p=0.95)
    prm = cfg.to_params(3)
    assert prm.top_k.dtype == jnp.int32 and prm.temperature.shape == (3,)
    assert dataclasses.asdict(cfg)["top_k"] == 20


def test_changed_parameter_values_do_not_retrace():
    traces = []

    @jax.jit
    def f(logits, params):
        traces.append(1)
        return process_logits(logits, params)

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 2, 64)), jnp.float32)
    for t, k, p, m in [(1.0, 0, 1.0, 0.0), (0.0, 5, 0.9, 0.1), (0.5, 64, 0.2, 0.5)]:
        f(logits, SamplingParams.create(4, t, k, p, m, 1.2, 0.3)).block_until_ready()
    assert len(traces) == 1


def test_sample_law_and_never_neg_inf():
    with np.errstate(divide="ignore"):
        lp = np.log(np.array([0.5, 0.0, 0.2, 0.25, 0.05, 0.0], np.float64))
    rows = keys.row_keys(11, np.arange(200_000))
    draws = np.asarray(jax.jit(jax.vmap(sample, in_axes=(0, None)))(rows, lp.astype(np.float32)))
    assert draws.min() >= 0 and not np.isin(draws, [1, 5]).any()
    chi = audit.chi_square_test(np.bincount(draws, minlength=6), np.exp(lp))
    assert chi.p_value > 1e-4, chi


def test_uniforms_and_gumbel_are_finite_and_open():
    u = np.asarray(keys.uniform_open(jax.random.key(1), (1_000_000,)))
    assert u.min() > 0.0 and u.max() < 1.0
    g = np.asarray(gumbel(jax.random.key(2), (1_000_000,)))
    assert np.all(np.isfinite(g))
    assert abs(g.mean() - np.euler_gamma) < 0.01


def test_single_draws_equal_the_gumbel_draw():
    """Rows with at most one possible token: draw_single (no noise) returns exactly what the
    Gumbel-max sample returns under any key; sample_rows switches to it only when every row
    qualifies, and the engine's greedy verification then emits the same tokens."""
    from specjax import sampling
    from specjax.sampling import sample_rows

    v = 50
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((6, v)), jnp.float32)
    greedy = sampling.process_logits(logits, sampling.SamplingConfig(temperature=0.0).to_params(6))
    hot = sampling.process_logits(logits, sampling.SamplingConfig(temperature=1.0).to_params(6))
    none = jnp.full((1, v), -jnp.inf)
    nan = greedy[:1].at[0, 3].set(jnp.nan)
    rows = jnp.concatenate([greedy, none, nan])
    assert bool(sampling.at_most_one_possible(rows)) and not bool(sampling.at_most_one_possible(hot))
    got = jax.vmap(sampling.draw_single)(rows)
    for seed in range(5):
        keys = jax.random.split(jax.random.key(seed), rows.shape[0])
        np.testing.assert_array_equal(got, jax.vmap(sampling.sample)(keys, rows))
        np.testing.assert_array_equal(sample_rows(keys, rows), got)
        hk = jax.random.split(jax.random.key(seed), 6)
        np.testing.assert_array_equal(sample_rows(hk, hot), jax.vmap(sampling.sample)(hk, hot))
        mixed = jnp.concatenate([greedy[:3], hot[3:]])
        np.testing.assert_array_equal(sample_rows(hk, mixed), jax.vmap(sampling.sample)(hk, mixed))
    assert list(np.asarray(got[-2:])) == [-1, -1]
    np.testing.assert_array_equal(got[:6], jnp.argmax(logits, -1))
    # the explicit switch: sample(..., single=True) is draw_single
    np.testing.assert_array_equal(jax.vmap(lambda k, r: sampling.sample(k, r, single=True))(keys, rows), got)


def test_top_values_is_an_argument_of_the_pipeline():
    """How each row's largest values are found is passed in (a sharded run passes its own);
    the default is lax.top_k, an equivalent search gives the same law, and the argument is
    really used (a search that returns wrong values changes the top-k / top-p cut)."""
    from specjax import sampling

    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((4, 300)), jnp.float32)
    params = sampling.SamplingConfig(temperature=0.9, top_k=7, top_p=0.8).to_params(4)
    base = sampling.process_logits(logits, params)
    same = sampling.process_logits(logits, params,
                                   top_values=lambda z, m: -jnp.sort(-z, axis=-1)[:, :m])
    np.testing.assert_array_equal(np.asarray(same), np.asarray(base))
    wrong = sampling.process_logits(logits, params, top_values=lambda z, m: jnp.sort(z, axis=-1)[:, :m])
    assert not np.array_equal(np.isfinite(np.asarray(wrong)), np.isfinite(np.asarray(base)))
    rows = sampling.process_rows(logits, params, None, jnp.asarray(False),
                                 top_values=lambda z, m: -jnp.sort(-z, axis=-1)[:, :m])
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(base))


def test_row_sum_off_cpu_is_one_reduce_with_the_same_sums(monkeypatch, target, draft):
    """Off CPU (``PAIRWISE_SUM_BACKENDS``) row_sum is XLA's one reduce instead of the pairwise
    tree that buys CPU its batch-independent bits; the GPU/TPU path runs here through the
    same switch: the same sums up to float32 rounding, and an engine on that path still
    gives the autoregressive greedy tokens (exactness does not rest on the order)."""
    from specjax import engine, sampling
    from specjax.drafts import DraftModelProposer

    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 49153)), jnp.float32)
    tree = jax.jit(lambda a: sampling.row_sum(a))(x)
    assert "concatenate" in str(jax.make_jaxpr(lambda a: sampling.row_sum(a))(x))  # CPU: pairwise levels
    prompts = [[1, 2, 3], [4, 5], [6, 6, 6, 1]]
    greedy = SamplingConfig(temperature=0.0)
    monkeypatch.setattr(sampling, "PAIRWISE_SUM_BACKENDS", ())
    jax.clear_caches()  # traces made with the pairwise order must not be reused (nor kept, below)
    try:
        jaxpr = str(jax.make_jaxpr(lambda a: sampling.row_sum(a))(x))
        assert jaxpr.count("reduce_sum") == 1 and "concatenate" not in jaxpr
        np.testing.assert_allclose(jax.jit(lambda a: sampling.row_sum(a))(x), tree, rtol=2e-5, atol=1e-4)
        np.testing.assert_allclose(sampling.logsumexp(x), jax.nn.logsumexp(x, axis=-1), rtol=1e-6)
        spec = engine.SpeculativeEngine(target, DraftModelProposer(draft, 3), "token")
        hlo = spec.lower(prompts, seed=1, max_new_tokens=12, sampling_params=greedy).as_text()
        got = spec.generate(prompts, seed=1, max_new_tokens=12, sampling_params=greedy)
        want = engine.AutoregressiveEngine(target).generate(prompts, seed=1, max_new_tokens=12, greedy=True)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert got.tokens == want.tokens
    pairwise = engine.SpeculativeEngine(target, DraftModelProposer(draft, 3), "token")
    # the program really took the other path: fewer ops than the pairwise one
    assert len(hlo) < len(pairwise.lower(prompts, seed=1, max_new_tokens=12, sampling_params=greedy).as_text())


def _cut_program(logits, params, fixed, monkeypatch, hints=None):
    """process_logits traced with the exact cut by conditional (fixed=False) or by the
    fixed search: its output and its jaxpr."""
    from specjax import sampling

    monkeypatch.setenv("SPECJAX_SYNC_FREE", "1" if fixed else "0")

    def fn(x, p):
        with sampling.batch_hints(hints):
            return sampling.process_logits(x, p)
    jaxpr = str(jax.make_jaxpr(fn)(logits, params))
    return np.asarray(jax.jit(fn)(logits, params)), jaxpr


@pytest.mark.parametrize("v", [700, 5000])
def test_fixed_cut_gives_the_conditional_cut_bit_for_bit(monkeypatch, v):
    """The exact top-k / top-p cut of rows whose cut is not among the candidates, found by
    the fixed search over every row (the GPU form: no conditional, whose predicate would be a
    host sync per pass there): the same output bits as the conditional bisection on this CPU
    (the same sums), the documented law, and no conditional or loop left for it."""
    from specjax import sampling

    rng = np.random.default_rng(v)
    b = 24
    logits = _random_batch(rng, b, v, 1.0)  # flat rows: wide nuclei
    logits[2:6] *= 8.0  # peaked rows: the cut among the candidates
    t = rng.choice([0.3, 1.0, 1.7], b).astype(np.float32)
    k = rng.choice([0, 3, 300, 600], b).astype(np.int32)
    p = rng.choice([1.0, 0.5, 0.9, 0.99], b).astype(np.float32)
    params = SamplingParams.create(b, t, k, p)
    cond, cond_jaxpr = _cut_program(logits, params, False, monkeypatch)
    fixed, fixed_jaxpr = _cut_program(logits, params, True, monkeypatch)
    assert np.isfinite(cond).sum(-1).max() > sampling._CANDIDATES  # the cut was searched for
    np.testing.assert_array_equal(fixed, cond)
    _assert_matches(fixed, logits, t, k, p, np.zeros(b, np.float32))
    # (the batch-level conds the missing hints leave open take their all-rows branch too)
    assert fixed_jaxpr.count(" cond[") == 0 < cond_jaxpr.count(" cond[") and " while[" not in fixed_jaxpr
    # the top-k search is left out where the hints rule a wide top-k out; it is needed here
    hints = sampling.hints_for(params, v, False)
    assert hints.wide_top_k
    narrow, narrow_jaxpr = _cut_program(logits, params, True, monkeypatch,
                                        dataclasses.replace(hints, wide_top_k=False))
    assert len(narrow_jaxpr) < len(fixed_jaxpr)
    wide = k > sampling._CANDIDATES
    np.testing.assert_array_equal(narrow[~wide], fixed[~wide])
    assert not np.array_equal(np.isfinite(narrow[wide]), np.isfinite(fixed[wide]))


def test_fixed_cut_resolves_from_the_environment(monkeypatch):
    from specjax import sampling

    monkeypatch.delenv("SPECJAX_SYNC_FREE", raising=False)
    assert sampling.sync_free() is False  # a CPU
    monkeypatch.setattr(sampling, "SYNC_FREE_BACKENDS", ("cpu",))
    assert sampling.sync_free() is True
    monkeypatch.setenv("SPECJAX_SYNC_FREE", "0")
    assert sampling.sync_free() is False
    monkeypatch.setenv("SPECJAX_SYNC_FREE", "sometimes")
    with pytest.raises(ValueError, match="SPECJAX_SYNC_FREE"):
        sampling.sync_free()


def test_fixed_search_finds_the_bisections_threshold():
    """_lift_threshold against _bisect_threshold, threshold bits compared (a kept set hides a
    threshold a few keys off): counts and masses, ties and -inf, the pipeline's bracket
    [-inf, 0] and brackets whose upper end fails the rule (both return it)."""
    from specjax import sampling

    rng = np.random.default_rng(7)
    r, v = 32, 400
    z = -np.abs(rng.normal(size=(r, v)) * rng.choice([0.01, 1.0, 30.0], (r, 1))).astype(np.float32)
    z[:, :8] = np.round(z[:, :8])  # ties
    z[3, 10:] = -np.inf
    z[4] = np.float32(-1.0) - np.arange(v, dtype=np.float32) * np.spacing(np.float32(1))  # adjacent keys
    z -= z.max(-1, keepdims=True)
    mass = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    count = rng.integers(1, v + 1, r).astype(np.int32)
    share = rng.choice([0.05, 0.5, 0.9, 0.999], r).astype(np.float32)
    lo = np.where(rng.random(r) < 0.5, -np.inf, np.sort(z, -1)[:, v // 4]).astype(np.float32)
    hi = np.where(rng.random(r) < 0.5, 0.0, np.sort(z, -1)[:, v // 2]).astype(np.float32)
    for m, target in ((None, count), (mass, share)):
        for a, b in ((np.full(r, -np.inf, np.float32), np.zeros(r, np.float32)), (lo, hi)):
            want = jax.jit(lambda *x, m=m: sampling._bisect_threshold(x[0], m, *x[1:]))(z, target, a, b)
            for bits in (4, 8):  # 8: 255 probes a step, what one-row passes take
                got = jax.jit(lambda *x, m=m, bits=bits: sampling._lift_threshold(x[0], m, *x[1:], bits=bits))(
                    z, target, a, b)
                np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32))


def _candidate_reference(logits, temperature, top_k, top_p, m=256):
    """A draft's law (cut="candidates"): the reference pipeline where its cut lies among
    the m largest values; else the law renormalized over those m values (no min-p here)."""
    ref = reference_row(logits, temperature, top_k, top_p, 0.0)
    if np.isfinite(ref).sum() <= m or not (0 < top_k < len(ref) or top_p < 1):
        return ref
    z = np.asarray(logits, np.float64) / temperature
    keep = z >= np.sort(z)[::-1][m - 1]
    zz = np.where(keep, z, -np.inf)
    return zz - zz.max() - np.log(np.sum(np.exp(zz - zz.max())))


def test_draft_cut_at_the_candidates():
    """process_rows(cut="candidates"), a draft's pipeline: the exact law's bits wherever
    the top-k / top-p cut lies among the 256 candidates; where it lies past them (a flat
    row's wide nucleus, a top-k of 400) the law over the candidates, renormalized."""
    from specjax import sampling

    rng = np.random.default_rng(11)
    v, b = 700, 6
    logits = (rng.normal(size=(b, v)) * np.array([[0.3], [0.3], [8.0], [8.0], [0.3], [1.0]])).astype(np.float32)
    t = np.array([1.0, 1.0, 1.0, 0.7, 1.0, 1.0], np.float32)
    k = np.array([0, 400, 0, 20, 0, 0], np.int32)
    p = np.array([0.9, 1.0, 0.9, 0.9, 1.0, 0.5], np.float32)
    params = SamplingParams.create(b, t, k, p, np.zeros(b, np.float32))
    rows = jax.jit(sampling.process_rows, static_argnames="cut")
    exact = np.asarray(rows(logits, params, None, jnp.asarray(False)))
    cand = np.asarray(rows(logits, params, None, jnp.asarray(False), cut="candidates"))
    kept = np.isfinite(exact).sum(-1)  # what each row tests: cuts past the candidates (0, 1),
    assert (kept[:2] > 256).all() and (kept[[2, 3, 5]] <= 256).all() and kept[4] == v  # among them, none
    wide = np.arange(b) < 2
    np.testing.assert_array_equal(cand[~wide], exact[~wide])
    for r in range(b):
        ref = _candidate_reference(logits[r], t[r], k[r], p[r])
        np.testing.assert_array_equal(np.isfinite(cand[r]), np.isfinite(ref), err_msg=f"row {r}")
        np.testing.assert_allclose(cand[r][np.isfinite(ref)], ref[np.isfinite(ref)], atol=2e-5)
    assert (np.isfinite(cand[wide]).sum(-1) == 256).all()
    with pytest.raises(ValueError, match="cut must be one of"):
        sampling.process_rows(logits, params, None, jnp.asarray(False), cut="approx")


def test_a_drafts_pipeline_cuts_at_the_candidates(monkeypatch):
    """ProposeContext.process, the pipeline every proposer calls: the candidates' cut on the
    backends of drafts.base.CANDIDATE_CUT_BACKENDS (a GPU) or where DRAFT_CUT says so, the
    target's exact cut elsewhere (the CPU) or where it says "exact"."""
    from specjax import sampling
    from specjax.drafts import base

    rng = np.random.default_rng(12)
    b, v = 3, 700
    logits = jnp.asarray(rng.normal(size=(b, v)) * 0.3, jnp.float32)  # flat: wide nuclei
    params = SamplingConfig(temperature=1.0, top_p=0.9).to_params(b)
    ctx = base.ProposeContext(seq=jnp.zeros((b, 8), jnp.int32), seq_len=jnp.full((b,), 4, jnp.int32),
                              params=params, counts=jnp.zeros((b, v), jnp.int32),
                              round_keys=jax.random.split(jax.random.key(0), b),
                              use_penalties=jnp.asarray(False))
    want = np.asarray(sampling.process_rows(logits, params, None, jnp.asarray(False), cut="candidates"))
    assert (np.isfinite(want).sum(-1) == 256).all()
    exact = np.asarray(process(logits, params))
    assert (np.isfinite(exact).sum(-1) > 256).all()
    for setting, backends, expect in ((None, ("gpu",), exact), (None, ("gpu", "cpu"), want),
                                      ("candidates", (), want), ("exact", ("cpu",), exact)):
        monkeypatch.setattr(base, "DRAFT_CUT", setting)
        monkeypatch.setattr(base, "CANDIDATE_CUT_BACKENDS", backends)
        np.testing.assert_array_equal(np.asarray(ctx.process(logits, ctx.counts, 0)), expect,
                                      err_msg=f"{setting} {backends}")
