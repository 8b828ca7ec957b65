"""Adaptive speculation length (``k="auto"``): exactness of the whole loop when the number
of draft tokens changes from round to round (and from row to row), the cost model, and
a mutant that peeks at the current round and must fail the law test."""
from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import engine, sampling, verify
from specjax.audit import chi_square_test
from specjax.drafts import DraftModelProposer
from specjax.models import cpu_kernels
from specjax.models.llama import LlamaLM, tiny_config
from tests.engine_law import exact_chain_law, histogram

V = 8
PROMPT = [1, 5, 2]
ROWS = 40_000
ALPHA_SIG = 1e-3
K = 2


class _Cycle(engine.SpeculativeEngine):
    """Each row drafts (gen_len + prompt length) mod (K+1) tokens: j changes every round,
    rows of a batch differ, plain rounds (j = 0 for every row) happen; history only."""

    def choose_k(self, c, costs, inputs, tail=True):
        return (c.state.seq_len) % (self.k + 1)


class _Refilled(engine.SpeculativeEngine):
    """The rule as a dataset run uses it (rows' own rate: slots are refilled): in one
    batch of 40,000 rows that wait for the slowest, the batch's rate never pays for a
    draft, and the law test would see plain rounds only."""

    def choose_k(self, c, costs, inputs, tail=True):
        return super().choose_k(c, costs, inputs, False)


class _Peek(engine.SpeculativeEngine):
    """MUTANT: drafts 1 token for the rows whose acceptance uniform at this round's first
    draft position is below 1/2, none for the others: the choice looks at the current
    round's draws (a drafted token is then accepted with probability min(1, 2p/q), not
    min(1, p/q), so the output leans toward the draft's law)."""

    def choose_k(self, c, costs, inputs, tail=True):
        # the uniforms the round's verifier draws its acceptances with (u_0: position 0)
        u = jax.vmap(lambda rk: verify._acceptance_uniforms(rk, 1)[0])(self.round_keys(c, inputs[2]))
        return jnp.where(u < 0.5, 1, 0).astype(jnp.int32)


def _hist(eng, cfg, n, rows=ROWS):
    out = eng.generate([PROMPT] * rows, seed=0, row_indices=np.arange(rows), sampling_params=cfg,
                       max_new_tokens=n)
    toks = np.array(out.tokens)
    assert toks.shape == (rows, n)
    return histogram(toks, V, n), out


@pytest.fixture(scope="module")
def law(target):
    return exact_chain_law(target, PROMPT, 4, sampling.SamplingConfig(temperature=1.0))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["rule/token", "cycle/block", "mutant_peek/token"])
def test_adaptive_k_law(target, draft, law, variant):
    kind, method = variant.split("/")
    cfg = sampling.SamplingConfig(temperature=1.0)
    # costs that make the rule switch as evidence comes in: with the prior (a = 0.5) it
    # drafts 2, and with this draft's acceptance it falls back to 1 or 0
    cls = {"rule": _Refilled, "cycle": _Cycle, "mutant_peek": _Peek}[kind]
    # the mutant fails by far on an eighth of the rows (p = 0 to double precision on 10,000;
    # the chi-square statistic scales with the rows: printed below)
    rows = ROWS // 8 if kind == "mutant_peek" else ROWS
    eng = cls(target, DraftModelProposer(draft, K), method, adaptive=True, costs={rows: [1.0, 1.2, 1.35]})
    hist, out = _hist(eng, cfg, 4, rows=rows)
    used = np.asarray(out.raw["k_rounds"])
    chi = chi_square_test(hist, law)
    if kind == "mutant_peek":
        print(f"mutant_peek: chi-square {chi.statistic:.1f} on {chi.dof} dof, p={chi.p_value:.3g}")
        assert chi.p_value < 1e-6, f"the peeking mutant passed (p={chi.p_value:.3g}): no power"
        return
    assert (used > 0).sum() >= 2, f"only one j was used: {used}"  # the law covers switching
    assert chi.p_value > ALPHA_SIG, f"{variant}: chi-square {chi.statistic:.1f}, p={chi.p_value:.2e}, j used {used}"


