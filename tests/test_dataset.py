"""Continuous batching (``generate_dataset``): every row's output is what it gets alone,
with ragged prompt lengths, ragged max_new_tokens and early stops; one compiled program
set for the whole run."""
from __future__ import annotations

import numpy as np
import pytest

from specjax import engine, sampling
from specjax.drafts import DraftModelProposer

V = 8


@pytest.fixture(scope="module")
def models(target, draft):  # the law-test models (tests/conftest.py)
    return target, draft


# One engine of each kind for the tests that run the same shapes (a program one compiled,
# kept by the engine, is the one another runs: test_a_second_run_with_other_stop_tokens_and_controls'
# first run is test_rows_equal_one_row_runs[autoregressive]'s). The insert tests make their own: they
# record what their engine traces.
@pytest.fixture(scope="module")
def engines(models):
    target, draft = models
    return {"speculative": engine.SpeculativeEngine(target, DraftModelProposer(draft, 3), "token"),
            "autoregressive": engine.AutoregressiveEngine(target)}


def _dataset(n=11, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, V, rng.integers(2, 20)).tolist() for _ in range(n)]
    return prompts, rng.integers(1, 30, n)


@pytest.mark.parametrize("which", ["speculative", pytest.param("autoregressive", marks=pytest.mark.extended)])
def test_rows_equal_one_row_runs(engines, which):
    eng = engines[which]
    prompts, max_new = _dataset()
    cfg = sampling.SamplingConfig(temperature=1.0)
    kw = dict(seed=5, sampling_params=cfg, stop_tokens=[0])
    seen = []
    out = eng.generate_dataset(prompts, batch_size=4, max_new_tokens=max_new, compact=True,
                               on_row=lambda i, row: seen.append(i), **kw)
    assert sorted(seen) == list(range(len(prompts))) and seen != list(range(len(prompts)))  # refilled out of order
    assert out.raw["inserts"] == len(prompts) - 4 and out.raw["batch_size"] == 4
    assert any(out.finished_by_stop) and not all(out.finished_by_stop)
    # the tail moved to fewer slots (4 -> 2 -> 1 here), and the stages add up
    sizes = [m for m, _ in out.raw["stages"]]
    assert sizes[0] == 4 and len(sizes) > 1 and sizes == sorted(sizes, reverse=True), out.raw["stages"]
    assert sum(it for _, it in out.raw["stages"]) == out.raw["iterations"]
    assert out.raw["slot_iterations"] == sum(m * it for m, it in out.raw["stages"])
    whole = eng.generate_dataset(prompts, batch_size=4, max_new_tokens=max_new, compact=False, **kw)
    assert whole.tokens == out.tokens and whole.raw["stages"] == [(4, whole.raw["iterations"])]
    # compact="auto" (the default) moves to the sizes the run above built
    auto = eng.generate_dataset(prompts, batch_size=4, max_new_tokens=max_new, **kw)
    assert auto.tokens == out.tokens and auto.raw["stages"] == out.raw["stages"]
    # sizes as a list (here only 1, whose programs the run above compiled)
    ones = eng.generate_dataset(prompts, batch_size=4, max_new_tokens=max_new, compact=[1], **kw)
    assert ones.tokens == out.tokens and {m for m, _ in ones.raw["stages"]} == {4, 1}
    with pytest.raises(ValueError, match="compact"):
        eng.generate_dataset(prompts, batch_size=4, max_new_tokens=max_new, compact=[2, 0], **kw)
    for i, p in enumerate(prompts):
        one = eng.generate([p], row_indices=[i], max_new_tokens=int(max_new[i]), **kw)
        assert one.tokens[0] == out.tokens[i], i
        assert one.finished_by_stop[0] == out.finished_by_stop[i]
        if out.stats is not None:
            assert one.stats[0].rounds == out.stats[i].rounds
            assert one.stats[0].accepted == out.stats[i].accepted
    # a second dataset with other values and lengths (same buckets): no new trace
    traces = eng.trace_count
    eng.generate_dataset(prompts[::-1], batch_size=4, max_new_tokens=max_new[::-1], **kw)
    assert eng.trace_count == traces


def test_insert_width():
    # a quarter of the power-of-two bucket (at least 16); the dataset's width past the chunk
    assert [engine.insert_width(n, 64, 512) for n in (1, 16, 17, 33, 40, 48, 49, 64)] == \
        [16, 16, 32, 48, 48, 48, 64, 64]
    assert [engine.insert_width(n, 1024, 512) for n in (65, 100, 130, 300, 512, 513)] == \
        [96, 128, 192, 384, 512, 1024]
    assert engine.insert_width(300, 1024, 256) == 1024 and engine.insert_width(40, 32, 512) == 32


