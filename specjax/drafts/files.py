"""Draft files and the shipped default drafts.

Draft files (``.npz``): ``meta`` (JSON: kind, config, training info) plus the weights.
``kind == "eagle"``: the head's trainable weights and ``token_map`` (the target's
embedding / head are taken from the target at load time, so files stay small);
``kind == "llama"``: an independent draft's canonical weights (``embed`` may be omitted
when ``embed_from_target``, e.g. a target-initialised draft with a frozen embedding).

A draft changes only speed, never the output law. For SmolLM2-135M-Instruct (the embedded
default target) the default draft is the EAGLE head shipped as package data in
``specjax/drafts/data/`` (trained by ``scripts/train_draft.py
configs/train/eagle_smollm2_gpu.yaml``; its file's ``info`` holds the step count and
held-out numbers); any other target gets prompt lookup (an n-gram proposer that needs no
weights).
"""
from __future__ import annotations

import importlib.resources
import json
import os
import warnings
import zipfile
from typing import Optional

import numpy as np

# target name (the GGUF's general.name) -> shipped draft file in specjax/drafts/data/;
# the shape is checked on load
SHIPPED = {"Smollm2 135M 8k Lc100K Mix1 Ep2": "smollm2-135m-instruct-eagle.npz"}


def shipped_draft_path(target) -> Optional[str]:
    """The shipped draft file for ``target`` (matched by name and shape), or None.
    :class:`DraftFileError` when the installation lacks it or it is unreadable."""
    name = SHIPPED.get(getattr(target.config, "name", None))
    if name is None:
        return None
    res = importlib.resources.files("specjax.drafts").joinpath("data", name)
    if not res.is_file():
        raise DraftFileError(f"the shipped draft {name} is missing from the installation")
    path = str(res)  # package data is a plain file in a wheel or an editable install
    c, t = read_draft_meta(path)["config"], target.config
    if (c.get("vocab_size"), c.get("dim")) != (t.vocab_size, t.dim):
        return None
    return path


def default_draft_for(target):
    """The draft ``specjax generate`` uses for ``target``: the shipped draft model, or
    'lookup' (no shipped draft for it; or, with a warning, one that cannot be loaded)."""
    try:
        path = shipped_draft_path(target)
        return "lookup" if path is None else load_draft_model(path, target)
    except DraftFileError as e:
        warnings.warn(f"specjax: {e}; using prompt lookup as the draft instead", stacklevel=2)
        return "lookup"


def save_draft(path: str, kind: str, config: dict, weights: dict, info: Optional[dict] = None,
               dtype: str = "float32") -> None:
    """Write a draft file (npz): ``meta`` JSON plus int arrays and float weights stored as
    ``dtype`` (float32, or float16 for half the size; :func:`read_draft` returns float32)."""
    if kind not in ("eagle", "llama"):
        raise ValueError(f"unknown draft kind {kind!r}")
    if dtype not in ("float32", "float16"):
        raise ValueError(f"draft files store float32 or float16 weights, not {dtype!r}")
    meta = dict(kind=kind, config=config, info=info or {}, format=1)
    arrays = {}
    for k, v in weights.items():
        if v is None:
            continue
        a = np.asarray(v)
        if np.issubdtype(a.dtype, np.floating):
            if dtype == "float16" and np.isfinite(a).all() and np.abs(a).max(initial=0.0) >= 65504:
                raise ValueError(f"draft weight {k!r} does not fit float16 (max |x| = {np.abs(a).max()})")
            a = a.astype(dtype)
        arrays[k] = a
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    os.replace(tmp, path)


def _float32(weights: dict) -> dict:
    return {k: (v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v) for k, v in weights.items()}


class DraftFileError(ValueError):
    """A draft file that cannot be used: missing, not a draft file, or not for this target."""


# what numpy / zipfile raise for a truncated, corrupt or foreign file
_UNREADABLE = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, UnicodeDecodeError)


def _open(path: str):
    """``np.load`` of a draft file (no pickles), with one clear error for anything that is
    not a readable ``.npz`` holding a ``meta`` entry."""
    if not os.path.isfile(path):
        raise DraftFileError(f"draft file {path}: no such file")
    try:
        f = np.load(path, allow_pickle=False)
    except _UNREADABLE as e:
        raise DraftFileError(f"draft file {path}: not a readable .npz draft file "
                             f"({type(e).__name__})") from None
    if not isinstance(f, np.lib.npyio.NpzFile) or "meta" not in f.files:
        if isinstance(f, np.lib.npyio.NpzFile):
            f.close()
        raise DraftFileError(f"draft file {path}: not a specjax draft file (no 'meta' entry)")
    return f


