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
