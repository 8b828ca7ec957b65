"""No library module changes module-level state at run time (checked on the source).

What counts, inside any function or method of a library module:
* a ``global`` statement;
* assigning to, augmenting or deleting an item or attribute of a name the module binds at
  its top level by assignment (``_CACHE[key] = ...``, ``_STATE.x = ...``);
* calling a mutating method on such a name (``_CACHE.update(...)``, ``.append``, ...).
A name the function binds itself (parameter or local) is not the module's. Memoization
through ``functools.lru_cache`` is allowed: it is not a module global.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = [p for d in ("specjax", "models") for p in sorted((REPO / d).rglob("*.py"))]
MUTATING = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear",
            "add", "discard", "remove", "__setitem__", "__delitem__"}


def _module_names(tree: ast.Module) -> set:
    names = set()
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    names.add(n.id)
    return names


def _local_names(fn) -> set:
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    names |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
    return names


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def check_source(source: str, filename: str = "<module>") -> list:
    """``file:line: what`` for every run-time change of module-level state."""
    tree = ast.parse(source, filename=filename)
    module = _module_names(tree)
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(fn, ast.Lambda):
            continue
        own = _local_names(fn)
        shared = module - own
        for n in ast.walk(fn):
            where = f"{filename}:{getattr(n, 'lineno', 0)}"
            if isinstance(n, ast.Global):
                found.append(f"{where}: global {', '.join(n.names)}")
            targets = []
            if isinstance(n, ast.Assign):
                targets = n.targets
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
                targets = [n.target]
            elif isinstance(n, ast.Delete):
                targets = n.targets
            for t in targets:
                if isinstance(t, (ast.Subscript, ast.Attribute)) and _root(t) in shared:
                    found.append(f"{where}: changes module-level {_root(t)}")
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr in MUTATING and _root(n.func.value) in shared):
                found.append(f"{where}: {_root(n.func.value)}.{n.func.attr}(...) on module-level state")
    return sorted(set(found))


@pytest.mark.parametrize("source", [
    "_ENGINES = {}\ndef get(k):\n    _ENGINES[k] = 1\n",
    "_SWITCH = False\ndef on():\n    global _SWITCH\n    _SWITCH = True\n",
    "_STATE = {}\ndef build():\n    _STATE.update(ok=True)\n",
    "class _Box:\n    x = 0\n_BOX = _Box()\ndef f():\n    _BOX.x += 1\n",
    "_SEEN = []\nclass A:\n    def m(self, v):\n        _SEEN.append(v)\n",
], ids=["item-assignment", "global", "mutating-call", "attribute", "method"])
def test_planted_module_state_is_found(source):
    assert check_source(source), source


def test_locals_and_memoization_are_not_module_state():
    source = ("import functools\n_TABLE = {'a': 1}\n"
              "def f(_TABLE):\n    _TABLE['b'] = 2\n"
              "def g():\n    d = dict(_TABLE)\n    d['c'] = 3\n    return d\n"
              "@functools.lru_cache(maxsize=None)\ndef h(x):\n    return x\n")
    assert check_source(source) == []


def test_library_changes_no_module_level_state():
    assert LIBRARY
    found = [f for p in LIBRARY for f in check_source(p.read_text(encoding="utf-8"),
                                                     str(p.relative_to(REPO)))]
    assert not found, "\n".join(found)
