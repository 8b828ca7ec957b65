"""The contract between the engine and any model family.

The engine sees a model only through :class:`LanguageModel`:

* ``init_cache(batch, max_len)`` -> :class:`KVCache`
* ``apply(params, tokens[B, T], cache, return_hidden=False) -> ModelOutput``

``return_hidden`` asks for hidden states from the same forward (no extra pass): ``False``
none, ``True`` the final hidden states (after the final norm), or a tuple of hidden-state
indices numbered as transformers' ``output_hidden_states`` (0: the embeddings; i in
1..L-1: the residual stream after decoder layer i; L: after the final norm, i.e. what
``True`` gives), returned concatenated on the feature axis in the order given ([B, T,
n * D]). :func:`hidden_indices` normalizes the argument.

``apply`` is a *pure* function of ``params`` (the ``nnx.State`` from one
``nnx.split``), safe to call inside ``jax.jit`` / ``lax.while_loop`` / ``lax.scan``.
Token ``t`` of row ``b`` is written to cache slot ``cache.lengths[b] + t`` and sits at
RoPE position ``cache.lengths[b] + t``; the returned cache has ``lengths + T``.
A query at position ``pos`` attends to slots ``0..pos`` only, so slots at or beyond a
row's length are stale and never read: rollback is just setting ``lengths`` back.

Optional tree attention (draft trees, ``specjax.tree``): a model that sets
``supports_tree = True`` takes ``apply(..., tree=TreeAttention(...))``: the T new tokens
are nodes of a tree over the committed prefix (``cache.lengths``), each at its own
position and attending to the prefix and to the tree slots the mask names (its ancestors
and itself) only; the returned cache keeps ``lengths`` (tree entries are tentative).
:func:`move_slots` then copies an accepted path's entries to contiguous slots.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class KVCache:
    """Explicit KV cache pytree.

    k, v: [L, B, N_kv, S, H] (layers, batch, kv heads, slots, head dim): each head's slots
    are contiguous, so attention reads a chunk of slots as a plain slice
    lengths: int32[B], number of valid slots per row (= position of the next token).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return self.replace(lengths=lengths)


class TreeAttention(NamedTuple):
    """Tree attention of T new tokens over a REGION of W slots after the prefix.

    Slot ``lengths[b] + w`` (``0 <= w < W``) of row b holds a tree node at depth
    ``region_depth[b, w]`` (position ``lengths[b] + region_depth[b, w]``): written by this
    call or an earlier one (incremental growth). New token t of row b is written to slot
    ``lengths[b] + offset[b] + t`` (the new tokens fill consecutive region slots), sits at
    position ``lengths[b] + depth[b, t]``, and attends to every prefix slot
    ``s < lengths[b]`` (sliding windows count positions) and to the region slots w with
    ``mask[b, t, w]`` (its ancestors and itself)."""

    depth: jax.Array  # int32[B, T]
    offset: jax.Array  # int32[B]: the first new token's region slot
    mask: jax.Array  # bool[B, T, W]
    region_depth: jax.Array  # int32[B, W]

    @classmethod
    def dense(cls, depth, mask) -> "TreeAttention":
        """The whole tree in one call: token t in region slot t (``W = T``);
        ``depth`` int32[B, T], ``mask`` bool[B, T, T] (or [T, T], broadcast)."""
        depth = jnp.asarray(depth, jnp.int32)
        b, t = depth.shape
        mask = jnp.broadcast_to(jnp.asarray(mask, bool), (b, t, t))
        return cls(depth=depth, offset=jnp.zeros((b,), jnp.int32), mask=mask, region_depth=depth)


def move_slots(cache: KVCache, start, src, num) -> KVCache:
    """Copy, in every layer and head, slot ``start[b] + src[b, d]`` to slot ``start[b] + d``
    for ``d < num[b]`` (``src`` int32[B, D], ``src[b, d] >= d``: entries only move down).
    The accepted path of a draft tree into contiguous slots; lengths unchanged."""
    b, d = src.shape
    s = cache.k.shape[3]
    rows = jnp.arange(b)[:, None]
    from_slot = jnp.clip(start[:, None] + src, 0, s - 1)  # [B, D]
    keep = jnp.arange(d)[None, :] < num[:, None]
    to_slot = jnp.where(keep, start[:, None] + jnp.arange(d)[None, :], s)  # s: dropped

    def one(c):  # [L, B, Nkv, S, H]
        moved = c[:, rows, :, from_slot]  # [B, D, L, Nkv, H] (advanced indices first)
        return c.at[:, rows, :, to_slot].set(moved, mode="drop")

    return cache.replace(k=one(cache.k), v=one(cache.v))


