"""Key derivation: one key per row, then fold_in(round), fold_in(role), fold_in(position).

Every random draw in specjax comes from a key made by :func:`derive`.  A row key is
given by the caller or derived from a seed and the row's *index in its dataset*
(:func:`row_keys`), never from its slot in a batch, so a row's sample depends only on
its own key, prompt and settings.

Roles are distinct integers; no key is used for two roles.
"""
from __future__ import annotations

import numbers
import operator

import jax
import jax.numpy as jnp
import numpy as np

# Roles (folded in after the round).
DRAFT = 0  # the draft's sampling of token i of a block
ACCEPT = 1  # the acceptance uniform(s) of a block
RESIDUAL = 2  # the correction draw from the residual
BONUS = 3  # the bonus draw from p_{K+1}
TARGET = 4  # plain autoregressive sampling from the target


SEED_BITS = 64  # seeds are integers in [0, 2**64)
ROW_INDEX_BITS = 32  # row indices are integers in [0, 2**32) (folded in as uint32)


def check_seed(seed) -> int:
    """``seed`` as a Python int, or ValueError unless it is an integer in [0, 2**64)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral) \
            or not 0 <= int(seed) < 2 ** SEED_BITS:
        raise ValueError(f"seed must be an integer in [0, 2**{SEED_BITS}), got {seed!r}")
    return int(seed)


def check_row_indices(row_indices) -> np.ndarray:
    """Row indices as uint32, or ValueError unless every one is an integer in [0, 2**32)."""
    idx = np.asarray(row_indices)
    if idx.size and (idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= 2 ** ROW_INDEX_BITS):
        raise ValueError(f"row indices must be integers in [0, 2**{ROW_INDEX_BITS})")
    return idx.astype(np.uint32)


def seed_key(seed: int) -> jax.Array:
    """The base key of a seed in [0, 2**64): distinct seeds give distinct keys (with 64-bit
    types off, ``jax.random.key`` keeps only the low 32 bits, so 2**32 would be seed 0).
    Below 2**32 it is exactly ``jax.random.key(seed)``."""
    seed = check_seed(seed)
    if jax.config.jax_default_prng_impl == "threefry2x32":  # key data [high word, low word]
        return jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))
    if seed >= 2 ** 32:
        raise ValueError(f"seed {seed} needs the threefry2x32 PRNG (seeds below 2**32 work with any)")
    return jax.random.key(seed)


def row_keys(seed: int, row_indices) -> jax.Array:
    """Keys for rows identified by their index in a dataset (not their batch slot):
    ``row_indices`` a flat sequence, one index per row."""
    base = seed_key(seed)
    if np.ndim(row_indices) != 1:
        raise ValueError(f"row indices must be a flat sequence (one per row), got shape {np.shape(row_indices)}")
    idx = jnp.asarray(check_row_indices(row_indices))
    return jax.vmap(lambda i: fold_in(base, i))(idx)


def round_key(row_key: jax.Array, round_index) -> jax.Array:
    return fold_in(row_key, round_index)


def role_key(key: jax.Array, role: int) -> jax.Array:
    return fold_in(key, role)


def position_key(key: jax.Array, position) -> jax.Array:
    return fold_in(key, position)


def derive(row_key: jax.Array, round_index, role: int, position) -> jax.Array:
    """fold_in(row_key, round) -> fold_in(role) -> fold_in(position)."""
    return position_key(role_key(round_key(row_key, round_index), role), position)


# Threefry-2x32 (Salmon et al. 2011) as JAX computes it: 20 rounds, in groups of four
# with these rotations, a key injection after each group
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotate_left(x, r: int):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


@jax.jit
def _threefry2x32(k0, k1, x0, x1):
    """The threefry2x32 hash of the count words (x0, x1) under the key words (k0, k1), all
    uint32 (broadcast), unrolled: one elementwise expression that XLA fuses with its
    neighbours (JAX lowers the hash on CPU as a rolled loop: five passes over the
    arrays, or five iterations of a while loop for a key). Jitted, so that a program is
    traced with one copy per shape, not one per call: its ~140 jnp ops, each a jit of its
    own, took ~80 ms to trace per call, and a k="auto" engine's program calls it ~40 times
    (its lowering 4.3 -> 2.8 s on 2 cores; XLA inlines the call: the same compiled code)."""
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for g in range(5):
        for r in _ROTATIONS[g % 2]:
            x0 = x0 + x1
            x1 = x0 ^ _rotate_left(x1, r)
        x0 = x0 + ks[(g + 1) % 3]
        x1 = x1 + ks[(g + 2) % 3] + np.uint32(g + 1)
    return x0, x1


def _unrolled(key) -> bool:
    """``key`` is one threefry2x32 key (not an array of them: JAX refuses those, and so do
    these through it) and JAX draws with partitionable counts (both JAX's defaults): what
    :func:`random_bits` and :func:`fold_in` reproduce."""
    return (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 0
            and str(jax.random.key_impl(key)) == "threefry2x32" and bool(jax.config.jax_threefry_partitionable))


def _check_shape(shape) -> tuple:
    """``shape`` as a tuple of Python ints >= 0 (never a float cut to an int), else ValueError."""
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        dims = None
    if dims is None or any(isinstance(d, (bool, np.bool_)) for d in shape) or any(d < 0 for d in dims):
        raise ValueError(f"shape must be a sequence of integers >= 0, got {shape!r}")
    return dims


def _check_data(data):
    """What :func:`fold_in` folds in: an integer. A host value (Python or numpy) must lie in
    [0, 2**32): it is folded in as uint32, so 2**32 would be 0's key and -1 that of
    2**32 - 1 (another round, role or position). Traced values: their dtype only."""
    if isinstance(data, (bool, np.bool_)):
        raise TypeError(f"fold_in data must be an integer, got {data!r}")
    if np.ndim(data) != 0:
        raise ValueError(f"fold_in data must be a scalar (jax.vmap over several), got shape {np.shape(data)}")
    if isinstance(data, jax.Array):  # traced or on a device: checked by dtype (no transfer)
        if not jnp.issubdtype(data.dtype, jnp.integer):
            raise TypeError(f"fold_in data must be an integer, got dtype {data.dtype}")
        return
    a = np.asarray(data)
    if a.dtype.kind not in "iu":
        raise TypeError(f"fold_in data must be an integer, got {data!r}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= 2 ** 32):
        raise ValueError(f"fold_in data must lie in [0, 2**32) (folded in as uint32), got {data!r}")


def random_bits(key: jax.Array, shape) -> jax.Array:
    """``jax.random.bits(key, shape, jnp.uint32)``, bit for bit, computed by the unrolled
    hash when :func:`_unrolled` holds: value i (row-major) is the xor of the two words of
    threefry2x32(key, (0, i)). Fused with what uses the bits (the Gumbel noise of a draw
    over the vocabulary): about 2x faster than JAX's rolled loop for one row of 49,152
    values on 2 CPU cores, 7.6x for four. Any other key, or 2**32 values or more:
    ``jax.random.bits``."""
    shape = _check_shape(shape)
    n = int(np.prod(shape, dtype=np.int64))
    if not _unrolled(key) or n >= 2 ** 32:
        return jax.random.bits(key, shape, jnp.uint32)
    data = jax.random.key_data(key)
    x0, x1 = _threefry2x32(data[0], data[1], jnp.zeros(shape, jnp.uint32),
                           jax.lax.iota(jnp.uint32, n).reshape(shape))
    return x0 ^ x1


def fold_in(key: jax.Array, data) -> jax.Array:
    """``jax.random.fold_in(key, data)``, bit for bit (the hash of the count (0, data) as
    uint32), unrolled when :func:`_unrolled` holds, else JAX's. ``data``: an integer, in
    [0, 2**32) when given on the host (ValueError: never wrapped onto another value)."""
    _check_data(data)
    if not _unrolled(key):
        return jax.random.fold_in(key, data)
    k = jax.random.key_data(key)
    y0, y1 = _threefry2x32(k[0], k[1], np.uint32(0), jnp.asarray(data, dtype=jnp.uint32))
    return jax.random.wrap_key_data(jnp.stack([y0, y1]), impl="threefry2x32")


def uniform_open(key: jax.Array, shape=()) -> jax.Array:
    """float32 uniforms strictly inside (0, 1): ``jax.random.uniform(key, shape,
    jnp.float32, minval=tiny, maxval=1)``, bit for bit (23 random mantissa bits)."""
    tiny = jnp.float32(jnp.finfo(jnp.float32).tiny)
    bits = random_bits(key, shape)
    f = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32) - jnp.float32(1.0)
    return jnp.maximum(tiny, f * (jnp.float32(1.0) - tiny) + tiny)
