"""Full-engine tests: exactness of the whole loop (prefill, rounds, rollback, commit),
greedy equality, batch invariance, determinism, stop rules and no recompilation."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.llama import LlamaLM, tiny_config
from specjax import build, engine, sampling
from specjax.drafts import DraftModelProposer, PromptLookupProposer
from specjax.sampling import process_rows, sample_rows
from specjax.audit import chi_square_test
from tests.engine_law import exact_chain_law, exact_controlled_law, histogram, pad_after_stop

V = 8
ROWS = 100_000
ALPHA_SIG = 1e-3  # a correct engine fails a single test with this probability


PROMPT = [1, 5, 2]


def _engine_hist(eng, cfg, n, rows=ROWS, chunk=25_000, seed=0):
    """Histogram of ``rows`` rows (row indices 0..rows-1), in calls of at most ``chunk``."""
    hist = np.zeros(V ** n, np.int64)
    for start in range(0, rows, chunk):
        idx = np.arange(start, min(start + chunk, rows))
        out = eng.generate([PROMPT] * idx.size, seed=seed, row_indices=idx, sampling_params=cfg,
                           max_new_tokens=n)
        toks = np.array(out.tokens)
        assert toks.shape == (idx.size, n)
        hist += histogram(toks, V, n)
    return hist


CASES = {
    "t1": sampling.SamplingConfig(temperature=1.0),
    "combined": sampling.SamplingConfig(temperature=0.8, top_k=6, top_p=0.9),
    # the target's law at draft position i depends on the draft tokens before it
    "penalties": sampling.SamplingConfig(temperature=0.9, repetition_penalty=1.8, presence_penalty=0.7),
}


@pytest.mark.slow
@pytest.mark.parametrize("method, case", [("token", c) for c in CASES] + [("block", "t1")])
def test_engine_law_matches_target_chain(target, draft, method, case):
    # block verification with filters and penalties: the processing is the same code for both
    # methods, and block_verify's law under any p and q is the exact audit's (test_verify.py)
    k, n = 2, 4  # N >= K+2: at least two rounds, so rollback and re-feeding are exercised
    cfg = CASES[case]
    law = exact_chain_law(target, PROMPT, n, cfg)
    assert abs(law.sum() - 1) < 1e-5
    eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, k), method)
    # 100,000 rows for the chain at T=1 and for the penalties (whose stale-counts mutant
    # below needs them); 50,000 for block verification (its law under any p and q is the
    # exact audit's) and for the filters, as the other engines' law tests
    full = method == "token" and case in ("t1", "penalties")
    hist = _engine_hist(eng, cfg, n, rows=ROWS if full else ROWS // 2)
    chi = chi_square_test(hist, law)
    assert chi.p_value > ALPHA_SIG, f"{method}/{case}: chi-square {chi.statistic:.1f}, p={chi.p_value:.2e}"


def test_bfloat16_target_runs_with_float32_probability_math(target, draft):
    """bfloat16 weights and compute for the target (the accelerator setting): the engines run
    it (its logits come out float32 and are processed in float32, as every model's), and
    greedy speculative decoding gives the autoregressive engine's greedy tokens. (Its sampling law is the law of the engine
    program's bfloat16 logits, which XLA's excess precision makes program-dependent: see
    ARCHITECTURE.md, "bfloat16 targets".)"""
    t16 = target.with_config(dtype="bfloat16", param_dtype="bfloat16")
    assert t16.params["embed"][...].dtype == jnp.bfloat16
    prompts = [[1, 5, 2], [4, 4, 7, 1], [3, 6]]
    spec = engine.SpeculativeEngine(t16, DraftModelProposer(draft, 3), "token")
    got = spec.generate(prompts, seed=0, max_new_tokens=24, sampling_params=sampling.SamplingConfig(temperature=0.0))
    want = engine.AutoregressiveEngine(t16).generate(prompts, seed=0, max_new_tokens=24, greedy=True)
    assert got.tokens == want.tokens
    assert all(0.0 <= s.mean_alpha <= 1.0 for s in got.stats)


def _numpy_init(cfg, seed):
    """LlamaLM with numpy-drawn weights (LlamaLM.init's jax.random draws compile per shape)."""
    from specjax.models.llama import expected_shapes

    rng = np.random.default_rng(seed)
    w = {k: (1.0 + 0.1 * rng.standard_normal(s) if k.endswith("norm") else
             rng.standard_normal(s) / (1.0 if k == "embed" else np.sqrt(s[-1]))).astype(np.float32)
         for k, s in expected_shapes(cfg).items()}
    return LlamaLM.from_weights(cfg, w)


@pytest.mark.slow
def test_engine_law_qwen3_style_models():
    """Target and draft with Qwen3's switches (per-head q/k RMSNorm, head_dim 12 != dim /
    n_heads, untied head); the target also has a sliding window of 3 on its first layer (Qwen
    sliding layers) and XLA's chunked attention in 2-slot chunks, so verification steps read
    the cache through the window. The engine's law is the target's chain law."""
    qwen3 = dict(vocab_size=V, head_dim=12, qk_norm=True, tie_embeddings=False)
    tgt = _numpy_init(tiny_config(n_layers=2, sliding_window=3, layer_types=("sliding", "full"),
                                  cpu_kernels="xla", attn_chunk=2, **qwen3), seed=31)
    drf = _numpy_init(tiny_config(n_layers=1, **qwen3), seed=32)
    k, n, rows = 2, 4, 20_000
    cfg = CASES["t1"]
    law = exact_chain_law(tgt, PROMPT, n, cfg)
    eng = engine.SpeculativeEngine(tgt, DraftModelProposer(drf, k), "token")
    chi = chi_square_test(_engine_hist(eng, cfg, n, rows=rows), law)
    assert chi.p_value > ALPHA_SIG, f"chi-square {chi.statistic:.1f}, p={chi.p_value:.2e}"


class _OffByOneRollback(engine.SpeculativeEngine):
    @staticmethod
    def target_cache_lengths(seq_len):
        return seq_len  # keeps a stale slot: the target reads a KV entry it should not


class _StalePenaltyCounts(engine.SpeculativeEngine):
    @staticmethod
    def position_counts(counts, x, nd):
        # every scored position sees only the committed tokens, not the drafts before it
        return jnp.broadcast_to(counts[:, None, :], (x.shape[0], x.shape[1] + 1, counts.shape[-1]))


class _DraftWithOtherSettings(DraftModelProposer):
    """Samples draft tokens at a different temperature than the q it reports."""

    def draw(self, keys, logits, counts, ctx, position):
        lp = ctx.process(logits, counts, position)
        hot = ctx.params.replace(temperature=ctx.params.temperature * 2.0)
        x = sample_rows(keys, process_rows(logits, hot, counts, ctx.use_penalties))
        return x, lp


@pytest.mark.slow
@pytest.mark.parametrize("mutant", ["rollback_off_by_one", "draft_other_settings", "stale_penalty_counts"])
def test_engine_mutants_fail_the_law_test(target, draft, mutant):
    k, n = 2, 4
    cfg = CASES["penalties" if mutant == "stale_penalty_counts" else "t1"]
    law = exact_chain_law(target, PROMPT, n, cfg)
    if mutant == "rollback_off_by_one":
        eng = _OffByOneRollback(target, DraftModelProposer(draft, k), "token")
    elif mutant == "stale_penalty_counts":
        eng = _StalePenaltyCounts(target, DraftModelProposer(draft, k), "token")
    else:
        eng = engine.SpeculativeEngine(target, _DraftWithOtherSettings(draft, k), "token")
    # the stale counts shift the law a little (p = 0.2 on 25,000 rows; chi-square 284 on
    # 138 dof, p = 4e-12, on 100,000): the full 100,000. The other two fail by far on a
    # tenth (chi-square 4,225 and 5,449 on 33 dof on 10,000 rows)
    few = ROWS // 10
    hist = (_engine_hist(eng, cfg, n) if mutant == "stale_penalty_counts" else
            _engine_hist(eng, cfg, n, rows=few))
    chi = chi_square_test(hist, law)
    assert chi.p_value < 1e-6, f"mutant {mutant} passed the law test (p={chi.p_value:.3g}); the test has no power"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["draft_cut", "mutant_target_cut"])
