"""Compiled programs kept on disk (``engine.use_compile_cache``, what the command line turns
on): a later compile of the same program loads it, the results are the same, a folder JAX
was given is left alone, a damaged entry is compiled again and replaced, and a program
built for another kind of CPU turns the folder off for the host."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax

from specjax import engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process: compile (saved), drop the in-memory programs and compile again (loaded from
# disk), then damage the saved file (as a process killed while writing it would) and compile
# twice more (the load fails: compiled, the file replaced; then loaded again). Every program
# is saved, however fast it compiles.
_SCRIPT = r"""
import json, pathlib, sys
import jax, jax.numpy as jnp
from jax import monitoring
events = []
monitoring.register_event_listener(lambda e, **kw: events.append(e))
from specjax import engine
folder = engine.use_compile_cache(sys.argv[1] != "off")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
f = lambda x: jnp.sin(x) * 2.0 + jnp.cumsum(x)
x = jnp.linspace(0.0, 1.0, 16)
def run():
    jax.clear_caches()
    events.clear()
    y = jax.jit(f)(x)
    return {"y": y.tolist(), "hits": events.count("/jax/compilation_cache/cache_hits"),
            "misses": events.count("/jax/compilation_cache/cache_misses")}
out = {"folder": folder, "max_size": jax.config.jax_compilation_cache_max_size, "first": run(), "again": run()}
if folder:
    saved = list(pathlib.Path(folder).glob("*-cache"))
    for p in saved:
        p.write_bytes(b"not a program")
    out["damaged_files"] = len(saved)
    out["damaged"] = run()
    out["replaced"] = run()
    out["after"] = str(engine.compile_cache_dir())
print(json.dumps(out))
"""


def _run(tmp_path, *args, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "SPECJAX_COMPILE_CACHE")}
    e.update(SPECJAX_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    res = subprocess.run([sys.executable, "-c", _SCRIPT, *(args or ("on",))], capture_output=True, text=True, env=e, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def test_a_later_compile_loads_the_saved_program_and_a_damaged_one_is_replaced(tmp_path):
    out, err = _run(tmp_path)
    folder = tmp_path / "xla" / engine._host_tag()
    assert out["folder"] == str(folder) and out["max_size"] == engine.COMPILE_CACHE_MAX_BYTES
    assert out["first"]["misses"] == 1 and out["first"]["hits"] == 0  # compiled and saved
    assert out["again"]["hits"] == 1 and out["again"]["misses"] == 0  # loaded, not compiled
    assert out["again"]["y"] == out["first"]["y"]
    # a damaged entry: compiled again (same result), one line, the file replaced, cache on
    assert out["damaged"]["y"] == out["first"]["y"] and out["damaged"]["misses"] == 1
    n = out["damaged_files"]
    assert n >= 1 and err.count("did not load") == 1 and f"{n} damaged file(s) removed" in err, err[-2000:]
    assert out["replaced"]["hits"] == 1 and out["replaced"]["y"] == out["first"]["y"]
    assert out["after"] == str(folder) and not (folder / "DISABLED").exists()

    off, _ = _run(tmp_path / "off", SPECJAX_COMPILE_CACHE="0")  # the mutant: nothing kept
    assert off["folder"] is None and off["again"]["hits"] == 0 and off["again"]["y"] == out["first"]["y"]
    assert not (tmp_path / "off" / "xla").exists()
    # --no-compile-cache: not even a folder JAX was given is used
    given = tmp_path / "given"
    off, _ = _run(tmp_path / "flag", "off", JAX_COMPILATION_CACHE_DIR=str(given))
    assert off["folder"] is None and off["again"]["hits"] == 0 and not list(given.glob("*-cache"))
    on, _ = _run(tmp_path / "flag", JAX_COMPILATION_CACHE_DIR=str(given))  # without it: that folder
    assert on["folder"] == str(given) and on["again"]["hits"] == 1 and list(given.glob("*-cache"))


def test_a_folder_jax_was_given_is_kept(tmp_path, monkeypatch):
    """tests/conftest.py gives JAX a folder for the whole run: that one stays in use."""
    given = jax.config.jax_compilation_cache_dir
    assert given
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    assert engine.use_compile_cache() == given and jax.config.jax_compilation_cache_dir == given
    assert not (tmp_path / "xla").exists()


def test_a_program_built_for_another_cpu_turns_the_folder_off(tmp_path, monkeypatch, capsys):
    """XLA refuses a CPU program compiled for features this host lacks (JAX then compiles):
    the folder is marked off for this host, said in one line, other warnings pass through."""
    import warnings

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    folder = engine.compile_cache_dir()
    folder.mkdir(parents=True)
    refused = ("Error reading persistent compilation cache entry for 'jit__program': XlaRuntimeError: "
               "Target machine feature +avx512f is not supported on the host machine. Machine type used "
               "for XLA:CPU compilation doesn't match the machine type for execution.")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine._watch_cache_reads(folder)
        warnings.warn("something else")
        warnings.warn(refused)
    assert [str(w.message) for w in seen] == ["something else"]
    assert (folder / "DISABLED").exists() and engine.compile_cache_dir() is None
    err = capsys.readouterr().err
    assert err.count("did not load") == 1 and "not kept for this host from now on" in err
