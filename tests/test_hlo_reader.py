"""scripts/bench/hlo.py: kernels, host syncs and bytes per loop iteration of compiled HLO
(what scripts/accel_aot.py reports for a GPU or TPU), on a hand-written module whose counts are
known and on programs XLA compiles here."""
import jax
import jax.numpy as jnp
import pytest

from scripts.bench import hlo
from scripts import accel_aot

# A decode-like loop: each iteration reads one row of a cache (a slice), runs an inner loop
# of 4 known trips (2 kernels each), a data-dependent conditional (2 kernels or none) and
# writes one row back in place; the loop's predicate is one more kernel.
MODULE = """HloModule m, is_scheduled=true

FileNames
1 "/repo/specjax/engine.py"
2 "/usr/lib/python3/site-packages/jax/_src/lax.py"

FunctionNames
1 "round_body"
2 "bind"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=99 end_line=99 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}

%fused_dus (p0: f32[8,16], p1: f32[1,16], p2: s32[]) -> f32[8,16] {
  %p1 = f32[1,16]{1,0} parameter(1)
  %p0 = f32[8,16]{1,0} parameter(0)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dus = f32[8,16]{1,0} dynamic-update-slice(%p0, %p1, %p2, %c)
}

%fused_slice (q0: f32[8,16], q1: s32[]) -> f32[1,16] {
  %q0 = f32[8,16]{1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = f32[1,16]{1,0} dynamic-slice(%q0, %q1, %c0), dynamic_slice_sizes={1,16}
  ROOT %n = f32[1,16]{1,0} negate(%ds)
}

%fused_exp (r0: f32[1,16]) -> f32[1,16] {
  %r0 = f32[1,16]{1,0} parameter(0)
  ROOT %e = f32[1,16]{1,0} exponential(%r0)
}

%inner_body (t: (s32[], f32[1,16])) -> (s32[], f32[1,16]) {
  %t = (s32[], f32[1,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[1,16]{1,0} get-tuple-element(%t), index=1
  %f = f32[1,16]{1,0} fusion(%x), kind=kLoop, calls=%fused_exp
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[1,16]{1,0}) tuple(%i2, %f)
}

%inner_cond (t2: (s32[], f32[1,16])) -> pred[] {
  %t2 = (s32[], f32[1,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%t2), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %four), direction=LT
}

%branch_a (a: f32[1,16]) -> f32[1,16] {
  %a = f32[1,16]{1,0} parameter(0)
  %a1 = f32[1,16]{1,0} fusion(%a), kind=kLoop, calls=%fused_exp
  ROOT %a2 = f32[1,16]{1,0} fusion(%a1), kind=kLoop, calls=%fused_exp
}

%branch_b (b: f32[1,16]) -> f32[1,16] {
  ROOT %b = f32[1,16]{1,0} parameter(0)
}

%body (s: (s32[], f32[8,16], pred[])) -> (s32[], f32[8,16], pred[]) {
  %s = (s32[], f32[8,16]{1,0}, pred[]) parameter(0)
  %k = s32[] get-tuple-element(%s), index=0
  %cache = f32[8,16]{1,0} get-tuple-element(%s), index=1
  %flag = pred[] get-tuple-element(%s), index=2
  %row = f32[1,16]{1,0} fusion(%cache, %k), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(f)/while/body/slice" stack_frame_id=2}
  %zero = s32[] constant(0)
  %it = (s32[], f32[1,16]{1,0}) tuple(%zero, %row)
  %w = (s32[], f32[1,16]{1,0}) while(%it), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
  %y = f32[1,16]{1,0} get-tuple-element(%w), index=1
  %z = f32[1,16]{1,0} conditional(%flag, %y, %y), true_computation=%branch_a, false_computation=%branch_b
  %new = f32[8,16]{1,0} fusion(%cache, %z, %k), kind=kLoop, calls=%fused_dus
  ROOT %out = (s32[], f32[8,16]{1,0}, pred[]) tuple(%k, %new, %flag)
}

%cond (c: (s32[], f32[8,16], pred[])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}, pred[]) parameter(0)
  %kk = s32[] get-tuple-element(%c), index=0
  %eight = s32[] constant(8)
  ROOT %more = pred[] compare(%kk, %eight), direction=LT
}

ENTRY %main (cache0: f32[8,16], flag0: pred[]) -> (s32[], f32[8,16], pred[]) {
  %cache0 = f32[8,16]{1,0} parameter(0)
  %flag0 = pred[] parameter(1)
  %k0 = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, pred[]) tuple(%k0, %cache0, %flag0)
  ROOT %loop = (s32[], f32[8,16]{1,0}, pred[]) while(%init), condition=%cond, body=%body
}
"""


