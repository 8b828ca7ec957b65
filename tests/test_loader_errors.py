"""Bad model files give one clear error (naming the file and what is wrong) before heavy
work: never a raw error from numpy / struct / safetensors, never a silently wrong model.

Found by a bug hunt in the loaders; each test failed (a raw ZeroDivisionError, TypeError,
KeyError, SafetensorError or numpy reshape error, a traceback from the CLI, or a model /
tokenizer loaded silently wrong) before the fix it guards."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from specjax import build, cli
from specjax.drafts.files import DraftFileError, load_draft_model, save_draft
from specjax.models import gguf_loader
from specjax.models.config import preset_from_dict
from specjax.models.gguf_loader import GGUFError, load_gguf, permute_rope_rows, read_config
from specjax.models.hf_checkpoint import HFCheckpointError, config_from_hf, load_hf
from specjax.models.llama import expected_shapes, tiny_config
from specjax.models.tokenizer import Tokenizer, TokenizerError

CFG = tiny_config(vocab_size=8, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
_GGUF_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
               "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
_TOKENS = ["<|endoftext|>", "h", "i", "a", "b", "c", "d", "e"]


def _weights(cfg=CFG, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in expected_shapes(cfg).items()}


def write_gguf(path, meta=None, drop_meta=(), change=None, extra=None, tokenizer=False, cfg=CFG):
    """A float32 llama GGUF of random weights in llama.cpp's layout (no jax involved);
    ``meta`` replaces ``llama.*`` values, ``change`` maps a tensor name to a function of its
    array, ``extra`` adds tensors."""
    w = _weights(cfg)
    wr = gguf.GGUFWriter(str(path), "llama")
    m = {"block_count": cfg.n_layers, "context_length": 64, "embedding_length": cfg.dim,
         "feed_forward_length": cfg.ffn_dim, "attention.head_count": cfg.n_heads,
         "attention.head_count_kv": cfg.n_kv_heads, "rope.freq_base": 10000.0,
         "attention.layer_norm_rms_epsilon": 1e-5, "rope.dimension_count": cfg.head_dim,
         "vocab_size": cfg.vocab_size}
    m.update(meta or {})
    for k, v in m.items():
        if k in drop_meta:
            continue
        key = f"llama.{k}"
        if isinstance(v, float):
            wr.add_float32(key, v)
        elif isinstance(v, str):
            wr.add_string(key, v)
        elif isinstance(v, list):
            wr.add_array(key, v)
        else:
            wr.add_uint32(key, v)
    if tokenizer:
        wr.add_tokenizer_model("gpt2")
        wr.add_tokenizer_pre("gpt2")
        wr.add_token_list(_TOKENS[: cfg.vocab_size])
        wr.add_token_types([3] + [1] * (cfg.vocab_size - 1))
        wr.add_token_merges([])
        wr.add_eos_token_id(0)
    tensors = {"token_embd.weight": w["embed"], "output_norm.weight": w["final_norm"]}
    for k, g in _GGUF_NAMES.items():
        for i in range(cfg.n_layers):
            a = w[k][i]
            if k in ("wq", "wk"):
                a = permute_rope_rows(a, cfg.n_heads if k == "wq" else cfg.n_kv_heads)
            tensors[f"blk.{i}.{g}.weight"] = a
    tensors.update(extra or {})
    for name, a in tensors.items():
        if change and name in change:
            a = change[name](a)
        wr.add_tensor(name, np.ascontiguousarray(a))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


# --------------------------------------------------------------------------------------
# GGUF


@pytest.mark.parametrize("meta, message", [
    ({"attention.head_count": 0}, "llama.attention.head_count = 0: must be positive"),  # was ZeroDivisionError
    ({"embedding_length": "wide"}, "llama.embedding_length = 'wide': expected an integer"),  # was int()'s ValueError
    ({"attention.head_count": [4, 4]}, "llama.attention.head_count is an array"),  # was a TypeError
    ({"attention.layer_norm_rms_epsilon": "small"}, "layer_norm_rms_epsilon = 'small': expected a finite number"),
    ({"attention.head_count": 7}, "embedding_length = 32 is not a multiple of llama.attention.head_count = 7"),
    ({"feed_forward_length": 0}, "invalid config: LlamaConfig.ffn_dim must be a positive int"),  # no file named
    ({"attention.head_count_kv": 3}, "n_heads=4 is not a multiple of n_kv_heads=3"),
])
def test_gguf_bad_metadata_is_one_error_naming_the_file(tmp_path, meta, message):
    path = write_gguf(tmp_path / "m.gguf", meta=meta, drop_meta=("rope.dimension_count",))
    for read in (read_config, load_gguf):
        with pytest.raises(GGUFError, match=message) as e:
            read(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("meta", [{"rope.freq_base": 0.0}, {"rope.freq_base": -1.0},
                                  {"rope.freq_base": float("nan")},
                                  {"attention.layer_norm_rms_epsilon": -1e-5}])
def test_gguf_rope_base_and_norm_eps_are_checked(tmp_path, meta):
    """A RoPE base <= 0 or a negative RMSNorm epsilon loaded silently (NaN logits)."""
    path = write_gguf(tmp_path / "m.gguf", meta=meta)
    with pytest.raises(GGUFError, match="rope.freq_base|layer_norm_rms_epsilon"):
        read_config(path)


@pytest.mark.parametrize("name, change", [
    ("blk.0.attn_q.weight", lambda a: np.zeros((36, 32), np.float32)),  # was numpy's reshape error
    ("blk.1.attn_k.weight", lambda a: a.reshape(2, 8, 32)),  # was numpy's reshape error
    ("blk.0.ffn_gate.weight", lambda a: np.ascontiguousarray(a.T)),
    ("token_embd.weight", lambda a: a.reshape(-1)),
])
def test_gguf_misshapen_tensor_is_named_before_any_dequantization(tmp_path, monkeypatch, name, change):
    path = write_gguf(tmp_path / "m.gguf", change={name: change})
    monkeypatch.setattr(gguf_loader, "_dequantize", lambda t: pytest.fail("dequantized before the shape check"))
    with pytest.raises(GGUFError, match=f"shape mismatch between GGUF tensors and metadata: tensor '{name}'") as e:
        load_gguf(path, weight_blocks=False)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("name", ["blk.-1.attn_norm.weight", "blk.x.attn_norm.weight", "blk.0.weight"])
def test_gguf_malformed_layer_names(tmp_path, name):
    """blk.-1 used to overwrite the last layer's tensor silently (Python's index -1); the
    others were a raw ValueError from int() / unpacking."""
    path = write_gguf(tmp_path / "m.gguf", extra={name: np.full(32, 7.0, np.float32)})
    with pytest.raises(GGUFError, match="unexpected layer tensor"):
        load_gguf(path, weight_blocks=False)


# --------------------------------------------------------------------------------------
# GGUF tokenizer


def _tok_meta(**changes):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": list(_TOKENS),
            "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1, 1, 4], "tokenizer.ggml.merges": ["h i"],
            "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.bos_token_id": 0}
    meta["tokenizer.ggml.tokens"].append("hi")
    meta["tokenizer.ggml.token_type"].append(1)
    for k, v in changes.items():
        k = "tokenizer.ggml." + k
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    return meta


def test_gguf_tokenizer_metadata_checks():
    tok = Tokenizer.from_gguf_metadata(_tok_meta())
    assert tok.special_ids == (0, 7) and tok.encode("hi") == [8]
    cases = [
        (dict(token_type=[3, 1]), "2 tokenizer.ggml.token_type entries for 9 tokens"),  # was: special token 7 lost
        (dict(tokens=None), "lacks tokenizer.ggml.tokens"),  # was a KeyError
        (dict(eos_token_id=99), "eos_token_id = 99 is not a token id"),  # was accepted
        (dict(bos_token_id=-1), "bos_token_id = -1 is not a token id"),
        (dict(merges=["zz qq"]), "GGUF tokenizer: .*out of vocabulary"),  # was the Rust exception
        (dict(merges=["hi"]), "merges must be a list of 'left right' strings"),  # was a multi-line TypeError
    ]
    for changes, message in cases:
        with pytest.raises(TokenizerError, match=message) as e:
            Tokenizer.from_gguf_metadata(_tok_meta(**changes))
        assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------
# HF checkpoint folders


def _hf_config(**changes):
    c = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32,
         "tie_word_embeddings": True}
    c.update(changes)
    return c


def _hf_tensors(seed=0):
    cfg = config_from_hf(_hf_config())
    w = _weights(cfg, seed)
    names = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    t = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["final_norm"]}
    for k, n in names.items():
        t[f"model.layers.0.{n}.weight"] = np.ascontiguousarray(w[k][0])
    return t


def write_hf(folder, config=None, tensors=None):
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or _hf_config()))
    save_file(tensors or _hf_tensors(), str(folder / "model.safetensors"))
    return folder


def test_hf_config_json_that_is_not_an_object(tmp_path):
    d = write_hf(tmp_path / "ck")
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(HFCheckpointError, match="config.json: must hold a JSON object, got list"):
        load_hf(d)  # was AttributeError: 'list' object has no attribute 'get'
    with pytest.raises(HFCheckpointError, match="must hold a JSON object"):
        config_from_hf([1, 2])  # the CLI's path: it parses config.json itself
    (d / "config.json").write_text("{broken")
    with pytest.raises(HFCheckpointError, match="config.json: not a readable config.json"):
        load_hf(d)  # was a JSONDecodeError that named no file


@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling=[1]), "rope_scaling must be a mapping"),  # was AttributeError
    (dict(rope_theta=0), "rope_theta=0.0"),  # was loaded: NaN RoPE angles
    (dict(rms_norm_eps=-1), "rms_norm_eps=-1.0"),
    (dict(num_attention_heads=3, num_key_value_heads=1, head_dim=None), "head_dim=5 must be even"),  # raw ValueError
    (dict(num_key_value_heads=3), "not a multiple of n_kv_heads=3"),
    # was read as Python reads a string: "false" is truthy, so the head was tied
    (dict(tie_word_embeddings="false"), "tie_word_embeddings='false' \\(want true or false\\)"),
    (dict(attention_bias=0), "attention_bias=0 \\(want true or false\\)"),
])
def test_hf_bad_config_values(tmp_path, changes, message):
    d = write_hf(tmp_path / "ck", config=_hf_config(**changes))
    with pytest.raises(HFCheckpointError, match=message) as e:
        load_hf(d)
    assert str(d) in str(e.value)


def test_hf_corrupt_safetensors_names_the_file(tmp_path):
    d = write_hf(tmp_path / "ck")
    data = (d / "model.safetensors").read_bytes()
    for cut in (5, len(data) // 2):
        (d / "model.safetensors").write_bytes(data[:cut])
        with pytest.raises(HFCheckpointError, match="model.safetensors: not a readable safetensors file"):
            load_hf(d)  # was safetensors' SafetensorError, naming no file


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.bool_])
def test_hf_integer_weights_are_refused(tmp_path, dtype):
    """Integer codes (a quantized checkpoint) were cast to float32 and loaded as weights."""
    t = _hf_tensors()
    t["model.layers.0.self_attn.q_proj.weight"] = (t["model.layers.0.self_attn.q_proj.weight"] * 50).astype(dtype)
    d = write_hf(tmp_path / "ck", tensors=t)
    with pytest.raises(HFCheckpointError, match="q_proj.weight' has dtype"):
        load_hf(d)


def test_hf_tensor_in_two_files(tmp_path):
    """Without an index, a tensor in two files was taken from the last one read, silently;
    with an index, the index decides (as in HF)."""
    from safetensors.numpy import save_file

    d = write_hf(tmp_path / "ck")
    save_file({"model.norm.weight": np.zeros(16, np.float32)}, str(d / "z-other.safetensors"))
    with pytest.raises(HFCheckpointError, match="tensor 'model.norm.weight' is in both"):
        load_hf(d)
    names = list(_hf_tensors())
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model.safetensors" for n in names}}))
    load_hf(d)


@pytest.mark.parametrize("index, message", [("{broken", "not a readable safetensors index"),
                                            ("{}", "no weight_map"), ("[]", "no weight_map")])
def test_hf_bad_index(tmp_path, index, message):
    d = write_hf(tmp_path / "ck")
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(HFCheckpointError, match=message):
        load_hf(d)  # was a JSONDecodeError / KeyError / TypeError


def _word_tokenizer(folder):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    vocab["</s>"] = len(vocab)
    t = HFTokenizer(models.WordLevel(vocab, unk_token="a"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.save(str(folder / "tokenizer.json"))


def test_hf_tokenizer_add_bos_with_a_bos_token_it_lacks(tmp_path):
    """add_bos_token with a bos_token not in tokenizer.json: encode left the BOS out silently."""
    _word_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": True}))
    with pytest.raises(TokenizerError, match="add_bos_token but its bos_token '<s>' is not a token"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    assert Tokenizer.from_hf_folder(tmp_path).add_bos is False  # no BOS asked for: fine


# --------------------------------------------------------------------------------------
# model presets


BASE = {"family": "llama", "config": {"vocab_size": 8, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                      "head_dim": 8, "ffn_dim": 64}}


@pytest.mark.parametrize("checkpoint, message", [
    ("gguf", "checkpoint must be a mapping"),  # these three were TypeErrors (a traceback from the CLI)
    ({"format": "gguf", "pth": "x"}, "checkpoint needs a format and at most a path"),
    ({"path": "x.gguf"}, "checkpoint needs a format"),
    ({"format": "hf", "path": 5}, "checkpoint path must be a string or null"),  # failed in build()
])
def test_preset_bad_checkpoint(checkpoint, message):
    with pytest.raises(ValueError, match=message):
        preset_from_dict({**BASE, "checkpoint": checkpoint}, name="p")


def test_preset_config_not_a_mapping():
    with pytest.raises(ValueError, match="preset p: config must be a mapping"):
        preset_from_dict({**BASE, "config": [1, 2]}, name="p")
    with pytest.raises(ValueError, match="preset p: LlamaConfig.dim must be a positive int"):
        preset_from_dict({**BASE, "config": {**BASE["config"], "dim": 0}}, name="p")


def test_preset_checkpoint_of_another_shape(tmp_path):
    """The preset's shape (what the metadata checks read) and the checkpoint's differed
    silently: build() returned the checkpoint's model."""
    path = write_gguf(tmp_path / "m.gguf")
    pre = preset_from_dict({**BASE, "config": {**BASE["config"], "n_layers": 1},
                            "checkpoint": {"format": "gguf", "path": str(path)}}, name="p")
    with pytest.raises(ValueError, match=r"preset 'p': its checkpoint .*m.gguf has n_layers=2 \(the preset says 1\)"):
        pre.build()