# the 3-row batch the engine tests below share (with the same shapes: batch 3, the prompt
# bucket of 16, the output bucket of 32 for max_new_tokens 12, 16 or 20), so that each
# engine compiles its program once for the whole module
PROMPTS3 = [[1, 5, 2], [3, 3, 1, 4], [2, 6, 7, 1, 1]]


@pytest.fixture(scope="module")
def auto_token(target, draft):
    """k="auto" with the engine's own rule (token method): one program for every cost
    table (the costs are its argument); each test sets the table it uses."""
    return engine.SpeculativeEngine(target, DraftModelProposer(draft, K), "token", adaptive=True)


@pytest.fixture(scope="module")
def fixed_token(target, draft):
    """The fixed-K engines (token method), K = 1 and K = 2."""
    return {j: engine.SpeculativeEngine(target, DraftModelProposer(draft, j), "token") for j in (1, 2)}


def test_a_rows_tokens_do_not_depend_on_the_other_rows_k(target, draft):
    """Rows with different j in one round: each row's tokens are those it gets alone
    (capped num_draft, keys by position), at T=1, with plain rounds in between. "Alone": in
    a batch of copies of the row (same key by row index), so that every row of the round
    has the row's own j, as in a batch of one (and the batch's program is reused)."""
    eng = _Cycle(target, DraftModelProposer(draft, K), "token", adaptive=True, costs={3: [1, 1, 1]})
    prompts = PROMPTS3
    cfg = dict(sampling_params=sampling.SamplingConfig(temperature=1.0), max_new_tokens=12)
    together = eng.generate(prompts, seed=3, **cfg)
    plain = 0
    for i, p in enumerate(prompts):
        alone = eng.generate([p] * 3, seed=3, row_indices=[i] * 3, **cfg)
        for r in range(3):
            assert alone.tokens[r] == together.tokens[i]
            assert alone.stats[r].rounds == together.stats[i].rounds
        plain += int(alone.raw["k_rounds"][0])
    assert plain > 0 and np.count_nonzero(together.raw["k_rounds"]) >= 2


@pytest.mark.parametrize("j", [1, 2])
def test_a_rule_that_always_drafts_j_gives_the_fixed_k_engines_tokens(auto_token, fixed_token, j):
    """k=auto whose costs make j the best choice every round draws what the fixed K=j
    engine draws (same keys, same rounds), at T=1 over a batch: its branches add no draw
    and skip none. (Measured on SmolLM2 at batch 1: the same tokens for all 16 benchmark
    prompts, and 1.0-1.4% more time than fixed K=1.)"""
    costs = [10.0, 1.0, 100.0] if j == 1 else [10.0, 5.0, 1.0]
    auto, fixed = auto_token, fixed_token[j]
    auto.set_costs(3, costs)
    prompts = PROMPTS3
    cfg = dict(seed=5, sampling_params=sampling.SamplingConfig(temperature=1.0), max_new_tokens=16)
    a, f = auto.generate(prompts, **cfg), fixed.generate(prompts, **cfg)
    assert a.tokens == f.tokens
    assert [s.rounds for s in a.stats] == [s.rounds for s in f.stats]
    assert np.asarray(a.raw["k_rounds"]).tolist() == [0 if i != j else int(np.asarray(a.raw["iterations"]))
                                                      for i in range(K + 1)]


def test_adaptive_greedy_equals_autoregressive_greedy(target, draft):
    ar = engine.AutoregressiveEngine(target).generate([PROMPT, [4, 4]], seed=0, max_new_tokens=16, greedy=True)
    eng = _Cycle(target, DraftModelProposer(draft, K), "greedy", adaptive=True, costs={2: [1, 1.1, 1.2]})
    assert eng.generate([PROMPT, [4, 4]], seed=0, max_new_tokens=16).tokens == ar.tokens


def test_the_rule_drafts_when_it_pays_and_not_when_it_does_not():
    def auto(acc, reach, since=0):
        z = engine.AutoState.zeros(3)
        return z.replace(accepted=jnp.asarray(acc, jnp.float32), reached=jnp.asarray(reach, jnp.float32),
                         since=jnp.int32(since))
    high = auto([90, 80, 70], [100, 90, 80])
    low = auto([5, 1, 0], [100, 5, 1])
    flat = [1.0, 1.1, 1.15, 1.2]
    steep = [1.0, 1.9, 2.8, 3.7]
    assert int(engine.choose_k(high, flat)) == 3
    assert int(engine.choose_k(low, flat)) == 0
    assert int(engine.choose_k(high, steep)) == 0  # 2.7 tokens for 1.9x the cost: no
    assert int(engine.choose_k(low, flat)) == 0 and int(engine.choose_k(auto([5, 1, 0], [100, 5, 1], 40), flat)) == 1  # probe
    assert int(engine.choose_k(engine.AutoState.zeros(3), [1.0, np.inf, 1.0, np.inf])) == 2  # inf: never


