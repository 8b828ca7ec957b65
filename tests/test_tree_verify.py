"""specjax.tree: draft trees and their exact verifiers (i.i.d., without replacement, point
mass, greedy); exact enumeration and Monte Carlo audits, and the mutants they reject."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import audit, keys
from specjax import tree as T
from specjax import verify as V
from specjax.sampling import SamplingConfig, sample

from tests._mutants import SELECT_MUTANTS, TREE_MUTANTS, wrong_mask_parent

LAWS = {c: functools.partial(T.tree_law, candidates=c) for c in T.CANDIDATES}
SAMPLERS = {"iid": T.iid_tree_verify, "without_replacement": T.without_replacement_tree_verify,
            "point_mass": T.point_mass_tree_verify}
RUN = {c: jax.jit(jax.vmap(f)) for c, f in SAMPLERS.items()}  # [64 rows, 6 nodes, V=5]
DRAW = {"iid": "iid", "without_replacement": "without_replacement", "point_mass": "topk"}

# A depth-first, irregular tree: 0 -> 1 -> 2, 0 -> 3, then a second root child 4 -> 5.
IRREGULAR = np.array([-1, 0, 1, 0, -1, 4], np.int32)
FILTERED = SamplingConfig(temperature=0.8, top_k=2)


def _tables(v, depth, target_cfg, draft_cfg, seed=0):
    target = audit.process_table(audit.random_logits_table(seed + 1, v, depth), target_cfg)
    if draft_cfg == "point_mass":
        return target, audit.point_mass_table(seed + 9, v, depth)
    if draft_cfg == "target":
        return target, target
    if draft_cfg == "target_on_half":  # q == p on half the contexts: zero residuals
        draft = audit.process_table(audit.random_logits_table(seed + 2, v, depth),
                                    SamplingConfig())
        half = np.random.default_rng(seed).random(len(target)) < 0.5
        return target, np.where(half[:, None], target, draft)
    return target, audit.process_table(audit.random_logits_table(seed + 2, v, depth),
                                       draft_cfg)


def _shape(shape):
    return np.asarray(shape, np.int32) if isinstance(shape, np.ndarray) else \
        T.full_tree_shape(shape)[0]


# name: (V, shape: branching per level or a parent array, target settings, draft settings)
CASES = {
    "v4_b2_d2": (4, (2, 2), SamplingConfig(), SamplingConfig()),
    "v4_b3_d2_draft_top2": (4, (3, 3), SamplingConfig(), SamplingConfig(top_k=2)),
    "v4_b2_d3_both_top2": (4, (2, 2, 2), FILTERED, SamplingConfig(top_k=2)),
    "v5_b3_1_topp_vs_t1.5": (5, (3, 1), SamplingConfig(top_p=0.8, min_p=0.05),
                             SamplingConfig(temperature=1.5)),
    "v4_irregular_d3": (4, IRREGULAR, SamplingConfig(temperature=0.7), SamplingConfig()),
    "v4_point_mass_draft": (4, (2, 2), FILTERED, "point_mass"),
    "v4_draft_equals_target_on_half": (4, (2, 2), SamplingConfig(), "target_on_half"),
    "v4_greedy_target": (4, (3, 1), SamplingConfig(temperature=0.0), SamplingConfig()),
}
# Cases a draw cannot fill: without replacement needs >= b tokens in every draft row.
WOR_CASES = ["v4_b2_d2", "v4_b2_d3_both_top2", "v5_b3_1_topp_vs_t1.5", "v4_irregular_d3",
             "v4_draft_equals_target_on_half"]


def _case(name):
    v, shape, tcfg, dcfg = CASES[name]
    parent = _shape(shape)
    target, draft = _tables(v, int(T.shape_depths(parent).max()), tcfg, dcfg)
    return target, draft, parent


# --- shapes -----------------------------------------------------------------------------

def test_shapes_chain_and_ancestor_mask():
    parent, depth = T.full_tree_shape((3, 2))
    np.testing.assert_array_equal(parent, [-1, -1, -1, 0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(depth, [1, 1, 1, 2, 2, 2, 2, 2, 2])
    p2, d2 = T.full_tree_shape(2, 3)
    assert len(p2) == 14 and d2.max() == 3
    np.testing.assert_array_equal(T.shape_depths(IRREGULAR), [1, 2, 3, 2, 1, 2])
    with pytest.raises(ValueError):
        T.shape_depths([-1, 1])  # a parent must come first
    made = T.make_tree(np.arange(6) % 3, IRREGULAR)
    np.testing.assert_array_equal(made.depth, T.shape_depths(IRREGULAR))
    assert made.valid.all() and made.q_root is None
    m = np.asarray(T.ancestor_mask(IRREGULAR))
    for i, path in enumerate(audit.tree_paths(IRREGULAR)):
        np.testing.assert_array_equal(np.nonzero(m[i])[0], path)
    assert not np.asarray(T.ancestor_mask(IRREGULAR, np.arange(6) < 4))[4:].any()
    chain = T.chain_tree(np.array([3, 1, 2]), np.zeros((3, 5)), num_draft=2)
    np.testing.assert_array_equal(chain.parent, [-1, 0, 1])
    np.testing.assert_array_equal(chain.depth, [1, 2, 3])
    np.testing.assert_array_equal(chain.valid, [True, True, False])
    assert chain.q_root.shape == (5,) and np.isneginf(chain.q_node[2]).all()


# --- exact enumeration ------------------------------------------------------------------

@pytest.mark.parametrize("candidates", T.CANDIDATES)
def test_exact_law(candidates):
    names = WOR_CASES if candidates == "without_replacement" else list(CASES)
    for name in names:
        target, draft, parent = _case(name)
        res = audit.audit_tree_law(LAWS[candidates], target, draft, parent, DRAW[candidates])
        print(f"\nexact {candidates} {name}: err={res.max_abs_error:.1e} "
              f"E={res.expected_tokens:.4f}")
        assert res.passed, (name, res)
    _, _, parent = _case("v4_b2_d2")
    target, draft, _ = _case("v4_b2_d2")
    assert audit.audit_tree_law(LAWS["iid"], target, draft, parent).expected_tokens > 2.0


def test_point_mass_is_exact_for_any_candidates():
    """Point-mass verification does not care how the candidates came about: i.i.d. draws
    (duplicate siblings included) and a point-mass draft (all siblings equal) are exact."""
    for name in ["v4_b2_d2", "v4_irregular_d3", "v4_point_mass_draft"]:
        target, draft, parent = _case(name)
        res = audit.audit_tree_law(LAWS["point_mass"], target, draft, parent, "iid")
        assert res.passed, (name, res)


def test_draw_without_replacement_needs_the_support():
    target, draft, parent = _case("v4_b3_d2_draft_top2")  # 3 siblings, 2 possible tokens
    with pytest.raises(ValueError, match="cannot fill"):
        audit.exact_tree_law(LAWS["without_replacement"], target, draft, parent,
                             "without_replacement")


# --- Monte Carlo against the samplers -------------------------------------------------------

MC_ROWS = 100_000  # the audit runs rows in chunks of 32768


@pytest.mark.parametrize("candidates,case", [("iid", "v4_b2_d2"),
                                             ("point_mass", "v4_b2_d3_both_top2"),
                                             ("without_replacement", "v4_irregular_d3")])
def test_monte_carlo(candidates, case):
    target, draft, parent = _case(case)
    mc = audit.audit_tree_monte_carlo(SAMPLERS[candidates], 1234, target, draft, parent,
                                      DRAW[candidates], MC_ROWS)
    _, expected = audit.exact_tree_law(LAWS[candidates], target, draft, parent,
                                       DRAW[candidates])
    depth = int(T.shape_depths(parent).max())
    print(f"\nMC {candidates} {case}: chi2={mc.chi2.statistic:.1f} dof={mc.chi2.dof} "
          f"p={mc.chi2.p_value:.3f} tokens/round={mc.mean_tokens:.4f} (exact {expected:.4f})")
    assert mc.passed and mc.chi2.impossible == 0, mc
    assert abs(mc.mean_tokens - expected) < 5 * np.sqrt((depth + 1) ** 2 / 4 / MC_ROWS)


# --- mutants: the same checks must fail --------------------------------------------------

MUTANT_ROWS = 30_000  # one chunk


@pytest.mark.parametrize("mutant,candidates", [(m, "iid") for m in TREE_MUTANTS]
                         + [("accept_against_unadjusted_residual", "point_mass")])
def test_tree_mutants_fail_exact_and_monte_carlo(mutant, candidates):
    sampler, law = TREE_MUTANTS[mutant](candidates)
    target, draft, parent = _case("v4_b2_d2")
    exact = audit.audit_tree_law(law, target, draft, parent, DRAW[candidates])
    mc = audit.audit_tree_monte_carlo(sampler, 99, target, draft, parent, DRAW[candidates],
                                      MUTANT_ROWS)
    print(f"\nmutant {mutant} ({candidates}): exact err={exact.max_abs_error:.2e} | MC "
          f"chi2={mc.chi2.statistic:.1f} dof={mc.chi2.dof} p={mc.chi2.p_value:.2e}")
    assert not exact.passed and exact.max_abs_error > 1e-3
    assert not mc.passed and mc.chi2.p_value < 1e-6


def test_ancestor_mask_of_random_trees():
    """The mask's rows are each node's path (itself and its ancestors) for random
    topological trees, with the depth bound and without; a bound one level too small
    misses the deepest nodes' roots."""
    rng = np.random.default_rng(5)
    for n in (1, 2, 7, 30, 44):
        parent = np.array([rng.integers(-1, i) for i in range(n)], np.int32)  # topological
        depth = T.shape_depths(parent)
        valid = rng.random(n) < 0.8
        want = np.zeros((n, n), bool)
        for i in range(n):
            j = i
            while j >= 0:
                want[i, j] = True
                j = parent[j]
        for bound in (None, int(depth.max()), n):
            np.testing.assert_array_equal(np.asarray(T.ancestor_mask(parent, max_depth=bound)), want)
            np.testing.assert_array_equal(np.asarray(T.ancestor_mask(parent, valid, bound)), want & valid[:, None])
        if depth.max() > 1:
            short = np.asarray(T.ancestor_mask(parent, max_depth=int(depth.max()) - 1))
            assert not np.array_equal(short, want)