def test_engine_law_with_a_draft_cut_at_its_candidates(target, draft, monkeypatch, variant):
    """A draft's top-p cut made at the last of the pipeline's candidates where the exact
    cut lies past them (specjax.drafts.base.DRAFT_CUT, the GPU's default); the target's
    stays exact. With the candidates cut to 3 of the 8 tokens and a flat law (T = 8, top-p
    0.95; the tiny models are peaked) the draft's cut is the candidates' in most rounds and
    the target's needs the exact search: the output law is still the target chain's. A
    mutant that cuts the target's law at its candidates as well fails."""
    import functools

    k, n = 2, 4
    cfg = sampling.SamplingConfig(temperature=8.0, top_p=0.95)
    law = exact_chain_law(target, PROMPT, n, cfg)
    monkeypatch.setattr(sampling, "_CANDIDATES", 3)
    # nearly every row's exact cut lies past 3 candidates here, so the search takes its
    # rows 1024 at a time, not the shipped 8 (built for the few such rows of a real
    # vocabulary): the same thresholds, 75k rows a pass searched in ~75 loop steps, not ~9k
    monkeypatch.setattr(sampling, "_SLOW_ROWS", 1024)
    from specjax.drafts import base
    monkeypatch.setattr(base, "DRAFT_CUT", "candidates")  # the GPU's default, on the CPU
    if variant == "mutant_target_cut":
        monkeypatch.setattr(engine, "process_rows", functools.partial(sampling.process_rows, cut="candidates"))
    jax.clear_caches()  # the candidates are read when a program is traced
    try:
        # the draft's first law: cut at its 3 candidates, where the exact nucleus is wider
        logits = draft.apply(draft.params, jnp.asarray([PROMPT]), draft.init_cache(1, 8)).logits[:, -1]
        q = [np.isfinite(np.asarray(sampling.process_rows(logits, cfg.to_params(1), None, jnp.asarray(False), cut=c))).sum()
             for c in ("candidates", "exact")]
        assert q[0] == 3 < q[1], q
        eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, k), "token")
        # (the mutant fails by far: chi-square 56,150 on 475 dof on 10,000 rows)
        hist = (_engine_hist(eng, cfg, n, rows=ROWS // 2) if variant == "draft_cut" else
                _engine_hist(eng, cfg, n, rows=ROWS // 10))
    finally:
        jax.clear_caches()
    chi = chi_square_test(hist, law)
    if variant == "draft_cut":
        assert chi.p_value > ALPHA_SIG, f"chi-square {chi.statistic:.1f}, p={chi.p_value:.2e}"
    else:
        assert chi.p_value < 1e-6, f"the mutant passed the law test (p={chi.p_value:.3g}); the test has no power"


# generation controls: min_new_tokens (the stop token 0 is masked before 2 tokens), an
# allowed set, a banned token and a logit bias, through the one pipeline for both models
STOP = 0
CONTROLS = dict(min_new_tokens=2, allowed_tokens=[0, 1, 2, 3, 5, 6], banned_tokens=[5],
                logit_bias={0: 1.0, 3: 0.5})


class _MinNewAtRoundStart(engine.SpeculativeEngine):
    @staticmethod
    def generated_before(gen_len, k):
        # every scored position evaluated as if it were the round's first
        return jnp.broadcast_to(gen_len[:, None], (gen_len.shape[0], k + 1))


def _controlled_hist(eng, cfg, n, rows=40_000, chunk=40_000):
    hist = np.zeros(V ** n, np.int64)
    for start in range(0, rows, chunk):
        idx = np.arange(start, min(start + chunk, rows))
        out = eng.generate([PROMPT] * idx.size, seed=0, row_indices=idx,
                           sampling_params=cfg, max_new_tokens=n, stop_tokens=[STOP], **CONTROLS)
        hist += histogram(pad_after_stop(out.tokens, STOP, n), V, n)
    return hist


@pytest.fixture(scope="module")
def controlled_law(target):
    return exact_controlled_law(target, PROMPT, 4, CASES["t1"], STOP, **CONTROLS)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["token", "autoregressive", "mutant_min_new_at_round_start"])
def test_generation_controls_law(target, draft, controlled_law, variant):
    k, n = 2, 4
    cfg = CASES["t1"]
    law = controlled_law
    assert abs(law.sum() - 1) < 1e-5
    stop_early = sum(law[i] for i in range(V ** n) if STOP in np.unravel_index(i, (V,) * n)[:2])
    assert stop_early < 1e-12 and law.reshape((V,) * n)[:, :, STOP].sum() > 0.1  # the test has power
    if variant == "autoregressive":
        eng = build.make_autoregressive_engine(target)
    elif variant == "token":
        eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, k), "token")
    else:
        eng = _MinNewAtRoundStart(target, DraftModelProposer(draft, k), "token")
    # the mutant fails by far on 10,000 rows (chi-square 6,340 on 23 dof)
    rows = 10_000 if variant.startswith("mutant") else 40_000
    chi = chi_square_test(_controlled_hist(eng, cfg, n, rows=rows), law)
    if variant.startswith("mutant"):
        assert chi.p_value < 1e-6, f"the mutant passed (p={chi.p_value:.3g}): the test has no power"
    else:
        assert chi.p_value > ALPHA_SIG, f"{variant}: chi-square {chi.statistic:.1f}, p={chi.p_value:.2e}"


