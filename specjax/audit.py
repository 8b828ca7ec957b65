"""Exactness audit: exact enumeration and Monte Carlo checks for any verifier.

The synthetic model is CONTEXT-DEPENDENT: a table with one row of log-probs for every
prefix of length ``0..depth`` (row order: by length, then the prefix read as a base-V
number, first token most significant; see :func:`prefix_index`).  A verifier that
looked up the wrong position would therefore see the wrong row.

The quantity audited is the law of the first ``K + 1`` tokens of a sequence made by ONE
verification round (draft ``K`` tokens from the draft table, verify against the target
table) followed by plain sampling from the target until ``K + 1`` tokens exist.  An exact
verifier gives the target's own joint law of ``K + 1`` tokens.

* :func:`exact_round_law` -- that law by enumeration of every draft, in float64, from a
  verifier's law function (e.g. :func:`specjax.verify.token_law`), i.e. from the same
  helpers the sampler runs;
* :func:`monte_carlo_counts` -- that law's empirical counts from the sampler itself
  (jit + vmap over rows; drafts and the continuation drawn on the host);
* :func:`chi_square_test` -- counts vs. probabilities, with a p-value;
* :func:`audit_law`, :func:`audit_monte_carlo` -- the two checks with a pass/fail verdict;
* :func:`chi_square_two_sample`, :func:`sequence_permutation_test` -- two samples of tokens
  (e.g. speculative vs autoregressive output) drawn from one law? (the benchmark's check;
  no law is known, only samples).

Draft trees (:mod:`specjax.tree`): :func:`exact_tree_law` / :func:`audit_tree_law` (every
tree of positive probability for a shape, the verifier's per-tree law in float64) and
:func:`tree_monte_carlo_counts` / :func:`audit_tree_monte_carlo` (the jitted sampler on
host-drawn trees); the quantity is the law of the first D + 1 tokens (D = the tree's
depth) of one tree round followed by the target.

All chi-square figures share :func:`pearson_statistic` and :func:`chi2_sf`.

``draft_sample_table`` (default: the draft table) is the law the draft tokens are really
drawn from, while ``draft_table`` is what the verifier is told; making them differ
models a proposer whose processing does not match the log-probs it reports.
"""
from __future__ import annotations

import collections
import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import keys as _keys
from specjax import tree as _tree
from specjax import verify as _verify
from specjax.sampling import SamplingConfig, process_logits

__all__ = [
    "EXACT_TOL", "MC_ALPHA", "num_prefixes", "prefix_offsets", "prefix_index",
    "random_logits_table", "point_mass_table", "process_table", "normalize_table",
    "target_joint_law", "exact_round_law", "monte_carlo_counts", "sequence_index",
    "chi_square_test", "ChiSquare", "LawAudit", "MonteCarloAudit", "audit_law",
    "audit_monte_carlo", "pearson_statistic", "chi2_sf", "merge_bins", "chi_square_two_sample",
    "sequence_permutation_test",
    # draft trees
    "TREE_DRAWS", "tree_paths", "tree_context_rows", "enumerate_trees", "sample_trees",
    "exact_tree_law", "tree_monte_carlo_counts", "audit_tree_law", "audit_tree_monte_carlo",
    "dynamic_tree_valid",
]

EXACT_TOL = 1e-9  # max |law - target law| for an exact verifier (float64 enumeration)
MC_ALPHA = 1e-4  # a Monte Carlo check fails when its p-value is below this

def _count(value, name: str, lo: int = 1) -> int:
    """``value`` as an int >= ``lo``, else a one-line ValueError / TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return int(value)


def _table(table, name: str, vocab_size: Optional[int] = None, depth: Optional[int] = None) -> np.ndarray:
    """A prefix table checked: 2-D [rows, V] with V >= 1 (``vocab_size`` when given) and at
    least one row per prefix of length 0..``depth``; no NaN and no +inf (log-probs or
    logits; -inf is a probability 0)."""
    t = np.asarray(table)
    if t.ndim != 2 or t.shape[1] < 1:
        raise ValueError(f"{name} must be a 2-D table [prefixes, V], got shape {t.shape}")
    if not np.issubdtype(t.dtype, np.floating):
        raise TypeError(f"{name} must hold floats (log-probs), got dtype {t.dtype}")
    if vocab_size is not None and t.shape[1] != vocab_size:
        raise ValueError(f"{name} has V={t.shape[1]}, the target table V={vocab_size}")
    if depth is not None and t.shape[0] < num_prefixes(t.shape[1], depth):
        raise ValueError(f"{name} has {t.shape[0]} rows, fewer than the {num_prefixes(t.shape[1], depth)} "
                         f"prefixes of length 0..{depth} over V={t.shape[1]}")
    if np.isnan(t).any() or np.isposinf(t).any():
        raise ValueError(f"{name} holds NaN or +inf (not log-probs)")
    return t


def _tables(target_table, draft_table, draft_sample_table, depth: int, reference_table=None):
    """Check the audit's tables: the same V, rows for every prefix of length 0..``depth``."""
    v = _table(target_table, "target_table", depth=depth).shape[1]
    _table(draft_table, "draft_table", v, depth)
    if draft_sample_table is not None:
        _table(draft_sample_table, "draft_sample_table", v, depth)
    if reference_table is not None:
        _table(reference_table, "reference_table", v, depth)
    return v


def _num_draft(num_draft_max, num_draft):
    k = _count(num_draft_max, "num_draft_max", 1)
    n = k if num_draft is None else _count(num_draft, "num_draft", 0)
    if n > k:
        raise ValueError(f"num_draft={n} exceeds num_draft_max={k}")
    return k, n


LawFn = Callable[..., _verify.RoundLaw]  # (tokens, draft_lp, target_lp, num_draft)
VerifyFn = Callable[..., _verify.VerifyResult]  # (key, tokens, draft_lp, target_lp, n)


