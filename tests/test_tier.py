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
