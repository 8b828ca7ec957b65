"""Bad input to the public API of audit, verify, tree, sharding and train fails at once with a
one-line ValueError / TypeError naming the problem: never a pass, a result or a deep traceback."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import audit, sharding as S, tree as T, verify as V
from specjax.train import distill as D

KEY = jax.random.key(0)


def _tables(v=3, k=1):
    t = audit.normalize_table(audit.random_logits_table(0, v, k)).astype(np.float32)
    d = audit.normalize_table(audit.random_logits_table(1, v, k)).astype(np.float32)
    return t, d


# --- audit ----------------------------------------------------------------------------------

def test_chi_square_refuses_invalid_probs_and_empty_counts():
    with pytest.raises(ValueError, match="probs must be finite"):
        audit.chi_square_test([10, 10, 10], [0.5, np.nan, 0.5])  # was p = 1
    with pytest.raises(ValueError, match="probs must be finite"):
        audit.chi_square_test([50, 50, 0], [0.6, 0.6, -0.2])
    with pytest.raises(ValueError, match="no observations"):
        audit.chi_square_test([0, 0, 0], [0.3, 0.3, 0.4])  # was p = 1
    with pytest.raises(ValueError, match="same shape"):
        audit.chi_square_test([1, 2], [0.3, 0.3, 0.4])
    with pytest.raises(ValueError, match="counts must be"):
        audit.chi_square_test([5, -1, 5], [0.3, 0.3, 0.4])
    assert audit.chi_square_test([30, 50, 20], [0.25, 0.5, 0.25]).p_value > 0.01  # valid input unchanged


def test_monte_carlo_audit_refuses_zero_rows_and_nan_reference():
    t, d = _tables()
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        audit.audit_monte_carlo(V.token_verify, 0, t, d, 1, num_rows=0)  # was passed=True
    bad = t.copy()
    bad[0, 1] = np.nan
    with pytest.raises(ValueError, match="reference_table holds NaN"):
        audit.audit_monte_carlo(V.token_verify, 0, t, d, 1, num_rows=100, reference_table=bad)  # was a pass
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        audit.tree_monte_carlo_counts(T.iid_tree_verify, 0, t, d, [-1], num_rows=0)


def test_exact_law_checks_tables_and_num_draft():
    t, d = _tables(3, 2)
    with pytest.raises(ValueError, match="fewer than the 13 prefixes"):
        audit.audit_law(V.token_law, t[:5], d[:5], 2)
    t4, _ = _tables(4, 2)
    with pytest.raises(ValueError, match="draft_table has V=4"):
        audit.audit_law(V.token_law, t, t4, 2)
    with pytest.raises(ValueError, match="num_draft=3 exceeds num_draft_max=2"):
        audit.audit_law(V.token_law, t, d, 2, num_draft=3)
    with pytest.raises(ValueError, match="num_draft must be >= 0"):
        audit.audit_law(V.token_law, t, d, 2, num_draft=-1)
    with pytest.raises(ValueError, match="num_draft_max must be >= 1"):
        audit.audit_law(V.token_law, t, d, 0)
    with pytest.raises(ValueError, match="num_draft must be >= 0"):
        audit.monte_carlo_counts(V.token_verify, 0, t, d, 2, num_rows=10, num_draft=-1)


def test_tree_audit_checks_parent_and_tables():
    t, d = _tables(3, 1)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        audit.exact_tree_law(T.tree_law, t, d, [])
    with pytest.raises(ValueError, match="fewer than the 13 prefixes"):
        audit.exact_tree_law(T.tree_law, t, d, [-1, 0])  # depth 2 needs prefixes of length 2
    with pytest.raises(ValueError, match="draw must be one of"):
        audit.exact_tree_law(T.tree_law, t, d, [-1], draw="sampled")


def test_permutation_test_needs_permutations():
    a, b = [(0, [1, 2, 3, 1])] * 20, [(0, [1, 2, 3, 2])] * 20
    with pytest.raises(ValueError, match="n_perm must be >= 1"):
        audit.sequence_permutation_test(a, b, n_perm=0)  # was p_value_permutation = 1.0


# --- verify ----------------------------------------------------------------------------------

def test_verifiers_check_shapes_and_token_dtype():
    lp = jnp.log(jnp.full((3, 4), 0.25))
    with pytest.raises(TypeError, match="draft_tokens must be integer"):
        V.token_verify(KEY, jnp.array([0.7, 1.9]), lp[:2], lp)  # was truncated to [0, 1]
    with pytest.raises(ValueError, match=r"target_logits \[K\+1, V\]"):
        V.greedy_verify(jnp.array([0, 1, 2]), lp)
    with pytest.raises(ValueError, match=r"draft_logprobs \[K, V\]"):
        V.token_verify(KEY, jnp.array([0]), lp[0, :1], lp[:2, 0])
    with pytest.raises(ValueError, match="must be 1-D"):
        V.block_verify(KEY, jnp.array([[0], [1]]), lp[:2], lp)
    with pytest.raises(ValueError, match="k must be an integer >= 0"):
        V.expected_tokens_per_round(0.5, k=-1)
    ok = V.token_verify(KEY, np.array([0, 1]), lp[:2], lp)
    assert not bool(ok.error)


# --- tree ------------------------------------------------------------------------------------

def test_tree_inputs_are_checked():
    parent, _ = T.full_tree_shape((2, 1))
    with pytest.raises(ValueError, match="make_tree: tokens has shape"):
        T.make_tree([0, 1, 2], parent)  # was a DraftTree of 3 tokens for 4 nodes
    with pytest.raises(ValueError, match="must be an integer"):
        T.full_tree_shape((2.5, 1))  # was (2, 1)
    with pytest.raises(ValueError, match="integer node indices"):
        T.shape_depths([-1, 0.5])
    tree = T.make_tree([0, 1, 2, 3], parent)
    p = jnp.log(jnp.full((5, 4), 0.25))
    with pytest.raises(ValueError, match="tree.parent has shape"):
        T.greedy_tree_verify(tree._replace(parent=jnp.array([-1, -1, 0])), p[0], p[1:])
    with pytest.raises(ValueError, match=r"p_root \[V\] and p_node"):
        T.greedy_tree_verify(tree, p[0, :3], p[1:])
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        T.greedy_tree_verify(tree, p[0], p[1:], max_depth=0)
    sampled = tree._replace(q_root=p[0], q_node=p[1:])
    with pytest.raises(ValueError, match="max_tries must be an integer >= 1"):
        T.tree_verify(KEY, sampled, p[0], p[1:], max_tries=0)  # was ignored off GPU
    with pytest.raises(ValueError, match="q_root"):
        T.tree_verify(KEY, tree._replace(q_root=p[0, :3], q_node=p[1:, :3]), p[0], p[1:])
    assert not bool(T.tree_verify(KEY, sampled, p[0], p[1:]).error)


def test_ancestor_mask_refuses_cycles_and_bad_parents():
    with pytest.raises(ValueError, match="cycle"):
        T.ancestor_mask(np.array([1, 0, -1]))  # was a mask
    with pytest.raises(ValueError, match="parent\\[1\\] = 7"):
        T.ancestor_mask(np.array([-1, 7, 0]))  # was a mask
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        T.ancestor_mask(np.array([-1, 0, 1]), max_depth=0)
    m = np.asarray(T.ancestor_mask(np.array([-1, 0, 1]), max_depth=3))
    np.testing.assert_array_equal(m, np.tril(np.ones((3, 3), bool)))
    # traced parents are the verifiers' business (their error flag): no host check there
    jax.jit(T.ancestor_mask)(jnp.array([-1, 0, 1]))


def test_chain_tree_refuses_num_draft_out_of_range():
    lp = jnp.zeros((2, 4))
    with pytest.raises(ValueError, match="num_draft must be an integer in"):
        T.chain_tree(jnp.array([1, 2]), lp, num_draft=5)  # was every node valid
    assert np.asarray(T.chain_tree(jnp.array([1, 2]), lp, num_draft=1).valid).tolist() == [True, False]


# --- sharding --------------------------------------------------------------------------------

def test_sharding_configs_fail_in_one_line():
    with pytest.raises(ValueError, match="mesh.data must be a positive int"):
        S.MeshConfig(data=True)
    with pytest.raises(ValueError, match="unknown mesh keys"):
        S.sharding_from_dict({"mesh": {"dat": 2}})
    with pytest.raises(ValueError, match="mesh must be a mapping"):
        S.sharding_from_dict({"mesh": [1, 2]})
    with pytest.raises(ValueError, match="rules.target must be a mapping"):
        S.sharding_from_dict({"rules": {"target": ["vocab"]}})
    with pytest.raises(ValueError, match="rules.draft must be a mapping"):
        S.sharding_from_dict({"rules": {"draft": "targett"}})
    with pytest.raises(ValueError, match="a mesh axis name"):
        S.sharding_from_dict({"rules": {"target": {"vocab": 5}}})
    with pytest.raises(TypeError, match="unknown mesh overrides"):
        S.make_plan("dp", modle=2)
    with pytest.raises(ValueError, match="at least one device"):
        S.make_mesh(S.MeshConfig(), devices=[])
    assert S.sharding_from_dict({"rules": {"draft": "target", "target": {"batch": "data"}}}).draft.get("batch") == "data"


def test_plan_spec_and_top_values_check_their_inputs():
    plan = S.make_plan("dp")
    with pytest.raises(ValueError, match="3 logical names"):
        plan.spec(("batch", "vocab", "heads"), (8, 16))
    with pytest.raises(ValueError, match="3 logical names"):
        plan.put(np.zeros((8, 16)), ("batch", "vocab", None))
    with pytest.raises(ValueError, match="m must be an integer in"):
        plan.top_values(jnp.zeros((2, 16)), 0)  # was an empty result
    with pytest.raises(ValueError, match=r"z must be \[N, V\]"):
        plan.top_values(jnp.zeros((16,)), 2)
    assert plan.spec(("batch",), (8, 16)) == S.P("data")


# --- train -----------------------------------------------------------------------------------

TINY = dict(vocab_size=64, n_layers=2, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


def _run_cfg(tmp_path, train_lines=("1 2 3", "4 5 6"), held_lines=("7 8", "9 10"), **sections):
    tr, ho = tmp_path / "train.txt", tmp_path / "held.txt"
    tr.write_text("\n".join(train_lines))
    ho.write_text("\n".join(held_lines))
    d = dict(seed=1, target=dict(kind="tiny", config=TINY, seed=3),
             data=dict(prompts=str(tr), heldout=str(ho), prompt_format="ids", cache_dir=str(tmp_path / "c")),
             draft=dict(kind="eagle"), train=dict(steps=10, warmup=2, out_dir=str(tmp_path / "out"), progress=False))
    for k, v in sections.items():
        d[k] = dict(d[k], **v)
    return d


def test_train_config_refuses_what_build_draft_and_the_data_would(tmp_path):
    D.load_config(_run_cfg(tmp_path))
    bad = [
        (dict(draft=dict(kind="target_init", n_layers=5)), "exceeds the target's 2 layers"),
        (dict(draft=dict(kind="target_init", config={"dim": 16})), "not read by a target_init"),
        (dict(draft=dict(config={"ffn_dimm": 3})), "unknown EagleConfig fields"),
        (dict(draft=dict(config={"n_layers": 3})), "set draft.n_layers"),
        (dict(draft=dict(config={"dim": 16})), "the target's width 32"),
        (dict(data=dict(topk=100)), "data.topk=100 exceeds"),
    ]
    for sections, msg in bad:
        with pytest.raises(D.ConfigError, match=msg):
            D.load_config(_run_cfg(tmp_path, **sections))
    with pytest.raises(D.ConfigError, match="token id 70 outside"):
        D.load_config(_run_cfg(tmp_path, train_lines=("1 2 3", "4 5 70")))  # would be clamped
    with pytest.raises(D.ConfigError, match="whitespace-separated token ids"):
        D.load_config(_run_cfg(tmp_path, held_lines=("7 8", "9 x")))
    with pytest.raises(D.ConfigError, match="data.heldout: no prompts"):
        D.load_config(_run_cfg(tmp_path, held_lines=("# only a comment",)))


def test_resume_refuses_checkpoints_without_their_config(tmp_path):
    cfg = D.load_config(_run_cfg(tmp_path))
    out = str(tmp_path / "out")
    D._save(D._ckpt_manager(out), 3, ({"w": np.zeros(2, np.float32)},))
    with pytest.raises(D.ResumeError, match="no config.json"):
        D._check_resume(out, cfg)  # was: resume step 3 of a run of unknown config
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(D.ResumeError, match="unreadable"):
        D._check_resume(out, cfg)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)
    assert D._check_resume(out, cfg) == 3