# --------------------------------------------------------------------------------------
# Prefix tables
# --------------------------------------------------------------------------------------

def num_prefixes(vocab_size: int, depth: int) -> int:
    """Number of prefixes of length 0..depth."""
    return sum(vocab_size ** m for m in range(depth + 1))


def prefix_offsets(vocab_size: int, depth: int) -> np.ndarray:
    """offsets[m] = row of the first prefix of length m."""
    return np.cumsum([0] + [vocab_size ** m for m in range(depth + 1)])[:-1]


def prefix_index(prefix, vocab_size: int):
    """Table row of a prefix (int array [..., m]; m may be 0); numpy or jax."""
    xp = jnp if isinstance(prefix, jax.Array) else np
    prefix = xp.asarray(prefix)
    m = prefix.shape[-1]
    offset = sum(vocab_size ** j for j in range(m))
    weights = xp.asarray([vocab_size ** (m - 1 - j) for j in range(m)], dtype=np.int32)
    return offset + xp.sum(prefix * weights, axis=-1).astype(np.int32)


def random_logits_table(seed: int, vocab_size: int, depth: int, scale: float = 2.0,
                        ties: bool = True) -> np.ndarray:
    """float32 [num_prefixes, V] random logits, one row per prefix of length 0..depth.

    With ``ties`` some rows get exactly tied values, to exercise tie rules.
    """
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(num_prefixes(vocab_size, depth), vocab_size)) * scale
    if ties:
        rows = rng.random(table.shape[0]) < 0.25
        table[rows, 1] = table[rows, 0]
    return table.astype(np.float32)


def point_mass_table(seed: int, vocab_size: int, depth: int) -> np.ndarray:
    """Log-probs of a deterministic lookup proposer: one token per prefix (0 / -inf)."""
    rng = np.random.default_rng(seed)
    n = num_prefixes(vocab_size, depth)
    table = np.full((n, vocab_size), -np.inf, np.float32)
    table[np.arange(n), rng.integers(0, vocab_size, n)] = 0.0
    return table


def process_table(logits_table, params) -> np.ndarray:
    """Run every row through :func:`specjax.sampling.process_logits` with one setting."""
    if isinstance(params, SamplingConfig):
        params = params.to_params(1)
    n = np.asarray(logits_table).shape[0]
    params = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n,)), params)
    return np.asarray(jax.jit(process_logits)(jnp.asarray(logits_table), params))


def normalize_table(logprob_table) -> np.ndarray:
    """float64 rows renormalized exactly (removes float32 normalization rounding)."""
    t = np.asarray(logprob_table, np.float64)
    m = np.max(t, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return t - (m + np.log(np.sum(np.exp(t - m), axis=-1, keepdims=True)))


# --------------------------------------------------------------------------------------
# Exact laws
# --------------------------------------------------------------------------------------

def _conditionals(table: np.ndarray, vocab_size: int, length: int) -> list:
    """[cond_1, ..., cond_length]; cond_s has shape (V,)*s: p(z_s | z_<s) (float64)."""
    probs = np.exp(normalize_table(table))
    out = []
    for s in range(1, length + 1):
        if s == 1:
            rows = probs[:1]
        else:
            prefixes = np.indices((vocab_size,) * (s - 1)).reshape(s - 1, -1).T
            rows = probs[prefix_index(prefixes, vocab_size)]
        out.append(rows.reshape((vocab_size,) * s))
    return out


def _expand(a: np.ndarray, ndim: int) -> np.ndarray:
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def target_joint_law(target_table, vocab_size: int, length: int) -> np.ndarray:
    """float64 [V**length]: law of ``length`` tokens sampled from the target table."""
    law = np.ones((vocab_size,) * length)
    for c in _conditionals(target_table, vocab_size, length):
        law = law * _expand(c, length)
    return law.reshape(-1)


@functools.lru_cache(maxsize=None)
def _law_runner(law_fn):
    """jit(vmap(law_fn)), built once per law function (memoized)."""
    return jax.jit(jax.vmap(law_fn, in_axes=(0, 0, 0, None)))


def exact_round_law(law_fn: LawFn, target_table, draft_table, num_draft_max: int,
                    num_draft: Optional[int] = None, draft_sample_table=None):
    """Law of the first K+1 tokens (one round, then the target) by exact enumeration.

    ``law_fn(draft_tokens, draft_logprobs, target_logprobs, num_draft) -> RoundLaw`` is
    evaluated in float64 (x64 enabled locally) on float64-renormalized tables.  K =
    ``num_draft_max``; with ``num_draft`` < K the unused positions are filled with NaN
    log-probs and ``PAD_ID`` tokens, which the verifier must ignore.
    Returns ``(law float64[V**(K+1)], expected tokens emitted by the round)``.
    """
    k, n = _num_draft(num_draft_max, num_draft)
    _tables(target_table, draft_table, draft_sample_table, k)
    target = normalize_table(target_table)
    reported = normalize_table(draft_table)
    sampled = normalize_table(draft_table if draft_sample_table is None
                              else draft_sample_table)
    v = target.shape[1]
    drafts = np.indices((v,) * k).reshape(k, -1).T  # [V**K, K]
    rows = [prefix_index(drafts[:, :i], v) for i in range(k + 1)]
    q_prob = np.ones(drafts.shape[0])
    for i in range(n):
        q_prob *= np.exp(sampled[rows[i], drafts[:, i]])
    # Unused positions are not sampled: keep one representative (zeros) per used prefix.
    q_prob[np.any(drafts[:, n:] != 0, axis=1)] = 0.0
    possible = q_prob > 0  # only drafts that can occur are shown to the verifier
    draft_lp = np.stack([reported[rows[i]] for i in range(k)], axis=1)
    target_lp = np.stack([target[rows[i]] for i in range(k + 1)], axis=1)
    tokens = drafts.copy()
    draft_lp[:, n:] = np.nan
    target_lp[:, n + 1:] = np.nan
    tokens[:, n:] = _verify.PAD_ID
    # Impossible drafts get a possible one's inputs (fixed shapes: one compile per (V, K)).
    shown = np.where(possible, np.arange(len(possible)), np.argmax(possible))
    with jax.enable_x64(True):
        law = _law_runner(law_fn)(
            jnp.asarray(tokens[shown], jnp.int32), jnp.asarray(draft_lp[shown], jnp.float64),
            jnp.asarray(target_lp[shown], jnp.float64), jnp.asarray(n, jnp.int32))
    stop = np.where(possible[:, None], np.asarray(law.stop_probs, np.float64), 0.0)
    emit = np.exp(np.asarray(law.emit_logprobs, np.float64))
    # Stopping with probability exactly 0 contributes nothing (its row may be anything).
    mass = np.where(stop[..., None] > 0, stop[..., None] * emit, 0.0)
    mass = mass * q_prob[:, None, None]
    length = k + 1
    cond = _conditionals(target_table, v, length)
    out = np.zeros((v,) * length)
    for t in range(k + 1):
        # Accepted prefix = the first t draft tokens; sum out the rest of the draft.
        a = mass[:, t, :].reshape((v,) * k + (v,))
        b = a.sum(axis=tuple(range(t, k))) if t < k else a  # (V,)*(t+1)
        cont = np.ones((v,) * length)
        for s in range(t + 2, length + 1):
            cont = cont * _expand(cond[s - 1], length)
        out += _expand(b, length) * cont
    expected = float(np.sum(q_prob[:, None] * stop * np.arange(1, k + 2)))
    return out.reshape(-1), expected


# --------------------------------------------------------------------------------------
# Monte Carlo
# --------------------------------------------------------------------------------------

def sequence_index(tokens, vocab_size: int) -> np.ndarray:
    """Flat index of each sequence [N, L] in the ``(V,)*L`` outcome grid."""
    tokens = np.asarray(tokens, np.int64)
    weights = vocab_size ** np.arange(tokens.shape[-1] - 1, -1, -1, dtype=np.int64)
    return tokens @ weights


def _sample_rows(rng: np.random.Generator, logprobs: np.ndarray) -> np.ndarray:
    """One inverse-CDF draw per row of float64 log-probs [N, V] (host side)."""
    probs = np.exp(logprobs)
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(len(probs)) * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(-1), probs.shape[1] - 1)