def test_wrong_tree_mask_fails_exact_and_monte_carlo():
    """The target scores each depth-2 node after its parent's sibling (a wrong mask)."""
    target, draft, parent = _case("v4_b2_d2")
    wrong = wrong_mask_parent(parent)
    np.testing.assert_array_equal(wrong, [-1, -1, 1, 1, 0, 0])
    exact = audit.audit_tree_law(LAWS["iid"], target, draft, parent, target_parent=wrong)
    mc = audit.audit_tree_monte_carlo(T.iid_tree_verify, 99, target, draft, parent,
                                      num_rows=MUTANT_ROWS, target_parent=wrong)
    print(f"\nwrong mask: exact err={exact.max_abs_error:.2e} | MC p={mc.chi2.p_value:.2e}")
    assert not exact.passed and exact.max_abs_error > 1e-3
    assert not mc.passed and mc.chi2.p_value < 1e-6


def test_without_replacement_draws_verified_as_iid_fail():
    """Siblings drawn without replacement but verified with the i.i.d. rule (q instead of
    the adjusted q_k): not exact."""
    target, draft, parent = _case("v4_b2_d2")
    exact = audit.audit_tree_law(LAWS["iid"], target, draft, parent, "without_replacement")
    assert not exact.passed and exact.max_abs_error > 1e-3, exact


