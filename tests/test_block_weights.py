"""GGUF block weights (int8 codes, float32 scale and offset per 32 inputs): the kernel and the
model give the float32 path's bits, the loader keeps exactly gguf's weights, and the model
uses them where they apply."""
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import cpu_kernels as ck
from specjax.models import gguf_loader
from specjax.models.llama import BlockWeights, LlamaConfig, LlamaLM, tiny_config

pytestmark = pytest.mark.skipif(ck.compiler() is None, reason="no C++ compiler to build the kernel")
Q = gguf.GGMLQuantizationType
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def _random_blocks(rng, shape, kind, size=1.0):
    """Random blocks of ``shape`` [..., K, N] in the kernel's layout ([K / 32, N] scales) with
    the codes and float16-valued scales (and offsets) of a GGUF block type, of about ``size``:
    a float16 scale times a code is exact in float32, which the bit equality rests on."""
    *lead, k, n = shape
    if kind == "q8_0":
        code = rng.integers(-128, 128, shape)
    elif kind == "q4_0":
        code = rng.integers(-8, 8, shape)
    else:
        code = rng.integers(0, 16, shape)
    sshape = (*lead, k // 32, n)
    d = (size * rng.standard_normal(sshape)).astype(np.float16).astype(np.float32)
    m = (np.full(sshape, -0.0, np.float32) if kind != "q4_1"
         else (size * rng.standard_normal(sshape)).astype(np.float16).astype(np.float32))
    return code.astype(np.int8), d, m


def _dense(code, d, m):
    return (np.repeat(d, 32, axis=-2) * code.astype(np.float32)) + np.repeat(m, 32, axis=-2)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("m", [1, 3, 6, 8, 9, 12, 23, 24, 64, 65, 130])
def test_kernel_gives_the_float32_kernels_bits(kind, m):
    rng = np.random.default_rng(m)
    k, n = 576, 960
    code, d, o = _random_blocks(rng, (k, n), kind)
    w = _dense(code, d, o)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = np.asarray(jax.jit(ck.small_matmul)(x, w))
    got = np.asarray(jax.jit(ck.block_matmul)(x, code, d, o))
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # and XLA's rebuild of the weights is the same float32 weights
    np.testing.assert_array_equal(_bits(jax.jit(ck.dequantize_blocks)(code, d, o)), _bits(w))


@pytest.mark.parametrize("k, n", [(1536, 576), (96, 4160), (64, 64)])
def test_kernel_bits_across_tiles_and_ranges(k, n):
    """Row ranges that end inside a 64-row tile and blocks that straddle tiles (K = 1536 split
    between threads, K = 96 less than two tiles), several column blocks (N = 4160)."""
    rng = np.random.default_rng(k + n)
    code, d, o = _random_blocks(rng, (k, n), "q4_1")
    w = _dense(code, d, o)
    for m in (1, 2, 4, 8, 16):
        x = rng.standard_normal((m, k)).astype(np.float32)
        np.testing.assert_array_equal(_bits(jax.jit(ck.block_matmul)(x, code, d, o)),
                                      _bits(jax.jit(ck.small_matmul)(x, w)))


def test_kernel_pads_columns_and_reads_stacked_layers_in_place():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    code, d, o = _random_blocks(rng, (64, 100), "q4_1")  # N = 100: padded to 128, cut back
    np.testing.assert_array_equal(_bits(ck.block_matmul(x, code, d, o)), _bits(ck.small_matmul(x, _dense(code, d, o))))
    codes, ds, os_ = _random_blocks(rng, (3, 64, 192), "q8_0")
    for layer in range(3):
        got = jax.jit(ck.block_matmul_stacked)(x, codes, ds, os_, layer)
        want = ck.small_matmul(x, _dense(codes[layer], ds[layer], os_[layer]))
        np.testing.assert_array_equal(_bits(got), _bits(want))
    # the gradient with respect to x is the float matmul's
    w = _dense(code, d, o)
    g = jax.grad(lambda x: ck.block_matmul(x, code, d, o).sum())(x)
    np.testing.assert_allclose(g, np.broadcast_to(w.sum(1), x.shape), rtol=1e-5, atol=1e-5)


def test_packed_q4_codes_give_the_int8_codes_bits():
    """Q4 codes packed two per byte (pack_q4): the same products as the int8 codes on every
    path of the kernel (1-130 rows, tiles and K ranges, padded columns, stacked layers) and
    in XLA's rebuild; codes outside 0..15 or a last axis not in 32-column groups are refused."""
    rng = np.random.default_rng(11)
    for k, n, ms in [(576, 960, (1, 2, 3, 4, 6, 8, 9, 12, 16, 23, 24, 65, 130)), (1536, 576, (1, 4, 9)),
                     (96, 4160, (1, 5, 16)), (64, 96, (3,))]:  # N = 96: padded to 128
        code, d, o = _random_blocks(rng, (k, n), "q4_1")
        packed = ck.pack_q4(code)
        assert packed.dtype == np.uint8 and packed.shape == (k, n // 2)
        np.testing.assert_array_equal(ck.unpack_q4(packed), code)
        np.testing.assert_array_equal(_bits(jax.jit(ck.dequantize_blocks)(packed, d, o)), _bits(_dense(code, d, o)))
        for m in ms:
            x = rng.standard_normal((m, k)).astype(np.float32)
            np.testing.assert_array_equal(_bits(jax.jit(ck.block_matmul)(x, packed, d, o)),
                                          _bits(jax.jit(ck.block_matmul)(x, code, d, o)), err_msg=f"{k} {n} {m}")
    codes, ds, os_ = _random_blocks(rng, (3, 64, 192), "q4_1")
    x = rng.standard_normal((5, 64)).astype(np.float32)
    for layer in range(3):
        np.testing.assert_array_equal(_bits(jax.jit(ck.block_matmul_stacked)(x, ck.pack_q4(codes), ds, os_, layer)),
                                      _bits(ck.block_matmul(x, codes[layer], ds[layer], os_[layer])))
    assert not ck.packable_q4(_random_blocks(rng, (64, 64), "q4_0")[0])  # -8..7
    assert not ck.packable_q4(np.zeros((64, 48), np.int8))
    with pytest.raises(ValueError, match="pack_q4"):
        ck.pack_q4(np.full((32, 32), 16, np.int8))


class _Tensor:
    """What the loader reads of a GGUF tensor: name, type, shape (ne0 first) and raw data."""

    def __init__(self, name, arr, qtype):
        self.name, self.tensor_type = name, qtype
        self.shape = np.array(arr.shape[::-1])
        self.data = gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_loader_blocks_are_ggufs_own_weights(qtype):
    w = np.random.default_rng(int(qtype)).standard_normal((96, 128)).astype(np.float32)  # [out, in]
    t = _Tensor("blk.0.ffn_up.weight", w, qtype)
    b = gguf_loader._blocks(t)
    assert b.code.dtype == np.int8 and b.code.shape == (96, 128) and b.scale.shape == (96, 4)
    np.testing.assert_array_equal(_bits(b.dequantize()), _bits(gguf_loader._dequantize(t)))


def _block_model(scan, tied=True, seed=0):
    """A tiny model quantized to Q4_1-like blocks, and the float model of the same weights."""
    cfg = tiny_config(vocab_size=128, dim=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=96, n_layers=2,
                      scan_layers=scan, tie_embeddings=tied)
    rng = np.random.default_rng(seed)
    w = LlamaLM.init(cfg, seed).canonical_weights()
    head = "embed" if tied else "lm_head"
    for name in MATRICES + (head,):
        code, d, o = _random_blocks(rng, w[name].shape[:-2] + w[name].shape[-1:] + w[name].shape[-2:-1], "q4_1",
                                    size=0.05)
        # canonical layout is [..., out, in] with blocks along in: swap the kernel-layout axes
        sw = lambda a: np.ascontiguousarray(np.swapaxes(a, -1, -2))  # noqa: E731
        w[name] = BlockWeights(sw(code), sw(d), sw(o))
    blocks = LlamaLM.from_weights(cfg.replace(weight_blocks=True), w)
    dense = LlamaLM.from_weights(cfg, w)  # BlockWeights are dequantized for a float model
    return blocks, dense


def _logits(lm, toks, max_len=32):
    toks = jnp.asarray(toks, jnp.int32)
    out = jax.jit(lm.apply)(lm.params, toks, lm.init_cache(toks.shape[0], max_len))
    return np.asarray(out.logits)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("tied", [True, False])
def test_model_with_blocks_gives_the_float_models_bits(scan, tied):
    blocks, dense = _block_model(scan, tied)
    leaves = {str(np.asarray(v).dtype) for v in jax.tree.leaves(blocks.params)}
    assert {"int8", "uint8"} <= leaves  # really stored as codes: the head's, the layers' packed Q4
    toks = np.random.default_rng(1).integers(0, 128, (3, 9))
    np.testing.assert_array_equal(_bits(_logits(blocks, toks)), _bits(_logits(dense, toks)))
    # XLA's ops (weights rebuilt in the graph) give the XLA float path's bits
    bx, dx = blocks.with_config(cpu_kernels="xla"), dense.with_config(cpu_kernels="xla")
    assert bx.config.weight_blocks
    np.testing.assert_array_equal(_bits(_logits(bx, toks)), _bits(_logits(dx, toks)))


def test_blocks_round_trip_and_switch_off():
    blocks, dense = _block_model(scan=False)
    kept = blocks.canonical_weights(blocks=True)
    assert all(isinstance(kept[k], BlockWeights) for k in MATRICES + ("embed",))
    assert all(kept[k].code.dtype == np.int8 for k in MATRICES)  # packed codes come back unpacked
    again = LlamaLM.from_weights(blocks.config, kept).canonical_weights(blocks=True)
    for k in MATRICES:
        np.testing.assert_array_equal(again[k].code, kept[k].code, err_msg=k)
    flat, ref = blocks.canonical_weights(), dense.canonical_weights()
    for k in ref:
        np.testing.assert_array_equal(_bits(flat[k]), _bits(ref[k]), err_msg=k)
    toks = [[3, 1, 4, 1, 5, 9, 2, 6]]
    scanned = blocks.with_config(scan_layers=True)
    assert scanned.config.weight_blocks
    np.testing.assert_array_equal(_bits(_logits(scanned, toks)), _bits(_logits(dense, toks)))
    off = blocks.with_config(weight_blocks=False)
    assert not off.config.weight_blocks and all(np.asarray(v).dtype == np.float32 for v in jax.tree.leaves(off.params))
    np.testing.assert_array_equal(_bits(_logits(off, toks)), _bits(_logits(dense, toks)))
    # a change that leaves no room for blocks rebuilds them in float32 first, as with float weights
    bf, dbf = (m.with_config(dtype="bfloat16", param_dtype="bfloat16") for m in (blocks, dense))
    assert not bf.config.weight_blocks
    np.testing.assert_array_equal(_logits(bf, toks), _logits(dbf, toks))
    with pytest.raises(ValueError, match="weight_blocks"):
        blocks.with_config(dtype="bfloat16", param_dtype="bfloat16", weight_blocks=True)


def test_block_config_errors():
    with pytest.raises(ValueError, match="weight_blocks"):
        tiny_config(vocab_size=128, dim=64, head_dim=32, ffn_dim=96, n_heads=2, n_kv_heads=1, weight_blocks=True,
                    dtype="bfloat16", param_dtype="bfloat16")
    with pytest.raises(ValueError, match="weight_blocks"):
        tiny_config(weight_blocks=True)  # dim 16, head_dim 8: not blocks of 32
    cfg = tiny_config(vocab_size=128, dim=64, head_dim=32, ffn_dim=96, n_heads=2, n_kv_heads=1)
    with pytest.raises(ValueError, match="not BlockWeights"):
        LlamaLM.from_weights(cfg.replace(weight_blocks=True), LlamaLM.init(cfg).canonical_weights())
    assert isinstance(LlamaConfig.__dataclass_fields__["weight_blocks"].default, bool)


@pytest.fixture(scope="module")
def real_path():
    try:
        return gguf_loader.default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.real_model
def test_real_model_keeps_its_blocks_and_its_tokens(real_path):
    """SmolLM2's GGUF (Q4_1 layers, Q8_0 embedding) loads as blocks on CPU by default, with
    gguf's weights bit for bit and the float32 model's tokens."""
    from specjax import sampling
    from specjax.build import make_autoregressive_engine

    lm, _ = gguf_loader.load_gguf_cached()
    assert lm.config.weight_blocks == ck.blocks_vectorized()  # "auto": on where measured
    if not lm.config.weight_blocks:
        lm = gguf_loader.load_gguf(weight_blocks=True)[0]
    reader = gguf_loader.open_gguf(real_path)
    for t in reader.tensors:
        if t.tensor_type.name in ("Q8_0", "Q4_1") and t.name in ("token_embd.weight", "blk.7.attn_q.weight",
                                                                  "blk.29.ffn_down.weight"):
            np.testing.assert_array_equal(_bits(gguf_loader._blocks(t).dequantize()),
                                          _bits(gguf_loader._dequantize(t)), err_msg=t.name)
    dense = lm.with_config(weight_blocks=False)
    prompts = [[1, 9690, 198, 2683, 359, 253], [1, 4093, 314, 253, 2298, 30, 2]]
    kw = dict(seed=5, max_new_tokens=12, sampling_params=sampling.SamplingConfig(temperature=1.0))
    a = make_autoregressive_engine(lm).generate(prompts, **kw)
    b = make_autoregressive_engine(dense).generate(prompts, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not gguf_loader.read_config(weight_blocks=False).weight_blocks
    assert not gguf_loader.read_config(dtype="bfloat16", param_dtype="bfloat16").weight_blocks