def _mc_tables(target_table, draft_table, draft_sample_table):
    """The Monte Carlo runners' tables: (target float32, reported draft float32, target
    normalized, the draft law tokens are sampled from, normalized)."""
    target32 = np.asarray(target_table, np.float32)
    reported32 = np.asarray(draft_table, np.float32)
    sampled = normalize_table(draft_table if draft_sample_table is None else draft_sample_table)
    return target32, reported32, normalize_table(target32), sampled


@functools.lru_cache(maxsize=None)
def _runner(verify_fn):
    """jit(vmap(verify_fn)), built once per verifier (memoized)."""
    return jax.jit(jax.vmap(verify_fn, in_axes=(0, 0, 0, 0, None)))


def monte_carlo_counts(verify_fn: VerifyFn, seed: int, target_table, draft_table,
                       num_draft_max: int, num_rows: int = 200_000,
                       num_draft: Optional[int] = None, draft_sample_table=None):
    """Run the sampler ``verify_fn`` on ``num_rows`` independent rows (jit + vmap).

    The drafts and the continuation after the round are drawn on the host (numpy,
    ``seed``); the verifier gets float32 log-probs as the engine would pass them, and row
    keys ``round_key(row_keys(seed, i), 0)``.  Positions beyond ``num_draft`` are
    garbage (NaN log-probs, PAD_ID tokens) that the verifier must ignore.
    Returns ``(counts int64[V**(K+1)], mean tokens emitted by the round, error count)``.
    """
    k, n = _num_draft(num_draft_max, num_draft)
    num_rows = _count(num_rows, "num_rows", 1)
    _tables(target_table, draft_table, draft_sample_table, k)
    target32, reported32, target, sampled = _mc_tables(target_table, draft_table, draft_sample_table)
    v = target.shape[1]
    rng = np.random.default_rng(seed)
    draft = np.zeros((num_rows, k), np.int64)
    for i in range(n):
        draft[:, i] = _sample_rows(rng, sampled[prefix_index(draft[:, :i], v)])
    rows = [prefix_index(draft[:, :i], v) for i in range(k + 1)]
    draft_lp = np.stack([reported32[r] for r in rows[:k]], axis=1)
    target_lp = np.stack([target32[r] for r in rows], axis=1)
    draft_lp[:, n:] = np.nan
    target_lp[:, n + 1:] = np.nan
    tokens = np.where(np.arange(k) < n, draft, _verify.PAD_ID).astype(np.int32)
    round_keys = jax.vmap(lambda r: _keys.round_key(r, 0))(
        _keys.row_keys(seed, np.arange(num_rows)))
    res = _runner(verify_fn)(round_keys, tokens, draft_lp, target_lp,
                             jnp.asarray(n, jnp.int32))
    out = np.asarray(res.tokens).astype(np.int64)
    error = np.asarray(res.error)
    accepted = np.asarray(res.num_accepted)
    out, accepted = out[~error], accepted[~error]
    for t in range(k + 1):  # continue with the target until K+1 tokens exist
        fill = out[:, t] == _verify.PAD_ID
        if fill.any():
            out[fill, t] = _sample_rows(rng, target[prefix_index(out[fill, :t], v)])
    counts = np.bincount(sequence_index(out, v), minlength=v ** (k + 1))
    return counts.astype(np.int64), float(np.mean(accepted + 1)), int(error.sum())