# --- positional (Sequoia-style) trees: a fixed irregular shape -------------------------------

def test_positional_tree_shape():
    parent, depth = T.positional_tree_shape(15)
    np.testing.assert_array_equal(np.bincount(depth)[1:], [5, 5, 4, 1])
    assert np.all(np.diff(depth) >= 0) and np.all(parent < np.arange(15))
    # the best 4 nodes when a first child is accepted w.p. 0.6 and a second 0.3: 0.6 (root's
    # first), 0.36 (its first), 0.3 (root's second), 0.216 (a chain of three first children)
    p4, d4 = T.positional_tree_shape(4, accept=(0.6, 0.3))
    np.testing.assert_array_equal(p4, [-1, -1, 0, 2])
    np.testing.assert_array_equal(d4, [1, 1, 2, 3])
    assert np.bincount(T.positional_tree_shape(44)[1]).max() == 16
    # a per-depth table: deeper children accepted w.p. 0.2 only, so the 4th node is the
    # root's second child's child (0.3 * 0.2 = 0.06), not a third level (0.6 * 0.2 * 0.2)
    pt, dt = T.positional_tree_shape(4, accept=((0.6, 0.3), (0.2,)))
    np.testing.assert_array_equal(pt, [-1, -1, 0, 1])
    np.testing.assert_array_equal(dt, [1, 1, 2, 2])
    np.testing.assert_array_equal(T.positional_tree_shape(15, accept=(T.DEFAULT_SIBLING_ACCEPT,))[0],
                                  T.positional_tree_shape(15)[0])
    assert T.positional_tree_shape(8, max_depth=1)[1].max() == 1
    for bad in [dict(nodes=0), dict(nodes=3, accept=(0.5, 1.5)), dict(nodes=3, accept=()),
                dict(nodes=9, max_depth=1), dict(nodes=3, accept=((0.5, 0.6),)),
                dict(nodes=3, accept=((0.5,), ()))]:
        with pytest.raises(ValueError, match="positional_tree_shape"):
            T.positional_tree_shape(**bad)