def test_early_rejections_do_not_stop_drafting_but_a_run_of_them_does():
    """Batch 1, a j=1 round 1.34 plain rounds (2 Intel cores): a call's first rejections
    weigh against the prior's 0.5 (worth AUTO_PRIOR_WEIGHT = 8 observations), so two of
    them leave drafting on (a prior worth 2, the mutant, turned it off after one, for the
    next 32+ rounds, most of a short call), while a run of rejections turns it off."""
    costs = [1.0, 1.34, 1.75, 2.2]
    one = jnp.ones((1,), jnp.int32)
    st = engine.AutoState.zeros(3)
    assert int(engine.choose_k(st, costs, jnp.asarray([48]))) == 1  # the prior alone: draft
    js = []
    for _ in range(12):  # every first draft rejected
        st = st.drafted(1, one > 0, one, 0 * one)
        js.append(int(engine.choose_k(st, costs, jnp.asarray([48]))))
    assert js[:2] == [1, 1], js
    assert js[-1] == 0 and js.index(0) >= 2, js
    with mock.patch.object(engine, "AUTO_PRIOR_WEIGHT", 2.0):
        assert int(engine.choose_k(engine.AutoState.zeros(3).drafted(1, one > 0, one, 0 * one), costs,
                                   jnp.asarray([48]))) == 0


def test_the_probe_interval_doubles_while_probes_do_not_pay():
    """Unpaid probes come after 32, 64, 128, 256, 256 ... plain rounds (a probe is 1-2
    steps of overhead where drafting does not pay, e.g. at batch 16 on CPU); when the rule
    drafts of itself the interval is 32 again. The mutant, a fixed interval, fails."""
    low = (jnp.asarray([5.0, 1, 0]), jnp.asarray([100.0, 5, 1]))
    high = (jnp.asarray([90.0, 80, 70]), jnp.asarray([100.0, 90, 80]))
    flat = jnp.asarray([1.0, 1.1, 1.15, 1.2])

    @jax.jit
    def rnd(st, evidence):
        st = st.replace(accepted=evidence[0], reached=evidence[1])
        j = engine.choose_k(st, flat)
        one = jnp.ones((1,), jnp.int32)
        return jax.lax.cond(j > 0, lambda s: s.drafted(1, one > 0, one, 0 * one), lambda s: s.plain(), st), j

    st, probes = engine.AutoState.zeros(3), []
    for r in range(900):
        st, j = rnd(st, low)
        if int(j):
            probes.append(r)
    assert np.diff(probes).tolist()[:4] == [65, 129, 257, 257] and probes[0] == 32
    assert int(st.gap) == engine.AUTO_PROBE_MAX
    st, j = rnd(st, high)  # drafts of itself: the interval is back to 32
    assert int(j) > 0 and int(st.gap) == engine.AUTO_PROBE


def test_a_costly_probe_waits_until_it_is_a_small_share_of_the_time():
    """A probe that costs x = 1 plain round more (costs 1, 2, 3, 4: drafting at a large
    batch) comes after at least x / AUTO_PROBE_SHARE = 100 plain rounds, then the doubled
    intervals once they are longer: 100, 101, 129, 257. The mutant, the interval without
    the minimum (probes after 32, 65, 129), fails."""
    low = (jnp.asarray([5.0, 1, 0]), jnp.asarray([100.0, 5, 1]))
    steep = jnp.asarray([1.0, 2.0, 3.0, 4.0])
    one = jnp.ones((1,), jnp.int32)

    def run(rule):
        @jax.jit
        def rnd(st):
            st = st.replace(accepted=low[0], reached=low[1])
            j = rule(st, steep)
            return jax.lax.cond(j > 0, lambda s: s.drafted(1, one > 0, one, 0 * one), lambda s: s.plain(), st), j

        st, probes = engine.AutoState.zeros(3), []
        for r in range(700):
            st, j = rnd(st)
            if int(j):
                probes.append(r)
        return probes

    assert engine.AUTO_PROBE_SHARE == 0.01
    probes = run(engine.choose_k)
    assert probes[0] == 100 and np.diff(probes).tolist()[:3] == [101, 129, 257], probes

    def mutant(st, costs):  # the interval alone: a probe at batch 16 every 32-256 rounds
        with mock.patch.object(engine, "AUTO_PROBE_SHARE", 1e9):
            return engine.choose_k(st, costs)

    bad = run(mutant)
    assert bad[0] == 32 and np.diff(bad).tolist()[:2] == [65, 129]