# --------------------------------------------------------------------------------------
# draft files


class _Target:  # what load_draft_model reads of a target before its weights
    class config:
        vocab_size, dim, n_layers, tie_embeddings = 8, 16, 2, True
    vocab_size = 8


DRAFT_CFG = {"vocab_size": 8, "dim": 16, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8,
             "ffn_dim": 32, "tie_embeddings": True}


def test_draft_file_bad_model_config(tmp_path):
    w = _weights(tiny_config(**DRAFT_CFG))
    for cfg, message in (({**DRAFT_CFG, "bogus": 1}, "unexpected keyword argument 'bogus'"),  # was a TypeError
                         ({k: v for k, v in DRAFT_CFG.items() if k != "dim"}, "missing 1 required"),
                         ({**DRAFT_CFG, "n_heads": 0}, "n_heads must be a positive int")):
        save_draft(str(tmp_path / "d.npz"), "llama", cfg, w)
        with pytest.raises(DraftFileError, match=f"d.npz: bad model config .*{message}"):
            load_draft_model(str(tmp_path / "d.npz"), _Target)


def test_draft_file_weights_checked_and_named(tmp_path):
    w = _weights(tiny_config(**DRAFT_CFG))
    save_draft(str(tmp_path / "d.npz"), "llama", DRAFT_CFG, {**w, "wq": w["wq"][:, :8]})
    with pytest.raises(DraftFileError, match="d.npz: tensor 'wq' has shape"):  # named no file
        load_draft_model(str(tmp_path / "d.npz"), _Target)
    save_draft(str(tmp_path / "i.npz"), "llama", DRAFT_CFG, {**w, "wq": (w["wq"] * 50).astype(np.int32)})
    with pytest.raises(DraftFileError, match="i.npz: tensor 'wq' has dtype int32"):  # was cast and loaded
        load_draft_model(str(tmp_path / "i.npz"), _Target)