def test_generation_controls_are_checked():
    tgt = LlamaLM.init(tiny_config(vocab_size=V, n_layers=1), seed=1)
    eng = build.make_autoregressive_engine(tgt)
    bad = [dict(banned_tokens=[V]), dict(allowed_tokens=[]), dict(min_new_tokens=-1),
           dict(logit_bias={1: float("inf")}), dict(logit_bias={-1: 1.0}),
           dict(allowed_tokens=[STOP], min_new_tokens=1, stop_tokens=[STOP]),
           dict(banned_tokens=list(range(V)))]
    for kw in bad:
        with pytest.raises(ValueError):
            eng.generate([PROMPT], seed=0, max_new_tokens=2, **kw)


def test_autoregressive_law_matches(target):
    n = 3
    cfg = CASES["combined"]
    law = exact_chain_law(target, PROMPT, n, cfg)
    out = build.generate_autoregressive(target, [PROMPT] * 50_000, seed=3, sampling_params=cfg,
                                         max_new_tokens=n)
    chi = chi_square_test(histogram(out.tokens, V, n), law)
    assert chi.p_value > ALPHA_SIG, f"p={chi.p_value:.2e}"


# ---------------------------------------------------------------------------- greedy


_GREEDY_PROMPTS = [[3, 9, 27, 17], [5, 1], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def greedy_case():
    """A 64-token target and draft, and the target's greedy tokens for _GREEDY_PROMPTS
    (computed once for the parametrizations below: the autoregressive run does not depend on
    them). The prompt-lookup, feature-proposer and streaming tests below use these models
    and shapes too (3 prompts in the 16-token bucket, max_new_tokens in the 64-token
    bucket), so that they reuse the autoregressive program and run, and the K=3 token
    engine's program, instead of compiling their own (XLA's compile is most of their time)."""
    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    dft = LlamaLM.init(tiny_config(vocab_size=64, n_layers=1, dim=32), seed=6)
    ar = build.generate_autoregressive(tgt, _GREEDY_PROMPTS, seed=0, max_new_tokens=40,
                                        sampling_params=sampling.SamplingConfig(temperature=0.0))
    return tgt, dft, ar


@pytest.mark.parametrize("k, method", [pytest.param(1, "greedy", marks=pytest.mark.extended), (4, "greedy"), (3, "token"),
                                       pytest.param(5, "block", marks=pytest.mark.extended)])
def test_speculative_greedy_equals_autoregressive_greedy(greedy_case, k, method):
    tgt, dft, ar = greedy_case
    cfg = sampling.SamplingConfig(temperature=0.0)
    sp = build.generate(tgt, dft, _GREEDY_PROMPTS, k=k, method=method, seed=0, sampling_params=cfg,
                         max_new_tokens=40)
    assert sp.tokens == ar.tokens
    assert all(len(t) == 40 for t in sp.tokens)


def test_prompt_lookup_greedy_equals_autoregressive(greedy_case):
    tgt, _, ar = greedy_case  # the target's greedy tokens for _GREEDY_PROMPTS, 40 each
    cfg = sampling.SamplingConfig(temperature=0.0)
    sp = build.generate(tgt, "lookup", _GREEDY_PROMPTS, k=4, method="greedy", seed=0, sampling_params=cfg,
                         max_new_tokens=40)
    assert sp.tokens == ar.tokens
    # greedy text from a small model repeats: lookup must have drafted and been accepted
    assert sum(s.accepted for s in sp.stats) > 0


@pytest.mark.slow
def test_prompt_lookup_law(target):
    """A point-mass proposer that sometimes proposes fewer than K tokens is exact too."""
    k, n = 3, 4
    cfg = CASES["t1"]
    law = exact_chain_law(target, PROMPT, n, cfg)
    eng = engine.SpeculativeEngine(target, PromptLookupProposer(vocab_size=V, k=k), "token")
    hist = _engine_hist(eng, cfg, n, rows=50_000)
    chi = chi_square_test(hist, law)
    assert chi.p_value > ALPHA_SIG, f"p={chi.p_value:.2e}"


# ----------------------------------------------------------------- stop rules, stats


def test_stop_tokens_and_max_new_tokens_cut_exactly(target, draft):
    # (2 rows, K=3, token: one program with test_statistics_are_consistent and the tests
    # after it; K, the method and the number of rows do not matter to the stop rules)
    prompts = [[1, 2, 3], [4, 4, 4, 4, 4]]
    cfg = sampling.SamplingConfig(temperature=1.0)
    full = build.generate(target, draft, prompts, k=3, seed=1, sampling_params=cfg, max_new_tokens=30)
    stop = full.tokens[0][5]
    cut = build.generate(target, draft, prompts, k=3, seed=1, sampling_params=cfg, max_new_tokens=30,
                          stop_tokens=[stop])
    for f, c, s in zip(full.tokens, cut.tokens, cut.finished_by_stop):
        if stop in f:
            i = f.index(stop)
            assert c == f[: i + 1] and s
        else:
            assert c == f and not s
    per_row = build.generate(target, draft, prompts, k=3, seed=1, sampling_params=cfg,
                              max_new_tokens=[7, 1])
    assert [len(t) for t in per_row.tokens] == [7, 1]
    for f, c in zip(full.tokens, per_row.tokens):
        assert c == f[: len(c)]


def test_statistics_are_consistent(target, draft):
    # (2 rows, K=3, token, 16-token prompt bucket, 32-token output bucket: the program of
    # the stop-rule test above and of several tests below, compiled once)
    out = build.generate(target, draft, [[1, 2, 3]] * 2, k=3, seed=0, max_new_tokens=20)
    for s, t in zip(out.stats, out.tokens):
        assert s.emitted == len(t) == 20
        assert 0 <= s.accepted <= s.drafted == 3 * s.rounds
        assert s.rounds >= 20 / 4
        assert 0.0 <= s.mean_alpha <= 1.0
        assert s.reached_per_position[0] == s.rounds
        assert abs(s.tokens_per_round - 20 / s.rounds) < 1e-9


def test_always_drafts_changes_speed_only(target, draft):
    """A proposer that promises K drafts skips the 'nothing drafted' conditional (and its
    copies of the KV cache): the same tokens and statistics as with the test in place."""
    # a greedy row and a sampled one with a penalty (2 rows: with always_drafts, the default,
    # the program of test_no_recompilation_for_new_values)
    cfg = sampling.SamplingParams.create(2, temperature=[0.0, 0.8], repetition_penalty=[1.0, 1.4])
    outs, cases = [], []
    for flag in (True, False):
        prop = dataclasses.replace(DraftModelProposer(draft, 3), always_drafts=flag)
        eng = engine.SpeculativeEngine(target, prop, "token")
        outs.append(eng.generate([[1, 2, 3], [6, 6, 6, 1]], seed=5, sampling_params=cfg,
                                 max_new_tokens=17))
        cases.append(eng.lower([[1, 2, 3]], seed=5, max_new_tokens=17).as_text().count("stablehlo.case"))
    assert cases[0] == cases[1] - 1  # the scoring conditional is gone, nothing else changed
    assert outs[0].tokens == outs[1].tokens
    assert [dataclasses.asdict(s) for s in outs[0].stats] == [dataclasses.asdict(s) for s in outs[1].stats]


# ------------------------------------------------- batch invariance and determinism


_SUBPROCESS = textwrap.dedent("""
    import json
    from specjax.models.llama import LlamaLM, tiny_config
    from specjax import build
    t = LlamaLM.init(tiny_config(vocab_size=8, n_layers=2), seed=11)
    d = LlamaLM.init(tiny_config(vocab_size=8, n_layers=1), seed=22)
    out = build.generate(t, d, [[1, 2, 3], [4, 5]], k=3, method="token", seed=9, max_new_tokens=20)
    print(json.dumps(out.tokens))
""")


def test_same_key_same_output_across_processes(target, draft):
    # (2 rows, K=3, token: the program of test_statistics_are_consistent, compiled once, and
    # read from the compilation cache by the subprocess)
    here = build.generate(target, draft, [[1, 2, 3], [4, 5]], k=3, method="token", seed=9,
                           max_new_tokens=20)
    again = build.generate(target, draft, [[1, 2, 3], [4, 5]], k=3, method="token", seed=9,
                            max_new_tokens=20)
    assert here.tokens == again.tokens
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, cwd=root,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == here.tokens
    other = build.generate(target, draft, [[1, 2, 3], [4, 5]], k=3, method="token", seed=10,
                            max_new_tokens=20)
    assert other.tokens != here.tokens


def test_no_recompilation_for_new_values(target, draft):
    eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, 3), "token")
    eng.generate([[1, 2, 3], [4, 5, 6, 7]], seed=0, max_new_tokens=20)
    assert eng.trace_count == 1
    eng.generate([[7, 7, 1], [0, 1]], seed=5, max_new_tokens=17,
                 sampling_params=sampling.SamplingParams.create(
                     2, temperature=[0.3, 0.0], top_k=[3, 0], top_p=[0.5, 1.0], min_p=[0.1, 0.0],
                     repetition_penalty=[1.3, 1.0]))
    eng.generate([[2, 2, 2, 2, 2, 2, 2], [1, 3]], keys=jax.random.split(jax.random.key(3), 2),
                 max_new_tokens=[5, 30], stop_tokens=[3])
    assert eng.trace_count == 1
    ar = engine.AutoregressiveEngine(target)
    ar.generate([[1, 2, 3]], seed=0, max_new_tokens=10)
    ar.generate([[3, 2, 1, 0]], seed=1, max_new_tokens=12,
                sampling_params=sampling.SamplingConfig(temperature=0.5, top_p=0.8))
    assert ar.trace_count == 1


