"""Packaging: ``specjax`` is the only top-level package, the ``models/`` folder ships as
``specjax.models`` (pyproject's package-dir), with the kernel sources and the shipped draft.

The wheel is built offline (``pip wheel --no-deps --no-build-isolation --no-index``, with the
setuptools and wheel of the dev extras) from a copy of the working tree in a temporary folder,
so the build leaves no ``build/`` or ``*.egg-info`` in the checkout and a stale ``build/lib``
there cannot leak old modules into the wheel.
"""
from __future__ import annotations

import importlib.resources
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"specjax": "specjax", "specjax.models": "models"}  # as pyproject's package-dir
SHIPPED_DRAFT = "smollm2-135m-instruct-eagle.npz"

# Not copied: VCS data, build outputs, caches and the git-ignored run/output folders.
_SKIP_TOP_LEVEL = {".git", "build", "dist", ".venv", "runs", "out", "data_cache", ".pytest_cache"}


def _ignore(folder: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith((".egg-info", ".pyc"))}
    if Path(folder) == REPO:
        skip |= _SKIP_TOP_LEVEL & set(names)
    return skip


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "out"
    shutil.copytree(REPO, src, ignore=_ignore)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(src)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        "pip wheel failed (the build needs the dev extras' setuptools>=68 and wheel: "
        f"pip install -e '.[dev]'):\n{proc.stdout}\n{proc.stderr}")
    (wheel,) = out.glob("specjax-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_wheel_has_only_specjax_at_top_level(wheel_names):
    top = {name.split("/")[0] for name in wheel_names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("specjax-"), sorted(top)
    assert top - dist_info == {"specjax"}, sorted(top)


def test_wheel_ships_models_kernels_and_draft(wheel_names):
    names = set(wheel_names)
    kernels = sorted(p.name for p in (REPO / "models" / "kernels").glob("*.cc"))
    assert kernels, "no models/kernels/*.cc in the checkout"
    wanted = ["specjax/models/__init__.py", "specjax/models/kernels/common.h",
              f"specjax/drafts/data/{SHIPPED_DRAFT}"]
    wanted += [f"specjax/models/kernels/{k}" for k in kernels]
    missing = [w for w in wanted if w not in names]
    assert not missing, f"missing from the wheel: {missing}"


def test_wheel_ships_every_library_module(wheel_names):
    """Every .py of specjax/ and models/ is in the wheel (a subpackage missing from pyproject's
    package list would be left out)."""
    names = set(wheel_names)
    missing = []
    for package, folder in PACKAGE_DIRS.items():
        root = REPO / folder
        for path in root.rglob("*.py"):
            rel = path.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            entry = "/".join(package.split(".") + list(rel.parts))
            if entry not in names:
                source = f"{folder}/{rel.as_posix()}"
                missing.append(source if source == entry else f"{source} (as {entry})")
    assert not missing, "library modules missing from the wheel:\n  " + "\n  ".join(sorted(missing))


def test_installed_project_has_no_top_level_models(tmp_path):
    """Outside the checkout, ``models`` is not importable and ``specjax.models`` is this
    checkout's models/ folder (the editable install honours package-dir)."""
    script = textwrap.dedent("""
        try:
            import models
        except ModuleNotFoundError as e:
            assert e.name == "models", repr(e)
        else:
            raise SystemExit("import models worked: " + str(getattr(models, "__file__", models)))
        import specjax.models
        print(specjax.models.__file__)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    where = Path(proc.stdout.strip().splitlines()[-1]).resolve()
    assert where == REPO / "models" / "__init__.py", (
        f"specjax.models comes from {where}, not this checkout: pip install -e '.[dev]'")


def test_shipped_draft_is_a_package_resource():
    resource = importlib.resources.files("specjax.drafts").joinpath("data").joinpath(SHIPPED_DRAFT)
    assert resource.is_file(), resource
