"""Parity with Hugging Face transformers for each model family load_hf reads.

The fixtures (tests/fixtures/families/<family>.npz, made by scripts/make_family_fixtures.py
with torch + transformers) hold a tiny random checkpoint (config.json text + every tensor)
and transformers' outputs for it: full-forward logits, 32 greedy tokens from a prompt
longer than the sliding windows. Here the HF
folder is rebuilt in tmp_path (some families as a sharded checkpoint) and loaded with
``load_hf``; no torch is needed.
"""
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.hf_checkpoint import (SUPPORTED_ARCHITECTURES, HFCheckpointError, architecture_for, config_from_hf,
                                          hf_config, load_hf, save_hf)
from specjax.models.llama import expected_shapes, tiny_config

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "families"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
SHARDED = ("qwen2", "gemma2")  # written as two shards + model.safetensors.index.json
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
WINDOWED = ("qwen2", "mistral", "gemma2", "gemma3")
ATOL = 1e-4  # float32, against transformers
MAX_LEN = 48


@functools.lru_cache(maxsize=None)
def fixture(family):
    with np.load(FIXTURES / f"{family}.npz") as z:
        return {k: z[k] for k in z.files}


def write_folder(family, path):
    """The fixture's checkpoint as an HF folder (sharded for SHARDED families)."""
    from safetensors.numpy import save_file

    z = fixture(family)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(str(z["config_json"]))
    tensors = {k[2:]: z[k] for k in z if k.startswith("t:")}
    if family in SHARDED:
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for f, ks in shards.items():
            save_file({k: tensors[k] for k in ks}, str(path / f))
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    else:
        save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: write_folder(f, root / f) for f in FAMILIES}


def forward(lm, tokens, cache=None):
    tokens = jnp.asarray(tokens, jnp.int32)
    if cache is None:
        cache = lm.init_cache(tokens.shape[0], MAX_LEN)
    out = _apply(lm)(lm.params, tokens, cache)
    return np.asarray(out.logits), out.cache


@functools.lru_cache(maxsize=None)
def _apply(lm):
    return jax.jit(lm.apply)


@functools.lru_cache(maxsize=None)
def model(family, path, **kw):
    return load_hf(path, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_greedy_decode_match_hf(folders, family):
    """One full forward (2 rows of 44 tokens, longer than every window; unrolled layers, CPU
    kernels) within 1e-4 of transformers'; 32 greedy tokens with the KV cache (prefill, then
    1-token steps) equal transformers' generate(), with step logits equal to the forward's."""
    z = fixture(family)
    assert json.loads(str(z["config_json"]))["architectures"] == [ARCH[family]]
    lm = model(family, folders[family])
    full = forward(lm, z["input_ids"])[0]
    assert np.abs(full - z["logits"]).max() < ATOL

    prompt, greedy = z["prompt"], z["greedy"]
    p, n = len(prompt), len(greedy)
    assert len(set(greedy.tolist())) > 10  # not a degenerate repetition
    logits, cache = forward(lm, prompt[None])
    steps, toks = [logits[0, -1]], []
    for _ in range(n):
        toks.append(int(steps[-1].argmax()))
        logits, cache = forward(lm, np.array([[toks[-1]]]), cache)
        steps.append(logits[0, -1])
    assert toks == greedy.tolist()
    steps = np.stack(steps[:n])
    assert np.abs(steps - z["logits"][0, p - 1:-1]).max() < ATOL
    assert np.abs(steps - full[0, p - 1:-1]).max() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_scanned_multi_token_steps_match_hf(folders, family):
    """The scanned model with XLA's chunked attention (4-slot chunks), fed 4 tokens at a time
    over its cache as the verifier is: logits within 1e-4 of transformers' full forward."""
    z = fixture(family)
    lm = model(family, folders[family], scan_layers=True, cpu_kernels="xla", attn_chunk=4)
    ids = z["input_ids"]
    cache, got = lm.init_cache(ids.shape[0], MAX_LEN), []
    for s in range(0, ids.shape[1], 4):
        logits, cache = forward(lm, ids[:, s:s + 4], cache)
        got.append(logits)
    assert np.abs(np.concatenate(got, axis=1) - z["logits"]).max() < ATOL


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_window_matters(folders, family):
    """Without the sliding window (a window longer than the sequence) the logits agree with
    transformers' only up to the window, where it cuts nothing: the fixtures exercise it."""
    z = fixture(family)
    lm = model(family, folders[family])
    w = lm.config.sliding_window
    assert 0 < w < z["input_ids"].shape[1]
    unwindowed = model(family, folders[family], sliding_window=MAX_LEN)
    got = forward(unwindowed, z["input_ids"])[0]
    assert np.abs(got[:, :w] - z["logits"][:, :w]).max() < ATOL
    assert np.abs(got[:, w:] - z["logits"][:, w:]).max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_save_hf_round_trip(folders, family, tmp_path):
    """save_hf writes the family's architecture and names; load_hf reads back the same
    config and the same weights, bit for bit."""
    lm = model(family, folders[family])
    save_hf(lm, tmp_path / "ck")
    orig = json.loads(str(fixture(family)["config_json"]))
    saved = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert saved["architectures"] == orig["architectures"] and saved["model_type"] == orig["model_type"]
    back = load_hf(tmp_path / "ck")
    assert back.config.replace(name="x") == lm.config.replace(name="x")
    a, b = lm.canonical_weights(), back.canonical_weights()
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    from safetensors.numpy import load_file

    assert sorted(load_file(str(tmp_path / "ck" / "model.safetensors"))) == sorted(
        k[2:] for k in fixture(family) if k.startswith("t:"))


def test_config_switches():
    """What each family's config.json turns on."""
    cfg = {f: config_from_hf(json.loads(str(fixture(f)["config_json"]))) for f in FAMILIES}
    assert cfg["qwen2"].qkv_bias and not cfg["qwen2"].qk_norm
    assert cfg["qwen2"].layer_types == ("full", "sliding") and cfg["qwen2"].sliding_window == 5
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim * cfg["qwen3"].n_heads != cfg["qwen3"].dim
    assert cfg["mistral"].sliding_layers == (True, True)
    g2, g3 = cfg["gemma2"], cfg["gemma3"]
    for g in (g2, g3):
        assert (g.norm_offset, g.sandwich_norm, g.embed_scale, g.mlp_act, g.tie_embeddings) == (
            1.0, True, True, "gelu_tanh", True)
    assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale) == (3.0, 10.0, 24 ** -0.5)
    assert g2.layer_types == ("sliding", "full") and not g2.qk_norm
    assert g2.replace(n_layers=1).layer_types == ("sliding",)  # a first-layers draft keeps its pattern
    assert g3.qk_norm and g3.attn_softcap == 0 and g3.final_softcap == 0
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling.rope_type, g3.rope_scaling.factor) == (
        1e6, 1e4, "linear", 4.0)
    assert cfg["llama"].rope_scaling.rope_type == "llama3"
    for f, c in cfg.items():  # num_params counts the switches' tensors
        assert c.num_params() == sum(math.prod(s) for s in expected_shapes(c).values()), f


