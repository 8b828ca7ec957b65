"""Hugging Face layout: a folder with ``config.json`` + ``*.safetensors``, for the model
families that :class:`specjax.models.llama.LlamaConfig`'s switches cover.

``load_hf(folder, **overrides) -> LlamaLM`` dispatches on ``config.json``'s
``architectures``; supported: :data:`SUPPORTED_ARCHITECTURES` (any other is refused with
an :class:`HFCheckpointError` naming it and the supported list)::

    LlamaForCausalLM    Llama 2/3 (llama3 / linear RoPE scaling), SmolLM2
    MistralForCausalLM  + sliding-window attention on every layer (``sliding_window``)
    Qwen2ForCausalLM    + Q/K/V biases; sliding layers from ``use_sliding_window`` /
                        ``max_window_layers`` or ``layer_types``
    Qwen3ForCausalLM    + per-head q/k RMSNorm, separate ``head_dim`` (no biases)
    Gemma2ForCausalLM   (1 + w) RMSNorm before and after attention and MLP, embeddings
                        scaled by sqrt(hidden_size), GeGLU (gelu-tanh), score scale
                        ``query_pre_attn_scalar ** -0.5``, attention and final-logit
                        soft-capping, alternating sliding / full layers (``layer_types``)
    Gemma3ForCausalLM   (``model_type: gemma3_text``) Gemma 2 without attention
                        soft-capping, with (1 + w) q/k norms and a separate RoPE base for
                        the sliding layers (``rope_local_base_freq``); five sliding layers
                        per full one by default

Checkpoints may be single-file or sharded (``model.safetensors.index.json``). Both the
classic ``config.json`` keys (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``)
and transformers 5's ``rope_parameters`` (per layer type for Gemma 3) are read.

``save_hf(lm, folder, architecture=None)`` writes ``config.json`` + ``model.safetensors``
with the family's names (``architecture`` defaults to the family the config's switches
describe, :func:`architecture_for`); a config no family can express is refused. HF uses
rotate-half RoPE and ``[out, in]`` matrices, the same as our canonical weights, so no
permutation is needed.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np

from specjax.models.host_memory import staging
from specjax.models.llama import LlamaConfig, LlamaLM, RopeScaling, check_weights, layer_keys, stack_layers

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")

# HF per-layer tensor name (after ``model.layers.{i}.``) -> canonical name
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
    # switches
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}
# Gemma 2/3 norm four times per layer; their "post_attention_layernorm" is the norm of the
# attention output, not the pre-MLP norm it is in Llama
_GEMMA_NORMS = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
_GLOBAL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}

# the LlamaConfig fields that describe the architecture (not runtime settings)
_ARCH_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "rope_theta",
                "rope_scaling", "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm", "norm_offset",
                "sandwich_norm", "embed_scale", "mlp_act", "attn_scale", "attn_softcap", "final_softcap",
                "sliding_window", "layer_types", "rope_local_theta")


class HFCheckpointError(ValueError):
    pass


def _layer_names(arch: str) -> dict:
    """HF per-layer suffix -> canonical name for ``arch``."""
    if arch in _GEMMA:
        names = {k: v for k, v in _LAYER.items() if not k.endswith("layernorm.weight")}
        names.update(_GEMMA_NORMS)
        return names
    return dict(_LAYER)


def _rope(p: Optional[dict], where: str) -> tuple[Optional[float], Optional[RopeScaling]]:
    """(rope_theta or None, scaling) from one RoPE parameter dict (``rope_scaling`` or a
    transformers-5 ``rope_parameters`` entry)."""
    if not p:
        return None, None
    if not isinstance(p, dict):
        raise HFCheckpointError(f"config.json: {where} must be a mapping, got {p!r}")
    theta = p.get("rope_theta")
    theta = None if theta is None else float(theta)
    kind = p.get("rope_type", p.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(factor=float(p["factor"]), rope_type="linear")
    if kind == "llama3":
        return theta, RopeScaling(
            factor=float(p["factor"]),
            low_freq_factor=float(p["low_freq_factor"]),
            high_freq_factor=float(p["high_freq_factor"]),
            original_max_position_embeddings=int(p["original_max_position_embeddings"]),
        )
    raise HFCheckpointError(f"unsupported rope_scaling type {kind!r} in {where} (only default, linear, llama3)")


def _rope_config(hf: dict, arch: str) -> dict:
    """rope_theta, rope_scaling (and rope_local_theta for Gemma 3) from either config layout,
    with transformers' precedence: a non-empty ``rope_scaling`` over ``rope_parameters``, a
    ``rope_theta`` inside the parameters over the top-level one."""
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFCheckpointError(f"partial rotary embeddings are not supported "
                                f"(partial_rotary_factor={hf['partial_rotary_factor']})")
    params = hf.get("rope_parameters")
    if arch == "Gemma3ForCausalLM":
        full, sliding = {}, None
        if isinstance(params, dict) and "full_attention" in params:
            full, sliding = dict(params.get("full_attention") or {}), params.get("sliding_attention")
        full.update(hf.get("rope_scaling") or {})
        theta, scaling = _rope(full, "rope_parameters.full_attention")
        local_theta, local_scaling = _rope(sliding, "rope_parameters.sliding_attention")
        if local_scaling is not None:
            raise HFCheckpointError("RoPE scaling on Gemma 3's sliding layers is not supported")
        theta = theta if theta is not None else hf.get("rope_theta", 1_000_000.0)
        local_theta = local_theta if local_theta is not None else hf.get("rope_local_base_freq", 10_000.0)
        return dict(rope_theta=float(theta), rope_scaling=scaling, rope_local_theta=float(local_theta))
    theta, scaling = _rope(hf.get("rope_scaling") or params, "rope_scaling" if hf.get("rope_scaling")
                           else "rope_parameters")
    if theta is None:
        theta = hf.get("rope_theta", 10000.0)
    return dict(rope_theta=float(theta), rope_scaling=scaling)


def _flag(hf: dict, key: str, default: bool = False) -> bool:
    """A true/false key of config.json (absent or null: ``default``). Anything but a JSON
    boolean is an error: the string "false" is truthy, so reading it as Python does would
    silently turn the switch on (a tied head, a sliding window)."""
    v = hf.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise HFCheckpointError(f"config.json has a bad value: {key}={v!r} (want true or false)")
    return v


def _sliding_config(hf: dict, arch: str, n_layers: int) -> dict:
    """sliding_window and layer_types as HF's modeling code for ``arch`` applies them."""
    window = hf.get("sliding_window")
    if arch in _QWEN and not _flag(hf, "use_sliding_window"):
        window = None  # Qwen configs carry a sliding_window that is off unless use_sliding_window
    if arch in ("LlamaForCausalLM",):
        window = None
    if not window:
        return dict(sliding_window=0, layer_types=None)
    window = int(window)
    if arch == "MistralForCausalLM":  # every layer (transformers ignores Mistral layer_types)
        return dict(sliding_window=window, layer_types=None)
    lt = hf.get("layer_types")
    if lt is not None:
        bad = sorted(set(lt) - set(_HF_LAYER_TYPES))
        if bad:
            raise HFCheckpointError(f"unsupported layer_types {bad} (only {sorted(_HF_LAYER_TYPES)})")
        if len(lt) != n_layers:
            raise HFCheckpointError(f"layer_types has {len(lt)} entries for {n_layers} layers")
        types = tuple(_HF_LAYER_TYPES[t] for t in lt)
    elif arch in _QWEN:
        first = int(hf.get("max_window_layers", n_layers))
        types = tuple("sliding" if i >= first else "full" for i in range(n_layers))
    else:  # Gemma 2: every other layer; Gemma 3: five sliding layers per full one
        period = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern", 6))
        types = tuple("sliding" if (i + 1) % period else "full" for i in range(n_layers))
    if "sliding" not in types:
        return dict(sliding_window=0, layer_types=None)
    return dict(sliding_window=window, layer_types=None if all(t == "sliding" for t in types) else types)


