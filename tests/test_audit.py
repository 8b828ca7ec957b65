"""Exactness audit of the verifiers (exact enumeration + Monte Carlo), and of the audit's
power: every known-wrong variant in tests/_mutants.py must fail the same checks."""
import numpy as np
import pytest

from specjax import audit
from specjax import verify as V
from specjax.sampling import SamplingConfig

from tests._mutants import MUTANTS

ROWS = 200_000
LAWS = {"token": V.token_law, "block": V.block_law}
SAMPLERS = {"token": V.token_verify, "block": V.block_verify}


def _tables(v, k, target_cfg, draft_cfg, seed=0):
    target = audit.process_table(audit.random_logits_table(seed + 1, v, k), target_cfg)
    if draft_cfg == "point_mass":  # prompt-lookup style proposer (seed: often accepted)
        return target, audit.point_mass_table(seed + 9, v, k)
    return target, audit.process_table(audit.random_logits_table(seed + 2, v, k), draft_cfg)


FILTERED = SamplingConfig(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05)
# name: (V, K, target settings, draft settings, num_draft)
CASES = {
    "plain": (4, 3, SamplingConfig(), SamplingConfig(), None),
    "t0.7_topk3_topp0.9_minp0.05": (4, 3, FILTERED, FILTERED, None),
    "point_mass_draft_topk2_target": (4, 3, SamplingConfig(temperature=0.8, top_k=2),
                                      "point_mass", None),
    "draft_other_settings": (4, 3, SamplingConfig(temperature=0.7, top_p=0.9),
                             SamplingConfig(temperature=1.5), None),
    "v6_t1.3_topp0.8_minp0.1": (6, 2, SamplingConfig(temperature=1.3, top_p=0.8, min_p=0.1),
                                SamplingConfig(temperature=1.3, top_p=0.8, min_p=0.1), None),
    "v3_k4_num_draft2_topk2": (3, 4, SamplingConfig(temperature=0.8, top_k=2),
                               SamplingConfig(temperature=0.8, top_k=2), 2),
}


def _case(name):
    v, k, tcfg, dcfg, n = CASES[name]
    target, draft = _tables(v, k, tcfg, dcfg)
    return target, draft, k, ({} if n is None else {"num_draft": n})


# --- exact enumeration -------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_exact_law_token_and_block(case):
    target, draft, k, kw = _case(case)
    token = audit.audit_law(V.token_law, target, draft, k, **kw)
    block = audit.audit_law(V.block_law, target, draft, k, **kw)
    print(f"\nexact {case}: token err={token.max_abs_error:.1e} E={token.expected_tokens:.4f}"
          f" | block err={block.max_abs_error:.1e} E={block.expected_tokens:.4f}")
    assert token.passed and block.passed, (token, block)
    assert block.expected_tokens >= token.expected_tokens - 1e-12
    assert token.expected_tokens > 1.4  # acceptances really happen in every case


@pytest.mark.parametrize("name", ["token", "block"])
def test_exact_law_edge_cases(name):
    v, k = 4, 3
    target, draft = _tables(v, k, SamplingConfig(), SamplingConfig(), seed=10)
    # Draft equal to the target on half of the prefixes: w_t = 1 with r_t = 0 (h = 0/0).
    half = np.random.default_rng(0).random(len(target)) < 0.5
    mixed = np.where(half[:, None], target, draft)
    greedy_target, _ = _tables(v, k, SamplingConfig(temperature=0.0), SamplingConfig(), 10)
    for label, t, d, kw in [("draft==target on half", target, mixed, {}),
                            ("draft==target", target, target, {}),
                            ("greedy target", greedy_target, draft, {}),
                            ("num_draft=0", target, draft, {"num_draft": 0}),
                            ("num_draft=1", target, draft, {"num_draft": 1})]:
        res = audit.audit_law(LAWS[name], t, d, k, **kw)
        assert res.passed, (label, res)
    assert audit.audit_law(LAWS[name], target, target, k).expected_tokens == pytest.approx(k + 1)


def test_expected_tokens_match_alpha_formula_for_context_free_tables():
    v, k = 4, 3
    rng = np.random.default_rng(1)
    lengths = np.repeat(np.arange(k + 1), [v ** m for m in range(k + 1)])
    rows_t, rows_d = rng.normal(size=(k + 1, v)), rng.normal(size=(k + 1, v))
    target = audit.process_table(rows_t[lengths].astype(np.float32), SamplingConfig())
    draft = audit.process_table(rows_d[lengths].astype(np.float32), SamplingConfig())
    first = audit.prefix_offsets(v, k)
    alphas = V.overlap_alpha(draft[first[:k]], target[first[:k]])
    _, expected = audit.exact_round_law(V.token_law, target, draft, k)
    assert expected == pytest.approx(float(V.expected_tokens_per_round(alphas)), rel=1e-5)


# --- Monte Carlo against the samplers ----------------------------------------------------

