"""The library's import layering, checked on the source with ``ast`` (nothing is imported).

Layers, bottom up (a module may import only what its rule allows; third-party and standard
library imports are not checked):

* the math layer (``specjax.keys``, ``sampling``, ``verify``, ``audit``): only each other;
* ``specjax.configs`` (the YAML loader): nothing from specjax;
* ``specjax.models.*`` (the ``models/`` folder): only ``specjax.models.*`` and ``specjax.configs``;
* ``specjax.drafts.*``: the math layer, ``specjax.configs``, ``specjax.models.*``, ``specjax.drafts.*``;
* ``specjax.engine``: the math layer, ``specjax.drafts.base`` (the Proposer protocol) and
  ``specjax.models.base``;
* ``specjax.sharding``: ``specjax.configs`` and ``specjax.models.base``;
* ``specjax.build`` and ``specjax.train.*``: anything in the library except the commands
  (``specjax.cli``, ``specjax.demo``, ``specjax.__main__``);
* every library module: never ``scripts``, ``tests``, ``bench_common`` or a top-level ``models``
  (the folder is installed as ``specjax.models``; ``import models`` only works from the checkout).

Every import counts: ``import x``, ``from x import y``, relative imports (resolved against the
module's real name), imports inside functions or ``if TYPE_CHECKING:`` blocks, and
``importlib.import_module("literal")`` / ``__import__("literal")``. ``from pkg import name``
counts as importing ``pkg.name``, so ``from specjax import build`` is an import of
``specjax.build`` and ``from specjax.drafts import Proposer`` is not an import of
``specjax.drafts.base`` (it runs ``specjax/drafts/__init__.py``, which imports every draft).
"""
from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Folder -> package name, as pyproject's [tool.setuptools] package-dir installs them
# (test_package_dirs_match_pyproject keeps the two in step).
PACKAGE_DIRS = {"specjax": "specjax", "specjax.models": "models"}

MATH = ("specjax.keys", "specjax.sampling", "specjax.verify", "specjax.tree", "specjax.audit")
COMMANDS = ("specjax.cli", "specjax.demo", "specjax.__main__")
FORBIDDEN_TOP_LEVEL = ("scripts", "tests", "bench_common", "models")


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@dataclass(frozen=True)
class Rule:
    layer: str
    allowed: tuple[str, ...] | None  # specjax names (and everything below them); None: any
    denied: tuple[str, ...] = ()

    def permits(self, target: str) -> bool:
        if any(_within(target, d) for d in self.denied):
            return False
        return self.allowed is None or any(_within(target, a) for a in self.allowed)

    def describe(self) -> str:
        if self.allowed is None:
            return f"{self.layer} may import anything in specjax except {', '.join(self.denied)}"
        if not self.allowed:
            return f"{self.layer} may import nothing from specjax"
        return f"{self.layer} may import only {', '.join(self.allowed)}"


def rule_for(module: str) -> Rule | None:
    """The layering rule of a library module (None: only the rule shared by all modules)."""
    if module in MATH:
        return Rule("the math layer", MATH)
    if module == "specjax.configs":
        return Rule("specjax.configs", ())
    if _within(module, "specjax.models"):
        return Rule("specjax.models", ("specjax.models", "specjax.configs"))
    if _within(module, "specjax.drafts"):
        return Rule("specjax.drafts", MATH + ("specjax.configs", "specjax.models", "specjax.drafts"))
    if module == "specjax.engine":
        return Rule("specjax.engine", MATH + ("specjax.drafts.base", "specjax.models.base"))
    if module == "specjax.sharding":
        return Rule("specjax.sharding", ("specjax.configs", "specjax.models.base"))
    if module == "specjax.build":
        return Rule("specjax.build", None, COMMANDS)
    if _within(module, "specjax.train"):
        return Rule("specjax.train", None, COMMANDS)
    return None


@dataclass(frozen=True)
class Violation:
    filename: str
    line: int
    module: str
    target: str
    why: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}: {self.module} imports {self.target}: {self.why}"


