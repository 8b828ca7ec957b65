"""Where the test suite's XLA compile time goes: a pytest plugin and its report.

    PYTHONPATH=scripts COMPILE_REPORT_DIR=/tmp/compiles python -m pytest -p compile_report
    python scripts/compile_report.py /tmp/compiles          # totals by file, test, program

The plugin (loaded with ``-p compile_report``, in pytest and in every xdist worker) records
each compile that missed JAX's persistent cache (program name, the end of its cache key,
seconds) and each program read back from it, with the test that was running, as JSON lines
in ``$COMPILE_REPORT_DIR/<pid>.jsonl``. Subprocesses a test starts (the CLI, the README's
examples, the multi-device runs) are not recorded. It wraps two private functions of
``jax._src.compiler`` (``_compile_and_write_cache``, ``_cache_read``; JAX 0.10): a
development tool, not part of the library, and it fails loudly if JAX renames them.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import time

_current = {"test": "<collection>"}
_out = None


def _log(rec: dict) -> None:
    global _out
    if _out is None:
        folder = os.environ.get("COMPILE_REPORT_DIR", "compile_report")
        os.makedirs(folder, exist_ok=True)
        _out = open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a")
    _out.write(json.dumps(rec) + "\n")
    _out.flush()


def _install() -> None:
    from jax._src import compiler

    compile_and_write, cache_read = compiler._compile_and_write_cache, compiler._cache_read

    def compiled(backend, computation, devices, options, callbacks, module_name, cache_key):
        t = time.perf_counter()
        out = compile_and_write(backend, computation, devices, options, callbacks, module_name, cache_key)
        _log({"test": _current["test"], "kind": "compile", "program": module_name,
              "key": cache_key[-16:], "s": time.perf_counter() - t})
        return out

    def read(module_name, cache_key, *args, **kwargs):
        t = time.perf_counter()
        out = cache_read(module_name, cache_key, *args, **kwargs)
        if out[0] is not None:
            _log({"test": _current["test"], "kind": "hit", "program": module_name,
                  "key": cache_key[-16:], "s": time.perf_counter() - t})
        return out

    compiler._compile_and_write_cache, compiler._cache_read = compiled, read


def pytest_configure(config):
    _install()


def _hooks():
    import pytest

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(item, nextitem):
        _current["test"] = item.nodeid  # then pytest runs the test (None: the next hook runs it)

    return pytest_runtest_protocol


try:  # a plugin only where pytest is installed; the report needs neither pytest nor jax
    pytest_runtest_protocol = _hooks()
except ImportError:
    pass


def report(folder: str, top: int) -> None:
    recs = [json.loads(line) for f in glob.glob(os.path.join(folder, "*.jsonl")) for line in open(f)]
    comp = [r for r in recs if r["kind"] == "compile"]
    hits = [r for r in recs if r["kind"] == "hit"]
    print(f"{len(comp)} compiles, {sum(r['s'] for r in comp):.0f} s; {len(hits)} read back from the "
          f"cache, {sum(r['s'] for r in hits):.0f} s")
    twice = [k for k, n in collections.Counter(r["key"] for r in comp).items() if n > 1]
    print(f"programs compiled more than once (same cache key): {len(twice)}")
    for title, key in (("file", lambda r: r["test"].split("::")[0]), ("test", lambda r: r["test"]),
                       ("program", lambda r: r["program"])):
        s, n = collections.defaultdict(float), collections.Counter()
        for r in comp:
            s[key(r)] += r["s"]
            n[key(r)] += 1
        print(f"\nby {title}: seconds, compiles")
        for k, v in sorted(s.items(), key=lambda kv: -kv[1])[:top]:
            print(f"{v:8.1f} {n[k]:5d}  {k}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    report(a.folder, a.top)