@pytest.mark.parametrize("candidates", ["iid", "without_replacement"])
def test_positional_tree_exact_law(candidates):
    """An irregular shape (3 root children with 2, 1, 0 children, one grandchild) is exact
    for sampled candidates like a full tree."""
    parent, _ = T.positional_tree_shape(7, accept=(0.6, 0.3, 0.2), max_depth=3)
    assert len(set(parent.tolist())) > 2 and not np.array_equal(parent, T.full_tree_shape((3, 1))[0])
    target, draft = _tables(4, 3, SamplingConfig(temperature=0.8), SamplingConfig())
    res = audit.audit_tree_law(LAWS[candidates], target, draft, parent, DRAW[candidates])
    assert res.passed, res


# --- dynamic sampled trees: shaped as they grow (a stopping rule) -----------------------------

DYNAMIC = {  # name: (V, widths, target settings, draft settings)
    "v4_w2x2": (4, (2, 2), SamplingConfig(), SamplingConfig()),
    "v4_w2x1x1": (4, (2, 1, 1), SamplingConfig(temperature=0.7), SamplingConfig(top_k=3)),
}


def _dynamic_case(name):
    v, widths, tcfg, dcfg = DYNAMIC[name]
    target, draft = _tables(v, len(widths), tcfg, dcfg)
    return target, draft, widths


def test_select_level_keeps_a_prefix_decided_before_each_candidate():
    """The kept children of a node are its first j draws, and whether the j-th is kept does
    not change when its own q or a later sibling's changes (it does for the mutants)."""
    rng = np.random.default_rng(0)
    n, b, m = 3, 4, 5

    def kept(select, f, lq):
        sel, keep, _ = select(jnp.asarray(f), jnp.ones(n, bool), jnp.asarray(lq), jnp.ones((n, b), bool), m)
        out = np.zeros(n * b, bool)
        out[np.asarray(sel)[np.asarray(keep)]] = True
        return out.reshape(n, b)

    def lq_rows():
        q = rng.dirichlet(np.ones(8), size=n)[:, :b]
        return np.log(q)

    moved = {name: 0 for name in ["rule"] + list(SELECT_MUTANTS)}
    for _ in range(200):
        f = np.log(rng.random(n))
        lq = lq_rows()
        for name, select in [("rule", T.select_level)] + list(SELECT_MUTANTS.items()):
            k = kept(select, f, lq)
            if name == "rule":
                assert k.sum() == m and all(np.all(np.diff(row.astype(int)) <= 0) for row in k)
            i, j = rng.integers(n), rng.integers(b)
            other = lq.copy()
            other[i, j:] = np.log(rng.dirichlet(np.ones(8))[:b - j] * np.exp(lq[i, j:]).sum())
            moved[name] += kept(select, f, other)[i, j] != k[i, j]
    assert moved["rule"] == 0
    assert all(moved[name] > 0 for name in SELECT_MUTANTS), moved


@pytest.mark.parametrize("case", list(DYNAMIC))
def test_dynamic_tree_exact_law(case):
    target, draft, widths = _dynamic_case(case)
    res = audit.audit_tree_law(LAWS["without_replacement"], target, draft, None,
                               "without_replacement", widths=widths)
    full = audit.audit_tree_law(LAWS["without_replacement"], target, draft,
                                T.full_tree_shape(widths)[0], "without_replacement")
    print(f"\nexact dynamic {case}: err={res.max_abs_error:.1e} E={res.expected_tokens:.4f} "
          f"(full tree {full.expected_tokens:.4f})")
    assert res.passed, res
    # the rule dropped nodes (a smaller tree than the full one it was drawn from)
    assert 1.0 < res.expected_tokens < full.expected_tokens - 0.05


@pytest.mark.parametrize("mutant", list(SELECT_MUTANTS))
def test_dynamic_tree_mutants_fail(mutant):
    """A rule that looks at the candidate it decides on is not exact: the audit rejects it
    exactly (both cases) and by Monte Carlo (the first)."""
    for case in DYNAMIC:
        target, draft, widths = _dynamic_case(case)
        exact = audit.audit_tree_law(LAWS["without_replacement"], target, draft, None,
                                     "without_replacement", widths=widths, select=SELECT_MUTANTS[mutant])
        print(f"\nmutant {mutant} {case}: exact err={exact.max_abs_error:.2e}")
        assert not exact.passed and exact.max_abs_error > 1e-3
    target, draft, widths = _dynamic_case("v4_w2x2")
    mc = audit.audit_tree_monte_carlo(T.without_replacement_tree_verify, 99, target, draft, None,
                                      "without_replacement", MUTANT_ROWS, widths=widths,
                                      select=SELECT_MUTANTS[mutant])
    print(f"MC p={mc.chi2.p_value:.2e}")
    assert not mc.passed and mc.chi2.p_value < 1e-6