# ------------------------------------------------------------------------ bad input


def test_bad_input_is_rejected_before_work(target, draft):
    eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, 2), "token")
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]], seed=0)
    with pytest.raises(ValueError, match="outside"):
        eng.generate([[1, 99]], seed=0)
    with pytest.raises(ValueError, match="at least 2"):
        eng.generate([[1]], seed=0)
    with pytest.raises(ValueError, match="context"):
        eng.generate([[1, 2]], seed=0, max_new_tokens=10 ** 6)
    with pytest.raises(ValueError, match="key"):
        eng.generate([[1, 2]], keys=jax.random.split(jax.random.key(0), 3))
    with pytest.raises(ValueError):
        eng.generate([[1, 2]], seed=0, sampling_params={"temperature": -1.0})
    with pytest.raises(ValueError, match="K must be"):
        build.generate(target, draft, [[1, 2]], k=0, seed=0)
    with pytest.raises(ValueError, match="method"):
        build.generate(target, draft, [[1, 2]], k=2, method="typical", seed=0)
    # never coerced into another input (a bug hunt found each silently accepted)
    for prompts in ([[1.7, 2.2, 3.9]], [[[1, 2], [3, 4]]], [1, 2, 3]):
        with pytest.raises(ValueError, match="prompt 0"):
            eng.generate(prompts, seed=0)
    for max_new in (2.9, [3, 4], True):
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.generate([[1, 2]], seed=0, max_new_tokens=max_new)
    for stops in (5, [2.5]):
        with pytest.raises(ValueError, match="stop_tokens"):
            eng.generate([[1, 2]], seed=0, stop_tokens=stops)
    for ids in ([[1], [2]], [[1], 2, 3]):  # per-row lists must be one per row
        with pytest.raises(ValueError, match="one list per row"):
            eng.generate([[1, 2]] * 3, seed=0, banned_tokens=ids)
    with pytest.raises(ValueError, match="top_k has batch shape"):
        eng.generate([[1, 2]] * 4, seed=0, sampling_params=sampling.SamplingParams.create(4).replace(top_k=np.array([3])))
    with pytest.raises(ValueError, match="batch_size"):
        eng.generate_dataset([[1, 2]], seed=0, batch_size=np.int64(0))
    other = LlamaLM.init(tiny_config(vocab_size=V + 1), seed=0)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        build.generate(target, other, [[1, 2]], k=2, seed=0)
    # counts past int32 are errors, never wrapped around (2**32 + 3 once gave 3 tokens, a
    # min_new_tokens of 2**31 none; another bug hunt), and stop tokens are one flat set
    for max_new in (2 ** 32 + 3, 2 ** 31, np.uint64(2 ** 32), 1e30):
        with pytest.raises(ValueError, match="max_new_tokens must be < 2"):
            eng.generate([[1, 2]], seed=0, max_new_tokens=max_new)
    for min_new, msg in ((2 ** 31, "must be < 2"), ([1, 2, 3], "one per row")):
        with pytest.raises(ValueError, match=f"min_new_tokens.*{msg}"):
            eng.generate([[1, 2]] * 2, seed=0, max_new_tokens=6, stop_tokens=[5], min_new_tokens=min_new)
    for stops in ([[5], [6]], [[1], [2, 3]], np.array([[5], [6]])):
        with pytest.raises(ValueError, match="stop_tokens: expected one flat list"):
            eng.generate([[1, 2]] * 2, seed=0, stop_tokens=stops)
    # SamplingParams built field by field get create()'s checks
    f = lambda x, dt=np.float32: np.full(2, x, dt)  # noqa: E731
    for bad, msg in ((dict(temperature=f(-1.0)), "temperature"), (dict(top_k=f(2.5)), "top_k"),
                     (dict(top_p=f(0.0)), "top_p")):
        fields = dict(temperature=f(1.0), top_k=f(0, np.int32), top_p=f(1.0), min_p=f(0.0),
                      repetition_penalty=f(1.0), presence_penalty=f(0.0)) | bad
        with pytest.raises(ValueError, match=msg):
            eng.generate([[1, 2]] * 2, seed=0, sampling_params=sampling.SamplingParams(**fields))
    with pytest.raises(ValueError, match="not both"):
        eng.generate([[1, 2]], seed=0, keys=jax.random.split(jax.random.key(0), 1))
    with pytest.raises(ValueError, match="keys: expected one PRNG key per row"):
        eng.generate([[1, 2]] * 2, keys=[1, 2])
    assert eng.trace_count == 0


