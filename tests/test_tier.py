"""The extended tier (tests/conftest.py): tests marked ``extended`` are skipped, with their
reason, in the default run (CI's and the README's); ``--extended`` or ``SPECJAX_EXTENDED=1``
runs them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.extended
def test_marked_extended():
    """Runs in the extended tier only (what the test below checks)."""


def _run(env, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
                           "tests/test_tier.py::test_marked_extended", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_default_run_skips_the_extended_tier_and_says_so():
    env = {k: v for k, v in os.environ.items() if k != "SPECJAX_EXTENDED"}
    plain = _run(env)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "1 skipped" in plain.stdout and "extended tier: python -m pytest --extended runs it" in plain.stdout
    for run in (_run(env, "--extended"), _run(dict(env, SPECJAX_EXTENDED="1"))):
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


# ------------------------------------------------------------------ the test run's XLA options


def test_this_run_compiles_with_its_xla_flags(request):
    """This process's XLA_FLAGS are already what run_xla_flags makes of them: TEST_XLA_FLAGS
    added (or an option of theirs named otherwise), or none of them with --xla-defaults; with
    SPECJAX_TIER_PROBE set (the runs below), also written there."""
    from tests.conftest import run_xla_flags, xla_defaults

    flags = os.environ.get("XLA_FLAGS", "")
    assert run_xla_flags(flags, xla_defaults(request.config)) == flags.strip(), flags
    if os.environ.get("SPECJAX_TIER_PROBE"):
        with open(os.environ["SPECJAX_TIER_PROBE"], "w") as f:
            f.write(os.environ.get("XLA_FLAGS", ""))


def test_xla_flags_are_added_kept_or_removed():
    from tests.conftest import TEST_XLA_FLAGS, run_xla_flags

    assert run_xla_flags("", False) == " ".join(TEST_XLA_FLAGS)
    # an option already named keeps its value; others are kept as they are
    mine = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=2"
    assert run_xla_flags(mine, False) == mine + " --xla_cpu_use_fusion_emitters=false"
    assert run_xla_flags(mine, True) == mine
    assert run_xla_flags(run_xla_flags(mine, False), False) == run_xla_flags(mine, False)
    assert run_xla_flags(" ".join(TEST_XLA_FLAGS), True) == ""


def test_the_workers_and_subprocesses_get_the_runs_xla_flags(tmp_path):
    """A pytest run with one xdist worker: the worker's XLA_FLAGS are the run's (set by the
    controller before it starts the worker); --xla-defaults and SPECJAX_XLA_DEFAULTS=1 take
    them out, even when inherited."""
    from tests.conftest import TEST_XLA_FLAGS

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "SPECJAX_XLA_DEFAULTS")}
    probe = tmp_path / "flags"

    def flags(env, *args):
        probe.unlink(missing_ok=True)
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                              "tests/test_tier.py::test_this_run_compiles_with_its_xla_flags"],
                             cwd=ROOT, env=dict(env, SPECJAX_TIER_PROBE=str(probe)),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
        return probe.read_text().split()

    assert flags(env, "-n", "1") == list(TEST_XLA_FLAGS)
    assert flags(env, "-n", "0", "--xla-defaults") == []
    inherited = dict(env, XLA_FLAGS=" ".join(TEST_XLA_FLAGS))
    assert flags(dict(inherited, SPECJAX_XLA_DEFAULTS="1"), "-n", "0") == []