def test_measured_costs_are_smoothed_in_j():
    """Drafting rounds' costs become their line in j (a noisy 24.0, 27.2, 27.8 would
    never choose j=2); the plain round's cost stays; K=2 tables are left as measured."""
    got = engine.smooth_costs([21.7, 24.0, 27.2, 27.8])
    assert got[0] == 21.7 and np.allclose(got[1:], [24.433, 26.333, 28.233], atol=1e-3)
    assert np.allclose(np.diff(got[1:]), 1.9)
    assert engine.smooth_costs([20.0, 30.0, 41.0]).tolist() == [20.0, 30.0, 41.0]
    assert engine.smooth_costs([30.0, 20.0, 25.0, 30.0])[1] == 30.0  # never below a plain round


def test_calibration_passes_are_sized_by_the_warm_up_rounds():
    # rounds of 5 ms: a second of them is 200, so the whole 32 tokens; rounds of 0.3 s at
    # 8 tokens in 6 rounds: the 8-round floor, 11 tokens
    assert engine.calibration_tokens(0.04, 8, 8, 32) == 32
    assert engine.calibration_tokens(0.3 * 6, 6, 8, 32) == 8 * 8 // 6 + 1
    assert engine.calibration_tokens(0.05 * 8, 8, 8, 32) == 20  # 0.05 s a round: 20 rounds
    assert engine.calibration_tokens(0.0, 0, 8, 32) == 32  # an empty warm-up: all of them


def test_calibration_times_the_rounds_after_the_first(target, draft):
    """The timer leaves out the prefill and the first round (a drafting j's first round
    also makes a deferred draft's prompt pass, once per generation); a generation of one
    round is timed over that round."""
    eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, K), "token", adaptive=True)
    plain = np.array([1.0, np.inf, np.inf])  # j = 0 forced: a token a round
    for n, tokens, rounds in ((7, 7, 6), (1, 1, 1), (7, 5, 4)):  # (7, 5): a value, the same program
        batch = eng.prepare([PROMPT] * 2, seed=0, max_new_tokens=n, sampling_params=dict(temperature=1.0))
        dt, got = eng._sized_timer(batch, plain, tokens)()
        assert got == rounds and dt > 0, (n, tokens, got)
    assert sum(sig[0] == "_advance" for sig in eng._compiled) == 1