def test_numpy_integers_as_k_and_calibration_sizes(target, draft):
    assert build.make_engine(target, draft, k=np.int64(2), memo=False).k == 2
    assert engine.SpeculativeEngine(target, DraftModelProposer(draft, np.int64(3)), "token").k == 3
    # k='auto' measures its costs with runs that fit the model's context (a context of 48
    # once failed a 10-token call: the calibration's own 32 + 32 + K did not fit)
    assert engine.calibration_sizes(32, 32, 3, None) == (32, 32)
    assert engine.calibration_sizes(32, 32, 3, 67) == (32, 32)
    assert engine.calibration_sizes(32, 32, 3, 48) == (22, 23)
    assert engine.calibration_sizes(32, 32, 3, 6, min_prompt_len=2) == (2, 1)
    with pytest.raises(ValueError, match="cannot measure its round costs"):
        engine.calibration_sizes(32, 32, 3, 5, min_prompt_len=2)
    with pytest.raises(ValueError, match="batch_size"):
        build.make_engine(target, draft, k="auto", memo=False).calibrate(0)


def test_a_cache_larger_than_memory_is_an_error_before_any_work(target, draft, monkeypatch):
    """A KV cache that cannot fit the devices is a one-line error before the program is
    compiled or run, for every way of calling the engines (a benchmark run with a huge
    max_new_tokens was killed by the kernel instead); a dataset run sizes it by its slots."""
    assert engine.memory_limit() > 2 ** 30  # this machine's memory, read
    rows, length = 4, engine.cache_len_for(2, 8, 2)
    need = int(np.prod(target.init_cache(rows, length).k.shape)) * 4 * 2 + 4 * rows  # k, v, lengths
    engine.check_cache_memory(target, rows, length)
    monkeypatch.setattr(engine, "memory_limit", lambda: need - 1)
    with pytest.raises(ValueError, match=r"KV cache of 4 row\(s\) x \d+ positions needs"):
        engine.check_cache_memory(target, rows, length)
    prompts = [[1, 2]] * 4
    calls = 0

    def count(*a, **k):
        nonlocal calls
        calls += 1
        pytest.fail("compiled")

    for eng in (engine.AutoregressiveEngine(target), build.make_engine(target, draft, k=2, memo=False)):
        monkeypatch.setattr(eng, "_executable", count)
        for call in (eng.generate, eng.stream, eng.compile):
            with pytest.raises(ValueError, match="KV cache"):
                call(prompts, seed=0, max_new_tokens=8)
        with pytest.raises(ValueError, match="KV cache"):
            eng.generate_dataset(prompts * 2, batch_size=4, seed=0, max_new_tokens=8)
        monkeypatch.setattr(engine, "memory_limit", lambda: need)  # exactly enough
        engine.check_cache_memory(target, rows, length)
        monkeypatch.setattr(engine, "memory_limit", lambda: need - 1)
    assert calls == 0


