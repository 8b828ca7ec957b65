"""Key derivation: one key per row, then fold_in(round), fold_in(role), fold_in(position).

Every random draw in specjax comes from a key made by :func:`derive`.  A row key is
given by the caller or derived from a seed and the row's *index in its dataset*
(:func:`row_keys`), never from its slot in a batch, so a row's sample depends only on
its own key, prompt and settings.

Roles are distinct integers; no key is used for two roles.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Roles (folded in after the round).
DRAFT = 0  # the draft's sampling of token i of a block
ACCEPT = 1  # the acceptance uniform(s) of a block
RESIDUAL = 2  # the correction draw from the residual
BONUS = 3  # the bonus draw from p_{K+1}
TARGET = 4  # plain autoregressive sampling from the target


def row_keys(seed: int, row_indices) -> jax.Array:
    """Keys for rows identified by their index in a dataset (not their batch slot)."""
    base = jax.random.key(seed)
    idx = jnp.asarray(row_indices, dtype=jnp.uint32)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(idx)


def round_key(row_key: jax.Array, round_index) -> jax.Array:
    return jax.random.fold_in(row_key, round_index)


def role_key(key: jax.Array, role: int) -> jax.Array:
    return jax.random.fold_in(key, role)


def position_key(key: jax.Array, position) -> jax.Array:
    return jax.random.fold_in(key, position)


def derive(row_key: jax.Array, round_index, role: int, position) -> jax.Array:
    """fold_in(row_key, round) -> fold_in(role) -> fold_in(position)."""
    return position_key(role_key(round_key(row_key, round_index), role), position)


def uniform_open(key: jax.Array, shape=()) -> jax.Array:
    """float32 uniforms strictly inside (0, 1)."""
    tiny = jnp.finfo(jnp.float32).tiny
    return jax.random.uniform(key, shape, dtype=jnp.float32, minval=tiny, maxval=1.0)
