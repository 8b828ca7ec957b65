"""Tiny random Llama models: the KV-cache contract of specjax.models.base, scan vs unrolled."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models.base import KVCache, ModelOutput
from specjax.models.llama import LlamaConfig, LlamaLM, RopeScaling, default_scan_layers, rope_inv_freq, tiny_config

ATOL = 1e-5


_JIT = {}


def jitted(lm):
    """One jitted apply per model (compiles once per shape)."""
    if id(lm) not in _JIT:
        _JIT[id(lm)] = (lm, jax.jit(lm.apply))
    return _JIT[id(lm)][1]


def full_logits(lm, tokens, max_len=32, pad_to=16):
    """One forward over the whole sequence from an empty cache. The input is right-padded
    to ``pad_to`` tokens (causal: padding never changes earlier logits) so that one
    compilation serves every length."""
    tokens = np.asarray(tokens, np.int32)
    B, T = tokens.shape
    padded = np.zeros((B, max(T, pad_to)), np.int32)
    padded[:, :T] = tokens
    return jitted(lm)(lm.params, jnp.asarray(padded), lm.init_cache(B, max_len)).logits[:, :T]


@pytest.fixture(scope="module")
def lm():
    return LlamaLM.init(tiny_config(vocab_size=8, n_layers=2), seed=0)


@pytest.fixture(scope="module")
def seq():
    return np.random.default_rng(0).integers(0, 8, size=(1, 12)).astype(np.int32)


def test_protocol_shapes_and_dtypes(lm, seq):
    assert lm.vocab_size == 8
    cache = lm.init_cache(2, 16)
    assert isinstance(cache, KVCache)
    assert cache.k.shape == (2, 2, 2, 16, 8) and cache.max_len == 16
    assert cache.lengths.dtype == jnp.int32
    out = jax.jit(lm.apply, static_argnames="return_hidden")(
        lm.params, jnp.asarray(np.repeat(seq[:, :5], 2, 0)), cache, return_hidden=True)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (2, 5, 8) and out.logits.dtype == jnp.float32
    assert out.hidden.shape == (2, 5, 16)
    np.testing.assert_array_equal(out.cache.lengths, [5, 5])
    # hidden is after the final norm: the (tied) head applied to it gives the logits
    emb = lm.canonical_weights()["embed"]  # [V, D]
    np.testing.assert_allclose(out.hidden @ emb.T, out.logits, atol=1e-5)
    assert jitted(lm)(lm.params, jnp.asarray(seq[:, :3]), lm.init_cache(1, 8)).hidden is None


def test_cached_decode_equals_full_forward(lm, seq):
    ref = full_logits(lm, seq)
    step = jitted(lm)
    # prefill 4 tokens, then 8 single-token steps
    out = step(lm.params, jnp.asarray(seq[:, :4]), lm.init_cache(1, 32))
    got = [out.logits]
    cache = out.cache
    for t in range(4, 12):
        out = step(lm.params, jnp.asarray(seq[:, t : t + 1]), cache)
        got.append(out.logits)
        cache = out.cache
    np.testing.assert_allclose(np.concatenate(got, 1), ref, atol=ATOL)
    assert int(cache.lengths[0]) == 12
    # mixed chunk sizes
    cache, got = lm.init_cache(1, 32), []
    for a, b in [(0, 3), (3, 4), (4, 9), (9, 12)]:
        out = step(lm.params, jnp.asarray(seq[:, a:b]), cache)
        got.append(out.logits)
        cache = out.cache
    np.testing.assert_allclose(np.concatenate(got, 1), ref, atol=ATOL)


@pytest.mark.parametrize("batch", [1, 3])
def test_rollback_equals_never_fed(lm, seq, batch):
    """Verify K+1 = 4 tokens, accept 1, roll back; the next multi-token step must equal a
    model that never saw the rejected tokens (stale slots are never read)."""
    toks = np.repeat(seq, batch, 0)
    prefix, verify_block = toks[:, :5], toks[:, 5:9]
    step = jitted(lm)
    c = step(lm.params, jnp.asarray(prefix), lm.init_cache(batch, 32)).cache
    c = step(lm.params, jnp.asarray(verify_block), c).cache  # writes slots 5..8
    c = c.with_lengths(c.lengths - 3)  # keep 1 of 4: lengths 6
    nxt = np.array([[7, 0, 3]] * batch, np.int32)
    got = step(lm.params, jnp.asarray(nxt), c)
    ref = full_logits(lm, np.concatenate([toks[:, :6], nxt], 1))[:, 6:]
    np.testing.assert_allclose(got.logits, ref, atol=ATOL)
    np.testing.assert_array_equal(got.cache.lengths, [9] * batch)


def test_ragged_rows(lm):
    """Rows at different lengths in one batch: padded prefill, lengths set to the true
    prompt lengths, then T=3 steps; each row equals its own single-row forward."""
    rng = np.random.default_rng(1)
    plens = [2, 6, 4]
    bucket = 6
    prompts = [rng.integers(0, 8, size=n).astype(np.int32) for n in plens]
    padded = np.stack([np.pad(p, (0, bucket - len(p)), constant_values=5) for p in prompts])
    step = jitted(lm)
    out = step(lm.params, jnp.asarray(padded), lm.init_cache(3, 32))
    for b, n in enumerate(plens):  # prompt logits of the true tokens are right despite padding
        np.testing.assert_allclose(out.logits[b, :n], full_logits(lm, prompts[b][None])[0], atol=ATOL)
    cache = out.cache.with_lengths(jnp.asarray(plens, jnp.int32))
    conts = rng.integers(0, 8, size=(3, 6)).astype(np.int32)
    got = []
    for a in (0, 3):
        out = step(lm.params, jnp.asarray(conts[:, a : a + 3]), cache)
        got.append(out.logits)
        cache = out.cache
    got = np.concatenate(got, 1)
    np.testing.assert_array_equal(cache.lengths, np.asarray(plens) + 6)
    for b in range(3):
        ref = full_logits(lm, np.concatenate([prompts[b], conts[b]])[None])[0, plens[b] :]
        np.testing.assert_allclose(got[b], ref, atol=ATOL)


@pytest.mark.parametrize("chunk", [0, 4])
def test_scan_equals_unrolled(seq, chunk):
    cfg = tiny_config(vocab_size=8, n_layers=3, attn_chunk=chunk)
    lm_u = LlamaLM.init(cfg, seed=3)
    lm_s = lm_u.with_config(scan_layers=True)
    assert lm_s.config.scan_layers and not lm_u.config.scan_layers
    assert lm_s.params["layers"]["wqkv"][...].shape[0] == 3  # stacked on a layers axis
    for lm_ in (lm_u, lm_s):
        assert lm_.params is not None
    cu, cs = lm_u.init_cache(1, 32), lm_s.init_cache(1, 32)
    for a, b in [(0, 5), (5, 6)]:
        ou = jitted(lm_u)(lm_u.params, jnp.asarray(seq[:, a:b]), cu)
        os_ = jitted(lm_s)(lm_s.params, jnp.asarray(seq[:, a:b]), cs)
        np.testing.assert_allclose(ou.logits, os_.logits, atol=ATOL)
        np.testing.assert_allclose(ou.cache.k, os_.cache.k, atol=ATOL)
        cu, cs = ou.cache, os_.cache
    # weights survive the round trip through both layouts
    wu, ws = lm_u.canonical_weights(), lm_s.canonical_weights()
    for k in wu:
        np.testing.assert_array_equal(wu[k], ws[k])


def test_random_init_is_seeded():
    cfg = tiny_config()
    a = LlamaLM.init(cfg, 0).canonical_weights()
    b = LlamaLM.init(cfg, 0).canonical_weights()
    c = LlamaLM.init(cfg, 1).canonical_weights()
    np.testing.assert_array_equal(a["wq"], b["wq"])
    assert not np.array_equal(a["wq"], c["wq"])


def test_random_weights_are_the_eager_draws_bit_for_bit():
    """random_weights draws small tensors as the start of a flat power-of-two draw (one
    compile per size, not per shape): the values are those of jax.random.normal(key, shape)
    and the eager scaling, bit for bit (one config with every kind of tensor: norms with an
    offset, q/k norms, biases, an untied head)."""
    import math

    from specjax.models.llama import expected_shapes, random_weights

    cfg = tiny_config(vocab_size=16, n_layers=2, head_dim=12, qk_norm=True, qkv_bias=True, norm_offset=1.0,
                      tie_embeddings=False)
    shapes = sorted(expected_shapes(cfg).items())
    assert {"bq", "q_norm", "lm_head", "embed", "wq"} <= {n for n, _ in shapes}
    keys = jax.random.split(jax.random.key(7), len(shapes))
    got = random_weights(cfg, 7)
    assert all(isinstance(v, np.ndarray) for v in got.values())  # the flat path ran
    for key, (name, shp) in zip(keys, shapes):
        x = jax.random.normal(key, shp, jnp.float32)
        want = ((1.0 - cfg.norm_offset) + 0.1 * x if name.endswith("norm") else 0.1 * x if name in ("bq", "bk", "bv")
                else x if name == "embed" else x / math.sqrt(shp[-1]))
        assert got[name].dtype == np.float32 and got[name].shape == shp, name
        np.testing.assert_array_equal(got[name], np.asarray(want), err_msg=name)


def test_untied_head_and_canonical_round_trip(seq):
    cfg = tiny_config(vocab_size=8, n_layers=2, tie_embeddings=False)
    lm = LlamaLM.init(cfg, seed=5)
    w = lm.canonical_weights()
    assert "lm_head" in w and not np.array_equal(w["lm_head"], w["embed"])
    lm2 = LlamaLM.from_weights(cfg, w)
    np.testing.assert_array_equal(full_logits(lm, seq), full_logits(lm2, seq))
    # changing the head changes the logits (it is really used)
    w["lm_head"] = w["lm_head"] * 2
    assert not np.allclose(full_logits(LlamaLM.from_weights(cfg, w), seq), full_logits(lm, seq))


def test_pure_inside_while_loop_and_scan(lm, seq):
    """apply is a pure function of params usable in lax.scan / lax.while_loop."""
    toks = jnp.asarray(seq[0, :8])

    @jax.jit
    def decode_scan(params, cache):
        def body(c, tok):
            out = lm.apply(params, tok[None, None], c)
            return out.cache, out.logits[0, 0]

        return jax.lax.scan(body, cache, toks)

    @jax.jit
    def decode_while(params, cache):
        def cond(s):
            return s[0] < 8

        def body(s):
            i, c, acc = s
            out = lm.apply(params, jax.lax.dynamic_slice(toks, (i,), (1,))[None], c)
            return i + 1, out.cache, acc.at[i].set(out.logits[0, 0])

        return jax.lax.while_loop(cond, body, (0, cache, jnp.zeros((8, 8), jnp.float32)))[2]

    ref = full_logits(lm, seq[:, :8])[0]
    _, ls = decode_scan(lm.params, lm.init_cache(1, 16))
    np.testing.assert_allclose(ls, ref, atol=ATOL)
    np.testing.assert_allclose(decode_while(lm.params, lm.init_cache(1, 16)), ref, atol=ATOL)


def test_logical_axis_names(lm):
    specs = nnx.get_partition_spec(lm.params)
    names = set()
    for leaf in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
        names.update(n for n in leaf if n is not None)
    assert names <= {"embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers"}
    assert {"embed", "heads", "kv_heads", "head_dim", "mlp", "vocab"} <= names
    scanned = lm.with_config(scan_layers=True)
    assert tuple(nnx.get_partition_spec(scanned.params)["layers"]["w_down"].get_value()) == ("layers", "mlp", "embed")


def test_bfloat16_compute_runs(lm, seq):
    lm16 = lm.with_config(dtype="bfloat16", param_dtype="bfloat16")
    out = lm16(jnp.asarray(seq[:, :6]), lm16.init_cache(1, 16))
    assert out.logits.dtype == jnp.float32 and out.cache.k.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.logits, full_logits(lm, seq[:, :6]), atol=0.15)


def test_tokens_past_the_cache_are_dropped_not_clamped(lm, seq):
    """Writing beyond max_len must not overwrite earlier slots (engine guards against it)."""
    for batch in (1, 2):
        toks = jnp.asarray(np.repeat(seq[:, :6], batch, 0))
        c = jitted(lm)(lm.params, toks, lm.init_cache(batch, 8)).cache
        c2 = jitted(lm)(lm.params, toks[:, :4], c).cache  # slots 6..9: 8, 9 do not exist
        np.testing.assert_array_equal(c2.k[:, :, :, :6], c.k[:, :, :, :6])


def test_config_validation_and_rope_scaling():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        tiny_config(n_heads=3, n_kv_heads=2)
    with pytest.raises(ValueError, match="dtype"):
        tiny_config(dtype="float64")
    with pytest.raises(ValueError, match="positive int"):
        tiny_config(dim=0)
    cfg = tiny_config(head_dim=64, rope_theta=500000.0,
                      rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})
    assert isinstance(cfg.rope_scaling, RopeScaling)
    hash(cfg)  # frozen and hashable (usable as a static jit argument)
    base = rope_inv_freq(cfg.replace(rope_scaling=None))
    scaled = rope_inv_freq(cfg)
    # llama3: high frequencies untouched, low frequencies divided by the factor
    np.testing.assert_allclose(scaled[:4], base[:4], rtol=1e-6)
    np.testing.assert_allclose(scaled[-4:], base[-4:] / 8.0, rtol=1e-6)
    assert isinstance(cfg, LlamaConfig)


def test_layer_mode_auto_follows_the_backend_and_the_dtypes():
    # unrolled where it was measured faster (an H200; CPU with XLA's ops), scanned on TPU and
    # on CPU where the float32 kernels read the stacked weights in place
    from specjax.models import cpu_kernels as ck

    kernels = ck.available()[0] and jax.device_count() == 1
    assert [default_scan_layers(b) for b in ("cpu", "gpu", "cuda", "tpu")] == [kernels, False, False, True]
    assert not default_scan_layers("cpu", dtype="bfloat16", param_dtype="bfloat16")
    assert not default_scan_layers("cpu", cpu_kernels="xla")
    # float16 weights with float32 compute: Block._mm slices them for XLA (no stacked kernel)
    assert not default_scan_layers("cpu", dtype="float32", param_dtype="float16")
    assert not default_scan_layers("gpu", dtype="bfloat16") and default_scan_layers("tpu", dtype="bfloat16")
    on_cpu = jax.default_backend() == "cpu"
    assert tiny_config(scan_layers="auto").scan_layers is (jax.default_backend() == "tpu" or (on_cpu and kernels))
    assert tiny_config(scan_layers="auto", cpu_kernels="xla").scan_layers is (jax.default_backend() == "tpu")
    assert tiny_config(scan_layers=True).scan_layers is True
    with pytest.raises(ValueError, match="scan_layers must be true, false or 'auto'"):
        tiny_config(scan_layers="yes")
    from specjax.build import load_target
    from specjax.models.config import load_model_config

    for preset in ("llama3-8b-shape", "llama3-1b-shape", "smollm2-135m"):  # the presets say auto
        cfg = load_model_config(preset)
        assert cfg.scan_layers is default_scan_layers(dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                                      cpu_kernels=cfg.cpu_kernels)
    assert load_target("tiny")[0].config.scan_layers is default_scan_layers()
    assert load_target("tiny", param_dtype="bfloat16")[0].config.scan_layers is default_scan_layers(dtype="bfloat16")


@pytest.mark.parametrize("chunk", [4, 8])
def test_chunked_attention_equals_one_pass(chunk):
    """attn_chunk reads the cache in chunks up to the longest row (online softmax); it must
    match one pass over all slots: ragged rows, a max_len that is not a multiple of the
    chunk (last chunk overlaps), rows that reach the very last slot."""
    cfg = tiny_config(vocab_size=8, n_layers=2)
    one = LlamaLM.init(cfg.replace(attn_chunk=0), seed=7)
    chk = one.with_config(attn_chunk=chunk)
    rng = np.random.default_rng(3)
    S = 30
    toks = rng.integers(0, 8, size=(3, 12)).astype(np.int32)
    lens = jnp.asarray([3, 12, 7], jnp.int32)
    c1 = jitted(one)(one.params, jnp.asarray(toks), one.init_cache(3, S)).cache.with_lengths(lens)
    c2 = jitted(chk)(chk.params, jnp.asarray(toks), chk.init_cache(3, S)).cache.with_lengths(lens)
    seq1, got1 = list(toks[1]), []
    for _ in range(6):  # lengths grow to 3+18, 12+18 = 30 (row 1 fills the last slot), 7+18
        t = rng.integers(0, 8, size=(3, 3)).astype(np.int32)
        o1 = jitted(one)(one.params, jnp.asarray(t), c1)
        o2 = jitted(chk)(chk.params, jnp.asarray(t), c2)
        np.testing.assert_allclose(o1.logits, o2.logits, atol=ATOL)
        c1, c2 = o1.cache, o2.cache
        seq1 += list(t[1])
        got1.append(o2.logits[1])
    np.testing.assert_array_equal(c2.lengths, [21, 30, 25])
    ref = full_logits(one, np.asarray(seq1)[None])[0, 12:]
    np.testing.assert_allclose(np.concatenate(got1), ref, atol=ATOL)


def test_constrain_hooks_only_with_a_mesh(lm):
    """Block-boundary sharding constraints: absent without a mesh, present (and harmless)
    under a mesh with logical axis rules."""
    # under a mesh the CPU kernels step aside (a custom call is opaque to SPMD), so the
    # no-mesh reference uses XLA's ops too: then the results must agree to rounding noise
    lm = lm.with_config(cpu_kernels="xla")
    toks, cache = jnp.zeros((1, 3), jnp.int32), lm.init_cache(1, 8)
    f = jax.jit(lambda p, t, c: lm.apply(p, t, c).logits)
    assert "sharding_constraint" not in f.lower(lm.params, toks, cache).as_text()
    ref = f(lm.params, toks, cache)
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), nnx.logical_axis_rules([("batch", "data"), ("embed", "model")]):
        g = jax.jit(lambda p, t, c: lm.apply(p, t, c).logits)
        assert "sharding_constraint" in g.lower(lm.params, toks, cache).as_text()
        auto = lm.with_config(cpu_kernels="auto")
        assert "specjax_attention" not in jax.jit(lambda p, t, c: auto.apply(p, t, c).logits).lower(
            auto.params, toks, cache).as_text()
        np.testing.assert_allclose(g(lm.params, toks, cache), ref, atol=1e-6)


def test_hidden_states_of_several_layers_in_one_pass():
    """``return_hidden=(i, ...)``: the hidden states with those indices (0: embeddings, i:
    after layer i, L: after the final norm) concatenated, equal to running the blocks one by
    one, unrolled and scanned, and through a chunked prefill."""
    from specjax.models.base import prefill
    from specjax.models.llama import rope_tables

    lm = LlamaLM.init(tiny_config(vocab_size=64, n_layers=3, dim=16), seed=2)
    rng = np.random.default_rng(1)
    toks = jnp.asarray(rng.integers(0, 64, (2, 32)), jnp.int32)
    # reference: the embeddings, then each block in turn
    mod, cfg = lm.module(), lm.config
    pos = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32)[None], (2, 32))
    cos, sin = rope_tables(pos, cfg)
    x = jnp.transpose(jnp.take(mod.embed[...], toks, axis=1), (1, 2, 0))
    c = lm.init_cache(2, 32)
    ref, k, v = [x], c.k, c.v
    for i, blk in enumerate(mod.layers):
        x, k, v = blk(x, k, v, i, pos, cos, sin)
        ref.append(x)
    ref[3] = lm.apply(lm.params, toks, lm.init_cache(2, 32), return_hidden=True).hidden  # after the final norm
    want = (2, 0, 3, 1)
    expect = np.concatenate([np.asarray(ref[i]) for i in want], axis=-1)
    for scan in (False, True):
        m = lm.with_config(scan_layers=scan)
        fwd = jax.jit(m.apply, static_argnames="return_hidden")
        out = fwd(m.params, toks, m.init_cache(2, 32), return_hidden=want)
        assert out.hidden.shape == (2, 32, 4 * 16)
        np.testing.assert_allclose(out.hidden, expect, atol=2e-5)
        np.testing.assert_array_equal(out.logits, fwd(m.params, toks, m.init_cache(2, 32)).logits)
        lens = jnp.asarray([32, 21], jnp.int32)
        _, one = prefill(m, m.params, toks, lens, m.init_cache(2, 40), chunk=32, return_hidden=(1, 3))
        _, chunked = jax.jit(lambda p, t, n, c: prefill(m, p, t, n, c, chunk=8, return_hidden=(1, 3)))(
            m.params, toks, lens, m.init_cache(2, 40))
        for b, n in enumerate(np.asarray(lens)):
            np.testing.assert_allclose(chunked[b, :n], one[b, :n], atol=2e-5)
            np.testing.assert_allclose(one[b, :n], expect[b, :n][..., np.r_[48:64, 32:48]], atol=2e-5)
    for bad in ((4,), (-1,), (True,), "1"):
        with pytest.raises(ValueError, match="hidden-state index|return_hidden"):
            lm.apply(lm.params, toks[:, :4], lm.init_cache(2, 8), return_hidden=bad)


def _weight_product_rows(fn, *args):
    """The leading (row) size of every product in ``fn``'s jaxpr that has no batch axes (a
    weight product; attention's products have batch axes), nested jaxprs included."""
    rows = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general" and not e.params["dimension_numbers"][1][0]:
                rows.append(e.invars[0].aval.shape[0])
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr)  # a new function: traced anew
    return rows


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_one_row_product_is_two_rows_on_an_accelerator(monkeypatch, backend):
    """On a GPU or TPU backend a one-row weight product is computed as two rows (both
    compilers would turn a vector-matrix product into a multiply and a reduction: see
    ``models.llama._product``): ``_linear``, and every weight product of a one-row decode
    step (the TPU layouts' contractions and the LM head included); the row is the plain
    product's, and several rows stay one plain product. Traced as on that backend, run on
    the CPU."""
    from specjax.models.llama import _linear

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 3, 32)), jnp.float32)
    x1 = jnp.asarray(rng.standard_normal((1, 1, 64)), jnp.float32)
    x3 = jnp.asarray(rng.standard_normal((1, 3, 64)), jnp.float32)
    plain1, plain3 = _linear(x1, w, "xla"), _linear(x3, w, "xla")
    lin = lambda x, w: _linear(x, w, "xla")  # noqa: E731
    flags = dict(gate_up_first=True, qkv_input_last=True, wo_flat=True, scan_layers=True)
    lm_ = LlamaLM.init(tiny_config(vocab_size=8, n_layers=2, cpu_kernels="xla", **flags), seed=1)
    tok, cache = jnp.asarray([[3]], jnp.int32), lm_.init_cache(1, 16)
    step = lambda p, t, c: lm_.apply(p, t, c).logits  # noqa: E731
    want = np.asarray(jax.jit(step)(lm_.params, tok, cache))

    assert set(_weight_product_rows(lin, x1, w)) == {1}  # the CPU: one plain product
    assert 1 in _weight_product_rows(step, lm_.params, tok, cache)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert _weight_product_rows(lin, x1, w) == [2] and _weight_product_rows(lin, x3, w) == [3]
    rows = _weight_product_rows(step, lm_.params, tok, cache)
    assert len(rows) >= 5 and set(rows) == {2}, rows  # q/k/v, o, gate/up, down, LM head
    monkeypatch.setenv("SPECJAX_TWO_ROWS", "0")  # one row anyway (to time both forms on a device)
    assert set(_weight_product_rows(step, lm_.params, tok, cache)) == {1}
    monkeypatch.delenv("SPECJAX_TWO_ROWS")
    got1, got3 = jax.jit(lin)(x1, w), jax.jit(lin)(x3, w)
    assert got1.shape == plain1.shape == (1, 1, 96)
    np.testing.assert_allclose(np.asarray(got1), np.asarray(plain1), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got3), np.asarray(plain3))
    np.testing.assert_allclose(np.asarray(jax.jit(step)(lm_.params, tok, cache)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_tpu_layouts_give_the_same_model(seq, scan):
    """The TPU layouts, ``gate_up_first`` (``w_gate_up [2, D, F]``), ``qkv_input_last``
    (``wqkv [Nkv, G+2, H, D]``) and ``wo_flat`` (``wo [N*H, D]``), each alone and all three,
    store the same weights and compute the same logits as ``[D, 2, F]`` / ``[D, Nkv, G+2, H]``
    / ``[N, H, D]``, one row and several, unrolled and scanned; their logical axis names keep
    F on ``mlp``, the KV groups on ``kv_heads`` and the query heads on ``heads``."""
    flags = ("gate_up_first", "qkv_input_last", "wo_flat")
    cfg = tiny_config(vocab_size=8, n_layers=2, scan_layers=scan, **dict.fromkeys(flags, False))
    lm_f = LlamaLM.init(cfg, seed=5)
    D, F, Nkv, G, H, N = cfg.dim, cfg.ffn_dim, cfg.n_kv_heads, cfg.group_size, cfg.head_dim, cfg.n_heads
    lead = ("layers",) if scan else ()
    layouts = {"w_gate_up": {False: ((D, 2, F), ("embed", None, "mlp")), True: ((2, D, F), (None, "embed", "mlp"))},
               "wqkv": {False: ((D, Nkv, G + 2, H), ("embed", "kv_heads", None, "head_dim")),
                        True: ((Nkv, G + 2, H, D), ("kv_heads", None, "head_dim", "embed"))},
               "wo": {False: ((N, H, D), ("heads", "head_dim", "embed")), True: ((N * H, D), ("heads", "embed"))}}
    params = {"gate_up_first": "w_gate_up", "qkv_input_last": "wqkv", "wo_flat": "wo"}
    wf = lm_f.canonical_weights()
    for on in [(f,) for f in flags] + [flags]:
        lm_t = lm_f.with_config(**{f: f in on for f in flags})
        assert [getattr(lm_t.config, f) for f in flags] == [f in on for f in flags]
        for lm_ in (lm_f, lm_t):
            specs = nnx.get_partition_spec(lm_.params)["layers"]
            p, spec = (lm_.params["layers"], specs) if scan else (lm_.params["layers"][0], specs[0])
            for f in flags:
                name, flag = params[f], getattr(lm_.config, f)
                shape, names = layouts[name][flag]
                assert p[name][...].shape[len(lead):] == shape, (name, flag)
                assert tuple(spec[name].get_value()) == lead + names, (name, flag)
        wt = lm_t.canonical_weights()
        assert wf.keys() == wt.keys()
        for k in wf:
            np.testing.assert_array_equal(wf[k], wt[k])
        cf, ct = lm_f.init_cache(1, 32), lm_t.init_cache(1, 32)
        for a, b in [(0, 5), (5, 6), (6, 7)]:  # a prefill, then one-token steps
            of = jitted(lm_f)(lm_f.params, jnp.asarray(seq[:, a:b]), cf)
            ot = jitted(lm_t)(lm_t.params, jnp.asarray(seq[:, a:b]), ct)
            np.testing.assert_allclose(ot.logits, of.logits, atol=ATOL)
            np.testing.assert_allclose(ot.cache.v, of.cache.v, atol=ATOL)
            cf, ct = of.cache, ot.cache


@pytest.mark.parametrize("field", ["gate_up_first", "qkv_input_last", "wo_flat"])
def test_tpu_layouts_auto_follow_the_backend(monkeypatch, field):
    from specjax.models import llama

    default = {"gate_up_first": llama.default_gate_up_first, "qkv_input_last": llama.default_qkv_input_last,
               "wo_flat": llama.default_wo_flat}[field]
    assert [default(b) for b in ("cpu", "gpu", "cuda", "tpu")] == [False, False, False, True]
    assert getattr(tiny_config(), field) is (jax.default_backend() == "tpu")
    assert getattr(tiny_config(**{field: True}), field) is True
    with pytest.raises(ValueError, match=f"{field} must be true, false or 'auto'"):
        tiny_config(**{field: "yes"})
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    blocks = dict(dim=64, head_dim=32, n_heads=2, n_kv_heads=1, ffn_dim=96)  # whole 32-input blocks
    on_tpu = tiny_config(scan_layers="auto", **blocks)  # scanned, as the loaders pick on TPU
    assert getattr(on_tpu, field) is True
    # GGUF blocks keep their layout: "auto" gives way, an explicit True is an error, and turning
    # blocks on through replace turns the resolved layout off
    assert getattr(tiny_config(scan_layers=True, weight_blocks=True, **blocks), field) is False
    with pytest.raises(ValueError, match=f"{field}: GGUF block weights"):
        tiny_config(weight_blocks=True, **{field: True}, **blocks)
    assert getattr(on_tpu.replace(weight_blocks=True), field) is False
    if field == "qkv_input_last":  # scanned layers only (unrolled, XLA:TPU reads [D, Nkv, G+2, H] as it lies)
        assert on_tpu.scan_layers and not llama.default_qkv_input_last("tpu", scan_layers=False)
        assert tiny_config(scan_layers=False, **blocks).qkv_input_last is False
        assert on_tpu.replace(scan_layers=False).qkv_input_last is False  # resolved again
        assert on_tpu.replace(scan_layers=False).replace(scan_layers=True).qkv_input_last is True
        assert on_tpu.replace(scan_layers=False, qkv_input_last=True).qkv_input_last is True
