"""Test-only WRONG verifiers: each must fail the same exactness checks the real ones pass.

Every mutant has a sampler with the signature of :func:`specjax.verify.token_verify`
and, where its law has a closed form, a law function with the signature of
:func:`specjax.verify.token_law`.  They are built from the real helpers, changing one
thing each.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import verify as V

TOPK_MUTANT_K = 2


def _neg_inf_like(x):
    return jnp.full_like(x, -jnp.inf)


# 1. Resampling from p instead of the residual ----------------------------------------
# (the residual of p against q = 0 is p itself)

def resample_from_p_verify(key, tokens, dlp, tlp, num_draft=None):
    tokens, dlp, tlp, n, error = V.prepare_inputs(tokens, dlp, tlp, num_draft)
    tau, _ = V.token_tau(key, V.token_log_accept(tokens, dlp, tlp), n)
    return V.finish(key, tokens, _neg_inf_like(dlp), tlp, tau, n, jnp.float32(0), error)


def resample_from_p_law(tokens, dlp, tlp, num_draft=None):
    law = V.token_law(tokens, dlp, tlp, num_draft)
    n = V.resolve_num_draft(num_draft, tokens.shape[0])
    zeros = jnp.zeros((tokens.shape[0] + 1,), tlp.dtype)
    return V.RoundLaw(law.stop_probs, V.emission_table(_neg_inf_like(dlp), tlp, zeros, n))


# 2. Reusing the acceptance uniform for the residual draw (inverse CDF at u_tau) --------

def _inverse_cdf(probs, u):
    cdf = jnp.cumsum(probs)
    return jnp.minimum(jnp.sum(cdf < u), probs.shape[0] - 1).astype(jnp.int32)


def reused_uniform_verify(key, tokens, dlp, tlp, num_draft=None):
    tokens, dlp, tlp, n, error = V.prepare_inputs(tokens, dlp, tlp, num_draft)
    k = tokens.shape[0]
    tau, u = V.token_tau(key, V.token_log_accept(tokens, dlp, tlp), n)
    is_bonus = tau == n
    res = V.emission_log_weights(tlp[tau], dlp[jnp.minimum(tau, k - 1)], 0.0, False)
    reused = _inverse_cdf(jnp.exp(res - jax.nn.logsumexp(res)), u[jnp.minimum(tau, k - 1)])
    bonus = V.final_draw(key, tlp[tau], tau, n)
    return V.assemble(tokens, tau, jnp.where(is_bonus, bonus, reused), error)


def reused_uniform_law(tokens, dlp, tlp, num_draft=None):
    law = V.token_law(tokens, dlp, tlp, num_draft)
    k = tokens.shape[0]
    n = V.resolve_num_draft(num_draft, k)
    a = jnp.where(jnp.arange(k) < n, jnp.exp(V.token_log_accept(tokens, dlp, tlp)), 0.0)
    a = jnp.concatenate([a, jnp.zeros((1,), a.dtype)])
    probs = jnp.exp(law.emit_logprobs)  # residual after t accepted (bonus row at t = n)
    hi = jnp.cumsum(probs, axis=-1)
    lo = hi - probs
    # Given a rejection at t, u ~ U(a_t, 1): P(y) = |(lo_y, hi_y] & (a_t, 1)| / (1 - a_t).
    width = jnp.maximum(hi, a[:, None]) - jnp.maximum(lo, a[:, None])
    cond = width / jnp.where(a < 1, 1.0 - a, 1.0)[:, None]
    t = jnp.arange(k + 1)
    emit = jnp.where((t == n)[:, None], probs, cond)
    return V.RoundLaw(law.stop_probs, jnp.log(emit))


# 3. Accepting any draft token within the target's top-k -------------------------------

def _topk_log_accept(tokens, dlp, tlp):
    k = tokens.shape[0]
    kth = jax.lax.top_k(tlp[:k], TOPK_MUTANT_K)[0][:, -1]
    in_topk = V.gather_at(tlp[:k], tokens) >= kth
    return jnp.where(in_topk, 0.0, V.token_log_accept(tokens, dlp, tlp))


def topk_accept_verify(key, tokens, dlp, tlp, num_draft=None):
    tokens, dlp, tlp, n, error = V.prepare_inputs(tokens, dlp, tlp, num_draft)
    tau, _ = V.token_tau(key, _topk_log_accept(tokens, dlp, tlp), n)
    return V.finish(key, tokens, dlp, tlp, tau, n, jnp.float32(0), error)


def topk_accept_law(tokens, dlp, tlp, num_draft=None):
    n = V.resolve_num_draft(num_draft, tokens.shape[0])
    stop = V.token_stop_probs(_topk_log_accept(tokens, dlp, tlp), n)
    return V.RoundLaw(stop, V.token_law(tokens, dlp, tlp, num_draft).emit_logprobs)


# 4. (draft processed differently: see test_audit -- a table mismatch, not a verifier) --

# 5. Residual taken at the wrong position (one to the right) --------------------------

def _shift(x):
    return jnp.concatenate([x[1:], x[-1:]])


def residual_off_by_one_verify(key, tokens, dlp, tlp, num_draft=None):
    tokens, dlp, tlp, n, error = V.prepare_inputs(tokens, dlp, tlp, num_draft)
    k = tokens.shape[0]
    tau, _ = V.token_tau(key, V.token_log_accept(tokens, dlp, tlp), n)
    shifted = V.emission_log_weights(_shift(tlp)[tau], _shift(dlp)[jnp.minimum(tau, k - 1)],
                                     0.0, False)
    weights = jnp.where(tau == n, tlp[tau], shifted)
    return V.assemble(tokens, tau, V.final_draw(key, weights, tau, n), error)


def residual_off_by_one_law(tokens, dlp, tlp, num_draft=None):
    law = V.token_law(tokens, dlp, tlp, num_draft)
    k = tokens.shape[0]
    n = V.resolve_num_draft(num_draft, k)
    zeros = jnp.zeros((k + 1,), tlp.dtype)
    shifted = V.emission_table(_shift(dlp), _shift(tlp), zeros, k + 1)  # never "bonus"
    t = jnp.arange(k + 1)
    emit = jnp.where((t == n)[:, None], law.emit_logprobs, shifted)
    return V.RoundLaw(law.stop_probs, emit)


# 6. Block verification whose residual forgets the weight w_tau ------------------------

def block_unweighted_residual_verify(key, tokens, dlp, tlp, num_draft=None):
    tokens, dlp, tlp, n, error = V.prepare_inputs(tokens, dlp, tlp, num_draft)
    log_w = V.block_log_weights(tokens, dlp, tlp)
    tau = V.block_tau(key, V.block_log_stop(log_w, dlp, tlp, n))
    return V.finish(key, tokens, dlp, tlp, tau, n, jnp.float32(0), error)  # w_tau -> 1


def block_unweighted_residual_law(tokens, dlp, tlp, num_draft=None):
    law = V.block_law(tokens, dlp, tlp, num_draft)
    n = V.resolve_num_draft(num_draft, tokens.shape[0])
    zeros = jnp.zeros((tokens.shape[0] + 1,), tlp.dtype)
    return V.RoundLaw(law.stop_probs, V.emission_table(dlp, tlp, zeros, n))


MUTANTS = {
    "resample_from_p": (resample_from_p_verify, resample_from_p_law),
    "reused_acceptance_uniform": (reused_uniform_verify, reused_uniform_law),
    "accept_within_target_topk": (topk_accept_verify, topk_accept_law),
    "residual_off_by_one": (residual_off_by_one_verify, residual_off_by_one_law),
    "block_unweighted_residual": (block_unweighted_residual_verify,
                                  block_unweighted_residual_law),
}


# --------------------------------------------------------------------------------------
# Tree verifiers (specjax.tree): (sampler(key, tree, p_root, p_node), law(tree, p_root,
# p_node)) pairs built from the real parts, one change each.  The wrong tree mask is an
# input mutation instead (the target scores nodes after the wrong ancestors): see
# wrong_mask_parent and the audit's target_parent.
# --------------------------------------------------------------------------------------

from specjax import tree as TR  # noqa: E402


def _accept_against_p_step(candidates):
    """Each sibling accepted against the context's p, not the residual left by the
    rejected siblings (the residual is still updated for the final draw)."""
    real = TR.tree_step(candidates)

    def step(r, lz, qa, x, p):
        _, r2, lz2, qa2 = real(r, lz, qa, x, p)
        log_a = real(p, jnp.zeros((), p.dtype), qa, x, p)[0]
        return log_a, r2, lz2, qa2

    return step


def _no_sibling_update_step(candidates):
    """No residual update between siblings: each sibling meets a fresh r = p, and the
    final draw uses the residual of p against the last sibling's proposal only."""
    real = TR.tree_step(candidates)

    def step(r, lz, qa, x, p):
        return real(p, jnp.zeros((), p.dtype), qa, x, p)

    return step