# --------------------------------------------------------------------------------------
# Chi-square tests
# --------------------------------------------------------------------------------------

def pearson_statistic(observed, expected, axis=-1):
    """Pearson's sum of ``(observed - expected)**2 / expected`` over ``axis`` (cells with
    expected count 0 add nothing); numpy, any leading batch shape."""
    observed = np.asarray(observed, np.float64)
    expected = np.asarray(expected, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(expected > 0, (observed - expected) ** 2 / expected, 0.0)
    return terms.sum(axis=axis)


def chi2_sf(x: float, dof: int) -> float:
    """P(chi2(dof) >= x): scipy's survival function, or the Wilson-Hilferty normal
    approximation when scipy (a dev dependency) is not installed."""
    try:
        from scipy.stats import chi2
    except ImportError:
        z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))
    return float(chi2.sf(x, dof))


class ChiSquare(NamedTuple):
    statistic: float
    dof: int
    p_value: float
    impossible: int  # observations in cells of probability 0 (any -> p_value = 0)


def chi_square_test(counts, probs, min_expected: float = 5.0) -> ChiSquare:
    """Pearson chi-square (goodness of fit) of ``counts`` against ``probs`` (same flat grid).

    Cells whose expected count is below ``min_expected`` are pooled into one cell; an
    observation in a cell of probability 0 gives p-value 0.

    ValueError (before any statistic) for counts and probs of different shapes, NaN /
    infinite / negative probabilities or probabilities summing to 0, NaN / infinite /
    negative counts, or no observation at all: none of these is a valid test, and each
    would otherwise read as a pass.
    """
    counts = np.asarray(counts, np.float64)
    probs = np.asarray(probs, np.float64)
    if counts.shape != probs.shape or counts.ndim == 0:
        raise ValueError(f"chi_square_test: counts {counts.shape} and probs {probs.shape} must be "
                         "arrays of the same shape (one flat grid of outcomes)")
    if not np.isfinite(probs).all() or (probs < 0).any() or not probs.sum() > 0:
        raise ValueError("chi_square_test: probs must be finite, non-negative and not all 0 "
                         f"(got {int(np.isnan(probs).sum())} NaN, {int(np.isinf(probs).sum())} infinite, "
                         f"{int((probs < 0).sum())} negative, sum {np.nansum(probs):.6g})")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError("chi_square_test: counts must be finite and non-negative")
    total = counts.sum()
    if total <= 0:
        raise ValueError("chi_square_test: no observations (every count is 0): nothing to test")
    impossible = int(counts[probs <= 0].sum())
    if impossible:
        return ChiSquare(float("inf"), 0, 0.0, impossible)
    expected = probs / probs.sum() * total
    counts, expected = counts[probs > 0], expected[probs > 0]
    small = expected < min_expected
    obs = list(counts[~small])
    exp = list(expected[~small])
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    stat = float(pearson_statistic(obs, exp))
    dof = max(len(obs) - 1, 1)
    return ChiSquare(stat, dof, chi2_sf(stat, dof), 0)


def _contingency_statistic(obs: np.ndarray) -> np.ndarray:
    """Pearson chi-square of homogeneity of [..., bins, 2] contingency tables (expected
    counts from the margins)."""
    col = obs.sum(axis=-2, keepdims=True)
    row = obs.sum(axis=-1, keepdims=True)
    exp = row * col / obs.sum(axis=(-2, -1), keepdims=True)
    return pearson_statistic(obs, exp, axis=(-2, -1))


def merge_bins(a_counts: dict, b_counts: dict, min_expected: float):
    """Token -> bin index for two token histograms ``{token: count}``: tokens with an
    expected count >= ``min_expected`` in both samples get their own bin, the rest share
    one "rare" bin (folded into the last bin when it is itself too small). Returns
    ``(mapping, n_bins, rare_bin)``; tokens unknown to the mapping belong in ``rare_bin``."""
    keys = sorted(set(a_counts) | set(b_counts))
    na, nb = sum(a_counts.values()), sum(b_counts.values())
    n = na + nb
    mapping, n_bins, rare_tokens, rare = {}, 0, [], [0, 0]
    for t in keys:
        a, b = a_counts.get(t, 0), b_counts.get(t, 0)
        if min((a + b) * na / n, (a + b) * nb / n) >= min_expected:
            mapping[t] = n_bins
            n_bins += 1
        else:
            rare_tokens.append(t)
            rare[0] += a
            rare[1] += b
    tot = sum(rare)
    if tot and min(tot * na / n, tot * nb / n) >= min_expected:
        rare_bin = n_bins
        n_bins += 1
    else:
        rare_bin = max(n_bins - 1, 0)
    for t in rare_tokens:
        mapping[t] = rare_bin
    return mapping, max(n_bins, 1), rare_bin


def chi_square_two_sample(a_counts: dict, b_counts: dict, min_expected: float = 5.0) -> dict:
    """Two-sample chi-square homogeneity test on token histograms ``{token: count}``
    (rare tokens merged, see :func:`merge_bins`): a dict with the sample sizes ``n_a`` /
    ``n_b``, ``distinct_tokens``, ``chi2``, ``dof``, ``bins`` and the nominal ``p_value``
    (``chi2`` / ``p_value`` None, with a ``reason``, when untestable).

    The nominal p-value assumes independent tokens; tokens of one sequence are not, so it
    is too small (see :func:`sequence_permutation_test` for a valid p-value)."""
    na, nb = sum(a_counts.values()), sum(b_counts.values())
    out = {"n_a": int(na), "n_b": int(nb), "distinct_tokens": len(set(a_counts) | set(b_counts))}
    if na == 0 or nb == 0:
        return {**out, "chi2": None, "dof": 0, "p_value": None, "bins": 0, "reason": "empty sample"}
    mapping, n_bins, _ = merge_bins(a_counts, b_counts, min_expected)
    if n_bins < 2:
        return {**out, "chi2": None, "dof": 0, "p_value": None, "bins": n_bins,
                "reason": "fewer than 2 bins with enough expected counts"}
    obs = np.zeros((n_bins, 2))
    for t, c in a_counts.items():
        obs[mapping[t], 0] += c
    for t, c in b_counts.items():
        obs[mapping[t], 1] += c
    chi2 = float(_contingency_statistic(obs))
    dof = n_bins - 1
    return {**out, "chi2": chi2, "dof": dof, "p_value": chi2_sf(chi2, dof), "bins": n_bins}