def config_from_hf(hf: dict, **overrides: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` from a parsed ``config.json`` (the architecture's switches set
    as HF's modeling code applies them); ``overrides`` replace fields."""
    if not isinstance(hf, dict):
        raise HFCheckpointError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFCheckpointError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    gemma = arch in _GEMMA
    if _flag(hf, "mlp_bias"):
        raise HFCheckpointError("MLP biases are not supported")
    if _flag(hf, "attention_bias"):  # Qwen2's q/k/v biases are implied by the architecture, not this key
        raise HFCheckpointError(f"{arch}: attention_bias (biases on all four projections) is not supported; "
                                "only Qwen2's q/k/v biases are")
    if _flag(hf, "use_bidirectional_attention"):
        raise HFCheckpointError(f"{arch}: bidirectional attention is not supported")
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = hf.get(act_key) or hf.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in _ACTIVATIONS:
        raise HFCheckpointError(f"unsupported activation {act!r} (supported: {sorted(_ACTIVATIONS)})")
    try:
        dim = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        n_layers = int(hf["num_hidden_layers"])
        head_dim = int(hf.get("head_dim") or dim // n_heads)
        cfg = dict(
            vocab_size=int(hf["vocab_size"]),
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            ffn_dim=int(hf["intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=_flag(hf, "tie_word_embeddings", gemma),
            max_position=int(hf.get("max_position_embeddings", 8192)),
            name=str(hf.get("_name_or_path") or hf.get("model_type", "llama")),
            mlp_act=_ACTIVATIONS[act],
        )
        cfg.update(_rope_config(hf, arch))
        cfg.update(_sliding_config(hf, arch, n_layers))
        if arch == "Qwen2ForCausalLM":
            cfg.update(qkv_bias=True)
        if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
            cfg.update(qk_norm=True)
        if gemma:
            scalar = float(hf.get("query_pre_attn_scalar", head_dim))
            cfg.update(norm_offset=1.0, sandwich_norm=True, embed_scale=True, attn_scale=scalar ** -0.5,
                       final_softcap=float(hf.get("final_logit_softcapping") or 0.0))
        if arch == "Gemma2ForCausalLM":  # Gemma 3's attention ignores attn_logit_softcapping
            cfg.update(attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0))
    except HFCheckpointError:
        raise
    except KeyError as e:
        raise HFCheckpointError(f"config.json lacks {e.args[0]!r}") from e
    except (TypeError, ValueError, ZeroDivisionError) as e:  # e.g. null or 0 where a size belongs
        raise HFCheckpointError(f"config.json has a bad value: {e}") from e
    local = cfg.get("rope_local_theta")
    for key, v, ok in (("rope_theta", cfg["rope_theta"], cfg["rope_theta"] > 0),
                       ("rope_local_base_freq", local, local is None or local > 0),
                       ("rms_norm_eps", cfg["norm_eps"], cfg["norm_eps"] >= 0)):
        if not (ok and math.isfinite(v if v is not None else 1.0)):  # NaN logits otherwise
            raise HFCheckpointError(f"config.json has a bad value: {key}={v!r}")
    try:  # the config.json alone: zero sizes, heads that do not divide, ...
        LlamaConfig(**cfg)
    except ValueError as e:
        raise HFCheckpointError(f"config.json has a bad value: {e}") from None
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def _read_json_file(path: Path, what: str):
    """A JSON file's contents; an unreadable file or bad JSON is one HFCheckpointError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        raise HFCheckpointError(f"{path}: not a readable {what} ({e})") from None


def _weight_map(folder: Path) -> Optional[dict]:
    """``model.safetensors.index.json``'s weight_map (tensor name -> shard file), or None."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    d = _read_json_file(index, "safetensors index")
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
        raise HFCheckpointError(f"{index}: no weight_map (tensor name -> shard file) in it")
    return wm


def _safetensor_files(folder: Path, wm: Optional[dict]) -> list[Path]:
    """The folder's weight files: the shards ``wm`` (its index's weight_map) names, or
    every ``*.safetensors`` file when there is no index."""
    index = folder / "model.safetensors.index.json"
    if wm is not None:
        files = sorted(set(wm.values()))
        paths = [folder / f for f in files]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise HFCheckpointError(f"shards listed in {index.name} are missing: {missing}")
        return paths
    paths = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not paths:
        raise HFCheckpointError(f"no *.safetensors files in {folder}")
    return paths


# safetensors dtypes read as float32 weights; anything else (integer codes of a quantized
# checkpoint, booleans) would be cast to float32 as if it were a weight
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _tensor_files(folder: Path) -> dict:
    """``{path: [tensor names to read from it]}`` for a checkpoint folder, from its index and
    its files' headers alone (no tensor data is read): every file readable, every tensor in
    one file only, every dtype a float one. With an index (a sharded checkpoint), a tensor
    that the index places in another shard is skipped, as HF does."""
    from safetensors import safe_open

    weight_map = _weight_map(folder)
    plan, where = {}, {}
    for p in _safetensor_files(folder, weight_map):
        try:
            with safe_open(str(p), framework="flax") as f:
                keys = [k for k in f.keys()
                        if weight_map is None or k not in weight_map or folder / weight_map[k] == p]
                for k in keys:
                    if k in where:
                        raise HFCheckpointError(f"tensor {k!r} is in both {where[k]} and {p}")
                    where[k] = p
                    dt = f.get_slice(k).get_dtype()
                    if dt not in _FLOAT_DTYPES:
                        raise HFCheckpointError(f"{p}: tensor {k!r} has dtype {dt}; weights must be one of "
                                                f"{', '.join(_FLOAT_DTYPES)} (quantized checkpoints are not supported)")
                plan[p] = keys
        except (HFCheckpointError, MemoryError):
            raise
        except Exception as e:  # SafetensorError (truncated / corrupt header), OSError
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise HFCheckpointError(f"{p}: not a readable safetensors file ({msg})") from None
    return plan


def check_weight_files(folder: str | os.PathLike) -> None:
    """A checkpoint folder's safetensors files checked from their headers (cheap: no weights
    are read), as :func:`load_hf` would find them: HFCheckpointError naming the file."""
    _tensor_files(Path(folder))


def _read_tensors(folder: Path) -> dict:
    """Every tensor of the folder's weight files as float32, after :func:`_tensor_files`'
    checks."""
    from safetensors import safe_open

    out = {}
    for p, keys in _tensor_files(folder).items():
        try:
            with safe_open(str(p), framework="flax") as f:  # flax/jax arrays handle bfloat16
                for k in keys:
                    out[k] = np.asarray(f.get_tensor(k), dtype=np.float32)
        except MemoryError:
            raise
        except Exception as e:  # a file cut short after its header, OSError
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise HFCheckpointError(f"{p}: not a readable safetensors file ({msg})") from None
    return out


def hf_to_canonical(cfg: LlamaConfig, tensors: dict, source: str = "checkpoint",
                    architecture: str = "LlamaForCausalLM") -> dict:
    """HF tensors (``architecture``'s names) -> canonical weights for ``cfg``; a tensor the
    config has no place for is an error."""
    L = cfg.n_layers
    names = _layer_names(architecture)
    wanted = set(layer_keys(cfg))
    layers = {v: [None] * L for v in names.values() if v in wanted}
    out = {}
    for name, arr in tensors.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = arr
            continue
        if name.startswith("model.layers."):
            rest = name[len("model.layers."):]
            idx, _, kind = rest.partition(".")
            if kind in names and names[kind] in layers and idx.isdigit() and int(idx) < L:
                layers[names[kind]][int(idx)] = arr
                continue
            if kind.endswith(".bias"):
                raise HFCheckpointError(f"{source}: tensor {name!r}: biases are not supported for {architecture}")
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


def read_hf_config(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise HFCheckpointError(f"{folder} has no config.json")
    hf = _read_json_file(cfg_path, "config.json")
    if not isinstance(hf, dict):
        raise HFCheckpointError(f"{cfg_path}: must hold a JSON object, got {type(hf).__name__}")
    return hf


def load_hf(folder: str | os.PathLike, **config_overrides: Any) -> LlamaLM:
    """The model in an HF checkpoint folder (any of :data:`SUPPORTED_ARCHITECTURES`);
    ``config_overrides`` replace config fields (e.g. ``scan_layers=True``)."""
    folder = Path(folder)
    hf = read_hf_config(folder)
    try:
        cfg = config_from_hf(hf, **config_overrides)
    except HFCheckpointError as e:
        raise HFCheckpointError(f"{folder}: {e}") from None
    arch = (hf.get("architectures") or ["?"])[0]
    with staging():
        weights = hf_to_canonical(cfg, _read_tensors(folder),
                                  source=str(folder), architecture=arch)
        return LlamaLM.from_weights(cfg, weights)


# --------------------------------------------------------------------------------------
# export


def architecture_for(cfg: LlamaConfig) -> str:
    """The HF architecture whose switches ``cfg`` uses (save_hf's default)."""
    if cfg.sandwich_norm or cfg.norm_offset:
        return "Gemma3ForCausalLM" if cfg.qk_norm else "Gemma2ForCausalLM"
    if cfg.qk_norm:
        return "Qwen3ForCausalLM"
    if cfg.qkv_bias:
        return "Qwen2ForCausalLM"
    if cfg.sliding_window:
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def _rope_dict(theta: float, rs: Optional[RopeScaling]) -> dict:
    d = {"rope_type": "default", "rope_theta": theta}
    if rs is not None and rs.rope_type == "linear":
        d.update(rope_type="linear", factor=rs.factor)
    elif rs is not None:
        d.update(rope_type="llama3", factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                 high_freq_factor=rs.high_freq_factor,
                 original_max_position_embeddings=rs.original_max_position_embeddings)
    return d


def hf_config(cfg: LlamaConfig, dtype: str = "float32", architecture: Optional[str] = None) -> dict:
    """``config.json`` for ``cfg`` as ``architecture`` (default :func:`architecture_for`).
    Both RoPE layouts are written: the classic keys and transformers 5's ``rope_parameters``.
    Raises ValueError when ``architecture`` cannot express ``cfg``."""
    arch = architecture or architecture_for(cfg)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    gemma = arch in _GEMMA
    d = {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        ("hidden_activation" if gemma else "hidden_act"): {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[cfg.mlp_act],
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position,
        "attention_bias": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch == "LlamaForCausalLM":
        d["mlp_bias"] = False
    if arch == "Gemma3ForCausalLM":
        full = _rope_dict(cfg.rope_theta, cfg.rope_scaling)
        d["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.rope_local_theta if cfg.rope_local_theta is not None
            else cfg.rope_theta}}
        d["rope_theta"] = cfg.rope_theta
        d["rope_local_base_freq"] = d["rope_parameters"]["sliding_attention"]["rope_theta"]
        d["rope_scaling"] = None if cfg.rope_scaling is None else {k: v for k, v in full.items() if k != "rope_theta"}
    else:
        d["rope_parameters"] = _rope_dict(cfg.rope_theta, cfg.rope_scaling)
        d["rope_theta"] = cfg.rope_theta
        d["rope_scaling"] = (None if cfg.rope_scaling is None else
                             {k: v for k, v in d["rope_parameters"].items() if k != "rope_theta"})
    types = ["sliding_attention" if s else "full_attention" for s in cfg.sliding_layers]
    if arch == "MistralForCausalLM":
        d["sliding_window"] = cfg.sliding_window or None
    elif arch in _QWEN:
        d.update(use_sliding_window=bool(cfg.sliding_window), sliding_window=cfg.sliding_window or None,
                 max_window_layers=cfg.n_layers, layer_types=types)
    elif gemma:
        # a Gemma config always names its sliding window; with no sliding layer it is unused
        scalar = _effective_scale(cfg) ** -2
        if abs(scalar - round(scalar)) < 1e-6:
            scalar = int(round(scalar))  # transformers types query_pre_attn_scalar as an int
        d.update(sliding_window=cfg.sliding_window or cfg.max_position, layer_types=types,
                 query_pre_attn_scalar=scalar, final_logit_softcapping=cfg.final_softcap or None)
        if arch == "Gemma2ForCausalLM":
            d["attn_logit_softcapping"] = cfg.attn_softcap or None
    # the config must read back as the same architecture
    want, got = _architecture(cfg), _architecture(config_from_hf(d))
    diff = [f for f in want if not _same(want[f], got[f])]
    if diff:
        raise ValueError(f"{arch} cannot express this config: {', '.join(f'{f}={want[f]!r}' for f in diff)}")
    return d


def _effective_scale(cfg: LlamaConfig) -> float:
    return cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5


def _architecture(cfg: LlamaConfig) -> dict:
    """The architecture fields of ``cfg``, with equivalent settings made equal (the score
    scale, the per-layer windows, the RoPE base of the sliding layers)."""
    d = {f: getattr(cfg, f) for f in _ARCH_FIELDS}
    sliding = cfg.sliding_layers
    d.update(attn_scale=_effective_scale(cfg), layer_types=sliding,
             sliding_window=cfg.sliding_window if any(sliding) else 0,
             rope_local_theta=(cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta)
             if any(sliding) else None)
    return d


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def save_hf(lm: LlamaLM, folder: str | os.PathLike, dtype: str = "float32", tokenizer=None,
            architecture: Optional[str] = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` with ``architecture``'s names (default
    :func:`architecture_for` the config); with a :class:`specjax.models.tokenizer.Tokenizer`,
    also ``tokenizer.json`` and ``tokenizer_config.json``."""
    from safetensors.numpy import save_file

    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}")
    cfg = lm.config
    arch = architecture or architecture_for(cfg)
    config = hf_config(cfg, dtype, arch)  # refuses a config the architecture cannot express
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    w = lm.canonical_weights()
    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        import ml_dtypes

        np_dtype = ml_dtypes.bfloat16
    inv_g = {v: k for k, v in _GLOBAL.items()}
    inv_l = {v: k for k, v in _layer_names(arch).items()}
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
        json.dump(config, f, indent=2)
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