def test_eagle_draft_dtypes(tmp_path):
    from specjax.models.eagle import EagleConfig, trainable_shapes

    ec = EagleConfig(vocab_size=8, dim=16, n_heads=4, n_kv_heads=2, head_dim=4, ffn_dim=32, vocab_subset=4)
    w = {k: np.ones(s, np.float32) for k, s in trainable_shapes(ec).items()}
    save_draft(str(tmp_path / "e.npz"), "eagle", ec.to_dict(), {**w, "token_map": np.array([0.5, 1, 2, 3])})
    with pytest.raises(DraftFileError, match="token_map' has dtype float"):  # was truncated to ids
        load_draft_model(str(tmp_path / "e.npz"), _Target)
    save_draft(str(tmp_path / "f.npz"), "eagle", ec.to_dict(),
               {**w, "fc": w["fc"].astype(np.int8), "token_map": np.arange(4)})
    with pytest.raises(DraftFileError, match="'fc' has dtype int8"):
        load_draft_model(str(tmp_path / "f.npz"), _Target)


def test_check_draft_metadata_bad_eagle_config(tmp_path):
    p = tmp_path / "e.npz"
    for config, message in (({"vocab_size": 8, "dim": 16, "feature_layers": 5}, "feature_layers must be a list"),
                            ({"vocab_size": "8", "dim": 16}, "vocab_size must be a positive int, got '8'")):
        np.savez(p, meta=np.frombuffer(json.dumps({"kind": "eagle", "config": config}).encode(), np.uint8))
        with pytest.raises(ValueError, match=message):  # was a TypeError / "vocabulary 8, the target 8"
            build.check_draft_metadata(str(p), tiny_config(vocab_size=8, dim=16, n_layers=2))