def test_counts_of_a_known_module():
    mod = hlo.parse(MODULE)
    assert mod.entry == "main"
    loops = hlo.loops(mod)
    assert [(lp.name, lp.depth, lp.trip_count) for lp in loops] == [("loop", 0, None), ("w", 1, 4)]
    outer, inner = loops
    assert inner.per_iteration.kernels == 2 and inner.per_iteration.syncs == 0
    # slice 1 + inner loop 4 x 2 + branch a 2 (or b 0) + in-place update 1 + predicate 1
    assert outer.per_iteration.kernels == 13 and outer.least.kernels == 11
    assert outer.per_iteration.syncs == 2  # the loop's predicate and the conditional's
    assert hlo.main_loop(mod).name == "loop"
    # the slice reads one row (64 B) and its index (4 B) and writes a row; the update
    # writes one row in place and reads the row and the index, not the cache
    body = {i.name: i for i in mod.computations["body"]}
    shapes = {i.name: i.shape for i in mod.computations["body"]}
    assert hlo.kernel_bytes(mod, body["row"], shapes) == 64 + 4 + 64
    assert hlo.kernel_bytes(mod, body["new"], shapes) == 64 + 64 + 4
    assert outer.per_iteration.by_source["specjax/engine.py:round_body"] == 1


def test_shape_bytes():
    assert hlo.shape_bytes("bf16[30,1,3,208,64]{4,3,2,1,0}") == 30 * 3 * 208 * 64 * 2
    assert hlo.shape_bytes("(s32[], f32[4,256]{1,0}, pred[2])") == 4 + 4 * 256 * 4 + 2
    assert hlo.shape_bytes("f32[]") == 4


def test_a_program_xla_compiles_here():
    """The reader on XLA's own output: a while loop with an inner fori_loop of 3 trips and a
    conditional whose branches differ (CPU HLO has the GPU's loop and branch structure)."""
    def f(x, w, p):
        def inner(i, x):
            return jnp.tanh(x @ w) + i

        def body(c):
            i, x = c
            x = jax.lax.fori_loop(0, 3, inner, x)
            x = jax.lax.cond(p[i % 4] > 0, lambda x: jnp.tanh(x @ w @ w), jnp.sin, x)
            return i + 1, x

        return jax.lax.while_loop(lambda c: c[1].sum() < 100.0, body, (0, x))

    text = jax.jit(f).lower(jnp.ones((4, 64)), jnp.ones((64, 64)), jnp.ones(4)).compile().as_text()
    mod = hlo.parse(text)
    loops = hlo.loops(mod)
    outer = hlo.main_loop(mod)
    inner = [lp for lp in loops if lp.trip_count == 3]
    assert outer.depth == 0 and outer.trip_count is None and len(inner) == 1
    assert outer.per_iteration.syncs == 2 and inner[0].per_iteration.syncs == 0
    # the inner loop's kernels count three times over, the larger branch once
    assert outer.least.kernels >= 3 * inner[0].per_iteration.kernels
    assert outer.per_iteration.kernels > outer.least.kernels


def test_gpu_target_config_names_the_chip():
    text = accel_aot.target_config("h200")
    assert "memory_bandwidth: 4800000000000" in text and "major: 9" in text
    assert 'device_description_str: "NVIDIA H200 141GB HBM3e"' in text


