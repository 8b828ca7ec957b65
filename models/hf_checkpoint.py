"""Hugging Face layout: a folder with ``config.json`` + ``*.safetensors`` (Llama family).

``load_hf(folder, **overrides) -> LlamaLM`` reads ``LlamaForCausalLM`` /
``MistralForCausalLM`` (no sliding window) / ``Qwen2ForCausalLM`` (only without attention
biases) checkpoints, single-file or sharded (``model.safetensors.index.json``).
``save_hf(lm, folder)`` writes the model back as ``LlamaForCausalLM`` (config.json +
model.safetensors, optionally tokenizer.json). HF uses rotate-half RoPE and ``[out, in]``
matrices, the same as our canonical weights, so no permutation is needed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from specjax.models.llama import LlamaConfig, LlamaLM, RopeScaling, check_weights, stack_layers

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_GLOBAL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}


class HFCheckpointError(ValueError):
    pass


def config_from_hf(hf: dict, **overrides: Any) -> LlamaConfig:
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFCheckpointError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch == "MistralForCausalLM" and hf.get("sliding_window") not in (None, 0):
        raise HFCheckpointError("Mistral sliding-window attention is not supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise HFCheckpointError("attention/MLP biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"unsupported activation {hf.get('hidden_act')!r} (only silu)")
    try:
        dim = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        rs = hf.get("rope_scaling")
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "default":
                rs = None
            elif kind != "llama3":
                raise HFCheckpointError(f"unsupported rope_scaling type {kind!r} (only llama3)")
            else:
                rs = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
        cfg = dict(
            vocab_size=int(hf["vocab_size"]),
            dim=dim,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or dim // n_heads),
            ffn_dim=int(hf["intermediate_size"]),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=rs,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position=int(hf.get("max_position_embeddings", 8192)),
            name=str(hf.get("_name_or_path") or hf.get("model_type", "llama")),
        )
    except KeyError as e:
        raise HFCheckpointError(f"config.json lacks {e.args[0]!r}") from e
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def _safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        paths = [folder / f for f in files]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise HFCheckpointError(f"shards listed in {index.name} are missing: {missing}")
        return paths
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise HFCheckpointError(f"no *.safetensors files in {folder}")
    return paths


def _read_tensors(paths) -> dict:
    from safetensors import safe_open

    out = {}
    for p in paths:
        with safe_open(str(p), framework="flax") as f:  # flax/jax arrays handle bfloat16
            for k in f.keys():
                out[k] = np.asarray(f.get_tensor(k), dtype=np.float32)
    return out


def hf_to_canonical(cfg: LlamaConfig, tensors: dict, source: str = "checkpoint") -> dict:
    L = cfg.n_layers
    layers = {v: [None] * L for v in _LAYER.values()}
    out = {}
    for name, arr in tensors.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = arr
            continue
        if name.startswith("model.layers."):
            rest = name[len("model.layers."):]
            idx, _, kind = rest.partition(".")
            if kind in _LAYER and idx.isdigit() and int(idx) < L:
                layers[_LAYER[kind]][int(idx)] = arr
                continue
            if kind.endswith(".bias"):
                raise HFCheckpointError(f"{source}: tensor {name!r}: biases are not supported")
            if kind.endswith("rotary_emb.inv_freq"):
                continue
        raise HFCheckpointError(f"{source}: unexpected tensor {name!r}")
    try:
        out.update(stack_layers(layers))
    except ValueError as e:
        raise HFCheckpointError(f"{source}: {e}") from e
    if cfg.tie_embeddings and "lm_head" in out:
        if not np.array_equal(out["lm_head"], out["embed"]):
            raise HFCheckpointError(f"{source}: tie_word_embeddings is true but lm_head differs from embed_tokens")
        del out["lm_head"]
    try:
        check_weights(cfg, out, source=source)
    except ValueError as e:
        raise HFCheckpointError(f"shape mismatch with config.json: {e}") from e
    return out


def load_hf(folder: str | os.PathLike, **config_overrides: Any) -> LlamaLM:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise HFCheckpointError(f"{folder} has no config.json")
    with open(cfg_path) as f:
        hf = json.load(f)
    cfg = config_from_hf(hf, **config_overrides)
    weights = hf_to_canonical(cfg, _read_tensors(_safetensor_files(folder)), source=str(folder))
    return LlamaLM.from_weights(cfg, weights)


def hf_config(cfg: LlamaConfig, dtype: str = "float32") -> dict:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        d["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    return d


def save_hf(lm: LlamaLM, folder: str | os.PathLike, dtype: str = "float32", tokenizer=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (LlamaForCausalLM names); with a
    :class:`specjax.models.tokenizer.Tokenizer`, also ``tokenizer.json`` and
    ``tokenizer_config.json``."""
    from safetensors.numpy import save_file

    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = lm.config
    w = lm.canonical_weights()
    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        import ml_dtypes

        np_dtype = ml_dtypes.bfloat16
    inv_g = {v: k for k, v in _GLOBAL.items()}
    inv_l = {v: k for k, v in _LAYER.items()}
    tensors = {}
    for k, arr in w.items():
        arr = np.asarray(arr)
        if k in inv_g:
            tensors[inv_g[k]] = np.ascontiguousarray(arr.astype(np_dtype))
        else:
            for i in range(cfg.n_layers):
                tensors[f"model.layers.{i}.{inv_l[k]}"] = np.ascontiguousarray(arr[i].astype(np_dtype))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with open(folder / "config.json", "w") as f:
        json.dump(hf_config(cfg, dtype), f, indent=2)
    if tokenizer is not None:
        tokenizer.hf.save(str(folder / "tokenizer.json"))
        with open(folder / "tokenizer_config.json", "w") as f:
            json.dump(tokenizer_config(tokenizer), f, indent=2)
    return folder


def tokenizer_config(tokenizer) -> dict:
    """``tokenizer_config.json`` for a :class:`specjax.models.tokenizer.Tokenizer` (what
    ``Tokenizer.from_hf_folder`` and HF read: special tokens, the BOS rule, the template)."""
    name = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
    out = {"bos_token": name(tokenizer.bos_id), "eos_token": name(tokenizer.eos_id),
           "pad_token": name(tokenizer.pad_id), "add_bos_token": bool(tokenizer.add_bos)}
    if tokenizer.chat_template:
        out["chat_template"] = tokenizer.chat_template
    return {k: v for k, v in out.items() if v is not None}