def test_a_row_with_no_possible_token_is_an_error_not_minus_ones(target):
    """A penalty that pushes the only allowed token to -inf leaves nothing to draw: the
    autoregressive engine committed sample()'s -1 as tokens, silently (a bug hunt); it
    is the error the speculative engine's verifier reports."""
    kw = dict(seed=0, max_new_tokens=4, banned_tokens=[t for t in range(V) if t != 3],
              logit_bias={3: -3e38}, sampling_params=sampling.SamplingConfig(repetition_penalty=2.0))
    ar = engine.AutoregressiveEngine(target)
    with pytest.raises(FloatingPointError, match=r"no token possible\) met in rows \[0, 1\]"):
        ar.generate([[1, 3], [1, 2]], **kw)
    out = ar.generate([[1, 3], [1, 2]], raise_on_error=False, **kw)
    assert out.tokens == [[], [3]]  # row 1: 3 drawn, then seen, then impossible


def test_nan_logits_raise_not_sample(target, draft):
    # the target's config and the shapes of test_statistics_are_consistent (speculative) and
    # test_no_recompilation_for_new_values (autoregressive): their programs, with NaN weights
    w = target.canonical_weights()
    w["final_norm"] = w["final_norm"] * np.nan
    bad = LlamaLM.from_weights(target.config, w)
    with pytest.raises(FloatingPointError):
        build.generate(bad, draft, [[1, 2, 3]] * 2, k=3, seed=0, max_new_tokens=5)
    with pytest.raises(FloatingPointError):
        build.generate_autoregressive(bad, [[1, 2, 3]], seed=0, max_new_tokens=5)