def test_accel_aot_rejects_bad_lists_before_work(capsys):
    with pytest.raises(SystemExit) as e:
        accel_aot.main(["--batches", "0"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        accel_aot.main(["--ks", "x"])
    assert e.value.code == 2 and "bad list" in capsys.readouterr().err


def test_trip_counts_read_off_unannotated_loops():
    """XLA:TPU writes no trip counts: ``i < N`` on a counter that starts at 0 and that the
    body moves on gives N; a counter the body passes through gives none."""
    text = MODULE.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    assert "known_trip_count" not in text
    outer, inner = hlo.loops(hlo.parse(text))
    assert (inner.trip_count, outer.trip_count) == (4, None)
    assert outer.per_iteration.kernels == 13
    # a counter that starts elsewhere, or moves by another step, is no trip count either
    shifted = text.replace("%zero = s32[] constant(0)", "%zero = s32[] constant(1)")
    assert hlo.loops(hlo.parse(shifted))[1].trip_count is None
    by_two = text.replace("%one = s32[] constant(1)", "%one = s32[] constant(2)")
    assert hlo.loops(hlo.parse(by_two))[1].trip_count is None
    doubled = text.replace("%i2 = s32[] add(%i, %one)", "%i2 = s32[] add(%i, %i)")
    assert hlo.loops(hlo.parse(doubled))[1].trip_count is None


SMALL = """HloModule s

%fused_fresh (f0: f32[1,16], f1: s32[]) -> f32[8,16] {
  %f0 = f32[1,16]{1,0} parameter(0)
  %f1 = s32[] parameter(1)
  %z = f32[] constant(0)
  %c = s32[] constant(0)
  %b = f32[8,16]{1,0} broadcast(%z), dimensions={}
  ROOT %d = f32[8,16]{1,0} dynamic-update-slice(%b, %f0, %f1, %c)
}

ENTRY %main (x: f32[2,4096], w: bf16[4096,14336], r: f32[1,16], k: s32[]) -> f32[8,16] {
  %x = f32[2,4096]{1,0} parameter(0)
  %w = bf16[4096,14336]{1,0} parameter(1)
  %r = f32[1,16]{1,0} parameter(2)
  %k = s32[] parameter(3)
  %g = (bf16[2,14336]{1,0}, s8[33554432]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm"
  ROOT %new = f32[8,16]{1,0} fusion(%r, %k), kind=kLoop, calls=%fused_fresh
}
"""


def test_bytes_of_library_calls_and_fresh_updates():
    mod = hlo.parse(SMALL)
    ins = {i.name: i for i in mod.computations["main"]}
    shapes = {i.name: i.shape for i in mod.computations["main"]}
    # a cuBLAS gemm: its operands and result, not its workspace
    assert hlo.kernel_bytes(mod, ins["g"], shapes) == 2 * 4096 * 4 + 4096 * 14336 * 2 + 2 * 14336 * 2
    # an update of an array the fusion makes itself writes all of it
    assert hlo.kernel_bytes(mod, ins["new"], shapes) == 8 * 16 * 4 + 64 + 4


# XLA:TPU's asynchronous copies and slices (a start names its operand again in its result),
# and a slice and an update XLA did not fuse
ASYNC = """HloModule a, is_scheduled=true

ENTRY %main (w: bf16[8192,2048]) -> (bf16[2048,2048], bf16[8192,2048]) {
  %w = bf16[8192,2048]{1,0:T(8,128)(2,1)} parameter(0)
  %ss = ((bf16[8192,2048]{1,0:T(8,128)(2,1)}), bf16[2048,2048]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[2048:4096], [0:2048]}
  %sd = bf16[2048,2048]{1,0:T(8,128)(2,1)S(1)} slice-done(%ss)
  %cs = (bf16[8192,2048]{1,0:T(8,128)(2,1)}, bf16[8192,2048]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%w)
  %cd = bf16[8192,2048]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %i = s32[] constant(3)
  %z = s32[] constant(0)
  %row = bf16[1,2048]{1,0} dynamic-slice(%w, %i, %z), dynamic_slice_sizes={1,2048}
  %upd = bf16[8192,2048]{1,0} dynamic-update-slice(%w, %row, %z, %z)
  ROOT %t = (bf16[2048,2048]{1,0}, bf16[8192,2048]{1,0}, bf16[8192,2048]{1,0}) tuple(%sd, %cd, %upd)
}
"""


def test_asynchronous_starts_and_unfused_slices_count_their_data_once():
    mod = hlo.parse(ASYNC)
    ins = {i.name: i for i in mod.computations[mod.entry]}
    shapes = {i.name: i.shape for i in mod.computations[mod.entry]}
    assert hlo.tuple_elements(ins["ss"].shape)[1].startswith("bf16[2048,2048]{1,0:T(8,128)(2,1)S(1)}")
    # a slice-start reads and writes its slice (plus a 4-byte context), not the whole weight
    assert hlo.kernel_bytes(mod, ins["ss"], shapes) == 2 * (2048 * 2048 * 2 + 4)
    # a copy-start reads the weight and writes its copy once
    assert hlo.kernel_bytes(mod, ins["cs"], shapes) == 2 * 8192 * 2048 * 2 + 4
    # unfused slices read their slice, updates write theirs in place (plus the indices)
    assert hlo.kernel_bytes(mod, ins["row"], shapes) == 2 * 2048 * 2 + 8
    assert hlo.kernel_bytes(mod, ins["upd"], shapes) == 2 * 2048 * 2 + 8
    t = hlo.tally(mod, mod.entry)
    assert t.kernels == 4  # the starts, the slice and the update; the dones launch nothing
    assert t.bytes == 2 * (2048 * 2048 * 2 + 4) + 2 * 8192 * 2048 * 2 + 4 + 2 * (2 * 2048 * 2 + 8)


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.extended), 1.0])
def test_programs_traced_for_a_gpu_sync_once_per_round(target, draft, monkeypatch, temperature):
    """The programs as a GPU backend gets them (traced with ``jax.default_backend()`` reading
    "gpu", compiled here): per iteration of the decode loop, one host sync (the loop's own
    predicate) for a plain step, a chain round, a prompt-lookup round and an EAGLE tree round
    (greedy top-k tree at T = 0, sampled tree at T = 1): batch hints decide the sampling
    conds, ``engine.skip_empty_rounds`` drops the "nothing drafted" one and the sampled
    tree's descent runs a known number of steps (``sampling.sync_free``). On a GPU each
    conditional or data-dependent loop in a round is a predicate copied to the host."""
    from specjax import engine, sampling
    from specjax.drafts import DraftModelProposer, PromptLookupProposer
    from specjax.drafts.trees import make_tree_proposer
    from specjax.models.eagle import EagleConfig, EagleModel

    monkeypatch.delenv("SPECJAX_BATCH_HINTS", raising=False)
    monkeypatch.delenv("SPECJAX_SYNC_FREE", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = sampling.SamplingConfig(temperature=temperature)
    head = EagleModel.for_target(target, EagleConfig.for_target(target.config, n_heads=4, n_kv_heads=2,
                                                                head_dim=8, ffn_dim=32), seed=3)
    engines = {"autoregressive": engine.AutoregressiveEngine(target),
               "chain": engine.SpeculativeEngine(target, DraftModelProposer(draft, 3), "token"),
               "lookup": engine.SpeculativeEngine(target, PromptLookupProposer(vocab_size=8, k=3), "token"),
               "tree": engine.SpeculativeEngine(target, make_tree_proposer(head, 2, 2, 5, "iid", (2, 1)), "tree")}
    for name, eng in engines.items():
        assert eng.batch_hints, name  # the GPU default
        text = eng.lower([[1, 2, 3], [4, 5]], seed=0, sampling_params=cfg, max_new_tokens=8).compile().as_text()
        lp = hlo.main_loop(hlo.parse(text))
        assert lp.per_iteration.syncs == 1, (name, lp.per_iteration.syncs)


def test_accel_aot_without_the_chips_compiler_exits_2(monkeypatch, capsys):
    """Here (no CUDA plugin, no libtpu: not project dependencies) the script says what to
    install, in one line, with exit status 2."""
    import importlib.util
    import os

    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the script sets stays here
    for chip, what in (("h200", "jax-cuda12-plugin=="), ("v5e", "libtpu==")):
        if importlib.util.find_spec("libtpu" if chip == "v5e" else "jax_plugins") is not None:
            continue  # a machine with that compiler
        with pytest.raises(SystemExit) as e:
            accel_aot.main(["--chip", chip, "--batches", "1"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and what in err and len(err.strip().splitlines()) == 1, err


def test_arguments_taken_in_another_layout_are_counted():
    """``relaid_out``: the bytes of the arguments whose compiled layout is not an array's
    default (JAX copies them on every call); default layouts count nothing."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.layout import Format, Layout

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def formats(*orders):
        return tuple(Format(Layout(o), one) for o in orders), {}

    class Exe:  # what accel_aot reads of a compiled program
        in_avals = ((jax.core.ShapedArray((4, 8), jnp.bfloat16), jax.core.ShapedArray((2, 3, 5), jnp.float32),
                     jax.core.ShapedArray((7,), jnp.int32)), {})
        input_formats = formats((1, 0), (0, 1, 2), (0,))

    assert accel_aot.relaid_out(Exe) == 4 * 8 * 2  # the transposed bf16 [4, 8] only
    Exe.input_formats = formats((0, 1), (0, 2, 1), (0,))
    assert accel_aot.relaid_out(Exe) == 2 * 3 * 5 * 4
    exe = jax.jit(lambda a, b: (a @ b).sum()).lower(jnp.ones((4, 8)), jnp.ones((8, 3))).compile()
    assert accel_aot.relaid_out(exe) == 0  # the CPU keeps every default layout