def test_dynamic_tree_monte_carlo():
    target, draft, widths = _dynamic_case("v4_w2x2")
    mc = audit.audit_tree_monte_carlo(T.without_replacement_tree_verify, 1234, target, draft, None,
                                      "without_replacement", MC_ROWS, widths=widths)
    _, expected = audit.exact_tree_law(LAWS["without_replacement"], target, draft, None,
                                       "without_replacement", widths=widths)
    print(f"\nMC dynamic: chi2={mc.chi2.statistic:.1f} p={mc.chi2.p_value:.3f} "
          f"tokens/round={mc.mean_tokens:.4f} (exact {expected:.4f})")
    assert mc.passed and mc.chi2.impossible == 0, mc
    assert abs(mc.mean_tokens - expected) < 5 * np.sqrt(9 / 4 / MC_ROWS)


# --- a chain written as a tree is today's token verification --------------------------------

K, VOCAB, ROWS = 6, 5, 64  # a chain of 6 nodes: the shape RUN is compiled for


def _log_normalize(x):
    return np.array(x - jax.nn.logsumexp(x, axis=-1, keepdims=True), np.float32)


def _chain_problem(seed, rows=ROWS, point_mass=False):
    rng = np.random.default_rng(seed)
    dlp = _log_normalize(rng.normal(size=(rows, K, VOCAB)) * 1.5)
    tlp = _log_normalize(rng.normal(size=(rows, K + 1, VOCAB)) * 1.5)
    tlp[:, :, -1] = -np.inf  # a token the target never emits
    tlp = _log_normalize(tlp)
    cdf = np.cumsum(np.exp(dlp), -1)
    tokens = np.minimum((cdf < rng.random((rows, K, 1))).sum(-1), VOCAB - 1).astype(np.int32)
    if point_mass:
        dlp = np.where(np.arange(VOCAB) == tokens[..., None], 0.0, -np.inf).astype(np.float32)
    return tokens, dlp, tlp


def test_chain_as_tree_is_token_verification():
    """A chain as a tree: the same tokens as token_verify under every key, for every
    num_draft (i.i.d. rule; the point-mass rule against token_verify with point-mass q),
    and the same law (float64)."""
    chain_run = jax.jit(jax.vmap(V.token_verify, in_axes=(0, 0, 0, 0, None)))
    rk = keys.row_keys(3, np.arange(ROWS))

    def laws(t, d, p):
        return (V.token_law(t, d, p), T.tree_law(T.chain_tree(t, d), p[0], p[1:], "iid"),
                T.tree_law(T.chain_tree(t, None), p[0], p[1:], "point_mass"))

    for candidates in ["iid", "point_mass"]:
        point_mass = candidates == "point_mass"
        tokens, dlp, tlp = _chain_problem(7, point_mass=point_mass)

        for n in range(K + 1):
            g_d, g_t = dlp.copy(), tlp.copy()
            g_d[:, n:] = np.nan  # garbage both must ignore
            g_t[:, n + 1:] = np.nan
            a = chain_run(rk, tokens, g_d, g_t, jnp.int32(n))
            tree = T.DraftTree(*jax.vmap(lambda t, d: T.chain_tree(t, d, n))(tokens, g_d))
            b = RUN[candidates](rk, tree, g_t[:, 0], g_t[:, 1:])
            assert not np.asarray(b.error).any()
            np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
            np.testing.assert_array_equal(np.asarray(a.num_accepted),
                                          np.asarray(b.num_accepted))
            t = np.asarray(b.num_accepted)[:, None]
            np.testing.assert_array_equal(np.asarray(b.path),
                                          np.where(np.arange(K) < t, np.arange(K), -1))
        assert 0 < float(np.mean(np.asarray(b.num_accepted))) < K  # both outcomes happen
        with jax.enable_x64(True):
            chain, iid, pm = jax.jit(jax.vmap(laws))(
                tokens[:16], dlp[:16].astype(np.float64), tlp[:16].astype(np.float64))
        law = pm if point_mass else iid
        np.testing.assert_allclose(law.stop_probs, chain.stop_probs, rtol=0, atol=1e-15)
        np.testing.assert_allclose(np.exp(law.emit_logprobs), np.exp(chain.emit_logprobs),
                                   rtol=0, atol=1e-15)


# --- greedy ---------------------------------------------------------------------------------