def _meta(f, path: str) -> dict:
    try:
        meta = json.loads(bytes(f["meta"]).decode())
    except _UNREADABLE as e:
        raise DraftFileError(f"draft file {path}: unreadable meta ({type(e).__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise DraftFileError(f"draft file {path}: its meta has no config")
    return meta


def read_draft_meta(path: str) -> dict:
    """The ``meta`` dict of a draft file, without reading its weights."""
    with _open(path) as f:
        return _meta(f, path)


def read_draft(path: str, upcast: bool = True):
    """(meta dict, weights dict of numpy arrays); float weights as float32 unless not ``upcast``.
    :class:`DraftFileError` (a ValueError naming the file) for a missing, truncated or
    foreign file."""
    with _open(path) as f:
        meta = _meta(f, path)
        try:
            weights = {k: f[k] for k in f.files if k != "meta"}
        except _UNREADABLE as e:
            raise DraftFileError(f"draft file {path}: truncated or corrupt ({type(e).__name__})") from None
    return meta, (_float32(weights) if upcast else weights)


def _draft_config(meta: dict, path: str):
    """The ``EagleConfig`` (kind eagle) or ``LlamaConfig`` (kind llama) in a draft file's
    meta, checked: a bad or incomplete config is a :class:`DraftFileError` naming the file."""
    from specjax.models.eagle import EagleConfig
    from specjax.models.llama import LlamaConfig

    kind = meta.get("kind")
    if kind not in ("eagle", "llama"):
        raise DraftFileError(f"draft file {path}: unknown draft kind {kind!r}")
    try:
        if kind == "eagle":
            return EagleConfig.from_dict(dict(meta["config"]))
        return LlamaConfig(**meta["config"])
    except (TypeError, ValueError) as e:
        raise DraftFileError(f"draft file {path}: bad {'EAGLE' if kind == 'eagle' else 'model'} config ({e})") from None


def _check_dtypes(path: str, weights: dict, int_keys=("token_map",)) -> None:
    """Weights are floating point and ``int_keys`` integer: an integer array would be cast to
    float32 as if it were a weight, a float token map truncated to ids."""
    for k, v in weights.items():
        want_int = k in int_keys
        ok = np.issubdtype(v.dtype, np.integer) if want_int else np.issubdtype(v.dtype, np.floating)
        if not ok:
            raise DraftFileError(f"draft file {path}: tensor {k!r} has dtype {v.dtype}, expected "
                                 f"{'integer token ids' if want_int else 'floating point weights'}")


def _check_shapes(path: str, got: dict, expected: dict) -> None:
    """Every expected tensor present with its shape, nothing else."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise DraftFileError(f"draft file {path}: tensors missing {missing}, unexpected {extra}")
    for k, shape in expected.items():
        if tuple(np.shape(got[k])) != tuple(shape):
            raise DraftFileError(f"draft file {path}: tensor {k!r} has shape {tuple(np.shape(got[k]))}, "
                                 f"its config needs {tuple(shape)}")


def load_draft_model(path: str, target, param_dtype: str = "auto"):
    """The draft model in a file: an ``EagleModel`` or a ``LlamaLM`` (checked against the target).

    ``param_dtype`` (EAGLE heads): ``"auto"`` keeps weights stored in float16 as float16 (the
    same values; the CPU matmul kernel reads them as they are, streaming half the bytes, and
    computes in float32), otherwise the file's config; or a dtype name. A draft's numerics
    change only its q, which the verifier uses as it is: the output law stays the target's."""
    from specjax.models.base import embedding_weights
    from specjax.models.eagle import EagleConfig, EagleModel, trainable_shapes
    from specjax.models.llama import LlamaLM, check_weights

    meta, w = read_draft(path, upcast=False)
    kind = meta.get("kind")
    cfg = _draft_config(meta, path)
    _check_dtypes(path, w, ("token_map",) if kind == "eagle" else ())
    if kind == "eagle":
        c = dict(meta["config"])
        expected = trainable_shapes(cfg)
        if c.get("vocab_subset"):
            expected["token_map"] = (c["vocab_subset"],)
        _check_shapes(path, w, expected)
        floats = [v for v in w.values() if np.issubdtype(v.dtype, np.floating)]
        if param_dtype == "auto":
            if floats and all(v.dtype == np.float16 for v in floats):
                c["param_dtype"] = "float16"
        else:
            c["param_dtype"] = param_dtype
        cfg = EagleConfig.from_dict(c)
        tm = w.pop("token_map", None)
        try:
            return EagleModel.for_target(target, cfg, trainable=w, token_map=tm)
        except ValueError as e:  # a token map of ids outside the vocabulary, a head for another target
            raise DraftFileError(f"draft file {path}: {e}") from None
    w = _float32(w)
    if kind == "llama":
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocabulary V={cfg.vocab_size} does not match the target's "
                             f"V={target.vocab_size}")
        if meta.get("info", {}).get("embed_from_target") or "embed" not in w:
            tw = embedding_weights(target)
            w["embed"] = tw["embed"]
            if not cfg.tie_embeddings and "lm_head" not in w:
                w["lm_head"] = tw.get("lm_head", tw["embed"])
        try:
            check_weights(cfg, w, source=f"draft file {path}")
        except ValueError as e:  # before any weight is placed; the target's embedding included
            raise DraftFileError(str(e)) from None
        return LlamaLM.from_weights(cfg, w)
    raise DraftFileError(f"draft file {path}: unknown draft kind {kind!r}")
