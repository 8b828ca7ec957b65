"""The project's YAML presets (``configs/<kind>/*.yaml``): one loader for every kind.

Kinds: ``models`` (architectures and checkpoints), ``mesh`` (sharding rules), ``pods``
(deployments), ``bench`` (benchmark runs), ``train`` (draft training). A name is looked
up as ``configs/<kind>/<name>.yaml`` of this checkout; a path to a YAML file is read as
it is.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional, Union

CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"

PathLike = Union[str, os.PathLike]


def config_dir(kind: str) -> Path:
    return CONFIG_ROOT / kind


def list_configs(kind: str) -> list:
    """The preset names of a kind (file stems), sorted."""
    return sorted(p.stem for p in config_dir(kind).glob("*.yaml"))


def find_config(name_or_path: PathLike, kind: str, what: Optional[str] = None) -> Path:
    """``configs/<kind>/<name>.yaml`` for a name, or the given YAML path (which must exist).
    ``what`` names the kind in errors (default: "<kind> config")."""
    what = what or f"{kind} config"
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise FileNotFoundError(f"{what} file not found: {p}")
        return p
    q = config_dir(kind) / f"{name_or_path}.yaml"
    if not q.is_file():
        raise FileNotFoundError(f"unknown {what} {str(name_or_path)!r}; "
                                f"available: {', '.join(list_configs(kind))}")
    return q


def read_yaml(path: PathLike, allowed: Optional[Iterable[str]] = None) -> dict:
    """A YAML file holding a mapping (empty file: ``{}``); ``allowed``: the only top-level
    keys it may have. ValueError naming the file otherwise."""
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            d = yaml.safe_load(f)
        except yaml.YAMLError as e:  # one line: where and what
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise ValueError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(d).__name__}")
    if allowed is not None:
        unknown = set(d) - set(allowed)
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    return d


def load_config(name_or_path: PathLike, kind: str, allowed: Optional[Iterable[str]] = None,
                what: Optional[str] = None):
    """``(mapping, path)`` of a preset name or a YAML path (see :func:`find_config`)."""
    path = find_config(name_or_path, kind, what)
    return read_yaml(path, allowed), path


def read_prompt_file(path) -> list:
    """The prompts of a file given on a command line (one a line; blank lines and ``#``
    lines skipped; a relative path is the current directory's); ValueError (one line) for
    an unreadable, non-UTF-8 or prompt-less file. A UTF-8 byte-order mark (some editors
    write one) is not part of the first prompt."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or type(e).__name__})") from None
    if not lines:
        raise ValueError(f"{path}: no prompts (only blank or '#' comment lines)")
    return lines


def check_writable(path) -> None:
    """ValueError (one line) unless the file ``path`` can be written, tried now (a file
    created for the probe is removed again): for the scripts, before a run whose results
    would otherwise be lost at its end."""
    existed = os.path.lexists(path)
    try:
        open(path, "a").close()
    except OSError as e:
        raise ValueError(f"{path}: cannot write it ({e.strerror or type(e).__name__})") from None
    if not existed:
        os.remove(path)
