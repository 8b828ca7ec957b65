"""specjax.keys: seeds and row indices map to distinct keys, or are refused clearly."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax import build, keys
from specjax.models import LlamaLM, tiny_config


def test_small_seeds_are_jax_keys_and_large_seeds_do_not_collide():
    for s in (0, 7, 2 ** 31, 2 ** 32 - 1):
        np.testing.assert_array_equal(jax.random.key_data(keys.seed_key(s)),
                                      jax.random.key_data(jax.random.key(s)))
    data = {s: tuple(np.asarray(jax.random.key_data(keys.seed_key(s))).tolist())
            for s in (0, 1, 2 ** 32, 2 ** 32 + 1, 2 ** 63, 2 ** 64 - 1)}
    assert len(set(data.values())) == len(data), data  # jax.random.key(2**32) is key(0)


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 1.0, True, "3", None])
def test_bad_seeds_are_refused(seed):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        keys.check_seed(seed)


@pytest.mark.parametrize("rows", [[-1], [2 ** 32], [0.5]])
def test_bad_row_indices_are_refused(rows):
    with pytest.raises(ValueError, match="row indices"):
        keys.row_keys(0, rows)


def test_generate_takes_64_bit_seeds_and_refuses_others():
    t = LlamaLM.init(tiny_config(vocab_size=32, n_layers=1), seed=3)
    run = lambda seed: build.generate_autoregressive(t, [[1, 2, 3]] * 4, seed=seed,
                                                    max_new_tokens=24).tokens  # noqa: E731
    assert run(2 ** 32) != run(0)
    assert run(2 ** 64 - 1) == run(2 ** 64 - 1)
    with pytest.raises(ValueError, match="seed must be an integer"):
        run(2 ** 70)
    with pytest.raises(ValueError, match="seed must be an integer"):
        build.generate(t, "lookup", [[1, 2, 3]], seed=-5, max_new_tokens=4)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4), (49152,)])
def test_random_bits_are_jax_random_bits(shape):
    """The unrolled threefry (what every Gumbel draw uses) gives jax.random.bits' values bit
    for bit: for typed keys of small and 64-bit seeds, folded keys, under jit and vmap. A
    wrong rotation, key injection or count would change every value."""
    import jax.numpy as jnp

    ks = [keys.seed_key(0), keys.seed_key(2 ** 40 + 3), keys.derive(keys.seed_key(5), 7, keys.BONUS, 2)]
    for k in ks:
        want = np.asarray(jax.random.bits(k, shape, jnp.uint32))
        got = np.asarray(jax.jit(keys.random_bits, static_argnums=1)(k, shape))
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    rows = keys.row_keys(11, np.arange(4))
    want = jax.vmap(lambda k: jax.random.bits(k, shape, jnp.uint32))(rows)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(lambda k: keys.random_bits(k, shape)))(rows)),
                                  np.asarray(want))


def test_random_bits_of_other_keys_are_jax_random_bits():
    import jax.numpy as jnp

    k = jax.random.key(3, impl="rbg")
    np.testing.assert_array_equal(np.asarray(keys.random_bits(k, (9,))),
                                  np.asarray(jax.random.bits(k, (9,), jnp.uint32)))
    tiny = jnp.finfo(jnp.float32).tiny
    for shape in ((), (5,)):  # uniform_open's float conversion over JAX's bits
        np.testing.assert_array_equal(
            np.asarray(keys.uniform_open(k, shape)).view(np.uint32),
            np.asarray(jax.random.uniform(k, shape, jnp.float32, minval=tiny, maxval=1.0)).view(np.uint32))
    rows = keys.row_keys(0, [0, 1])  # an array of keys: refused as JAX refuses it, not misread
    with pytest.raises(ValueError, match="single key"):
        keys.random_bits(rows, (3,))
    with pytest.raises(ValueError, match="single key"):
        keys.fold_in(rows, 1)


def test_fold_in_and_uniforms_are_jax_s():
    """keys.fold_in (every key derivation) and keys.uniform_open (acceptance uniforms) give
    jax.random.fold_in's keys and jax.random.uniform's floats bit for bit."""
    import jax.numpy as jnp

    tiny = jnp.finfo(jnp.float32).tiny
    for k in (keys.seed_key(0), keys.seed_key(2 ** 40 + 3)):
        for d in (0, 1, 7, 2 ** 31 + 3, 2 ** 32 - 1, jnp.int32(-3), jnp.int32(12)):
            np.testing.assert_array_equal(np.asarray(jax.random.key_data(keys.fold_in(k, d))),
                                          np.asarray(jax.random.key_data(jax.random.fold_in(k, d))))
        for shape in ((), (4,), (2, 3), (10000,)):
            want = jax.random.uniform(k, shape, jnp.float32, minval=tiny, maxval=1.0)
            np.testing.assert_array_equal(np.asarray(keys.uniform_open(k, shape)).view(np.uint32),
                                          np.asarray(want).view(np.uint32))
    rows = keys.row_keys(3, np.arange(5))
    got = jax.jit(jax.vmap(lambda k, i: jax.random.key_data(keys.derive(k, i, keys.ACCEPT, i + 1))))(rows, jnp.arange(5))
    want = jax.vmap(lambda k, i: jax.random.key_data(jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
        k, i), keys.ACCEPT), i + 1)))(rows, jnp.arange(5))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
