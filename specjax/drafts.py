"""Default drafts for known targets.

A draft changes only speed, never the output law. Until a trained draft for
SmolLM2-135M-Instruct ships in the repository, the default is prompt lookup (an n-gram
proposer that needs no weights).
"""
from __future__ import annotations


def default_draft_for(target):
    """The draft ``specjax generate`` uses for ``target``: a model, a proposer, or 'lookup'."""
    return "lookup"


def first_layers_draft(target, n_layers: int):
    """A training-free draft: the target's first ``n_layers`` layers with its embedding,
    final norm and head (same vocabulary, same dtype settings)."""
    from models.llama import LlamaLM

    cfg = target.config
    if not 1 <= n_layers <= cfg.n_layers:
        raise ValueError(f"layers:{n_layers}: the target has {cfg.n_layers} layers")
    w = target.canonical_weights()
    w = {k: (v[:n_layers] if getattr(v, "ndim", 0) >= 1 and v.shape[0] == cfg.n_layers
             and k not in ("embed", "final_norm", "lm_head") else v) for k, v in w.items()}
    return LlamaLM.from_weights(cfg.replace(n_layers=n_layers, name=f"{cfg.name}-first{n_layers}"), w)
