"""The proposer contract: whatever proposes up to K draft tokens with the draft law q.

A proposer is a static Python object (hashable by identity) whose methods are pure
functions, called inside the engine's jitted ``lax.while_loop``:

* ``init(params, prompt_tokens[B, P], prompt_lens[B], cache_len, target_hidden) -> state``
  (prefill, once per generate call; ``target_hidden`` is the target's hidden states over the
  padded prompt [B, P, D'] when the proposer sets ``needs_target_hidden``, else None: the
  final hidden states [D' = D], or, when the proposer also names ``hidden_layers`` (a tuple
  of hidden-state indices, :func:`specjax.models.base.hidden_indices`), those states
  concatenated [D' = n * D]; the engine asks the target for them with
  :func:`hidden_request`, in every forward it makes, with no extra pass)
* ``propose(params, state, ProposeContext) -> Proposal`` (once per round)
* ``commit(params, state, CommitContext) -> state`` (after verification: the new committed
  tokens and lengths and, for feature-based drafts such as EAGLE-style heads, the target's
  final hidden states from this round's forward; rollback is resetting cache lengths)
* optional ``commit_plain(params, state, CommitContext) -> state``: after a round in which
  the engine drafted nothing (adaptive K, j = 0: one target step, no ``propose``); a
  proposer whose state must advance with every committed token (a draft model's cache)
  catches up here. Without it the engine calls ``commit``. Adaptive K also needs the
  proposer to be a dataclass with a field ``k`` (it compiles one copy per j).
* optional deferred plain commits: a proposer with ``plain_backlog = P > 0`` may only
  record a plain round in ``commit_plain`` (the EAGLE head keeps the target's hidden
  state) and run the work later, all at once, in ``catch_up(params, state, seq, seq_len)
  -> state``; ``backlog(state) -> int32[B]`` counts the rounds waiting and
  ``backlog_room(state) -> int`` (static) how many fit. The engine calls ``catch_up``
  before the first drafting round after plain rounds and before a row's backlog would
  exceed its room (it leaves the plain rounds' loop for that), never inside a round. Such
  a proposer also has ``init_deferred`` (``init``'s arguments), which an adaptive engine
  calls instead of ``init``: the pass over the prompt waits in the backlog as well, so that
  a run that never drafts never makes it.

A proposal carries ``tokens int32[B, K]``, the *processed* draft log-probs
``logprobs float32[B, K, V]`` that the tokens were actually drawn from, and
``num_draft int32[B]`` (how many of the K slots are real; the rest are ignored). A
proposer whose ``num_draft`` is always K sets ``always_drafts = True``: the engine then
scores every round with the full (K+1)-token step without first testing for rounds with
nothing drafted (that test is a conditional, which copies the target's whole KV cache).
The full step is always correct, so the flag changes speed only, never the output.
Exactness never depends on the proposer: only the verifier's maths does. What the
proposer must guarantee is that ``tokens[b, i]`` was drawn from ``exp(logprobs[b, i])``
(a deterministic proposer reports a point mass), through the shared pipeline
(:meth:`ProposeContext.process`: the context's parameters, counts, ``top_values`` and
generation controls) so that q is processed like the target's p: the same steps (on a
GPU a draft's top-k / top-p cut stops at the pipeline's candidates: :data:`DRAFT_CUT`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Protocol, runtime_checkable

import jax
import jax.numpy as jnp


# How a draft's top-k / top-p cut is made (specjax.sampling.process_rows' ``cut``), for
# the draft laws of every proposer (ProposeContext.process). "candidates": where a row's cut
# lies past the pipeline's 256 candidates (a nucleus wider than them, a top-k above them),
# the draft law is cut at the last candidate instead of at the exact cut, which needs the
# exact search: on a GPU a fixed search of ~16 kernels per draft position (51 of a K=3
# round's 716 at T = 1, top-p 0.9, compiled for an H200). The same law wherever the cut lies
# among the candidates. Exactness never depends on the draft law, only on the token having
# been drawn from it; acceptance does: measured on the CPU (BENCHMARKS.md, "A draft's top-k /
# top-p cut at the pipeline's candidates") it was unchanged at T = 1 top-p 0.9, up 2% at
# top-k 1000, but down 7% at T = 1.3 top-p 0.95, where nuclei are wide. "exact": the
# target's own cut (on the CPU a conditional bisection, which costs only where it runs).
# None: "candidates" on the backends of CANDIDATE_CUT_BACKENDS, else "exact".
DRAFT_CUT: Optional[str] = None
CANDIDATE_CUT_BACKENDS = ("gpu",)


def draft_cut() -> str:
    """The draft's cut (:data:`DRAFT_CUT`), resolved for the backend being traced for."""
    if DRAFT_CUT is not None:
        return DRAFT_CUT
    return "candidates" if jax.default_backend() in CANDIDATE_CUT_BACKENDS else "exact"


