"""Default drafts for known targets.

A draft changes only speed, never the output law. For SmolLM2-135M-Instruct (the embedded
default target) the default is the EAGLE head shipped in ``models/drafts/`` (trained by
``scripts/train_draft.py configs/train/eagle_smollm2_gpu.yaml``; its file's ``info`` holds
the step count and held-out numbers); any other target gets prompt lookup (an n-gram
proposer that needs no weights).
"""
from __future__ import annotations

import os

DRAFT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "drafts")
# target name (the GGUF's general.name) -> shipped draft file; the shape is checked on load
SHIPPED = {"Smollm2 135M 8k Lc100K Mix1 Ep2": "smollm2-135m-instruct-eagle.npz"}


def shipped_draft_path(target):
    """The shipped draft file for ``target`` (matched by name and shape), or None."""
    name = SHIPPED.get(getattr(target.config, "name", None))
    if name is None:
        return None
    path = os.path.join(DRAFT_DIR, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the shipped draft {path} is missing from the installation")
    from specjax.eagle import read_draft_meta

    c, t = read_draft_meta(path)["config"], target.config
    if (c["vocab_size"], c["dim"]) != (t.vocab_size, t.dim):
        return None
    return path


def default_draft_for(target):
    """The draft ``specjax generate`` uses for ``target``: a model, a proposer, or 'lookup'."""
    path = shipped_draft_path(target)
    if path is None:
        return "lookup"
    from specjax.eagle import load_draft_model

    return load_draft_model(path, target)


def first_layers_draft(target, n_layers: int):
    """A training-free draft: the target's first ``n_layers`` layers with its embedding,
    final norm and head (same vocabulary, same dtype settings)."""
    from specjax.models.llama import LlamaLM

    cfg = target.config
    if not 1 <= n_layers <= cfg.n_layers:
        raise ValueError(f"layers:{n_layers}: the target has {cfg.n_layers} layers")
    w = target.canonical_weights()
    w = {k: (v[:n_layers] if getattr(v, "ndim", 0) >= 1 and v.shape[0] == cfg.n_layers
             and k not in ("embed", "final_norm", "lm_head") else v) for k, v in w.items()}
    return LlamaLM.from_weights(cfg.replace(n_layers=n_layers, name=f"{cfg.name}-first{n_layers}"), w)