def test_costs_are_measured_once_and_saved(target, draft, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, K), "token", adaptive=True)
    c = eng.costs_for(2)
    assert c.shape == (K + 1,) and np.all(c > 0) and np.all(np.isfinite(c))
    # the rounds are timed through the streamed programs, whatever call measures them
    assert {sig[0] for sig in eng._compiled} == {"_start", "_advance", "_finish"}
    assert engine.cost_file().exists()
    again = engine.SpeculativeEngine(target, DraftModelProposer(draft, K), "token", adaptive=True)
    assert np.allclose(again.costs_for(2), c) and not again._compiled  # read, not measured
    other = engine.SpeculativeEngine(target, DraftModelProposer(draft, 1), "token", adaptive=True)
    assert other.cost_key(2) != eng.cost_key(2)
    # a streamed run (the CLI's default) or a dataset run measures with the programs it
    # compiles anyway: no whole-generation program compiled just to time rounds. (A cost
    # file of its own, so that it has no table to read and must measure; a batch of 2 rows
    # in the prompt bucket of 32 and the output bucket of 32: the shapes of the measure
    # above, whose compiled programs it reuses.)
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "streamed"))
    streamed = engine.SpeculativeEngine(target, DraftModelProposer(draft, K), "token", adaptive=True)
    assert not streamed.has_costs(2)
    streamed.compile([[1, 2, 3] * 7, [4, 5, 6] * 6], stream=True, seed=0, max_new_tokens=8)
    assert streamed.has_costs(2) and engine._load_costs().get(streamed.cost_key(2)) is not None
    assert {sig[0] for sig in streamed._compiled} == {"_start", "_advance", "_finish"}
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    # other CPU kernels (a new build of models/kernels): the table is measured again
    key = eng.cost_key(2)
    monkeypatch.setattr(cpu_kernels, "kernels_id", lambda: "another-build")
    rebuilt = engine.SpeculativeEngine(target, DraftModelProposer(draft, K), "token", adaptive=True)
    if jax.devices()[0].platform == "cpu":
        assert rebuilt.cost_key(2) != key and not rebuilt.has_costs(2)
    with pytest.raises(ValueError, match="K\\+1"):
        eng.set_costs(2, [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        eng.set_costs(2, [1.0, -1.0, 2.0])


class _Phases(engine.SpeculativeEngine):
    """j = 2, then plain, then 1, then plain rounds to the end (a plain round emits one token,
    so the last commit is never cut by max_new_tokens and the state can be compared)."""

    def choose_k(self, c, costs, inputs, tail=True):
        g = c.state.gen_len
        return jnp.where(g < 6, 2, jnp.where(g < 10, 0, jnp.where(g < 13, 1, 0))).astype(jnp.int32)


@pytest.mark.parametrize("kind", ["eagle", "draft_model"] + [pytest.param(k, marks=pytest.mark.extended) for k in (
    "eagle3", "eagle_backlog3", "eagle_no_backlog", "eagle_chunked")])
def test_proposer_state_after_plain_rounds_is_what_a_fresh_prefill_gives(kind):
    """Plain rounds (j = 0) skip ``propose``: the proposer must still end up where a fresh
    ``init`` over the committed sequence puts it (EAGLE head: its predicted feature and KV
    over the (feature, token) pairs; draft model: its KV cache over s[:c-2]). ``eagle3``: a
    head on several layers' hidden states, which the engine asks the target for in the
    prefill, the verify pass and the plain step alike. The EAGLE head defers its plain
    rounds' steps (``plain_backlog``, 32: caught up in one forward before the next drafting
    round; ``eagle_backlog3``: 3, so the 4 and 7 plain rounds in a row here overflow it and
    the engine catches up in between; ``eagle_chunked``: 8, fed 2 pairs per forward;
    ``eagle_no_backlog``: one step per plain round); the
    state the run ends with still has a backlog, which ``catch_up`` feeds."""
    from specjax.drafts import EagleProposer
    from specjax.models.eagle import EagleConfig, EagleModel

    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    if kind.startswith("eagle"):
        cfg = EagleConfig.for_target(tgt.config, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32,
                                     feature_layers=(1, 2, 0) if kind == "eagle3" else ())
        backlog = {"eagle_backlog3": 3, "eagle_no_backlog": 0, "eagle_chunked": 8}.get(kind, 32)
        prop = EagleProposer(EagleModel.for_target(tgt, cfg, seed=1), K, plain_backlog=backlog,
                             catch_up_chunk=2 if kind == "eagle_chunked" else 32)
    else:
        prop = DraftModelProposer(LlamaLM.init(tiny_config(vocab_size=64, n_layers=1, dim=32), seed=6), K)
    eng = _Phases(tgt, prop, "token", adaptive=True, costs={1: [1, 1, 1]})
    prompt = [3, 9, 27, 17, 4]
    out = eng.generate([prompt], seed=1, max_new_tokens=17, sampling_params=sampling.SamplingConfig(temperature=1.0))
    assert out.raw["k_rounds"][0] > 0 and out.raw["k_rounds"][1:].sum() > 0
    seq = np.array([prompt + out.tokens[0]], np.int32)
    c = seq.shape[1]
    cache_len = eng.target.init_cache(1, 64).max_len
    st = out.raw["proposer_state"]
    if kind.startswith("eagle"):
        assert ("n" in st) == (backlog > 0)
        if backlog:
            assert 0 < int(st["n"][0]) <= backlog  # the last plain rounds wait
            st = prop.catch_up(prop.params, st, jnp.asarray(seq), jnp.array([c]))
        hidden = tgt.apply(tgt.params, jnp.asarray(seq), tgt.init_cache(1, cache_len),
                           return_hidden=prop.hidden_layers or True).hidden
        fresh = prop.init(prop.params, jnp.asarray(seq), jnp.array([c]), cache_len, hidden)
        np.testing.assert_allclose(np.asarray(st["h"]), np.asarray(fresh["h"]), atol=2e-5)
        n = c - 1
        got, want = st["cache"], fresh["cache"]
    else:
        fresh = prop.init(prop.params, jnp.asarray(seq), jnp.array([c]), cache_len)
        n = c - 2
        got, want = st, fresh
    np.testing.assert_allclose(np.asarray(got.k)[:, 0, :, :n], np.asarray(want.k)[:, 0, :, :n], atol=2e-5)
    np.testing.assert_allclose(np.asarray(got.v)[:, 0, :, :n], np.asarray(want.v)[:, 0, :, :n], atol=2e-5)


def test_a_run_that_never_drafts_never_runs_the_eagle_head():
    """An adaptive engine leaves the EAGLE head's pass over the prompt in its backlog
    (``init_deferred``), so a run whose rounds are all plain never runs the head: its cache
    is still empty at the end and every pair (the prompt's and the plain rounds') waits,
    and catching up gives what a fresh prefill over the whole sequence gives. A fixed-K
    engine runs the head over the prompt at once (it drafts in its first round)."""
    from specjax.drafts import EagleProposer
    from specjax.models.eagle import EagleConfig, EagleModel

    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    cfg = EagleConfig.for_target(tgt.config, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32)
    prop = EagleProposer(EagleModel.for_target(tgt, cfg, seed=1), K, plain_backlog=32, catch_up_chunk=4)
    prompts = [[3, 9, 27, 17, 4], [5, 1, 8]]
    sp = sampling.SamplingConfig(temperature=1.0)
    eng = engine.SpeculativeEngine(tgt, prop, "token", adaptive=True, costs={2: [1, np.inf, np.inf]})
    out = eng.generate(prompts, seed=2, max_new_tokens=6, sampling_params=sp)
    assert out.raw["k_rounds"][1:].sum() == 0
    st = out.raw["proposer_state"]
    lens = np.array([len(p) + len(t) for p, t in zip(prompts, out.tokens)])
    assert np.asarray(st["cache"].lengths).tolist() == [0, 0]
    assert np.asarray(st["n"]).tolist() == (lens - 1).tolist()
    seq = np.zeros((2, lens.max()), np.int32)
    for i, (p, t) in enumerate(zip(prompts, out.tokens)):
        seq[i, : lens[i]] = p + t
    cache_len = st["cache"].max_len
    st = prop.catch_up(prop.params, st, jnp.asarray(seq), jnp.asarray(lens))
    hidden = tgt.apply(tgt.params, jnp.asarray(seq), tgt.init_cache(2, cache_len), return_hidden=True).hidden
    fresh = prop.init(prop.params, jnp.asarray(seq), jnp.asarray(lens), cache_len, hidden)
    np.testing.assert_allclose(np.asarray(st["h"]), np.asarray(fresh["h"]), atol=2e-5)
    for i in range(2):
        m = lens[i] - 1
        np.testing.assert_allclose(np.asarray(st["cache"].k)[:, i, :, :m], np.asarray(fresh["cache"].k)[:, i, :, :m], atol=2e-5)
    # the fixed engine's start (its prefill), not a whole run: what it leaves the head with
    fixed = engine.SpeculativeEngine(tgt, prop, "token")
    args, static = fixed._call_args(fixed.prepare(prompts, seed=2, max_new_tokens=1, sampling_params=sp))
    st = fixed._executable(args, static, "_start")(*args).proposer_state
    assert (np.asarray(st["cache"].lengths) > 0).all() and not np.asarray(st["n"]).any()


def test_chunked_catch_up_of_ragged_backlogs_is_a_fresh_prefill():
    """Rows with backlogs of 6 and 3 pairs (a row that finished stops adding), fed 2 pairs
    per forward (as many forwards as the longest needs) or in one: the head's state is what
    a fresh ``init`` over each row's committed sequence gives."""
    from specjax.drafts import EagleProposer
    from specjax.models.eagle import EagleConfig, EagleModel

    tgt = LlamaLM.init(tiny_config(vocab_size=64, n_layers=2, dim=32), seed=5)
    cfg = EagleConfig.for_target(tgt.config, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32)
    model = EagleModel.for_target(tgt, cfg, seed=1)
    seq = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 16)), jnp.int32)
    plen, n = np.array([5, 4]), np.array([6, 3])
    c = jnp.asarray(plen + n, jnp.int32)
    cache_len = 32
    hidden = tgt.apply(tgt.params, seq, tgt.init_cache(2, cache_len), return_hidden=True).hidden
    for chunk in (2, 8):
        prop = EagleProposer(model, K, plain_backlog=8, catch_up_chunk=chunk)
        st = prop.init(prop.params, seq[:, :5], jnp.asarray(plen), cache_len, hidden[:, :5])
        back = np.zeros(st["backlog"].shape, np.float32)
        for b in range(2):  # entry j: the target's hidden state after s[c - 1 - n + j]
            back[b, : n[b]] = np.asarray(hidden[b, plen[b] - 1: plen[b] - 1 + n[b]])
        st = dict(st, backlog=jnp.asarray(back), n=jnp.asarray(n, jnp.int32))
        st = prop.catch_up(prop.params, st, seq, c)
        fresh = prop.init(prop.params, seq, c, cache_len, hidden)
        np.testing.assert_allclose(np.asarray(st["h"]), np.asarray(fresh["h"]), atol=2e-5)
        assert np.asarray(st["cache"].lengths).tolist() == (plen + n - 1).tolist()
        for b in range(2):
            m = plen[b] + n[b] - 1
            np.testing.assert_allclose(np.asarray(st["cache"].k)[:, b, :, :m], np.asarray(fresh["cache"].k)[:, b, :, :m], atol=2e-5)
            np.testing.assert_allclose(np.asarray(st["cache"].v)[:, b, :, :m], np.asarray(fresh["cache"].v)[:, b, :, :m], atol=2e-5)


