"""Drafts: the :class:`Proposer` contract, one module per kind of draft, draft files.

* :mod:`.base`: ``Proposer`` (the protocol the engine depends on), ``Proposal``,
  ``ProposeContext``, ``CommitContext``;
* :mod:`.lookup`: prompt lookup (n-grams, no weights, point-mass q);
* :mod:`.model`: an independent draft model (``DraftModelProposer``) and the training-free
  ``first_layers_draft``;
* :mod:`.eagle`: the EAGLE-style feature head (``EagleProposer``);
* :mod:`.files`: draft files (save / read / load) and the shipped default drafts;
* :mod:`.training`: draft distillation (``scripts/train_draft.py``).

:func:`make_proposer` turns a draft (a model, ``"lookup"``, or a proposer) into a proposer.
"""
from __future__ import annotations

from specjax.drafts.base import CommitContext, Proposal, ProposeContext, Proposer, check_int
from specjax.drafts.eagle import EagleProposer
from specjax.drafts.lookup import PromptLookupProposer
from specjax.drafts.model import DraftModelProposer, first_layers_draft

LOOKUP_NAMES = ("lookup", "ngram", "prompt-lookup")


def make_proposer(draft, k: int, vocab_size: int) -> Proposer:
    """A proposer drafting ``k`` tokens from ``draft``: a draft model (a ``LlamaLM`` or an
    EAGLE head, ``specjax.models.eagle.EagleModel``), ``None`` or one of ``LOOKUP_NAMES``
    (prompt lookup), or a proposer (returned as it is; its ``k`` must equal ``k``). Its
    vocabulary must be ``vocab_size`` (the target's); ValueError otherwise."""
    from specjax.models.eagle import EagleModel

    k = check_int("make_proposer", "k", k)
    vocab_size = check_int("make_proposer", "vocab_size", vocab_size)
    if draft is None or (isinstance(draft, str) and draft in LOOKUP_NAMES):
        return PromptLookupProposer(vocab_size=vocab_size, k=k)
    if isinstance(draft, Proposer):
        if draft.k != k:
            raise ValueError(f"the proposer drafts K={draft.k}, asked for K={k}")
        return _same_vocab(draft, vocab_size)
    if isinstance(draft, EagleModel):
        return EagleProposer(_same_vocab(draft, vocab_size), k)
    if hasattr(draft, "apply") and hasattr(draft, "init_cache"):
        return DraftModelProposer(model=_same_vocab(draft, vocab_size), k=k)
    what = repr(draft) if isinstance(draft, str) else type(draft).__name__
    raise TypeError(f"cannot make a proposer from {what}: expected a draft model, "
                    f"one of {LOOKUP_NAMES}, or a proposer")


def _same_vocab(draft, vocab_size: int):
    if getattr(draft, "vocab_size", None) != vocab_size:
        raise ValueError(f"vocabulary mismatch: the draft has V={getattr(draft, 'vocab_size', None)}, "
                         f"asked for vocab_size={vocab_size}")
    return draft


__all__ = [
    "CommitContext", "DraftModelProposer", "EagleProposer", "PromptLookupProposer", "Proposal",
    "ProposeContext", "Proposer", "first_layers_draft", "make_proposer",
]