def test_classic_config_keys():
    """config.json as transformers 4 wrote it (rope_theta / rope_scaling / rope_local_base_freq
    / sliding_window_pattern, no layer_types) reads as the same config."""
    g3 = json.loads(str(fixture("gemma3")["config_json"]))
    classic = {k: v for k, v in g3.items() if k not in ("rope_parameters", "layer_types")}
    classic.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0},
                   sliding_window_pattern=2)
    assert config_from_hf(classic) == config_from_hf(g3)
    q2 = json.loads(str(fixture("qwen2")["config_json"]))
    classic = {k: v for k, v in q2.items() if k not in ("rope_parameters", "layer_types")}
    classic.update(rope_theta=1e6)  # layers from max_window_layers
    assert config_from_hf(classic) == config_from_hf(q2)
    classic["use_sliding_window"] = False
    assert config_from_hf(classic).sliding_window == 0


def test_unknown_architecture_and_inexpressible_configs(tmp_path):
    hf = json.loads(str(fixture("qwen3")["config_json"]))
    hf["architectures"] = ["PhiForCausalLM"]
    with pytest.raises(ValueError, match="unsupported architecture 'PhiForCausalLM'.*Qwen3ForCausalLM"):
        config_from_hf(hf)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(pytest.raises(HFCheckpointError, config_from_hf, hf).value)
    hf["architectures"] = ["Qwen3ForCausalLM"]
    hf["attention_bias"] = True
    with pytest.raises(HFCheckpointError, match="attention_bias"):
        config_from_hf(hf)
    # a config no family expresses, or not the family asked for, is refused (save_hf writes
    # hf_config's config.json, built before any tensor is written)
    both = tiny_config(vocab_size=8, qkv_bias=True, qk_norm=True)
    assert architecture_for(both) == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="Qwen3ForCausalLM cannot express this config: qkv_bias=True"):
        hf_config(both)
    mixed = tiny_config(vocab_size=8, n_layers=2, sliding_window=3, layer_types=("full", "sliding"))
    with pytest.raises(ValueError, match="MistralForCausalLM cannot express this config: layer_types"):
        hf_config(mixed)
    d = hf_config(mixed.replace(qkv_bias=True))  # Qwen2 takes per-layer windows
    assert d["architectures"] == ["Qwen2ForCausalLM"] and d["layer_types"] == ["full_attention", "sliding_attention"]
    assert config_from_hf(d).layer_types == ("full", "sliding")
    # a Qwen3 checkpoint without its q/k norms
    d = write_folder("qwen3", tmp_path / "q3")
    from safetensors.numpy import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.self_attn.k_norm.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="missing k_norm for layers \\[1\\]"):
        load_hf(d)


def _byte_tokenizer(folder):
    """A 256-token byte-level tokenizer (no merges; EOS = token 0) beside the checkpoint, so
    the command line can read the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": alphabet[0]}))


@pytest.mark.parametrize("family", FAMILIES)
def test_command_line_runs_each_family(folders, family, tmp_path, capsys):
    """`specjax generate --model <hf folder>` (autoregressive, to keep CI short; the speculative
    path of such folders is the engine law test above and test_cli's HF-folder runs), greedy:
    the text is the decoded greedy continuation the Python API gives for the same prompt."""
    import shutil

    from specjax import build, cli, sampling
    from specjax.models.tokenizer import TextStream, Tokenizer

    folder = shutil.copytree(folders[family], tmp_path / family)
    _byte_tokenizer(folder)
    prompt = "the cat sat on the mat"
    assert cli.main(["generate", prompt, "--raw", "--model", str(folder), "--temperature", "0",
                     "--max-new-tokens", "12", "--json", "--draft", "none"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert 1 <= report["autoregressive"]["new_tokens"] <= 12
    if family != "qwen3":  # one family also against the Python API (a second compile)
        return
    tok = Tokenizer.from_hf_folder(folder)
    out = build.generate_autoregressive(load_hf(folder), [tok.encode(prompt)], seed=0, max_new_tokens=12,
                                        sampling_params=sampling.SamplingConfig(temperature=0.0),
                                        stop_tokens=list(tok.stop_ids))
    assert report["texts"] == [TextStream.text(tok, out.tokens[0], tok.stop_ids)]
    assert report["autoregressive"]["new_tokens"] == len(out.tokens[0])