@pytest.mark.parametrize("which", ["speculative", pytest.param("autoregressive", marks=pytest.mark.extended)])
def test_inserts_prefill_at_their_own_width(models, which):
    """A dataset whose prompt bucket is 64 (one prompt of 60 tokens) and whose inserted
    prompts have 20-47 tokens: they are prefilled in buffers of 32 and 48 tokens (two
    programs, none of 64), and every row is still what it gets alone (a buffer of 64 for
    those of 33-47 tokens; of 32 for that of 20, the program test_rows_equal_one_row_runs
    runs for its 17-token prompt: the same K, stop token and output bucket)."""
    target, draft = models
    if which == "speculative":
        eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, 3), "token")
    else:
        eng = engine.AutoregressiveEngine(target)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, V, n).tolist() for n in (60, 35, 40, 47, 20, 44, 38)]
    kw = dict(seed=1, sampling_params=dict(temperature=1.0), stop_tokens=[0], max_new_tokens=12)
    traced, insert = [], eng._insert_program
    at = 2 if which == "speculative" else 1  # the prompts in _call_args' arguments

    def recorded(carry, args_one, slot, **static):
        traced.append(args_one[at].shape)
        return insert(carry, args_one, slot, **static)

    eng._insert_program = recorded
    out = eng.generate_dataset(prompts, batch_size=2, **kw)
    assert sorted(traced) == [(1, 32), (1, 48)], traced
    for i, p in enumerate(prompts):
        one = eng.generate([p], row_indices=[i], **kw)
        assert one.tokens[0] == out.tokens[i], i


def test_inserts_with_a_chunked_prefill(models):
    """A prefill chunk of 16 and a dataset bucket of 64: prompts of up to 16 tokens are
    inserted as one 16-token forward, longer ones at the dataset's width in chunks (the
    chunks past the prompt skipped); every row is still what it gets alone."""
    target, _ = models
    eng = engine.AutoregressiveEngine(target, prefill_chunk=16)
    traced, insert = [], eng._insert_program

    def recorded(carry, args_one, slot, **static):
        traced.append(args_one[1].shape)
        return insert(carry, args_one, slot, **static)

    eng._insert_program = recorded
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, V, n).tolist() for n in (50, 7, 12, 30, 40, 16, 3)]
    kw = dict(seed=2, sampling_params=dict(temperature=1.0), max_new_tokens=10)
    out = eng.generate_dataset(prompts, batch_size=2, **kw)
    assert sorted(traced) == [(1, 16), (1, 64)], traced
    for i, p in enumerate(prompts):
        assert eng.generate([p], row_indices=[i], **kw).tokens[0] == out.tokens[i], i


def test_batch_of_one_and_larger_than_the_dataset(engines):
    eng = engines["autoregressive"]
    prompts, max_new = _dataset(5, seed=1)
    kw = dict(seed=2, max_new_tokens=max_new, sampling_params=dict(temperature=1.0))
    ref = eng.generate(prompts, **kw).tokens  # one batch: rows keep their dataset index
    assert eng.generate_dataset(prompts, batch_size=1, **kw).tokens == ref
    assert eng.generate_dataset(prompts, batch_size=64, **kw).tokens == ref
    with pytest.raises(ValueError, match="batch_size"):
        eng.generate_dataset(prompts, batch_size=0, **kw)
    with pytest.raises(TypeError, match="on_row must be a function"):
        eng.generate_dataset(prompts, batch_size=2, on_row=1, **kw)
    with pytest.raises(TypeError, match="greedy must be True or False"):
        eng.generate_dataset(prompts, batch_size=2, greedy="x", **kw)


def test_a_row_with_nothing_to_generate_frees_its_slot_at_once(engines):
    """A row with max_new_tokens 0 is done when it enters a slot: the slot is refilled
    before the loop runs on (it idled until another row finished: 40 loop iterations for
    20 + 0 + 20 tokens at batch 2; a bug hunt), also when every row is such a row."""
    eng = engines["autoregressive"]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 1], [2, 2]]
    kw = dict(seed=1, sampling_params=dict(temperature=1.0))
    for budget, iterations in (([20, 0, 20, 0], 20), ([0, 20, 0, 20], 20), ([0, 0, 0, 0], 0)):
        out = eng.generate_dataset(prompts, batch_size=2, max_new_tokens=budget, **kw)
        assert [len(t) for t in out.tokens] == budget and out.raw["iterations"] == iterations, out.raw
        assert out.tokens == eng.generate(prompts, max_new_tokens=budget, **kw).tokens