# --------------------------------------------------------------------------------------
# the command line: exit 2 and one line on stderr, never a traceback


def _cli_exit_2(argv, capsys, monkeypatch, message):
    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("the model was loaded before checking input"))
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("specjax: error:") and "\n" not in err and message in err, err


def test_cli_preset_with_a_bad_checkpoint(tmp_path, capsys, monkeypatch):
    y = tmp_path / "bad.yaml"
    y.write_text("family: llama\ncheckpoint: gguf\nconfig: {vocab_size: 8, dim: 32, n_layers: 1, n_heads: 4, "
                 "n_kv_heads: 2, head_dim: 8, ffn_dim: 16}\n")
    _cli_exit_2(["generate", "hi", "--model", str(y)], capsys, monkeypatch, "checkpoint must be a mapping")


def test_cli_hf_folder_with_a_list_config(tmp_path, capsys, monkeypatch):
    d = write_hf(tmp_path / "ck")
    _word_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (d / "config.json").write_text("[]")
    _cli_exit_2(["generate", "hi", "--model", str(d)], capsys, monkeypatch, "config.json must hold a JSON object")


def test_cli_gguf_with_zero_heads(tmp_path, capsys, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", meta={"attention.head_count": 0}, tokenizer=True)
    _cli_exit_2(["generate", "hi", "--model", str(path), "--draft", "lookup"], capsys, monkeypatch,
                "head_count = 0: must be positive")


def test_cli_hf_folder_with_bad_weight_files_fails_before_loading(tmp_path, capsys, monkeypatch):
    """A corrupt or integer safetensors file was found only once the weights loaded (after
    "loading the model"); the CLI now reads the files' headers with the config."""
    d = write_hf(tmp_path / "ck")
    _word_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:5])
    _cli_exit_2(["generate", "hi", "--model", str(d), "--draft", "lookup"], capsys, monkeypatch,
                "model.safetensors: not a readable safetensors file")
    t = _hf_tensors()
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)
    write_hf(d, tensors=t)
    _cli_exit_2(["generate", "hi", "--model", str(d), "--draft", "lookup"], capsys, monkeypatch,
                "tensor 'model.norm.weight' has dtype I32")