def test_greedy_tree_verify_follows_the_greedy_target():
    """The longest path equal to the target's greedy chain (first matching sibling), then
    the greedy target's next token; a chain as a tree is greedy_verify."""
    v, parent = 3, IRREGULAR
    table = np.round(audit.random_logits_table(4, v, 3, ties=True))  # with exact ties
    rows = jax.jit(jax.vmap(T.greedy_tree_verify))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, v, size=(300, len(parent)))
    ctx = audit.tree_context_rows(tokens, parent, v)
    logits = table[ctx]
    n = len(parent)
    tree = T.DraftTree(jnp.asarray(tokens, jnp.int32), jnp.tile(parent, (300, 1)),
                       jnp.tile(T.shape_depths(parent), (300, 1)), jnp.ones((300, n), bool))
    res = jax.tree_util.tree_map(np.asarray, rows(tree, logits[:, 0], logits[:, 1:]))
    assert not res.error.any()
    for r in range(300):
        chain, cur, path = [], -1, []
        while True:
            top = int(np.argmax(table[audit.prefix_index(np.array(chain, int), v)]))
            kids = [i for i in range(n) if parent[i] == cur and tokens[r, i] == top]
            if not kids:
                chain.append(top)
                break
            cur = kids[0]
            path.append(cur)
            chain.append(top)
        t = len(path)
        assert res.num_accepted[r] == t
        np.testing.assert_array_equal(res.path[r][:t], path)
        np.testing.assert_array_equal(res.tokens[r][:t + 1], chain)
        assert (res.tokens[r][t + 1:] == V.PAD_ID).all() and (res.path[r][t:] == -1).all()
    assert res.num_accepted.max() == 3 and res.num_accepted.min() == 0
    c_tok, _, c_logits = _chain_problem(2, rows=64)
    c_tok[:, :2] = np.argmax(c_logits[:, :2], -1)  # so that some get accepted
    chain = jax.jit(jax.vmap(V.greedy_verify, in_axes=(0, 0, None)))
    as_tree = jax.jit(jax.vmap(lambda t, lg, m: T.greedy_tree_verify(
        T.chain_tree(t, None, m), lg[0], lg[1:]), in_axes=(0, 0, None)))
    for m in range(K + 1):
        a, b = chain(c_tok, c_logits, m), as_tree(c_tok, c_logits, m)
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


# --- batches, keys, invalid input -------------------------------------------------------------

def _random_trees(seed, rows, v=VOCAB, shape=(2, 2)):
    """Random i.i.d. trees over a full shape with some slots invalid (a subtree cut)."""
    rng = np.random.default_rng(seed)
    parent, depth = T.full_tree_shape(shape)
    n = len(parent)
    q = _log_normalize(rng.normal(size=(rows, n + 1, v)) * 1.5)
    p = _log_normalize(rng.normal(size=(rows, n + 1, v)) * 1.5)
    ctx = parent + 1
    cdf = np.cumsum(np.exp(q[:, ctx]), -1)
    tokens = np.minimum((cdf < rng.random((rows, n, 1))).sum(-1), v - 1).astype(np.int32)
    valid = np.ones((rows, n), bool)
    cut = rng.random(rows) < 0.3  # drop node 1 and its subtree
    valid[cut] &= (parent != 1) & (np.arange(n) != 1)
    tree = T.DraftTree(tokens, np.tile(parent, (rows, 1)), np.tile(depth, (rows, 1)), valid,
                       q[:, 0], q[:, 1:])
    return tree, p


def test_point_mass_target_fast_path_equals_every_sampler():
    """When every row of p is a point mass (greedy rows), the engine's fast path
    (point_mass_target_verify: a greedy descent, no residual pass) gives what each
    sampler gives, for any key; and it accepts something."""
    rows = 256
    tree, p = _random_trees(3, rows)
    v = p.shape[-1]
    rng = np.random.default_rng(5)
    top = rng.integers(0, v, size=p.shape[:2])
    # half the tree tokens are p's token at their context, so that paths get accepted
    ctx = np.asarray(tree.parent) + 1
    tok = np.asarray(tree.tokens).copy()
    hit = rng.random(tok.shape) < 0.5
    tok[hit] = np.take_along_axis(top, ctx, axis=1)[hit]
    tree = tree._replace(tokens=jnp.asarray(tok))
    # q must allow the token for the i.i.d. rule's validation: q > 0 everywhere here
    point = np.where(np.arange(v) == top[..., None], 0.0, -np.inf).astype(np.float32)
    fast = jax.jit(jax.vmap(lambda t, lp: T.point_mass_target_verify(t, lp[0], lp[1:])))(tree, point)
    assert not np.asarray(fast.error).any() and int(np.asarray(fast.num_accepted).max()) >= 2
    for cand in ("iid", "point_mass"):
        for seed in (0, 1):
            ks = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(rows))
            slow = RUN[cand](ks, tree, point[:, 0], point[:, 1:])
            for a, b in zip(fast, slow):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("candidates", ["iid", "point_mass"])