def _slowest_row_rate(accept, j, rows, budget, reps=4000, seed=0):
    """Monte Carlo: tokens per round of a batch of ``rows`` rows that each make ``budget``
    tokens drafting j per round (acceptance ``accept[i]`` at position i, independent),
    the batch running until its last row is done."""
    rng = np.random.default_rng(seed)
    made, rounds = np.zeros((reps, rows)), np.zeros((reps, rows))
    while (made < budget).any():
        running = made < budget
        acc = np.cumprod(rng.random((reps, rows, j)) < np.asarray(accept[:j]), axis=2).sum(axis=2)
        made = np.where(running, np.minimum(made + 1 + acc, budget), made)
        rounds += running
    return budget / rounds.max(axis=1).mean()


@pytest.mark.parametrize("accept", [[0.45, 0.45, 0.45], [0.7, 0.6, 0.5]])
def test_the_batch_rate_is_that_of_its_slowest_row(accept):
    """``batch_tokens_per_round`` against a simulation of rows that wait for the slowest:
    within 3% for 1, 4 and 16 rows of 48 or 200 tokens. The mutant, a row's own rate
    E_j (what the rule used before), is 12-20% too high at 16 rows x 48 tokens."""
    surv = jnp.cumprod(jnp.asarray(accept, jnp.float32))
    e = jnp.concatenate([jnp.ones((1,), jnp.float32), 1.0 + jnp.cumsum(surv)])
    for rows, budget in ((1, 48), (4, 48), (16, 48), (16, 200)):
        got = np.asarray(engine.batch_tokens_per_round(e, surv, jnp.full((rows,), budget)))
        sim = np.array([_slowest_row_rate(accept, j, rows, budget) for j in range(4)])
        assert got[0] == 1.0 and np.allclose(got, sim, rtol=0.03), (rows, budget, got, sim)
        if (rows, budget) == (16, 48):
            assert not np.allclose(np.asarray(e), sim, rtol=0.1)  # the mutant
    # rows far below the longest budget (or done) do not hold the batch up; many rows
    # that need few tokens: some row rejects every round, the rate is a plain step's
    one = np.asarray(engine.batch_tokens_per_round(e, surv, jnp.asarray([48])))
    assert np.allclose(np.asarray(engine.batch_tokens_per_round(e, surv, jnp.asarray([48, 10, 5, 0]))), one)
    assert np.allclose(np.asarray(engine.batch_tokens_per_round(e, surv, jnp.full((40_000,), 4))), 1.0)