# ------------------------------------------- feature-based proposers (EAGLE-style hook)

import dataclasses as _dc
from typing import Any as _Any

from specjax.drafts import Proposal


@_dc.dataclass(frozen=True, eq=False)
class _HiddenReadoutProposer:
    """Test proposer that reads the target's hidden states handed over at commit.

    Entry num_new-1 is the hidden state after token L'-2, whose greedy readout through
    the target's head must be the last committed token; the state counts mismatches."""

    embed: _Any
    vocab_size: int
    k: int
    needs_target_hidden: bool = True
    min_prompt_len: int = 2
    always_drafts: bool = True
    params: _Any = None

    def _readout(self, h):
        return jnp.argmax(h @ self.embed.T, axis=-1).astype(jnp.int32)

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None):
        b = prompt_tokens.shape[0]
        h = jnp.take_along_axis(target_hidden, (prompt_lens - 2)[:, None, None], axis=1)[:, 0]
        return dict(h=h, mismatch=jnp.zeros((b,), jnp.int32), checks=jnp.zeros((b,), jnp.int32))

    def propose(self, params, state, ctx):
        guess = self._readout(state["h"])
        toks = jnp.broadcast_to(guess[:, None], (guess.shape[0], self.k))
        lp = jnp.where(jax.nn.one_hot(toks, self.vocab_size) > 0, 0.0, -jnp.inf)
        return Proposal(toks, lp, jnp.full((guess.shape[0],), self.k, jnp.int32), state)

    def commit(self, params, state, ctx):
        ok = ctx.num_new > 0
        idx = jnp.maximum(ctx.num_new - 1, 0)
        h = jnp.take_along_axis(ctx.target_hidden, idx[:, None, None], axis=1)[:, 0]
        last = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]
        bad = ok & (self._readout(h) != last)
        return dict(h=jnp.where(ok[:, None], h, state["h"]), mismatch=state["mismatch"] + bad,
                    checks=state["checks"] + ok)


def test_feature_proposer_gets_the_right_hidden_states(greedy_case):
    tgt, _, ar = greedy_case  # the target's greedy tokens for _GREEDY_PROMPTS, 40 each
    embed = jnp.asarray(tgt.canonical_weights()["embed"])
    prop = _HiddenReadoutProposer(embed=embed, vocab_size=64, k=3)
    eng = engine.SpeculativeEngine(tgt, prop, "greedy")
    out = eng.generate(_GREEDY_PROMPTS, seed=0, max_new_tokens=40)
    assert out.tokens == ar.tokens
    st = out.raw["proposer_state"]
    assert np.all(np.asarray(st["checks"]) > 0)
    assert np.all(np.asarray(st["mismatch"]) == 0), np.asarray(st["mismatch"])