class ModelOutput(NamedTuple):
    logits: jax.Array  # float32[B, T, V]
    cache: KVCache
    # [B, T, D] final hidden states (after the final norm) for return_hidden=True; [B, T, n * D]
    # for a tuple of n hidden-state indices (see the module docstring); None for False
    hidden: Optional[jax.Array]


def hidden_indices(return_hidden, n_layers: int) -> Optional[tuple]:
    """``apply``'s ``return_hidden`` as a tuple of hidden-state indices (``True`` is
    ``(n_layers,)``: after the final norm) or None (``False``, ``None`` or ``()``). A
    ValueError for anything else or an index outside ``0..n_layers``."""
    if return_hidden is None or return_hidden is False:
        return None
    if return_hidden is True:
        return (n_layers,)
    try:
        idx = tuple(return_hidden)
    except TypeError:
        raise ValueError(f"return_hidden must be a bool or a tuple of hidden-state indices, "
                         f"got {return_hidden!r}") from None
    for i in idx:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not 0 <= i <= n_layers:
            raise ValueError(f"hidden-state index {i!r} outside 0..{n_layers} (0: embeddings, i: after "
                             f"layer i, {n_layers}: after the final norm)")
    return tuple(int(i) for i in idx) or None


class LanguageModel(Protocol):
    config: Any
    params: Any  # nnx.State, a pytree

    @property
    def vocab_size(self) -> int: ...

    def init_cache(self, batch: int, max_len: int) -> KVCache: ...

    def apply(self, params, tokens: jax.Array, cache: KVCache, return_hidden=False) -> ModelOutput: ...

    # optional: ``supports_tree = True`` and ``apply(..., tree=TreeAttention)`` (see above)
    # optional: ``compute_id() -> str``, see :func:`compute_id`
    # optional: ``embedding_weights() -> dict``, see :func:`embedding_weights`


def compute_id(model) -> str:
    """What besides its config and parameters sets the cost of a model's forward (e.g. the
    build of the project's CPU kernels): the model's optional ``compute_id()``, else ""."""
    f = getattr(model, "compute_id", None)
    return f() if callable(f) else ""


def embedding_weights(model) -> dict:
    """A model's float32 canonical ``embed`` (and ``lm_head`` when untied), [V, D], for a draft
    built on it: the model's optional ``embedding_weights()`` (which skips the layers: a
    GGUF block model would rebuild them all), else its ``canonical_weights()``."""
    f = getattr(model, "embedding_weights", None)
    return f() if callable(f) else model.canonical_weights()


PREFILL_CHUNK = 512  # prompt tokens per forward in :func:`prefill` (a power of two)


def prefill(model, params, tokens, lengths, cache: KVCache, *, chunk: int = PREFILL_CHUNK,
            return_hidden: bool = False):
    """Feed padded prompts ``tokens`` [B, P] (row b's first ``lengths[b]`` tokens are real)
    into an empty ``cache``, ``chunk`` tokens per forward: ``(cache, hidden or None)``.

    With ``P <= chunk`` this is one ``apply``. Longer prompts go through a ``fori_loop``
    over ``ceil(max(lengths) / chunk)`` chunks (chunks past the longest prompt are skipped,
    so a prompt is not paid at its bucket's size), each attending to the slots written so
    far: activations and attention scores are bounded by the chunk, not the square of the
    prompt. ``hidden`` ([B, P, D'], what ``apply`` returns for ``return_hidden``) has
    the same values at the real positions either way. The returned cache's lengths are
    unspecified: callers set them (e.g. to ``lengths - 1``). Slots past a row's length
    hold padding KV that later writes overwrite, as with one forward."""
    b, p = tokens.shape
    if p <= chunk:
        o = model.apply(params, tokens, cache, return_hidden=return_hidden)
        return o.cache, o.hidden
    if p % chunk:
        raise ValueError(f"prompt buffer of {p} tokens is not a multiple of the prefill chunk {chunk}")
    first = jax.eval_shape(lambda: model.apply(params, tokens[:, :chunk], cache,
                                               return_hidden=return_hidden))
    hidden = None
    if return_hidden:
        hs = first.hidden
        hidden = jax.numpy.zeros((b, p) + hs.shape[2:], hs.dtype)

    def body(i, carry):
        c, h = carry
        start = i * chunk
        x = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        o = model.apply(params, x, c.with_lengths(jax.numpy.full((b,), start, jax.numpy.int32)),
                        return_hidden=return_hidden)
        if return_hidden:
            h = jax.lax.dynamic_update_slice_in_dim(h, o.hidden.astype(h.dtype), start, axis=1)
        return o.cache, h

    n = (jax.numpy.max(lengths) + chunk - 1) // chunk
    cache, hidden = jax.lax.fori_loop(0, n, body, (cache, hidden))
    return cache, hidden