def test_vmap_equals_per_row_and_uses_the_documented_keys(candidates):
    tree, p = _random_trees(1, 64)
    rk = keys.row_keys(5, np.arange(64))
    run = RUN[candidates]
    batch = jax.tree_util.tree_map(np.asarray, run(rk, tree, p[:, 0], p[:, 1:]))
    # the same rows in another order and in another batch: the same results per row
    perm = np.random.default_rng(0).permutation(64)
    other = run(rk[perm], jax.tree_util.tree_map(lambda a: a[perm], tree), p[perm, 0],
                p[perm, 1:])
    np.testing.assert_array_equal(np.asarray(other.tokens), batch.tokens[perm])
    one = jax.jit(SAMPLERS[candidates])
    step = jax.jit(T.tree_step(candidates))
    for i in range(4):
        row = jax.tree_util.tree_map(lambda a: a[i], tree)
        res = one(rk[i], row, p[i, 0], p[i, 1:])
        np.testing.assert_array_equal(np.asarray(res.tokens), batch.tokens[i])
        np.testing.assert_array_equal(np.asarray(res.path), batch.path[i])
        # replay the descent with the documented keys: ACCEPT at node i, then RESIDUAL /
        # BONUS at position = number accepted
        P = np.asarray(T.contexts(p[i, 0], p[i, 1:]))
        Q = np.asarray(T.contexts(row.q_root, row.q_node))
        ak = keys.role_key(rk[i], keys.ACCEPT)
        cur, r, lz, qa, path = 0, P[0], np.float32(0), Q[0], []
        for j in range(len(row.tokens)):
            if not (row.valid[j] and row.parent[j] + 1 == cur):
                continue
            log_a, r2, lz2, qa2 = step(r, lz, qa, row.tokens[j], P[cur])
            if np.log(keys.uniform_open(keys.position_key(ak, j))) < log_a:
                cur, r, lz, qa = j + 1, P[j + 1], np.float32(0), Q[j + 1]
                path.append(j)
            else:
                r, lz, qa = r2, lz2, qa2
        leaf = not np.any(row.valid & (row.parent + 1 == cur))
        role = keys.BONUS if leaf else keys.RESIDUAL
        y = int(sample(keys.position_key(keys.role_key(rk[i], role), len(path)), r))
        np.testing.assert_array_equal(batch.path[i][:len(path)], path)
        assert batch.tokens[i][len(path)] == y
    assert len({int(a) for a in batch.num_accepted}) > 1


def _invalid_trees():
    """Row i < len(names) holds invalid case names[i]; the other rows are valid."""
    tree, p = _random_trees(3, 64)
    tree = tree._replace(valid=np.ones_like(tree.valid))
    t = {f: np.array(getattr(tree, f)) for f in tree._fields}
    t["tokens"][:, 1::2] = (t["tokens"][:, 0::2] + 1) % VOCAB  # siblings distinct
    names = []

    def case(name):
        names.append(name)
        return len(names) - 1

    t["parent"][case("parent_after_child"), 2] = 3
    i = case("parent_invalid")
    t["valid"][i, 0] = False
    t["depth"][case("wrong_depth"), 3] = 3
    t["tokens"][case("token_out_of_vocab"), 1] = VOCAB
    i = case("q_zero_at_candidate")
    t["q_node"][i, 0, t["tokens"][i, 2]] = -np.inf
    p[case("nan_in_used_p_row"), 3, 0] = np.nan
    p[case("raw_logits_in_p"), 0] += 3.0
    t["q_root"][case("nan_in_used_q_row"), 1] = np.nan
    i = case("duplicate_siblings")  # invalid for without_replacement only
    t["tokens"][i, 3] = t["tokens"][i, 2]
    i = case("garbage_in_invalid_nodes_is_fine")
    t["valid"][i, 4:] = False
    t["tokens"][i, 4:] = -3
    p[i, 5:] = np.nan
    t["q_node"][i, 4:] = np.nan
    t["parent"][i, 5] = 9
    return T.DraftTree(**t), p, names