@pytest.mark.parametrize("name", ["token", "block"])
@pytest.mark.parametrize("case", list(CASES))
def test_monte_carlo(case, name):
    target, draft, k, kw = _case(case)
    mc = audit.audit_monte_carlo(SAMPLERS[name], 1234, target, draft, k, ROWS, **kw)
    _, expected = audit.exact_round_law(LAWS[name], target, draft, k, **kw)
    print(f"\nMC {name} {case}: chi2={mc.chi2.statistic:.1f} dof={mc.chi2.dof} "
          f"p={mc.chi2.p_value:.3f} tokens/round={mc.mean_tokens:.4f} (exact {expected:.4f})")
    assert mc.passed, mc
    assert mc.chi2.impossible == 0  # never a sequence the target cannot produce
    assert abs(mc.mean_tokens - expected) < 5 * np.sqrt((k + 1) ** 2 / 4 / ROWS)


# --- mutants: the same checks must fail ----------------------------------------------------

@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mutants_fail_exact_and_monte_carlo(mutant):
    sampler, law = MUTANTS[mutant]
    target, draft, k, _ = _case("plain")
    exact = audit.audit_law(law, target, draft, k)
    mc = audit.audit_monte_carlo(sampler, 99, target, draft, k, ROWS)
    print(f"\nmutant {mutant}: exact err={exact.max_abs_error:.2e} | MC chi2="
          f"{mc.chi2.statistic:.1f} dof={mc.chi2.dof} p={mc.chi2.p_value:.2e}")
    assert not exact.passed and exact.max_abs_error > 1e-3
    assert not mc.passed and mc.chi2.p_value < 1e-6


def _wrong_order(logits_table, temperature, top_p):
    """top-p applied at temperature 1, THEN the temperature: the wrong pipeline order."""
    cut = audit.process_table(logits_table, SamplingConfig(top_p=top_p))
    return audit.process_table(cut, SamplingConfig(temperature=temperature))


@pytest.mark.parametrize("name", ["token", "block"])
def test_processing_mismatch_fails(name):
    v, k = 4, 3
    cfg = SamplingConfig(temperature=0.5, top_p=0.8)
    t_logits, d_logits = audit.random_logits_table(1, v, k), audit.random_logits_table(2, v, k)
    target = audit.process_table(t_logits, cfg)
    draft = audit.process_table(d_logits, cfg)
    variants = {
        # the proposer samples with another pipeline than the log-probs it reports
        "draft sampled top-p before temperature": dict(
            target_table=target, draft_table=draft,
            draft_sample_table=_wrong_order(d_logits, 0.5, 0.8)),
        "draft sampled at temperature 1.0, reported at 0.5": dict(
            target_table=target, draft_table=audit.process_table(d_logits, SamplingConfig(
                temperature=0.5)),
            draft_sample_table=audit.process_table(d_logits, SamplingConfig())),
        # the target is verified with another pipeline than the contract's
        "target top-p before temperature": dict(
            target_table=_wrong_order(t_logits, 0.5, 0.8), draft_table=draft,
            reference_table=target),
    }
    for label, kw in variants.items():
        exact = audit.audit_law(LAWS[name], num_draft_max=k, **kw)
        mc = audit.audit_monte_carlo(SAMPLERS[name], 7, num_draft_max=k, num_rows=ROWS, **kw)
        print(f"\nmismatch {name} {label}: exact err={exact.max_abs_error:.2e} | MC chi2="
              f"{mc.chi2.statistic:.1f} p={mc.chi2.p_value:.2e} errors={mc.errors}")
        assert not exact.passed and exact.max_abs_error > 1e-3, label
        assert not mc.passed, label


# --- the chi-square helper ------------------------------------------------------------------

def test_chi_square_helper():
    probs = np.array([0.5, 0.25, 0.25, 0.0])
    assert audit.chi_square_test([500, 250, 250, 0], probs).p_value > 0.99
    assert audit.chi_square_test([500, 250, 249, 1], probs).p_value == 0.0
    assert audit.chi_square_test([600, 200, 200, 0], probs).p_value < 1e-6
    # cells with tiny expectations are pooled, not dropped
    chi = audit.chi_square_test([1000, 0, 0], [0.998, 0.001, 0.001])
    assert chi.dof == 1 and chi.statistic == pytest.approx(4 / 998 + 4 / 2)


def test_chi_square_goodness_of_fit_uses_the_shared_pieces():
    from scipy import stats

    counts, probs = np.array([30, 50, 20]), np.array([0.25, 0.5, 0.25])
    chi = audit.chi_square_test(counts, probs)
    ref = stats.chisquare(counts, probs * counts.sum())
    assert chi.statistic == pytest.approx(ref.statistic) and chi.p_value == pytest.approx(ref.pvalue)
    assert audit.chi2_sf(chi.statistic, chi.dof) == pytest.approx(ref.pvalue)


# --- two samples: homogeneity test, bin merging, permutation of whole sequences -------------

def _counts(tokens):
    return dict(zip(*np.unique(np.asarray(tokens), return_counts=True)))