class ProposeContext(NamedTuple):
    """What a proposer sees at the start of a round (its ``propose``)."""

    seq: jax.Array  # int32[B, S_total] committed tokens (prompt + generated), garbage past seq_len
    seq_len: jax.Array  # int32[B]
    params: Any  # SamplingParams with fields [B]
    counts: jax.Array  # int32[B, V] token counts of the committed sequence (for penalties)
    round_keys: jax.Array  # key[B]: fold_in(row_key, round)
    use_penalties: jax.Array  # bool scalar: any row has a penalty on
    # how the sampling pipeline finds each row's largest values (None: lax.top_k; a
    # sharded run passes its vocabulary-sharded version): pass it to process_rows
    top_values: Optional[Callable] = None
    gen_len: Optional[jax.Array] = None  # int32[B] tokens generated so far (None: 0)
    controls: Any = None  # specjax.sampling.Controls of the call (None: no controls)

    def process(self, logits, counts, position: int):
        """The shared pipeline for the draft's [B, V] logits at draft ``position`` (0-based),
        or [B, T, V] logits that all sit there (the nodes of one level of a tree): the
        sampling parameters, penalties (``counts`` [B, V] or [B, T, V]: history including
        the drafts before this position; or a function of no arguments returning them,
        computed only when a penalty is on) and the generation controls at generated-token
        index ``gen_len + position``, exactly as the target gets them at that position
        (the top-k / top-p cut: :func:`draft_cut`)."""
        from specjax.sampling import process_rows

        allowed = bias = None
        if self.controls is not None:
            gen = jnp.zeros_like(self.seq_len) if self.gen_len is None else self.gen_len
            allowed = self.controls.allowed_at(gen + position)
            if logits.ndim == 3:
                allowed = allowed[:, None]
            bias = self.controls.bias_at(logits.ndim)
        return process_rows(logits, self.params, counts, self.use_penalties, allowed=allowed,
                            bias=bias, top_values=self.top_values, cut=draft_cut())


class CommitContext(NamedTuple):
    """What a proposer learns after verification (its ``commit``)."""

    seq: jax.Array  # int32[B, S_total], the committed tokens after this round
    seq_len: jax.Array  # int32[B], the new committed lengths c'
    # [B, K+1, D'] the target's hidden states from this round's forward (as init's
    # target_hidden: final, or the proposer's hidden_layers), or None when the proposer did
    # not ask (needs_target_hidden=False). Entry j is the hidden state after the committed
    # token at position c'-1-num_new+j, for j < num_new; later entries are stale.
    target_hidden: Optional[jax.Array]
    num_new: jax.Array  # int32[B]: valid leading entries of target_hidden (0 for finished rows)


class Proposal(NamedTuple):
    tokens: jax.Array  # int32[B, K]
    logprobs: jax.Array  # float32[B, K, V] (None for a tree of point masses)
    num_draft: jax.Array  # int32[B]
    state: Any
    # tree proposers (specjax.drafts.trees): a batched specjax.tree.DraftTree, else None
    tree: Any = None


@runtime_checkable
class Proposer(Protocol):
    """What the engine needs of a draft (see the module docstring)."""

    k: int  # draft tokens per round (the engine's K)
    vocab_size: int  # must equal the target's
    always_drafts: bool  # num_draft == K for every row and round (speed only)
    min_prompt_len: int  # shortest prompt the proposer can start from (checked on the host)
    needs_target_hidden: bool  # init / commit get the target's hidden states
    # optional: hidden_layers (a tuple of hidden-state indices, or None for the final hidden
    # states): which ones (see hidden_request)

    @property
    def params(self) -> Any:  # the pytree handed to the jitted program (None for none)
        ...

    def init(self, params, prompt_tokens, prompt_lens, cache_len, target_hidden=None) -> Any:
        ...

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        ...

    def commit(self, params, state, ctx: CommitContext) -> Any:
        ...


