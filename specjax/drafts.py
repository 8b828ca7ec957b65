"""Default drafts for known targets.

A draft changes only speed, never the output law. Until a trained draft for
SmolLM2-135M-Instruct ships in the repository, the default is prompt lookup (an n-gram
proposer that needs no weights).
"""
from __future__ import annotations


def default_draft_for(target):
    """The draft ``specjax generate`` uses for ``target``: a model, a proposer, or 'lookup'."""
    return "lookup"