def test_adaptive_tail_borrows_the_next_larger_cost_table(models):
    """The tail moves to every size; a size with no table borrows the nearest larger one's
    (never the smaller sizes', which would draft more than pays), and never measures."""
    target, draft = models
    eng = engine.SpeculativeEngine(target, DraftModelProposer(draft, 2), "token", adaptive=True)
    assert eng._tail_sizes(16) == [8, 4, 2, 1]
    big, mid = [1.0, 3.0, 5.0], [1.0, 1.5, 2.0]
    eng.set_costs(16, big)
    eng.set_costs(4, mid)
    eng.calibrate = None  # measuring would fail
    costs = lambda m: eng._opts_at({}, m, 16).get("costs")  # noqa: E731
    assert costs(16) is None and costs(4) is None  # their own tables
    assert list(costs(8)) == big and list(costs(2)) == mid and list(costs(1)) == mid
    ar = engine.AutoregressiveEngine(target)
    assert ar._tail_sizes(12) == [6, 3, 1] and ar._tail_sizes(12, False) == []
    assert ar._tail_sizes(16, [1, 12, 6, 16, 20, 6]) == [12, 6, 1]


def test_a_second_run_with_other_stop_tokens_and_controls(engines):
    """An engine is reused (``build.make_engine`` keeps them): a dataset run whose stop
    tokens take a wider buffer, or that bans tokens, after one that did not, compiles its
    own tail programs (they were once looked up by the loop state's shapes alone, and the
    run failed when its tail moved to fewer slots); the rows are the one-batch run's."""
    eng = engines["autoregressive"]
    prompts, max_new = _dataset(7, seed=3)
    kw = dict(seed=1, max_new_tokens=max_new, sampling_params=dict(temperature=1.0))
    eng.generate_dataset(prompts, batch_size=4, stop_tokens=[0], compact=True, **kw)
    for more in (dict(stop_tokens=[0] * 5), dict(stop_tokens=[0], banned_tokens=[5])):
        got = eng.generate_dataset(prompts, batch_size=4, compact=True, **more, **kw)
        assert len(got.raw["stages"]) > 1, got.raw["stages"]  # the tail moved
        assert got.tokens == eng.generate(prompts, **more, **kw).tokens


def test_tail_pays():
    # 100 rounds left of 0.1 s at 16 slots: moving to 4 saves at most 100 * 0.1 * 3/4 = 7.5 s
    assert engine.tail_pays(100, 0.1, 16, 4, 7.4) and not engine.tail_pays(100, 0.1, 16, 4, 7.6)
    assert not engine.tail_pays(100, 0.1, 16, 8, 5.1)  # 5 s at most
    assert not engine.tail_pays(0, 0.1, 16, 1, 0.0) and not engine.tail_pays(100, 0.0, 16, 1, 0.0)


def test_auto_compact_builds_a_tail_size_only_where_it_pays(models, monkeypatch):
    """``compact="auto"`` (the default): a tail size not built yet is moved to only when
    ``tail_pays`` says so, asked with the largest token budget left among the running
    rows, the measured seconds per loop iteration at the current size and the seconds this
    size's programs took to build; ``compile(dataset_batch=B)`` builds no tail program
    then. The rows' tokens are the same either way."""
    target, _ = models
    prompts, max_new = _dataset(7, seed=4)
    kw = dict(seed=2, max_new_tokens=max_new, sampling_params=dict(temperature=1.0), stop_tokens=[0])
    eng = engine.AutoregressiveEngine(target)
    eng.compile(prompts, dataset_batch=4, **kw)
    built = len(eng._compiled)
    asked = []

    def never(*a):
        asked.append(a)
        return False

    monkeypatch.setattr(engine, "tail_pays", never)
    stay = eng.generate_dataset(prompts, batch_size=4, **kw)
    assert len(eng._compiled) == built  # nothing built for the tail
    assert stay.raw["stages"] == [(4, stay.raw["iterations"])] and asked
    for left, round_s, slots, m, build_s in asked:
        assert slots == 4 and m in (1, 2) and 0 < left <= max(max_new) and round_s > 0 and build_s > 0
    monkeypatch.setattr(engine, "tail_pays", lambda *a: True)
    moved = eng.generate_dataset(prompts, batch_size=4, **kw)
    assert len(moved.raw["stages"]) > 1 and len(eng._compiled) > built
    assert moved.tokens == stay.tokens == eng.generate_dataset(prompts, batch_size=4, compact=False, **kw).tokens