def hidden_request(proposer):
    """What the engine passes as the target's ``return_hidden`` for ``proposer``: False
    (no ``needs_target_hidden``), True (the final hidden states) or the proposer's
    ``hidden_layers`` (a tuple of hidden-state indices)."""
    if not proposer.needs_target_hidden:
        return False
    layers = getattr(proposer, "hidden_layers", None)
    return tuple(layers) if layers else True


def draft_chain(k: int, step, final_draw, carry):
    """A K-token autoregressive draft: ``step(carry, i) -> (carry, (x_i, lp_i))`` for the
    first K-1 positions under ``lax.scan`` (each feeds its token to the draft), then
    ``final_draw(carry, K-1) -> (x_K, lp_K)`` (the last token is never fed).

    Returns ``(carry, tokens int32[B, K], logprobs [B, K, V])``."""
    if k > 1:
        carry, (xs, lps) = jax.lax.scan(step, carry, jnp.arange(k - 1))
        xs, lps = jnp.moveaxis(xs, 0, 1), jnp.moveaxis(lps, 0, 1)
    x_last, lp_last = final_draw(carry, k - 1)
    if k > 1:
        tokens = jnp.concatenate([xs, x_last[:, None]], axis=1)
        logprobs = jnp.concatenate([lps, lp_last[:, None]], axis=1)
    else:
        tokens, logprobs = x_last[:, None], lp_last[:, None]
    return carry, tokens.astype(jnp.int32), logprobs


def check_int(owner: str, name: str, value, low: int = 1) -> int:
    """``value`` as a Python int >= ``low`` (numpy's integers accepted: the engine's K is a
    static Python int), else ValueError naming ``owner: name`` (the models' own check)."""
    from specjax.models.llama import check_size

    return check_size(f"{owner}: {name}", value, low)


def check_fields(proposer, **lows) -> None:
    """Check (and store as Python ints) the integer fields ``lows`` (name -> lowest value)
    of a frozen dataclass proposer, in its ``__post_init__``."""
    for name, low in lows.items():
        object.__setattr__(proposer, name, check_int(type(proposer).__name__, name, getattr(proposer, name), low))


def check_draft_model(proposer, *needs: str) -> None:
    """TypeError unless the proposer's ``model`` has the attributes ``needs``."""
    model = proposer.model
    missing = [n for n in needs if not hasattr(model, n)]
    if missing:
        raise TypeError(f"{type(proposer).__name__}: model must be a draft model with {', '.join(needs)}; "
                        f"{type(model).__name__} has no {', '.join(missing)}")


class ModelBackedProposer:
    """Base of proposers that wrap a draft model (``self.model``): the vocabulary size
    and the parameters handed to the jitted program are the model's."""

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def params(self):
        return self.model.params


def is_tree_proposer(proposer) -> bool:
    """The proposer returns draft trees (``Proposal.tree``; it has ``tree_depth``)."""
    return getattr(proposer, "tree_depth", None) is not None


@dataclasses.dataclass(frozen=True, eq=False)
class ChainTreeProposer:
    """A chain proposer's drafts as a chain tree (``"iid"``: each node drawn from its q)."""

    inner: Any
    candidates: str = "iid"

    def __getattr__(self, name):  # k, vocab_size, params, init, flags: the inner proposer's
        return getattr(self.inner, name)

    @property
    def tree_depth(self) -> int:
        return self.inner.k

    @property
    def tree_nodes(self) -> int:
        return self.inner.k

    def propose(self, params, state, ctx: ProposeContext) -> Proposal:
        p = self.inner.propose(params, state, ctx)
        from specjax.tree import chain_tree

        tree = jax.vmap(chain_tree)(p.tokens, p.logprobs, p.num_draft)
        return p._replace(tree=tree)

    def commit(self, params, state, ctx: CommitContext):
        return self.inner.commit(params, state, ctx)