def test_two_sample_statistic_matches_scipy_contingency():
    from scipy import stats

    a = {0: 40, 1: 30, 2: 30}
    b = {0: 20, 1: 50, 2: 30}
    res = audit.chi_square_two_sample(a, b)
    table = np.array([[40, 20], [30, 50], [30, 30]])
    ref = stats.chi2_contingency(table, correction=False)
    assert res["bins"] == 3 and res["dof"] == 2 and (res["n_a"], res["n_b"]) == (100, 100)
    assert res["chi2"] == pytest.approx(ref.statistic) and res["p_value"] == pytest.approx(ref.pvalue)


def test_two_sample_same_law_accepted_other_law_rejected():
    rng = np.random.default_rng(0)
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.03, 0.01, 0.01])
    q = np.array([0.25, 0.25, 0.15, 0.1, 0.1, 0.05, 0.05, 0.03, 0.01, 0.01])  # 5% mass moved
    a = _counts(rng.choice(10, 20_000, p=p))
    same = audit.chi_square_two_sample(a, _counts(rng.choice(10, 20_000, p=p)))
    other = audit.chi_square_two_sample(a, _counts(rng.choice(10, 20_000, p=q)))
    assert same["p_value"] > 0.05, same
    assert other["p_value"] < 1e-6, other
    assert same["bins"] == other["bins"] == 10


def test_merge_bins_pools_rare_tokens():
    # tokens 0, 1 frequent; 2..5 rare (expected < 5 in each sample), together 16 per sample
    a = {0: 50, 1: 50, 2: 4, 3: 4, 4: 4, 5: 4}
    mapping, n_bins, rare = audit.merge_bins(a, dict(a), 5.0)
    assert n_bins == 3 and rare == 2
    assert mapping[0] != mapping[1] and {mapping[t] for t in (2, 3, 4, 5)} == {2}
    # a rare bin too small on its own is folded into the last frequent bin
    a = {0: 50, 1: 50, 2: 1, 3: 1}
    mapping, n_bins, rare = audit.merge_bins(a, dict(a), 5.0)
    assert n_bins == 2 and mapping[2] == mapping[3] == mapping[1] == rare == 1
    # untestable samples say why
    assert audit.chi_square_two_sample({}, a)["reason"] == "empty sample"
    few = audit.chi_square_two_sample({0: 3, 1: 2}, {0: 2, 1: 3})
    assert few["chi2"] is None and few["p_value"] is None and "bins" in few["reason"]


def _sequences(rng, n, law, length=20, strata=(0,)):
    """``(stratum, tokens)`` pairs whose tokens are strongly dependent within a sequence: each
    sequence repeats one token drawn from ``law`` (or ``law[stratum]``), with a little noise."""
    out = []
    for i in range(n):
        st = strata[i % len(strata)]
        p = law[st] if isinstance(law, dict) else law
        t = int(rng.choice(len(p), p=p))
        noise = rng.integers(0, len(p), size=length)
        out.append((st, np.where(rng.random(length) < 0.1, noise, t).tolist()))
    return out


def test_permutation_test_valid_under_dependence_and_has_power():
    rng = np.random.default_rng(1)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    a, b_same = _sequences(rng, 60, p), _sequences(rng, 60, p)
    same = audit.sequence_permutation_test(a, b_same, n_perm=1000, seed=0)
    other = audit.sequence_permutation_test(a, _sequences(rng, 60, q), n_perm=1000, seed=0)
    # tokens of a sequence are dependent: the nominal p-value is far too small, the
    # permutation p-value (whole sequences exchanged) is not
    assert same["p_value"] < 1e-3, same
    assert same["p_value_permutation"] > 0.05, same
    assert other["p_value_permutation"] <= 2 / 1001, other
    assert (same["n_seq_a"], same["n_seq_b"], same["n_perm"]) == (60, 60, 1000)
    # fixed seed: the same p-value
    assert audit.sequence_permutation_test(a, b_same, n_perm=1000, seed=0) == same


def test_permutation_test_permutes_within_strata():
    """Two prompts with different laws, group A mostly on prompt 0, group B mostly on prompt 1,
    both groups drawn from the same law per prompt: exchangeable within a prompt only."""
    rng = np.random.default_rng(2)
    laws = {0: np.array([0.7, 0.1, 0.1, 0.1]), 1: np.array([0.1, 0.1, 0.1, 0.7])}
    a = _sequences(rng, 40, laws, strata=(0,)) + _sequences(rng, 10, laws, strata=(1,))
    b = _sequences(rng, 10, laws, strata=(0,)) + _sequences(rng, 40, laws, strata=(1,))
    stratified = audit.sequence_permutation_test(a, b, n_perm=1000, seed=0)
    pooled = audit.sequence_permutation_test([(0, s) for _, s in a], [(0, s) for _, s in b],
                                             n_perm=1000, seed=0)
    assert stratified["chi2"] == pytest.approx(pooled["chi2"])  # same tokens, same statistic
    assert stratified["p_value_permutation"] > 0.05, stratified
    assert pooled["p_value_permutation"] <= 2 / 1001, pooled