def sequence_permutation_test(seqs_a: Sequence, seqs_b: Sequence, min_expected: float = 5.0,
                              n_perm: int = 2000, seed: int = 0) -> dict:
    """The statistic of :func:`chi_square_two_sample` with a valid p-value: sequences (not
    tokens) are the exchangeable units. ``seqs_*`` are ``(stratum, tokens)`` pairs (stratum:
    e.g. the prompt); group labels are permuted among the sequences of each stratum, which
    is exact under the null that every sequence of a stratum is an independent draw from
    one law -- provided no two sequences share random keys. Returns the two-sample dict
    plus ``p_value_permutation``, ``n_perm``, ``n_seq_a`` and ``n_seq_b``."""
    n_perm = _count(n_perm, "n_perm", 1)
    ca = collections.Counter(t for _, s in seqs_a for t in s)
    cb = collections.Counter(t for _, s in seqs_b for t in s)
    nominal = chi_square_two_sample(ca, cb, min_expected)
    if nominal["chi2"] is None:
        return {**nominal, "p_value_permutation": None, "n_perm": 0}
    mapping, n_bins, rare_bin = merge_bins(ca, cb, min_expected)
    seqs = list(seqs_a) + list(seqs_b)
    h = np.zeros((len(seqs), n_bins))
    for i, (_, s) in enumerate(seqs):
        for t in s:
            h[i, mapping.get(t, rare_bin)] += 1
    label = np.array([1.0] * len(seqs_a) + [0.0] * len(seqs_b))
    strata = collections.defaultdict(list)
    for i, (st, _) in enumerate(seqs):
        strata[st].append(i)
    rng = np.random.default_rng(seed)
    perms = np.empty((n_perm, len(seqs)))
    for p in range(n_perm):
        lab = label.copy()
        for idx in strata.values():
            lab[idx] = rng.permutation(label[idx])
        perms[p] = lab
    total = h.sum(axis=0)
    a = perms @ h  # [n_perm, bins]
    stats = _contingency_statistic(np.stack([a, total[None, :] - a], axis=-1))
    obs_a = label @ h
    obs = float(_contingency_statistic(np.stack([obs_a, total - obs_a], axis=-1)))
    p = (1 + int(np.sum(stats >= obs - 1e-9))) / (1 + n_perm)
    return {**nominal, "p_value_permutation": p, "n_perm": n_perm,
            "n_seq_a": len(seqs_a), "n_seq_b": len(seqs_b)}


# --------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------

class LawAudit(NamedTuple):
    max_abs_error: float
    expected_tokens: float
    passed: bool


class MonteCarloAudit(NamedTuple):
    chi2: ChiSquare
    mean_tokens: float
    errors: int
    passed: bool


def audit_law(law_fn: LawFn, target_table, draft_table, num_draft_max: int,
              tol: float = EXACT_TOL, reference_table=None, **kwargs) -> LawAudit:
    """Exact check: max |law - target joint law| < tol (float64 enumeration).

    ``reference_table`` (default: the target table) is the law the output must follow.
    """
    if reference_table is not None:
        _table(reference_table, "reference_table", _table(target_table, "target_table").shape[1],
               _count(num_draft_max, "num_draft_max", 1))
    law, expected = exact_round_law(law_fn, target_table, draft_table, num_draft_max,
                                    **kwargs)
    ref = target_table if reference_table is None else reference_table
    v = np.asarray(target_table).shape[1]
    err = float(np.max(np.abs(law - target_joint_law(ref, v, num_draft_max + 1))))
    return LawAudit(err, expected, bool(err < tol))


def audit_monte_carlo(verify_fn: VerifyFn, seed: int, target_table, draft_table,
                      num_draft_max: int, num_rows: int = 200_000, alpha: float = MC_ALPHA,
                      reference_table=None, **kwargs) -> MonteCarloAudit:
    """Statistical check of the sampler: chi-square p-value >= alpha and no error flags."""
    if reference_table is not None:
        _table(reference_table, "reference_table", _table(target_table, "target_table").shape[1],
               _count(num_draft_max, "num_draft_max", 1))
    counts, mean_tokens, errors = monte_carlo_counts(
        verify_fn, seed, target_table, draft_table, num_draft_max, num_rows, **kwargs)
    ref = target_table if reference_table is None else reference_table
    v = np.asarray(target_table).shape[1]
    chi = _chi_square_or_fail(counts, target_joint_law(ref, v, num_draft_max + 1))
    return MonteCarloAudit(chi, mean_tokens, errors,
                           bool(chi.p_value >= alpha and errors == 0))


def _chi_square_or_fail(counts, probs) -> ChiSquare:
    """:func:`chi_square_test`, or a failed one (p-value 0) when no row produced an
    outcome (every row flagged an error): nothing observed is never a pass."""
    if not np.asarray(counts).sum() > 0:
        return ChiSquare(float("nan"), 0, 0.0, 0)
    return chi_square_test(counts, probs)