def _imports(module: str, tree: ast.AST, is_package: bool):
    """(line, imported name, error or None) for every import in ``tree``, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 >= len(parts):
                    yield node.lineno, "." * node.level + (node.module or ""), \
                        "relative import beyond the top-level package"
                    continue
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                if node.module:
                    base += "." + node.module
            else:
                base = node.module or ""
            for alias in node.names:
                yield node.lineno, base if alias.name == "*" else f"{base}.{alias.name}", None
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if (name in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str) and not arg.value.startswith(".")):
                yield node.lineno, arg.value, None


def check_module(module: str, source: str, *, is_package: bool = False,
                 filename: str | None = None) -> list[Violation]:
    """Every layering violation in the source of library module ``module``.

    ``is_package``: the source is the package's ``__init__.py`` (relative imports then resolve
    against ``module`` itself)."""
    filename = filename or module
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        return [Violation(filename, e.lineno or 0, module, "?", f"cannot parse: {e.msg}")]
    rule = rule_for(module)
    found = []
    for line, target, error in _imports(module, tree, is_package):
        if error:
            found.append(Violation(filename, line, module, target, error))
        elif target.split(".")[0] in FORBIDDEN_TOP_LEVEL:
            found.append(Violation(filename, line, module, target,
                                   "library code never imports scripts, tests, bench_common or a "
                                   "top-level models (it is installed as specjax.models)"))
        elif (_within(target, "specjax") and rule is not None and not _within(target, module)
              and not rule.permits(target)):
            found.append(Violation(filename, line, module, target, rule.describe()))
    return sorted(found, key=lambda v: (v.filename, v.line, v.target))


def library_modules(repo: Path = REPO):
    """(module name, path, is_package) for every .py file of the installed packages."""
    for package, folder in PACKAGE_DIRS.items():
        root = repo / folder
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            parts = list(rel.with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join([package] + parts)
            # a sub-folder mapped to a package of its own is walked under that name
            if any(_within(name, other) and other != package and not _within(package, other)
                   for other in PACKAGE_DIRS):
                continue
            yield name, path, is_package


def check_tree(repo: Path = REPO) -> list[Violation]:
    found = []
    for module, path, is_package in library_modules(repo):
        found += check_module(module, path.read_text(encoding="utf-8"), is_package=is_package,
                              filename=str(path.relative_to(repo)))
    return found


# --- the checker finds planted violations -------------------------------------------------

# (module, source, the reported name, line); every source starts with an allowed import
PLANTED = [
    pytest.param("specjax.verify", "import jax\nfrom specjax.engine import SpeculativeEngine\n",
                 "specjax.engine.SpeculativeEngine", 2, id="math-imports-engine"),
    pytest.param("specjax.keys", "import specjax.models.base\n", "specjax.models.base", 1,
                 id="math-imports-models"),
    pytest.param("specjax.sampling", "from specjax import keys\nfrom . import configs\n",
                 "specjax.configs", 2, id="math-relative-import"),
    pytest.param("specjax.audit", "import importlib\nm = importlib.import_module('specjax.drafts')\n",
                 "specjax.drafts", 2, id="math-import_module"),
    pytest.param("specjax.configs", "import yaml\nfrom specjax import keys\n", "specjax.keys", 2,
                 id="configs-imports-specjax"),
    pytest.param("specjax.build", "from specjax import engine\nimport models\n", "models", 2,
                 id="top-level-models"),
    pytest.param("specjax.engine", "from models.llama import LlamaLM\n", "models.llama.LlamaLM", 1,
                 id="from-top-level-models"),
    pytest.param("specjax.cli", "import scripts.bench_common\n", "scripts.bench_common", 1,
                 id="imports-scripts"),
    pytest.param("specjax.demo", "from bench_common import load\n", "bench_common.load", 1,
                 id="imports-bench_common"),
    pytest.param("specjax.models.tokenizer", "def f():\n    from tests import conftest\n",
                 "tests.conftest", 2, id="imports-tests"),
    pytest.param("specjax.models.llama", "from specjax.models.base import KVCache\nfrom specjax import build\n",
                 "specjax.build", 2, id="models-imports-build"),
    pytest.param("specjax.models.eagle", "from . import llama\nfrom ..drafts import eagle\n",
                 "specjax.drafts.eagle", 2, id="models-relative-imports-drafts"),
    pytest.param("specjax.models.base",
                 "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specjax.engine import X\n",
                 "specjax.engine.X", 3, id="models-type-checking-import"),
    pytest.param("specjax.drafts.eagle",
                 "from specjax.drafts.base import Proposer\ndef f():\n    from specjax.cli import main\n",
                 "specjax.cli.main", 3, id="drafts-function-level-cli"),
    pytest.param("specjax.drafts.model", "from ..engine import SpeculativeEngine\n",
                 "specjax.engine.SpeculativeEngine", 1, id="drafts-relative-engine"),
    pytest.param("specjax.drafts.files", "import specjax.sharding\n", "specjax.sharding", 1,
                 id="drafts-imports-sharding"),
    pytest.param("specjax.engine", "from specjax.drafts import Proposer\n", "specjax.drafts.Proposer", 1,
                 id="engine-imports-drafts-package"),
    pytest.param("specjax.engine", "from specjax.models.llama import LlamaLM\n",
                 "specjax.models.llama.LlamaLM", 1, id="engine-imports-models-llama"),
    pytest.param("specjax.engine", "from specjax import configs\n", "specjax.configs", 1,
                 id="engine-imports-configs"),
    pytest.param("specjax.sharding", "from . import build\n", "specjax.build", 1,
                 id="sharding-relative-build"),
    pytest.param("specjax.sharding", "from specjax import keys\n", "specjax.keys", 1,
                 id="sharding-imports-math"),
    pytest.param("specjax.build", "def main():\n    from specjax.cli import main\n", "specjax.cli.main", 2,
                 id="build-imports-cli"),
    pytest.param("specjax.build", "import specjax.__main__\n", "specjax.__main__", 1,
                 id="build-imports-main"),
    pytest.param("specjax.models.llama", "from ... import engine\n", "...", 1,
                 id="relative-beyond-top-level"),
]


@pytest.mark.parametrize("module, source, target, line", PLANTED)
def test_planted_violation_is_reported(module, source, target, line):
    found = check_module(module, source)
    assert [(v.target, v.line) for v in found] == [(target, line)], [str(v) for v in found]
    assert str(found[0]).startswith(f"{module}:{line}: {module} imports {target}: ")


def test_every_violation_is_reported_with_file_and_line():
    source = "import models\nfrom specjax import build\ndef f():\n    from specjax.engine import X\n"
    found = check_module("specjax.models.llama", source, filename="models/llama.py")
    assert [str(v).split(": ")[0] for v in found] == ["models/llama.py:1", "models/llama.py:2",
                                                      "models/llama.py:4"]


def test_allowed_imports_are_not_reported():
    allowed = {
        "specjax.verify": "from specjax import keys as _keys\nfrom specjax.sampling import sample\n"
                          "from . import audit\nimport jax\n",
        "specjax.configs": "import yaml\nfrom pathlib import Path\n",
        "specjax.models.llama": "from specjax.models.base import KVCache\nfrom .cpu_kernels import x\n"
                                "from specjax.configs import load_config\n",
        "specjax.models.config": "from ..configs import load_config\nfrom . import llama\n",
        "specjax.drafts.eagle": "from specjax.drafts.base import Proposer\nfrom specjax.keys import DRAFT\n"
                                "def f():\n    from specjax.models.eagle import EagleModel\n"
                                "from specjax.configs import load_config\nfrom .lookup import x\n",
        "specjax.engine": "from specjax import keys, sampling, verify\n"
                          "from specjax.drafts.base import CommitContext, Proposer\n"
                          "from specjax.models.base import KVCache\nfrom .drafts.base import Proposal\n",
        "specjax.sharding": "from specjax.configs import config_dir\nfrom specjax.models.base import KVCache\n",
        "specjax.build": "from specjax.engine import SpeculativeEngine\nfrom specjax import sharding\n"
                         "from specjax.drafts import make_proposer\nfrom specjax.models import LlamaLM\n",
        "specjax.cli": "from specjax import build, engine\nfrom specjax.demo import run\n",
        "specjax": "__version__ = '0'\n",
    }
    # in a package's __init__, "." is the package itself
    assert check_module("specjax.drafts", "from . import eagle\nfrom .base import Proposer\n",
                        is_package=True) == []
    for module, source in allowed.items():
        assert check_module(module, source) == [], (module, [str(v) for v in check_module(module, source)])


def test_package_dirs_match_pyproject():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert config["tool"]["setuptools"]["package-dir"] == PACKAGE_DIRS


def test_module_names_follow_package_dir():
    names = {name: (path.relative_to(REPO).as_posix(), pkg) for name, path, pkg in library_modules()}
    assert names["specjax.models"] == ("models/__init__.py", True)
    assert names["specjax.models.llama"] == ("models/llama.py", False)
    assert names["specjax.engine"] == ("specjax/engine.py", False)
    assert names["specjax.drafts.base"] == ("specjax/drafts/base.py", False)
    assert not any(_within(name, "models") for name in names)


# --- the real tree ------------------------------------------------------------------------

def test_library_follows_the_layering():
    found = check_tree()
    assert not found, "layering violations:\n" + textwrap.indent("\n".join(map(str, found)), "  ")