def test_the_rule_counts_the_wait_for_the_slowest_row():
    """Batch 4 at T=1 on 2 CPU cores (acceptance ~0.45, a 1-draft round ~1.4 plain
    rounds; measured 2026-12-04): a row's own rate says draft 1 (1.45 tokens for 1.4x),
    the batch of 4 rows x 48 tokens waits for its slowest (about 1.37 tokens per round:
    plain); with 400 tokens left the wait is a smaller share (draft); a dataset run's
    refilled slots (``tail=False``) and one row: the row's own rate."""
    st = engine.AutoState.zeros(3).replace(accepted=jnp.full((3,), 450.0), reached=jnp.full((3,), 1000.0))
    costs = [1.0, 1.40, 1.6, 2.05]
    assert int(engine.choose_k(st, costs)) == 1
    assert int(engine.choose_k(st, costs, jnp.full((4,), 48))) == 0
    assert int(engine.choose_k(st, costs, jnp.full((4,), 400))) == 1
    assert int(engine.choose_k(st, costs, jnp.full((4,), 48), tail=False)) == 1
    assert int(engine.choose_k(st, costs, jnp.asarray([48]))) == 1


def test_no_probe_where_the_batch_has_too_few_tokens_left_to_use_it():
    """After 40 plain rounds a probe is due (gap 32), unless the fixed batch's rows have
    fewer tokens left than that (the evidence would come too late); a dataset run's slots
    are refilled, so it probes. The mutant, the probe without the check, drafts at 20."""
    st = engine.AutoState.zeros(3).replace(accepted=jnp.asarray([5.0, 1, 0]), reached=jnp.asarray([100.0, 5, 1]),
                                           since=jnp.int32(40))
    flat = [1.0, 1.1, 1.15, 1.2]
    assert int(engine.choose_k(st, flat)) == 1 and int(engine.choose_k(st, flat, jnp.full((4,), 100))) == 1
    assert int(engine.choose_k(st, flat, jnp.full((4,), 20))) == 0
    assert int(engine.choose_k(st, flat, jnp.full((4,), 20), tail=False)) == 1