# --------------------------------------------------------------------------------------
# Draft trees
# --------------------------------------------------------------------------------------
#
# A round on a tree of static shape ``parent`` (depth D): every node's token is drawn from
# the draft table at its path's prefix (``draw``), the verifier is told the reported
# draft rows and the target's rows at every context, and its output (accepted path + one
# token) is continued with the target until D + 1 tokens exist.  An exact verifier gives
# the target's joint law of D + 1 tokens.  ``target_parent`` (default: ``parent``) is
# the parent array the TARGET's contexts are built from: a different one models a wrong
# tree attention mask (node i scored after the wrong ancestors).

TREE_DRAWS = ("iid", "without_replacement", "topk")

TreeLawFn = Callable[..., "_tree.TreeLaw"]  # (tree, p_root, p_node)
TreeVerifyFn = Callable[..., "_tree.TreeVerifyResult"]  # (key, tree, p_root, p_node)


def tree_paths(parent) -> list:
    """For each node, the node indices on its path from the root (ancestors, then itself)."""
    parent = np.asarray(parent)
    _tree.shape_depths(parent)  # checks topological order
    paths = []
    for i, par in enumerate(parent):
        paths.append(([] if par < 0 else paths[par]) + [i])
    return paths


def tree_context_rows(tokens, parent, vocab_size: int) -> np.ndarray:
    """int [T, N+1]: prefix-table row of every context (0: root, j+1: node j's path)."""
    tokens = np.asarray(tokens)
    rows = [np.zeros(tokens.shape[0], np.int64)]
    for path in tree_paths(parent):
        rows.append(prefix_index(tokens[:, path], vocab_size))
    return np.stack(rows, axis=1)


def _node_law(table, tokens, parent, i: int, draw: str) -> np.ndarray:
    """float64 [T, V]: law of node i's token given the earlier nodes' tokens [T, >= i]."""
    v = table.shape[1]
    par = int(parent[i])
    row = np.zeros(tokens.shape[0], np.int64) if par < 0 else \
        prefix_index(tokens[:, tree_paths(parent[:par + 1])[par]], v)
    q = np.exp(table[row])
    earlier = [j for j in range(i) if parent[j] == par]  # earlier siblings
    if draw == "iid":
        return q
    if draw == "without_replacement":
        for j in earlier:
            q[np.arange(len(q)), tokens[:, j]] = 0.0
        total = q.sum(axis=1, keepdims=True)
        return np.where(total > 0, q / np.where(total > 0, total, 1.0), 0.0)
    if draw == "topk":  # the (rank)-th most likely token (ties -> lowest id)
        order = np.argsort(-q, axis=1, kind="stable")
        out = np.zeros_like(q)
        out[np.arange(len(q)), order[:, len(earlier) % v]] = 1.0
        return out
    raise ValueError(f"draw must be one of {TREE_DRAWS}, got {draw!r}")


def enumerate_trees(draft_table, parent, draw: str = "iid"):
    """Every token assignment of positive probability: ``(tokens int[T, N], prob float64[T])``."""
    table = normalize_table(draft_table)
    v = table.shape[1]
    parent = np.asarray(parent)
    tokens = np.zeros((1, 0), np.int64)
    prob = np.ones(1)
    for i in range(len(parent)):
        law = _node_law(table, tokens, parent, i, draw) * prob[:, None]  # [T, V]
        t, x = np.nonzero(law > 0)
        tokens = np.concatenate([tokens[t], x[:, None]], axis=1)
        prob = law[t, x]
    if abs(prob.sum() - 1.0) > 1e-9:
        raise ValueError(f"draw={draw!r} cannot fill this tree shape from the draft table "
                         f"(trees of positive probability have total {prob.sum():.6g})")
    return tokens, prob


def sample_trees(rng: np.random.Generator, draft_table, parent, draw: str, num_rows: int):
    """``num_rows`` trees drawn on the host: int [R, N]."""
    table = normalize_table(draft_table)
    parent = np.asarray(parent)
    tokens = np.zeros((num_rows, len(parent)), np.int64)
    for i in range(len(parent)):
        law = _node_law(table, tokens, parent, i, draw)
        cdf = np.cumsum(law, axis=1)
        u = rng.random(num_rows) * cdf[:, -1]
        tokens[:, i] = np.minimum((cdf <= u[:, None]).sum(-1), table.shape[1] - 1)
    return tokens


TREE_CHUNK = 4096  # trees per call of a jitted law or sampler (fixed shapes: one compile
TREE_NODES = 16  # per function); trees are padded with invalid slots to a multiple of this


def dynamic_tree_valid(tokens, widths, draft_table, select=None) -> np.ndarray:
    """bool [T, N]: which nodes of full trees of branching ``widths`` (drawn without
    replacement, tokens [T, N]) a dynamic sampled tree keeps: level by level, the rule
    ``select`` (default :func:`specjax.tree.select_level`, the proposers' rule) applied
    to the kept nodes' candidates with the draft law ``draft_table`` (a node of level l
    draws ``widths[l]`` candidates; the best ``widths[l]`` of the level stay). A node
    the rule drops is an invalid slot: the verifier skips it, so the audit checks the
    law of the tree the proposer would have built."""
    select = _tree.select_level if select is None else select
    table = normalize_table(draft_table)
    v = table.shape[1]
    widths = tuple(int(x) for x in widths)
    parent, _ = _tree.full_tree_shape(widths)
    rows = tree_context_rows(tokens, parent, v)  # [T, N+1]
    t, n = tokens.shape
    valid = np.zeros((t, n), bool)
    f_ctx = np.zeros(1, np.int64)  # contexts of the previous level's nodes (0: the root)
    f_score, f_ok = np.zeros((t, 1)), np.ones((t, 1), bool)
    start = 0
    for m in widths:
        kids = start + np.arange(len(f_ctx) * m).reshape(len(f_ctx), m)  # BFS: parent-major
        lq = table[rows[:, f_ctx][:, :, None], tokens[:, kids]]  # [T, n_f, m]
        with jax.enable_x64(True):
            sel, keep, score = map(np.asarray, _select_runner(select, m)(
                f_score, f_ok, lq, np.ones(lq.shape, bool)))
        r = np.arange(t)[:, None]
        level_ok = np.zeros((t, kids.size), bool)
        level_score = np.full((t, kids.size), -np.inf)
        level_ok[r, sel] = keep
        level_score[r, sel] = np.where(keep, score, -np.inf)
        valid[:, start:start + kids.size] = level_ok
        f_ctx, f_score, f_ok = kids.reshape(-1) + 1, level_score, level_ok
        start += kids.size
    return valid


