"""The contract between the engine and any model family.

The engine sees a model only through :class:`LanguageModel`:

* ``init_cache(batch, max_len)`` -> :class:`KVCache`
* ``apply(params, tokens[B, T], cache, return_hidden=False) -> ModelOutput``

``apply`` is a *pure* function of ``params`` (the ``nnx.State`` from one
``nnx.split``), safe to call inside ``jax.jit`` / ``lax.while_loop`` / ``lax.scan``.
Token ``t`` of row ``b`` is written to cache slot ``cache.lengths[b] + t`` and sits at
RoPE position ``cache.lengths[b] + t``; the returned cache has ``lengths + T``.
A query at position ``pos`` attends to slots ``0..pos`` only, so slots at or beyond a
row's length are stale and never read: rollback is just setting ``lengths`` back.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

import jax
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


class ModelOutput(NamedTuple):
    logits: jax.Array  # float32[B, T, V]
    cache: KVCache
    hidden: Optional[jax.Array]  # [B, T, D] final hidden states (after the final norm) or None


class LanguageModel(Protocol):
    config: Any
    params: Any  # nnx.State, a pytree

    @property
    def vocab_size(self) -> int: ...

    def init_cache(self, batch: int, max_len: int) -> KVCache: ...

    def apply(self, params, tokens: jax.Array, cache: KVCache, return_hidden: bool = False) -> ModelOutput: ...