class _Runs(engine.SpeculativeEngine):
    """j by the round index: 0 for rounds 0-2, 1 for rounds 3-5, 0 again, ... (history only)."""

    def choose_k(self, c, costs, inputs, tail=True):
        return jnp.broadcast_to((c.round // 3) % 2, c.state.seq_len.shape).astype(jnp.int32)


def test_branches_entered_are_counted(target, draft, auto_token, fixed_token):
    """``raw["switches"]``: the loop's branches entered, one per call and one per change of
    j (each costs a GPU a few host syncs: the branch chain's conditionals); a fixed j enters
    one branch, a fixed-K engine none. (Over the module's 3-row batch: every row has the
    round's j, so rows that finish early change nothing.)"""
    cfg = dict(sampling_params=sampling.SamplingConfig(temperature=1.0), max_new_tokens=20, seed=1)
    runs = _Runs(target, DraftModelProposer(draft, K), "token", adaptive=True, costs={3: [1, 1, 1]})
    out = runs.generate(PROMPTS3, **cfg)
    rounds = int(out.raw["iterations"])
    assert rounds > 6 and int(out.raw["switches"]) == -(-rounds // 3), (rounds, out.raw["switches"])
    eng = auto_token
    for j in range(K + 1):  # one engine, one program: the costs are its argument
        eng.set_costs(3, [1.0 if i == j else np.inf for i in range(K + 1)])
        out = eng.generate(PROMPTS3, **cfg)
        assert int(out.raw["switches"]) == 1 and out.raw["k_rounds"][j] == out.raw["iterations"], j
    assert int(fixed_token[K].generate(PROMPTS3, **cfg).raw["switches"]) == 0