@functools.lru_cache(maxsize=None)
def _select_runner(select, m):
    return jax.jit(jax.vmap(lambda f, o, q, c: select(f, o, q, c, m)))


def _tree_inputs(tokens, parent, target, reported, target_parent, dtype, valid=None):
    """The verifier's inputs for trees [T, N] as numpy arrays ``(tree, p_root, p_node)``,
    padded with invalid nodes to a multiple of ``TREE_NODES`` (root rows repeated);
    ``valid`` bool [T, N] (default: every node)."""
    v = target.shape[1]
    parent = np.asarray(parent, np.int32)
    tp = parent if target_parent is None else np.asarray(target_parent, np.int32)
    depth = _tree.shape_depths(parent)
    if not np.array_equal(_tree.shape_depths(tp), depth):
        raise ValueError("target_parent must give every node the same depth")
    t, n = tokens.shape
    pad = -n % TREE_NODES
    p = np.asarray(target, dtype)[tree_context_rows(tokens, tp, v)]
    q = np.asarray(reported, dtype)[tree_context_rows(tokens, parent, v)]
    p = np.concatenate([p, np.repeat(p[:, :1], pad, axis=1)], axis=1)
    q = np.concatenate([q, np.repeat(q[:, :1], pad, axis=1)], axis=1)

    def tile(row, fill):
        return np.tile(np.concatenate([row, np.full(pad, fill, row.dtype)]), (t, 1))

    valid = np.ones((t, n), bool) if valid is None else np.asarray(valid, bool)
    tree = _tree.DraftTree(
        np.concatenate([tokens, np.zeros((t, pad), tokens.dtype)], axis=1).astype(np.int32),
        tile(parent, _tree.ROOT), tile(depth, 1),
        np.concatenate([valid, np.zeros((t, pad), bool)], axis=1),
        q[:, 0], q[:, 1:])
    return tree, p[:, 0], p[:, 1:]


def _chunked(fn, args, chunk: int = TREE_CHUNK):
    """``fn`` (jitted, vmapped) over the leading axis of the numpy pytree ``args`` in
    chunks of fixed size (the last one padded with copies of row 0)."""
    total = jax.tree_util.tree_leaves(args)[0].shape[0]
    outs = []
    for start in range(0, total, chunk):
        def part(a):
            a = a[start:start + chunk]
            fill = chunk - a.shape[0]
            return jnp.asarray(np.concatenate([a, np.repeat(a[:1], fill, axis=0)]) if fill
                               else a)
        outs.append(jax.tree_util.tree_map(np.asarray, fn(*jax.tree_util.tree_map(part, args))))
    return jax.tree_util.tree_map(lambda *o: np.concatenate(o)[:total], *outs)


@functools.lru_cache(maxsize=None)
def _tree_law_runner(law_fn):
    return jax.jit(jax.vmap(law_fn))


def _continuations(target_table, v: int, length: int) -> list:
    """cont[m] (V,)*length: the target's law of tokens m+1..length given the first m."""
    cond = _conditionals(target_table, v, length)
    out = []
    for m in range(length + 1):
        c = np.ones((v,) * length)
        for s in range(m + 1, length + 1):
            c = c * _expand(cond[s - 1], length)
        out.append(c)
    return out


def _dynamic(parent, draw, widths, select):
    """``parent`` of the full tree a dynamic tree of ``widths`` is kept from (checked)."""
    if draw not in TREE_DRAWS:
        raise ValueError(f"draw must be one of {TREE_DRAWS}, got {draw!r}")
    if widths is None:
        if select is not None:
            raise ValueError("select needs widths (a dynamic sampled tree)")
        if parent is None:
            raise ValueError("parent (the tree's parent array) is needed unless widths is given")
        parent = np.asarray(parent)
        if parent.ndim != 1 or parent.size == 0:
            raise ValueError(f"parent must be a non-empty 1-D array of parent indices, got shape {parent.shape}")
        _tree.shape_depths(parent)  # integers, topological order
        return parent.astype(np.int32)
    if draw != "without_replacement":
        raise ValueError(f"a dynamic tree (widths) is drawn without replacement, not {draw!r}")
    full, _ = _tree.full_tree_shape(tuple(widths))
    if parent is not None and not np.array_equal(np.asarray(parent), full):
        raise ValueError("with widths, parent must be None or the full tree of branching widths")
    return full