# ---------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("which", ["speculative", "autoregressive"])
def test_stream_yields_the_same_tokens_as_generate(greedy_case, which):
    # greedy_case's models and shapes (3 prompts, max_new_tokens up to 35: the 64-token
    # bucket): generate's program is the K=3 token greedy test's or the autoregressive one's
    tgt, dft, _ = greedy_case
    eng = build.make_engine(tgt, dft, 3) if which == "speculative" else build.make_autoregressive_engine(tgt)
    prompts = [[4, 5, 6], [1, 2], [7, 8, 9, 10, 11]]
    kw = dict(seed=3, sampling_params=sampling.SamplingConfig(temperature=3.0),
              max_new_tokens=[20, 35, 9], stop_tokens=[25, 20])
    ref = eng.generate(prompts, **kw)
    assert any(ref.finished_by_stop) and len({len(t) for t in ref.tokens}) > 2  # ragged
    for chunk in (1, 3):
        st = eng.stream(prompts, chunk=chunk, **kw)
        got, chunks = [[] for _ in prompts], 0
        for new in st:
            chunks += 1
            assert len(new) == len(prompts)
            for i, x in enumerate(new):
                got[i] += x
        assert got == ref.tokens
        assert st.output.tokens == ref.tokens and st.output.finished_by_stop == ref.finished_by_stop
        if which == "speculative":
            assert [s.rounds for s in st.output.stats] == [s.rounds for s in ref.stats]
            assert chunks == -(-max(s.rounds for s in ref.stats) // chunk)
    for chunk in (0, 2 ** 31):  # refused when the stream is made, not at its first chunk
        with pytest.raises(ValueError, match="chunk"):
            eng.stream(prompts, chunk=chunk, **kw)
    # a loop left early goes on where it stopped, and a stream read to its end keeps its
    # output (a second read once set it to None; a bug hunt)
    st = eng.stream(prompts, chunk=2, **kw)
    got = next(iter(st))
    for new in st:
        got = [a + b for a, b in zip(got, new)]
        break
    rest = st.run()
    assert rest.tokens == ref.tokens and st.output is rest
    assert all(t[:len(g)] == g for t, g in zip(ref.tokens, got)) and any(got)  # what it yielded: a prefix
    assert list(st) == [] and st.run() is rest


# ---------------------------------------------------------------------------- long prompts


def test_chunked_prefill_equals_one_forward():
    from specjax.models.base import prefill

    m = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2), seed=4)
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(0, 64, (3, 128)), jnp.int32)
    lens = jnp.asarray([128, 70, 33], jnp.int32)  # 33: only three of the eight chunks run
    one_c, one_h = prefill(m, m.params, toks, lens, m.init_cache(3, 160), chunk=128, return_hidden=True)
    ch_c, ch_h = jax.jit(lambda p, t, l, c: prefill(m, p, t, l, c, chunk=16, return_hidden=True))(
        m.params, toks, lens, m.init_cache(3, 160))
    for b, n in enumerate(np.asarray(lens)):
        np.testing.assert_allclose(ch_c.k[:, b, :, :n], one_c.k[:, b, :, :n], atol=1e-5)
        np.testing.assert_allclose(ch_c.v[:, b, :, :n], one_c.v[:, b, :, :n], atol=1e-5)
        np.testing.assert_allclose(ch_h[b, :n], one_h[b, :n], atol=1e-4)
    # the chunks past the longest prompt are skipped (the last rows stay as initialised)
    short = jnp.asarray([20, 20, 20], jnp.int32)
    c2, _ = prefill(m, m.params, toks, short, m.init_cache(3, 160), chunk=16)
    assert not np.asarray(c2.k[:, :, :, 32:]).any() and np.asarray(c2.k[:, :, :, 16:32]).any()


def test_engines_with_a_small_prefill_chunk_give_the_same_greedy_tokens():
    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    dft = LlamaLM.init(tiny_config(vocab_size=64, n_layers=1, dim=32), seed=6)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, n).tolist() for n in (70, 17, 40)]
    kw = dict(seed=0, sampling_params=sampling.SamplingConfig(temperature=0.0), max_new_tokens=24)
    base = engine.AutoregressiveEngine(tgt).generate(prompts, **kw).tokens
    for eng in (engine.AutoregressiveEngine(tgt, prefill_chunk=16),
                engine.SpeculativeEngine(tgt, DraftModelProposer(dft, 3), prefill_chunk=16)):
        assert eng.generate(prompts, **kw).tokens == base
    with pytest.raises(ValueError, match="power of two"):
        engine.AutoregressiveEngine(tgt, prefill_chunk=24)


def test_full_pass_off_the_cpu_changes_speed_only(target, monkeypatch):
    """Prompt lookup drafts nothing where nothing matches; off the CPU the round still runs
    the K+1-token pass (engine.skip_empty_rounds): no conditional, the same tokens and
    statistics as the 1-token step the CPU runs there. One row of a 256-token model, so
    that rounds where no row drafted occur (its position 0 is reached in fewer rounds than
    it ran), and rows of the V=8 model that draft now and then."""
    wide = LlamaLM.init(tiny_config(vocab_size=256, n_layers=1), seed=3)
    cases = [(wide, [[40, 50, 6]], sampling.SamplingConfig(temperature=1.0), 256),
             (target, [[1, 2, 3, 1, 2, 3, 1], [4, 5, 6], [7, 7, 7, 7]],
              sampling.SamplingParams.create(3, temperature=[0.0, 1.0, 0.7]), V)]
    for tgt, prompts, cfg, vocab in cases:
        outs, conds = [], []
        for skip in (True, False):
            monkeypatch.setattr(engine, "skip_empty_rounds", lambda skip=skip: skip)
            eng = engine.SpeculativeEngine(tgt, PromptLookupProposer(vocab_size=vocab, k=3), "token")
            outs.append(eng.generate(prompts, seed=4, sampling_params=cfg, max_new_tokens=12))
            conds.append(eng.lower(prompts, seed=4, sampling_params=cfg, max_new_tokens=12)
                         .as_text().count("stablehlo.case"))
        assert conds[1] == conds[0] - 1
        assert outs[0].tokens == outs[1].tokens
        # (repr: the per-position acceptance of a position never reached is nan in both)
        stats = [[repr(dataclasses.asdict(s)) for s in o.stats] for o in outs]
        assert stats[0] == stats[1]
        if len(prompts) == 1:  # some rounds drafted nothing at all, some drafted
            st = outs[0].stats[0]
            assert 0 < st.reached_per_position[0] < st.rounds, dataclasses.asdict(st)