@pytest.mark.parametrize("candidates", T.CANDIDATES)
def test_invalid_input_sets_error(candidates):
    tree, p, names = _invalid_trees()
    res = RUN[candidates](keys.row_keys(0, np.arange(64)), tree, p[:, 0], p[:, 1:])
    res = jax.tree_util.tree_map(np.asarray, res)
    q_cases = {"q_zero_at_candidate", "nan_in_used_q_row"}
    for i, case in enumerate(names):
        bad = case != "garbage_in_invalid_nodes_is_fine" and not (
            candidates == "point_mass" and case in q_cases)  # point masses ignore q
        if case == "duplicate_siblings":
            bad = candidates == "without_replacement"
        assert res.error[i] == bad, (case, candidates)
        if bad:
            assert res.num_accepted[i] == 0 and (res.tokens[i] == V.PAD_ID).all()
            assert (res.path[i] == -1).all()
    assert not res.error[len(names):].any()
    too_deep = jax.jit(functools.partial(SAMPLERS[candidates], max_depth=1))(
        keys.row_keys(0, [0])[0], jax.tree_util.tree_map(lambda a: a[-1], tree), p[-1, 0],
        p[-1, 1:])
    assert bool(too_deep.error) and too_deep.tokens.shape == (2,)


@pytest.mark.parametrize("candidates", T.CANDIDATES)
def test_sync_free_descent_makes_the_same_draws(monkeypatch, candidates):
    """The descent as a loop over every node (``sampling.sync_free``, the GPU form: a
    ``while`` over the nodes tried syncs the host per node there) gives the same outputs bit
    for bit as the ``while`` over the nodes tried, on random trees with cut subtrees, and
    leaves no ``while`` in the program."""
    rows = 256
    tree, p = _random_trees(11, rows, shape=(3, 2))
    tries = T.max_tries(T.full_tree_shape((3, 2))[0])
    assert tries == 5  # 3 root children, then 2 grandchildren, of 9 nodes
    ks = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(4), i))(jnp.arange(rows))
    args = (ks, tree, p[:, 0], p[:, 1:])
    outs, jaxprs = {}, {}
    for free, bound in (("0", None), ("1", None), ("1", tries), ("1", tries - 2)):
        monkeypatch.setenv("SPECJAX_SYNC_FREE", free)
        fn = jax.vmap(functools.partial(T.tree_verify, candidates=candidates, max_tries=bound))  # traced afresh
        jaxprs[free, bound] = str(jax.make_jaxpr(fn)(*args))
        outs[free, bound] = jax.jit(fn)(*args)
    assert " while[" in jaxprs["0", None] and " while[" not in jaxprs["1", None]
    base = outs["0", None]
    assert int(np.asarray(base.num_accepted).max()) >= 2
    for form in (("1", None), ("1", tries)):  # every node, and the shape's bound
        for a, b in zip(base, outs[form]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a bound the shape does not guarantee: the rows that needed the last step are errors,
    # never a shortened descent; every other row is as before
    # (without replacement, the rows whose random siblings repeat a token are errors already)
    short = outs["1", tries - 2]
    err, base_err = np.asarray(short.error), np.asarray(base.error)
    assert (err >= base_err).all() and (err & ~base_err).any() and not err.all()
    np.testing.assert_array_equal(np.asarray(short.tokens)[~err], np.asarray(base.tokens)[~err])


def test_max_tries_of_the_shipped_shapes():
    """The bound the EAGLE proposer gives its sampled trees: the full 2x1x1 tree tries at most
    4 of its 6 nodes, the 44-node positional tree 22; a chain of n nodes n; none for trees
    grown by widths (their shape depends on the draws)."""
    from specjax import build
    from specjax.models.eagle import EagleConfig, EagleModel
    from specjax.models.llama import LlamaLM, tiny_config

    assert T.max_tries(T.full_tree_shape((2, 1, 1))[0]) == 4
    assert T.max_tries(np.arange(5) - 1) == 5  # a chain
    assert T.max_tries(T.positional_tree_shape(44, T.DEFAULT_SIBLING_ACCEPT)[0]) == 22
    target = LlamaLM.init(tiny_config(vocab_size=16, n_layers=1), seed=1)
    head = EagleModel.for_target(target, EagleConfig.for_target(target.config, n_heads=2, n_kv_heads=1,
                                                                head_dim=8, ffn_dim=16), seed=2)
    tries = {spec: build.TreeSpec.parse(spec).proposer(head, 16).max_tries
             for spec in ("", "sampled_nodes=44", "widths=3x4x4x3", "candidates=point_mass")}
    assert tries == {"": 4, "sampled_nodes=44": 22, "widths=3x4x4x3": None, "candidates=point_mass": None}