def exact_tree_law(law_fn: TreeLawFn, target_table, draft_table, parent,
                   draw: str = "iid", target_parent=None, draft_sample_table=None,
                   widths=None, select=None):
    """Law of the first D+1 tokens (one tree round, then the target) by exact enumeration
    of every tree of positive probability (:func:`enumerate_trees`); ``law_fn(tree,
    p_root, p_node) -> TreeLaw`` is evaluated in float64 on float64-renormalized tables.
    ``widths``: a DYNAMIC sampled tree (``parent`` None): every full tree of branching
    ``widths`` is enumerated and the nodes the rule ``select`` drops are invalid
    (:func:`dynamic_tree_valid`).
    Returns ``(law float64[V**(D+1)], expected tokens emitted by the round)``."""
    parent = _dynamic(parent, draw, widths, select)
    depth = _tree.shape_depths(parent)
    length = int(depth.max()) + 1
    _tables(target_table, draft_table, draft_sample_table, length - 1)
    target = normalize_table(target_table)
    reported = normalize_table(draft_table)
    sampled = reported if draft_sample_table is None else normalize_table(draft_sample_table)
    v = target.shape[1]
    tokens, prob = enumerate_trees(sampled, parent, draw)
    valid = None if widths is None else dynamic_tree_valid(tokens, widths, sampled, select)
    with jax.enable_x64(True):
        inputs = _tree_inputs(tokens, parent, target, reported, target_parent, np.float64, valid)
        law = _chunked(_tree_law_runner(law_fn), inputs)
        n = len(parent)
        stop = np.asarray(law.stop_probs, np.float64)[:, :n + 1]
        emit = np.exp(np.asarray(law.emit_logprobs, np.float64))[:, :n + 1]
    weight = prob[:, None] * stop  # [T, N+1]
    ctx_depth = np.concatenate([[0], depth])
    paths = [[]] + tree_paths(parent)
    acc = [np.zeros(v ** m) for m in range(length + 1)]
    for c, path in enumerate(paths):
        m = ctx_depth[c]
        pre = sequence_index(tokens[:, path], v) if path else np.zeros(len(tokens), np.int64)
        mass = np.where(weight[:, c, None] > 0, weight[:, c, None] * emit[:, c], 0.0)
        flat = (pre[:, None] * v + np.arange(v)).reshape(-1)
        acc[m + 1] += np.bincount(flat, weights=mass.reshape(-1), minlength=v ** (m + 1))
    cont = _continuations(target_table, v, length)
    out = np.zeros((v,) * length)
    for m in range(1, length + 1):
        out += _expand(acc[m].reshape((v,) * m), length) * cont[m]
    expected = float(np.sum(weight * (ctx_depth + 1)))
    return out.reshape(-1), expected


MC_CHUNK = 32768  # rows per call of a jitted tree sampler


@functools.lru_cache(maxsize=None)
def _tree_runner(verify_fn):
    """jit(vmap(verify_fn)) taking raw key data (numpy-chunkable)."""
    return jax.jit(jax.vmap(lambda k, *a: verify_fn(jax.random.wrap_key_data(k), *a)))


def tree_monte_carlo_counts(verify_fn: TreeVerifyFn, seed: int, target_table, draft_table,
                            parent, draw: str = "iid", num_rows: int = 100_000,
                            target_parent=None, draft_sample_table=None, widths=None,
                            select=None):
    """Run the tree sampler ``verify_fn(key, tree, p_root, p_node)`` on ``num_rows``
    independent rows (jit + vmap; trees and the continuation drawn on the host with numpy
    ``seed``; float32 inputs; keys ``round_key(row_keys(seed, i), 0)``; ``widths`` /
    ``select``: a dynamic tree, as in :func:`exact_tree_law`).
    Returns ``(counts int64[V**(D+1)], mean tokens emitted by the round, error count)``."""
    num_rows = _count(num_rows, "num_rows", 1)
    parent = _dynamic(parent, draw, widths, select)
    length = int(_tree.shape_depths(parent).max()) + 1
    _tables(target_table, draft_table, draft_sample_table, length - 1)
    target32, reported32, target, sampled = _mc_tables(target_table, draft_table, draft_sample_table)
    v = target.shape[1]
    rng = np.random.default_rng(seed)
    tokens = sample_trees(rng, sampled, parent, draw, num_rows)
    valid = None if widths is None else dynamic_tree_valid(tokens, widths, sampled, select)
    inputs = _tree_inputs(tokens, parent, target32, reported32, target_parent, np.float32, valid)
    round_keys = jax.random.key_data(jax.vmap(lambda r: _keys.round_key(r, 0))(
        _keys.row_keys(seed, np.arange(num_rows))))
    res = _chunked(_tree_runner(verify_fn), (np.asarray(round_keys),) + inputs,
                   MC_CHUNK)
    error = np.asarray(res.error)
    out = np.asarray(res.tokens)[~error, :length].astype(np.int64)
    accepted = np.asarray(res.num_accepted)[~error]
    for t in range(length):  # continue with the target until D+1 tokens exist
        fill = out[:, t] == _verify.PAD_ID
        if fill.any():
            out[fill, t] = _sample_rows(rng, target[prefix_index(out[fill, :t], v)])
    counts = np.bincount(sequence_index(out, v), minlength=v ** length)
    return counts.astype(np.int64), float(np.mean(accepted + 1)), int(error.sum())


def audit_tree_law(law_fn: TreeLawFn, target_table, draft_table, parent, draw: str = "iid",
                   tol: float = EXACT_TOL, **kwargs) -> LawAudit:
    """Exact check of a tree verifier: max |law - target joint law| < tol."""
    law, expected = exact_tree_law(law_fn, target_table, draft_table, parent, draw, **kwargs)
    v = np.asarray(target_table).shape[1]
    length = round(math.log(law.size, v))
    err = float(np.max(np.abs(law - target_joint_law(target_table, v, length))))
    return LawAudit(err, expected, bool(err < tol))


def audit_tree_monte_carlo(verify_fn: TreeVerifyFn, seed: int, target_table, draft_table,
                           parent, draw: str = "iid", num_rows: int = 100_000,
                           alpha: float = MC_ALPHA, **kwargs) -> MonteCarloAudit:
    """Statistical check of a tree sampler: chi-square p-value >= alpha and no errors."""
    counts, mean_tokens, errors = tree_monte_carlo_counts(
        verify_fn, seed, target_table, draft_table, parent, draw, num_rows, **kwargs)
    v = np.asarray(target_table).shape[1]
    length = round(math.log(counts.size, v))
    chi = _chi_square_or_fail(counts, target_joint_law(target_table, v, length))
    return MonteCarloAudit(chi, mean_tokens, errors, bool(chi.p_value >= alpha and errors == 0))