def tree_mutant(candidates, step_factory=None, final_from_p=False):
    """(sampler, law) of the tree verifier with ``step_factory``'s step and/or the
    correction drawn from p instead of the final residual."""
    make_step = step_factory or TR.tree_step

    def sampler(key, tree, p_root, p_node):
        tree, P, Q, md = TR.tree_prepare(tree, p_root, p_node, candidates)
        error = TR.tree_validate(tree, P, Q, candidates, md)
        cur, num, path, r, _, _ = TR.descend(key, tree, P, Q, make_step(candidates), md)
        return TR.tree_finish(key, tree, cur, num, path, P[cur] if final_from_p else r,
                              error, md)

    def law(tree, p_root, p_node):
        tree, P, Q, _ = TR.tree_prepare(tree, p_root, p_node, candidates,
                                        dtype=jnp.asarray(p_root).dtype)
        out = TR.law_scan(tree, P, Q, make_step(candidates))
        if final_from_p:
            out = out._replace(emit_logprobs=P - jax.nn.logsumexp(P, axis=-1, keepdims=True))
        return out

    return sampler, law


def wrong_mask_parent(parent):
    """A wrong tree mask: every node below depth 1 is scored after its parent's next
    sibling (cyclically) instead of its parent; same depths, still topological in
    breadth-first order."""
    import numpy as np

    parent = np.asarray(parent)
    out = parent.copy()
    for i, par in enumerate(parent):
        if par >= 0:
            group = [j for j in range(len(parent)) if parent[j] == parent[par]]
            out[i] = group[(group.index(par) + 1) % len(group)]
    return out


TREE_MUTANTS = {
    "accept_against_unadjusted_residual": lambda c: tree_mutant(c, _accept_against_p_step),
    "no_residual_update_between_siblings": lambda c: tree_mutant(c, _no_sibling_update_step),
    "correction_from_p": lambda c: tree_mutant(c, final_from_p=True),
}


def _select_by(rank_fn):
    """A dynamic-tree selection rule ranking candidates by ``rank_fn(f_score, q [n, b])``
    (otherwise :func:`specjax.tree.select_level`: the same :func:`specjax.tree.keep_best`)."""
    from specjax.tree import keep_best

    def select(f_score, f_ok, cand_lq, cand_ok, m):
        return keep_best(rank_fn(f_score, cand_lq), f_score, f_ok, cand_lq, cand_ok, m)

    return select


def _rank_own_q(f_score, lq):  # EAGLE-2's rule on sampled candidates: reads the candidate itself
    return f_score[:, None] + lq


def _rank_mass_after(f_score, lq):  # mass left AFTER the candidate: reads its own q
    import jax.numpy as jnp

    left = 1.0 - jnp.minimum(jnp.cumsum(jnp.exp(lq), axis=-1), 1.0)
    return f_score[:, None] + jnp.log(jnp.maximum(left, 1e-30))


# dynamic sampled trees: rules whose choice of a candidate depends on that candidate
SELECT_MUTANTS = {
    "rank_by_own_q": _select_by(_rank_own_q),
    "rank_by_mass_left_after_it": _select_by(_rank_mass_after),
}
