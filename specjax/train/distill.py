"""Training drafts the target accepts: on-policy data, distillation, checkpoints, evaluation.

``scripts/train_draft.py CONFIG.yaml`` runs :func:`train`. Everything is a pure function of
the config (and its ``seed``): model init, the data (sampled from the target with the
project's own batched decoding, :func:`specjax.build.generate_autoregressive`), the data
order (a permutation per epoch from ``(seed, epoch)``, so the batch of step i is a function
of i) and the loss curve.

Data (paid once, cached as npz under ``data.cache_dir`` keyed by a hash of the target and
data settings): prompts -> on-policy continuations -> ONE teacher-forced target forward per
sequence, storing at every position the target's top-k probabilities (temperature 1) and
its final hidden states (float16 for training; float32 for the held-out split, whose exact
target law is recomputed from them as ``softmax(h @ head.T)``). For an EAGLE-3 head
(``draft.feature_layers``) the same forward also returns those layers' hidden states,
stored concatenated as ``features`` (float16 / float32 likewise; the training split then
keeps no final hidden states, which nothing reads); the layers are part of the cache key.

Draft kinds: ``independent`` (a small Llama, own embedding), ``target_init`` (the target's
first N layers + its embedding / head, frozen or not), ``eagle`` (:mod:`specjax.models.eagle`;
EAGLE-1/2 style, or EAGLE-3 style with ``draft.feature_layers``: hidden-state indices of
the target, :func:`specjax.models.base.hidden_indices`).
Losses (weights in ``train.losses``): ``fkl`` forward KL (cross-entropy to the top-k),
``rkl`` reverse KL (the mass outside the top-k spread uniformly), ``tv`` (1 - sum_k
min(p, q), i.e. 1 - alpha over the top-k), ``hidden`` (smooth-L1 to the target's next hidden
state, EAGLE-1/2 heads only: an EAGLE-3 head's output has no single target feature to
match). EAGLE heads train draft positions 1..``unroll`` (fed their own output features
after the first, as in decoding: EAGLE-3's "training-time test"), with the token loss at
every position.

Only positions whose next token was GENERATED are trained (unless ``train.prompt_positions``)
and evaluated: the chat template / system prompt is nearly free to predict and would
inflate alpha. Evaluation on the held-out split: the exact overlap alpha = sum_x min(p, q) at temperature
1 and greedy agreement (argmax q == argmax p, the acceptance at temperature 0), per draft
position (EAGLE: positions 1..eval_positions along its own feature chain; token-only drafts
see teacher-forced tokens, so one number serves every position).

Checkpoints: orbax, every ``ckpt_every`` steps and at the end; a restarted run resumes from
the latest and ends with the same parameters as an uninterrupted one. Asking for fewer steps
than are checkpointed is refused; rerunning a finished run keeps its recorded results.
Relative paths in a training config (prompts, cache_dir, out_dir) are from the repository root.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.configs import CONFIG_ROOT, load_config as load_yaml_config, read_yaml

REPO = str(CONFIG_ROOT.parent)  # relative data paths in training configs are from here
LOSSES = ("fkl", "rkl", "tv", "hidden")
KINDS = ("independent", "target_init", "eagle")


class ConfigError(ValueError):
    pass


# --------------------------------------------------------------------------------------
# config


def _strict(cls, d: Optional[Mapping], where: str):
    if d is not None and not isinstance(d, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {d!r}")
    d = dict(d or {})
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(d) - names)
    if extra:
        raise ConfigError(f"{where}: unknown keys {extra} (expected some of {sorted(names)})")
    try:
        return cls(**d)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e


def _check(cond, msg):
    if not cond:
        raise ConfigError(msg)


def _int(v, name, lo=None):
    _check(isinstance(v, int) and not isinstance(v, bool), f"{name} must be an integer, got {v!r}")
    if lo is not None:
        _check(v >= lo, f"{name} must be >= {lo}, got {v}")


SEED_LIMIT = 2 ** 32  # model init keys keep 32 bits of a seed (jax.random.key): larger ones would collide


def _seed(v, name):
    _int(v, name, 0)
    _check(v < SEED_LIMIT, f"{name} must be < 2**32, got {v}")


def _str(v, name):
    _check(isinstance(v, str) and v != "", f"{name} must be a non-empty string, got {v!r}")


def _bool(v, name):
    _check(isinstance(v, bool), f"{name} must be true or false, got {v!r}")


def _num(v, name, lo=None, hi=None, lo_open=False):
    _check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
           f"{name} must be a finite number, got {v!r}")
    if lo is not None:
        _check(v > lo if lo_open else v >= lo, f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None:
        _check(v <= hi, f"{name} must be <= {hi}, got {v}")


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    kind: str = "default"  # default (SmolLM2-135M-Instruct GGUF) | tiny (random tiny Llama)
    config: Optional[dict] = None  # tiny: specjax.models.llama.tiny_config arguments
    seed: int = 0  # tiny: init seed
    # default: LlamaConfig overrides for the run (e.g. {scan_layers: true}: one compiled layer
    # body, which compiles far faster on an accelerator; same weights, same law)
    overrides: Optional[dict] = None

    def __post_init__(self):
        _check(self.kind in ("default", "tiny"), f"target.kind must be 'default' or 'tiny', got {self.kind!r}")
        _seed(self.seed, "target.seed")
        _check(self.overrides is None or isinstance(self.overrides, dict), "target.overrides must be a mapping")
        if self.overrides:
            from specjax.models.llama import LlamaConfig

            names = {f.name for f in dataclasses.fields(LlamaConfig)}
            bad = sorted(set(self.overrides) - (names - {"vocab_size", "dim", "n_layers", "n_heads",
                                                         "n_kv_heads", "head_dim", "ffn_dim"}))
            _check(not bad, f"target.overrides: not a run setting of LlamaConfig: {bad}")
        if self.kind == "tiny":
            _check(isinstance(self.config, dict), "target.config (a dict) is needed for a tiny target")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    prompts: Any = "configs/train/prompts_train.txt"  # a path or a list of paths
    heldout: Any = "configs/train/prompts_heldout.txt"
    prompt_format: str = "chat"  # chat (user message in the chat template) | raw | ids
    max_prompts: int = 0  # 0: all
    max_heldout: int = 0
    samples_per_prompt: int = 1
    max_new_tokens: int = 128
    gen_batch: int = 32
    teacher_batch: int = 4
    temperature: float = 1.0
    topk: int = 32
    cache_dir: str = "data_cache/train"

    def __post_init__(self):
        _check(self.prompt_format in ("chat", "raw", "ids"),
               f"data.prompt_format must be chat, raw or ids, got {self.prompt_format!r}")
        for f in ("max_prompts", "max_heldout"):
            _int(getattr(self, f), f"data.{f}", 0)
        for f in ("samples_per_prompt", "max_new_tokens", "gen_batch", "teacher_batch", "topk"):
            _int(getattr(self, f), f"data.{f}", 1)
        _num(self.temperature, "data.temperature", 0.0)
        _str(self.cache_dir, "data.cache_dir")
        for f in ("prompts", "heldout"):
            v = getattr(self, f)
            if isinstance(v, (list, tuple)):
                _check(len(v) > 0 and all(isinstance(x, str) and x for x in v),
                       f"data.{f} must be a path or a non-empty list of paths, got {v!r}")
                object.__setattr__(self, f, tuple(v))
            else:
                _check(isinstance(v, str) and v, f"data.{f} must be a path or a list of paths")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    kind: str = "eagle"
    n_layers: int = 1  # eagle / target_init: layers (independent: config.n_layers)
    config: Optional[dict] = None  # independent: LlamaConfig fields; eagle: EagleConfig overrides
    freeze_embed: bool = True  # target_init: keep the target's embedding / head fixed
    vocab_subset: int = 0  # eagle: score only the most frequent tokens (0: all)
    # eagle: random | random_fc (fc not "copy the feature") | target_last (the head's layer
    # starts as the target's last; EAGLE-3: on the feature half of q/k/v, and out_norm as the
    # target's final norm)
    init: str = "random"
    # eagle: [] an EAGLE-1/2 head (the target's final hidden states); hidden-state indices
    # (0: embeddings, i: after layer i, L: after the final norm) for an EAGLE-3 head
    feature_layers: Optional[list] = None

    def __post_init__(self):
        _check(self.kind in KINDS, f"draft.kind must be one of {KINDS}, got {self.kind!r}")
        _int(self.n_layers, "draft.n_layers", 1)
        _int(self.vocab_subset, "draft.vocab_subset", 0)
        fl = self.feature_layers
        _check(fl is None or isinstance(fl, (list, tuple)), "draft.feature_layers must be a list of layer indices")
        for i in fl or ():
            _int(i, "draft.feature_layers[]", 0)
        _check(len(set(fl or ())) == len(fl or ()), f"draft.feature_layers has a repeated index: {fl}")
        object.__setattr__(self, "feature_layers", list(fl or []))
        _check(isinstance(self.freeze_embed, bool), "draft.freeze_embed must be true or false")
        _check(self.init in ("random", "random_fc", "target_last"),
               f"draft.init must be random, random_fc or target_last, got {self.init!r}")
        if self.kind == "independent":
            _check(isinstance(self.config, dict), "an independent draft needs draft.config (LlamaConfig fields)")
        _check(self.config is None or isinstance(self.config, dict), "draft.config must be a mapping")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 8
    lr: float = 1e-3
    warmup: int = 20
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    losses: Optional[dict] = None  # {fkl, rkl, tv, hidden}: weights
    unroll: int = 2  # eagle: draft positions trained
    eval_every: int = 50
    eval_positions: int = 4
    eval_batch: int = 2
    ckpt_every: int = 50
    log_every: int = 10
    prompt_positions: bool = False  # also train on prompt positions (never evaluated)
    out_dir: str = "runs/draft"
    progress: bool = True
    export_dtype: str = "float32"  # float32 | float16: the exported draft file's weights

    def __post_init__(self):
        for f in ("steps", "batch_size", "unroll", "eval_every", "eval_positions", "eval_batch",
                  "ckpt_every", "log_every"):
            _int(getattr(self, f), f"train.{f}", 1)
        _int(self.warmup, "train.warmup", 0)
        _check(self.warmup < self.steps, f"train.warmup ({self.warmup}) must be < train.steps ({self.steps})")
        _num(self.lr, "train.lr", 0.0, lo_open=True)
        _num(self.end_lr_ratio, "train.end_lr_ratio", 0.0, 1.0)
        _num(self.weight_decay, "train.weight_decay", 0.0)
        _num(self.clip, "train.clip", 0.0, lo_open=True)
        _check(self.export_dtype in ("float32", "float16"),
               f"train.export_dtype must be float32 or float16, got {self.export_dtype!r}")
        _str(self.out_dir, "train.out_dir")
        _bool(self.progress, "train.progress")
        _bool(self.prompt_positions, "train.prompt_positions")
        _check(self.losses is None or isinstance(self.losses, Mapping),
               f"train.losses must be a mapping of loss weights, got {self.losses!r}")
        losses = dict(self.losses or {"fkl": 1.0})
        bad = sorted(set(losses) - set(LOSSES))
        _check(not bad, f"train.losses: unknown losses {bad} (known: {list(LOSSES)})")
        for k, v in losses.items():
            _num(v, f"train.losses.{k}", 0.0)
        _check(any(v > 0 for k, v in losses.items() if k != "hidden"),
               "train.losses needs a positive weight on fkl, rkl or tv")
        object.__setattr__(self, "losses", losses)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    seed: int
    target: TargetSpec
    data: DataConfig
    draft: DraftConfig
    train: TrainConfig

    def to_dict(self):
        return dataclasses.asdict(self)


def _target_config_value(spec: TargetSpec, name: str) -> int:
    if spec.kind == "tiny":
        from specjax.models.llama import tiny_config

        return getattr(tiny_config(**spec.config), name)
    return int(load_yaml_config("smollm2-135m", "models")[0]["config"][name])


def target_vocab(spec: TargetSpec) -> int:
    return _target_config_value(spec, "vocab_size")


def _target_llama_config(spec: TargetSpec):
    """The target's LlamaConfig from its spec alone (no weights loaded)."""
    from specjax.models.llama import LlamaConfig, tiny_config

    if spec.kind == "tiny":
        return tiny_config(**spec.config)
    return LlamaConfig(**load_yaml_config("smollm2-135m", "models")[0]["config"])


def _check_draft_shape(cfg: "RunConfig", v: int) -> None:
    """What :func:`build_draft` would refuse (or silently override) after the data is paid
    for, refused here: a target_init draft deeper than the target, ``draft.config`` where it
    is not read, EAGLE overrides that are not EagleConfig fields, that ``draft.n_layers`` /
    ``draft.vocab_subset`` set, or that do not fit the target."""
    dr = cfg.draft
    dc = dr.config or {}
    if dr.kind == "target_init":
        nl = _target_config_value(cfg.target, "n_layers")
        if dr.n_layers > nl:
            raise ConfigError(f"draft.n_layers={dr.n_layers} exceeds the target's {nl} layers")
        if dr.config is not None:
            raise ConfigError("draft.config is not read by a target_init draft (its layers are the target's): "
                              "remove it")
    if dr.kind != "eagle":
        return
    from specjax.models.eagle import EagleConfig

    fields = {f.name for f in dataclasses.fields(EagleConfig)}
    bad = sorted(set(dc) - fields)
    if bad:
        raise ConfigError(f"draft.config: unknown EagleConfig fields {bad}")
    for k, where in (("n_layers", "draft.n_layers"), ("vocab_subset", "draft.vocab_subset")):
        if k in dc:
            raise ConfigError(f"set {where}, not draft.config.{k} (draft.config.{k} would be ignored)")
    try:
        tcfg = _target_llama_config(cfg.target)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"target.config: {e}") from None
    if "dim" in dc and dc["dim"] != tcfg.dim:
        raise ConfigError(f"draft.config.dim={dc['dim']}: an EAGLE head has the target's width {tcfg.dim}")
    try:
        EagleConfig.for_target(tcfg, **dict(dc, n_layers=dr.n_layers, vocab_subset=dr.vocab_subset,
                                            feature_layers=tuple(dr.feature_layers)))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"draft.config: {e}") from None


def _check_prompt_files(cfg: "RunConfig", v: int) -> None:
    """Both splits have prompts (training ones left after the held-out ones are removed), and
    ``prompt_format: ids`` lines are token ids in [0, V) (an id past the vocabulary would be
    clamped by the embedding lookup into another token, silently)."""
    dc = cfg.data
    held = prompt_lines(dc.heldout)
    train_lines = training_lines(dc)[0]
    if not held:
        raise ConfigError("data.heldout: no prompts (every line is empty or a # comment)")
    if not train_lines:
        raise ConfigError("data.prompts: no prompts left (empty, or every one is also a held-out prompt)")
    if dc.prompt_format != "ids":
        return
    for f, lines in (("prompts", train_lines), ("heldout", held)):
        for ln in lines:
            try:
                ids = [int(t) for t in ln.split()]
            except ValueError:
                raise ConfigError(f"data.{f}: prompt_format ids needs whitespace-separated token ids, got "
                                  f"{ln[:60]!r}") from None
            bad = [t for t in ids if not 0 <= t < v]
            if bad:
                raise ConfigError(f"data.{f}: token id {bad[0]} outside the target's vocabulary [0, {v}) "
                                  f"in {ln[:60]!r}")


def load_config(src) -> RunConfig:
    """A RunConfig from a YAML path or a dict; every bad value fails here, before any work."""
    if isinstance(src, (str, os.PathLike)):
        try:
            d = read_yaml(src)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif isinstance(src, Mapping):
        d = dict(src)
    else:
        raise ConfigError("the training config must be a mapping")
    extra = sorted(set(d) - {"seed", "target", "data", "draft", "train"})
    if extra:
        raise ConfigError(f"unknown top-level keys {extra}")
    seed = d.get("seed", 0)
    _seed(seed, "seed")
    cfg = RunConfig(
        seed=seed,
        target=_strict(TargetSpec, d.get("target"), "target"),
        data=_strict(DataConfig, d.get("data"), "data"),
        draft=_strict(DraftConfig, d.get("draft"), "draft"),
        train=_strict(TrainConfig, d.get("train"), "train"),
    )
    try:
        v = target_vocab(cfg.target)
    except (TypeError, ValueError) as e:  # a tiny target's config: unknown or bad fields
        raise ConfigError(f"target.config: {e}") from None
    dc = cfg.draft.config or {}
    if "vocab_size" in dc and dc["vocab_size"] != v:
        raise ConfigError(f"vocabulary mismatch: the draft has V={dc['vocab_size']}, the target V={v}")
    if cfg.data.topk > v:
        raise ConfigError(f"data.topk={cfg.data.topk} exceeds the target's V={v}")
    if cfg.draft.vocab_subset > v:
        raise ConfigError(f"draft.vocab_subset={cfg.draft.vocab_subset} exceeds the target's V={v}")
    if cfg.draft.kind != "eagle" and cfg.draft.vocab_subset:
        raise ConfigError("draft.vocab_subset is only for eagle heads")
    if cfg.draft.kind != "eagle" and cfg.train.losses.get("hidden", 0) > 0:
        raise ConfigError("the hidden-state loss needs a feature draft (draft.kind: eagle)")
    if cfg.draft.feature_layers:
        if cfg.draft.kind != "eagle":
            raise ConfigError("draft.feature_layers is only for eagle heads")
        if cfg.train.losses.get("hidden", 0) > 0:
            raise ConfigError("the hidden-state loss is for EAGLE-1/2 heads: an EAGLE-3 head "
                              "(draft.feature_layers) has no single target feature to match")
        nl = _target_config_value(cfg.target, "n_layers")
        bad = [i for i in cfg.draft.feature_layers if i > nl]
        if bad:
            raise ConfigError(f"draft.feature_layers {bad} exceed the target's hidden-state indices "
                              f"0..{nl} ({nl} layers)")
    if "feature_layers" in dc:
        raise ConfigError("set the EAGLE-3 layers with draft.feature_layers, not draft.config")
    for f in ("prompts", "heldout"):
        for p in map(_path, _files(getattr(cfg.data, f))):
            if not os.path.isfile(p):
                raise ConfigError(f"data.{f}: no such file {p}")
    same = ({os.path.abspath(_path(p)) for p in _files(cfg.data.prompts)}
            & {os.path.abspath(_path(p)) for p in _files(cfg.data.heldout)})
    if same:
        raise ConfigError(f"data.prompts and data.heldout must be different files ({sorted(same)[0]} is in both)")
    if cfg.draft.kind == "independent":
        from specjax.models.llama import LlamaConfig

        try:
            LlamaConfig(**dict(dc, vocab_size=v))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"draft.config: {e}") from e
    _check_draft_shape(cfg, v)
    _check_prompt_files(cfg, v)
    return cfg


def _path(p):
    return p if os.path.isabs(p) else os.path.join(REPO, p)


# --------------------------------------------------------------------------------------
# target and prompts


def load_target(spec: TargetSpec):
    """(LlamaLM, tokenizer or None)."""
    from specjax.models.llama import LlamaLM, tiny_config

    if spec.kind == "tiny":
        return LlamaLM.init(tiny_config(**spec.config), seed=spec.seed), None
    from specjax.build import load_target as load_run_target

    lm, tok, _ = load_run_target("default", **(spec.overrides or {}))
    return lm, tok


def _files(src) -> tuple:
    """A prompt source (``data.prompts`` / ``data.heldout``): one path or a list of paths."""
    return (src,) if isinstance(src, str) else tuple(src)


def prompt_lines(src) -> list:
    """The prompts of one file or of several (concatenated in order): one per non-empty
    line; lines starting with ``#`` are comments (as in the benchmark's prompt files)."""
    lines = []
    for path in _files(src):
        with open(_path(path), encoding="utf-8") as f:
            lines += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return lines


def _same_text(line: str) -> str:
    return " ".join(line.lower().split())


def training_lines(dc: "DataConfig") -> tuple:
    """The training prompts without any that is also a held-out prompt (compared ignoring
    case and spacing), and how many were dropped: held-out alpha must measure prompts the
    head never saw."""
    held = {_same_text(x) for x in prompt_lines(dc.heldout)}
    lines = prompt_lines(dc.prompts)
    kept = [x for x in lines if _same_text(x) not in held]
    return kept, len(lines) - len(kept)


def read_prompts(path, fmt, tok, limit=0, lines=None):
    """Token ids of the prompts of ``path`` (one file or a list: :func:`prompt_lines`;
    ``lines``: these texts instead), the first ``limit`` if given, in ``fmt``."""
    lines = prompt_lines(path) if lines is None else list(lines)
    if limit:
        lines = lines[:limit]
    if fmt == "ids":
        return [[int(t) for t in ln.split()] for ln in lines]
    if tok is None:
        raise ConfigError(f"prompt_format {fmt!r} needs a tokenizer (the default target)")
    if fmt == "raw":
        return [tok.encode(ln) for ln in lines]
    return [tok.encode_user(ln) for ln in lines]


# --------------------------------------------------------------------------------------
# data


def feature_layers(cfg: RunConfig) -> Optional[tuple]:
    """The target hidden states an EAGLE-3 draft reads (None for every other draft)."""
    return tuple(cfg.draft.feature_layers) if cfg.draft.kind == "eagle" and cfg.draft.feature_layers else None


def _data_key(cfg: RunConfig, split: str, text_only: bool = False) -> str:
    """The cache key of a split's data; ``text_only``: of its generated sequences alone (the
    same for every feature set: an EAGLE-1 and an EAGLE-3 run share the on-policy text)."""
    d = dataclasses.asdict(cfg.data)
    d.pop("cache_dir")
    d.pop("teacher_batch")
    d.pop("gen_batch")  # rows are keyed by their index, not their batch: same data
    for f in ("prompts", "heldout"):
        shas = []
        for path in _files(d[f]):
            with open(_path(path), "rb") as fh:
                shas.append(hashlib.sha256(fh.read()).hexdigest())
        d[f + "_sha"] = shas[0] if isinstance(d[f], str) else shas  # one file: keys as before
        d.pop(f)
    if split == "train":
        dropped = training_lines(cfg.data)[1]
        if dropped:  # prompts that are also held out are left out (keys without any: as before)
            d["heldout_excluded"] = dropped
    tgt = dataclasses.asdict(cfg.target)
    if not tgt["overrides"]:
        tgt.pop("overrides")  # keys of configs written before the field existed stay valid
    key = dict(target=tgt, data=d, seed=cfg.seed, split=split, version=1)
    if feature_layers(cfg) and not text_only:  # EAGLE-3 data also holds these layers (other keys unchanged)
        key["features"] = list(feature_layers(cfg))
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _pad64(n) -> int:
    """``n`` rounded up to a multiple of 64: sequence lengths come in a few shapes only."""
    return int(math.ceil(int(n) / 64) * 64)


def _teacher_fn(target, topk, layers=None):
    """One forward: (top-k probabilities, their tokens, final hidden states, the hidden
    states of ``layers`` concatenated or None)."""
    want = True if not layers else tuple(layers) + (target.config.n_layers,)

    def f(params, toks):
        b, t = toks.shape
        out = target.apply(params, toks, target.init_cache(b, t), return_hidden=want)
        lp = jax.nn.log_softmax(out.logits, axis=-1)
        v, i = jax.lax.top_k(lp, topk)
        if not layers:
            return jnp.exp(v), i.astype(jnp.int32), out.hidden, None
        d = target.config.dim
        return jnp.exp(v), i.astype(jnp.int32), out.hidden[..., -d:], out.hidden[..., :-d]

    return jax.jit(f)


def _generate(cfg: RunConfig, split: str, target, tok, log, t0) -> tuple:
    """The split's on-policy sequences (prompt + continuation), as ``tokens`` [n, T] (T a
    multiple of 64, zero-padded), ``lengths`` [n] and ``prompt_lens`` [n]."""
    from specjax import sampling
    from specjax.build import generate_autoregressive

    dc = cfg.data
    if split == "train":
        lines, dropped = training_lines(dc)
        if dropped:
            log(f"[data] train: left out {dropped} prompts that are also held out")
        prompts = read_prompts(dc.prompts, dc.prompt_format, tok, dc.max_prompts, lines=lines)
    else:
        prompts = read_prompts(dc.heldout, dc.prompt_format, tok, dc.max_heldout)
    rows = [(i, r) for i in range(len(prompts)) for r in range(dc.samples_per_prompt)]
    stops = list(tok.stop_ids) if tok is not None else None
    offset = 0 if split == "train" else 1 << 24  # held-out rows get keys of their own
    sp = sampling.SamplingConfig(temperature=float(dc.temperature))
    seqs, plens = [], []
    for s in range(0, len(rows), dc.gen_batch):
        chunk = rows[s:s + dc.gen_batch]
        idx = [offset + i * dc.samples_per_prompt + r for i, r in chunk]
        pr = [prompts[i] for i, _ in chunk]
        out = generate_autoregressive(target, pr, seed=cfg.seed, row_indices=idx, sampling_params=sp,
                                             max_new_tokens=dc.max_new_tokens, stop_tokens=stops)
        for p, g in zip(pr, out.tokens):
            seqs.append(list(p) + list(g))
            plens.append(len(p))
        log(f"[data] {split}: generated {s + len(chunk)}/{len(rows)} rows, "
            f"{sum(len(x) - p for x, p in zip(seqs, plens))} new tokens, {time.time() - t0:.0f}s")
    lengths = np.array([len(x) for x in seqs], np.int32)
    toks = np.zeros((len(seqs), _pad64(lengths.max())), np.int32)  # batches are cropped to multiples of 64 anyway
    for i, x in enumerate(seqs):
        toks[i, :len(x)] = x
    return toks, lengths, np.array(plens, np.int32)


def _save_npz(path: str, arrays: dict) -> None:
    """Write ``arrays`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def build_data(cfg: RunConfig, split: str, target, tok, log=print) -> dict:
    """Generate (or load from the cache) the on-policy data of one split ('train'/'heldout').
    The generated text is also cached on its own (``*.text.npz``, keyed without the feature
    layers), so a run for another feature set pays only the teacher forward."""
    dc = cfg.data
    key = _data_key(cfg, split)
    cache_dir = _path(dc.cache_dir)
    path = os.path.join(cache_dir, f"{split}-{key}.npz")
    if os.path.isfile(path):
        with np.load(path) as f:
            data = {k: f[k] for k in f.files}
        data["cached"] = True
        log(f"[data] {split}: loaded {path} ({int(data['lengths'].sum())} tokens)")
        return data
    t0 = time.time()
    os.makedirs(cache_dir, exist_ok=True)
    text_path = os.path.join(cache_dir, f"{split}-{_data_key(cfg, split, text_only=True)}.text.npz")
    if os.path.isfile(text_path):  # the same on-policy text, generated for another feature set
        with np.load(text_path) as f:
            toks, lengths, plens = f["tokens"], f["lengths"], f["prompt_lens"]
        log(f"[data] {split}: {len(lengths)} generated rows from {text_path}")
    else:
        toks, lengths, plens = _generate(cfg, split, target, tok, log, t0)
        _save_npz(text_path, dict(tokens=toks, lengths=lengths, prompt_lens=plens))
    n, T = toks.shape
    layers = feature_layers(cfg)
    fn = _teacher_fn(target, dc.topk, layers)
    D = target.config.dim
    hdt = np.float16 if split == "train" else np.float32
    tp = np.zeros((n, T, dc.topk), np.float32)
    ti = np.zeros((n, T, dc.topk), np.int32)
    # the final hidden states: the held-out law, the EAGLE-1/2 input and hidden loss
    # (an EAGLE-3 run's training split does without them)
    hid = None if layers and split == "train" else np.zeros((n, T, D), hdt)
    feats = np.zeros((n, T, len(layers) * D), hdt) if layers else None
    tb = dc.teacher_batch
    order = np.argsort(lengths, kind="stable")  # similar lengths together: little padding
    for s in range(0, n, tb):
        rows_b = order[s:s + tb]
        tlen = min(T, _pad64(lengths[rows_b].max()))  # few shapes to compile
        blk = toks[rows_b, :tlen]
        pad = tb - blk.shape[0]
        if pad:
            blk = np.concatenate([blk, np.zeros((pad, tlen), np.int32)])
        p, i, h, f = jax.device_get(fn(target.params, jnp.asarray(blk)))
        m = tb - pad
        tp[rows_b, :tlen], ti[rows_b, :tlen] = p[:m], i[:m]
        if hid is not None:
            hid[rows_b, :tlen] = h[:m].astype(hdt)
        if feats is not None:
            f = f[:m].astype(hdt)
            if not np.isfinite(f).all():
                raise RuntimeError(f"hidden states of layers {list(layers)} overflow {np.dtype(hdt).name}")
            feats[rows_b, :tlen] = f
    data = dict(tokens=toks, lengths=lengths, prompt_lens=plens, topk_p=tp, topk_idx=ti)
    if hid is not None:
        data["hidden"] = hid
    if feats is not None:
        data["features"] = feats
    _save_npz(path, data)
    log(f"[data] {split}: {n} rows, {int(lengths.sum())} tokens "
        f"({int((lengths - plens).sum())} generated) in {time.time() - t0:.0f}s -> {path}")
    data["cached"] = False
    return data


def token_frequencies(data, vocab_size) -> np.ndarray:
    """Expected next-token counts under the target (top-k mass) plus observed tokens."""
    valid = np.arange(data["tokens"].shape[1])[None, :] < data["lengths"][:, None]
    f = np.bincount(data["topk_idx"][valid].ravel(), weights=data["topk_p"][valid].ravel(),
                    minlength=vocab_size)
    f += np.bincount(data["tokens"][valid].ravel(), minlength=vocab_size)
    return f


# --------------------------------------------------------------------------------------
# drafts


@dataclasses.dataclass
class Draft:
    """A draft in trainable form: ``forward(trainable, batch, n_steps)`` is pure."""

    kind: str
    graphdef: Any
    frozen: Any
    trainable: Any
    config: Any
    head: Any  # target head [V, D] (eval: p = softmax(h @ head.T))
    inv_map: Optional[np.ndarray]  # eagle subset: token -> subset index (-1 outside)
    token_map: Optional[np.ndarray]

    @property
    def eagle3(self) -> bool:
        return self.kind == "eagle" and self.config.eagle3

    @property
    def feature_key(self) -> Optional[str]:
        """The data entry the draft reads beside the tokens (None: tokens only)."""
        if self.kind != "eagle":
            return None
        return "features" if self.eagle3 else "hidden"

    def module(self, trainable=None):
        from flax import nnx

        return nnx.merge(self.graphdef, self.frozen, self.trainable if trainable is None else trainable)


def build_draft(cfg: RunConfig, target, train_data) -> Draft:
    from flax import nnx

    from specjax.models.eagle import EagleConfig, EagleModel, Frozen, random_trainable
    from specjax.models.llama import LlamaConfig, LlamaLM

    dr = cfg.draft
    tcfg = target.config
    tw = target.canonical_weights()
    head = tw["embed"] if tcfg.tie_embeddings else tw["lm_head"]
    inv = tm = None
    if dr.kind == "eagle":
        over = dict(dr.config or {})
        over["n_layers"] = dr.n_layers
        over["vocab_subset"] = dr.vocab_subset
        over["feature_layers"] = tuple(dr.feature_layers)
        ecfg = EagleConfig.for_target(tcfg, **over)
        if dr.vocab_subset:
            freq = token_frequencies(train_data, tcfg.vocab_size)
            order = np.argsort(-freq, kind="stable")
            tm = np.sort(order[: dr.vocab_subset]).astype(np.int32)
            inv = np.full((tcfg.vocab_size,), -1, np.int32)
            inv[tm] = np.arange(tm.size, dtype=np.int32)
        trainable = random_trainable(ecfg, cfg.seed, copy_feature=dr.init != "random_fc")
        if dr.init == "target_last":
            for k in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"):
                src = tw[k][-1:]
                if ecfg.eagle3 and k in ("wq", "wk", "wv"):
                    # EAGLE-3 attention reads [embedding, feature]: the target's layer on the
                    # feature half, the random start on the embedding half
                    src = np.concatenate([trainable[k][:1, :, :tcfg.dim], src], axis=-1)
                if src.shape[1:] != trainable[k].shape[1:]:
                    raise ConfigError(f"draft.init=target_last needs the target's layer shapes ({k})")
                trainable[k] = np.repeat(src, dr.n_layers, axis=0)
            if ecfg.eagle3:  # the output is read like the target's last residual stream
                trainable["out_norm"] = np.asarray(tw["final_norm"], np.float32).copy()
        model = EagleModel.for_target(target, ecfg, trainable=trainable, token_map=tm)
        module = model.module()
        graphdef, frozen, params = nnx.split(module, Frozen, nnx.Param)
        return Draft("eagle", graphdef, frozen, params, ecfg, head, inv, tm)
    if dr.kind == "independent":
        lcfg = LlamaConfig(**dict(dr.config, vocab_size=tcfg.vocab_size))
        lm = LlamaLM.init(lcfg, seed=cfg.seed)
        freeze = lambda path, x: False  # noqa: E731
    else:
        n = dr.n_layers
        if n > tcfg.n_layers:
            raise ConfigError(f"draft.n_layers={n} exceeds the target's {tcfg.n_layers} layers")
        lcfg = tcfg.replace(n_layers=n, name="draft", weight_blocks=False)  # trained: float32 weights
        w = {k: (v[:n] if k not in ("embed", "lm_head", "final_norm") else v) for k, v in tw.items()}
        lm = LlamaLM.from_weights(lcfg, w)
        frozen_names = ("embed", "lm_head") if dr.freeze_embed else ()
        freeze = lambda path, x: any(str(p) in frozen_names for p in path)  # noqa: E731
    module = lm.module()
    graphdef, frozen, params = nnx.split(module, freeze, nnx.Param)
    return Draft(dr.kind, graphdef, frozen, params, lcfg, head, None, None)


def export_draft(cfg: RunConfig, draft: Draft, path: str, info: dict) -> None:
    from specjax.drafts.files import save_draft
    from specjax.models.llama import LAYOUT_FIELDS

    m = draft.module()
    dt = cfg.train.export_dtype
    if draft.kind == "eagle":
        w = dict(m.trainable_weights())
        if draft.token_map is not None:
            w["token_map"] = draft.token_map
        save_draft(path, "eagle", draft.config.to_dict(), w, info, dtype=dt)
        return
    w = m.canonical_weights()
    info = dict(info)
    if draft.kind == "target_init" and cfg.draft.freeze_embed:
        w.pop("embed", None)
        w.pop("lm_head", None)
        info["embed_from_target"] = True
    c = dataclasses.asdict(draft.config)
    c.update(dict.fromkeys(LAYOUT_FIELDS, "auto"))  # the loading machine's layouts, not this one's
    save_draft(path, "llama", c, w, info, dtype=dt)


def _forward(draft: Draft, trainable, tokens, hidden, n_steps):
    """-> (logq [S, B, T, Vq] log-probs, the head's output features [S, B, T, D] or None).

    ``hidden``: the data entry ``draft.feature_key`` (EAGLE heads). Entry (j, b, t) is the
    draft law of token s[t+1] at draft position j+1."""
    m = draft.module(trainable)
    if draft.kind == "eagle":
        nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        out = m.unrolled(hidden.astype(jnp.float32), nxt, n_steps)  # predicts h_{p+1}
        # re-index so that entry t is the law of s[t+1] (the prediction made at p = t-1)
        out = jnp.concatenate([jnp.zeros_like(out[:, :, :1]), out[:, :, :-1]], axis=2)
        return jax.nn.log_softmax(m.logits(out), axis=-1), out
    from specjax.models.base import KVCache  # noqa: F401

    b, t = tokens.shape
    cfg = draft.config
    shape = (cfg.n_layers, b, cfg.n_kv_heads, t, cfg.head_dim)
    cache = KVCache(k=jnp.zeros(shape, cfg.compute_dtype), v=jnp.zeros(shape, cfg.compute_dtype),
                    lengths=jnp.zeros((b,), jnp.int32))
    lg = m(tokens, cache).logits
    return jax.nn.log_softmax(lg, axis=-1)[None], None


def _valid(lengths, plens, t, n_steps, eagle, prompt_positions=False):
    """[S, B, T]: entry t (law of s[t+1]) is trained / evaluated at draft position j+1.

    Positions whose next token s[t+1] was generated (plen-1 <= t <= len-2), plus the prompt
    positions when ``prompt_positions`` (the chat template is easy to predict and would
    inflate alpha: evaluation never counts them). An EAGLE head predicts at t from the
    pair at t-1 (needs t >= 1) and at draft position j+1 its chain starts at t-1-j
    (needs t >= j+1)."""
    pos = jnp.arange(t)[None, None, :]
    j = jnp.arange(n_steps)[:, None, None]
    ok = pos < lengths[None, :, None] - 1
    if not prompt_positions:
        ok = ok & (pos >= plens[None, :, None] - 1)
    if eagle:
        ok = ok & (pos >= j + 1)
    return ok


def _loss_fn(draft: Draft, weights: dict, n_steps: int, vocab_size: int, prompt_positions=False):
    eagle = draft.kind == "eagle"
    inv = None if draft.inv_map is None else jnp.asarray(draft.inv_map)

    def loss(trainable, batch):
        toks, lens = batch["tokens"], batch["lengths"]
        tp, ti = batch["topk_p"], batch["topk_idx"]
        logq, ph = _forward(draft, trainable, toks, batch.get(draft.feature_key), n_steps)
        S, B, T, _ = logq.shape
        valid = _valid(lens, batch["prompt_lens"], T, S, eagle, prompt_positions).astype(jnp.float32)
        ntok = jnp.maximum(valid.sum(axis=(1, 2)), 1.0)  # [S]
        mi = ti if inv is None else inv[ti]
        miss = mi < 0
        lq = jnp.take_along_axis(logq, jnp.broadcast_to(jnp.maximum(mi, 0)[None], (S,) + mi.shape), axis=-1)
        lq = jnp.where(miss[None], -jnp.inf, lq)
        qk = jnp.exp(lq)
        p = tp[None]
        terms = {}
        terms["fkl"] = -jnp.sum(jnp.where(miss[None], 0.0, p * lq), -1)
        terms["tv"] = 1.0 - jnp.sum(jnp.minimum(p, qk), -1)
        rest = jnp.clip(1.0 - jnp.sum(tp, -1), 1e-8, 1.0)[None]
        k = tp.shape[-1]
        neg_ent = jnp.sum(jnp.exp(logq) * logq, -1)
        cross = jnp.sum(qk * jnp.log(jnp.maximum(p, 1e-12)), -1) + \
            (1.0 - jnp.sum(qk, -1)) * jnp.log(rest / (vocab_size - k))
        terms["rkl"] = neg_ent - cross
        if eagle and not draft.eagle3:  # EAGLE-1/2: the output is a predicted final hidden state
            th = batch["hidden"].astype(jnp.float32)
            d = ph - th[None]
            ad = jnp.abs(d)
            terms["hidden"] = jnp.mean(jnp.where(ad < 1.0, 0.5 * d * d, ad - 0.5), -1)
        per = {n: jnp.mean(jnp.sum(v * valid, axis=(1, 2)) / ntok) for n, v in terms.items()}
        total = sum(weights.get(n, 0.0) * per[n] for n in per if weights.get(n, 0.0))
        per["alpha_topk"] = 1.0 - per["tv"]
        return total, per

    return loss


def make_optimizer(tc: TrainConfig):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.steps, end_value=tc.lr * tc.end_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(tc.clip), optax.adamw(sched, weight_decay=tc.weight_decay)), sched


def make_train_step(draft: Draft, tc: TrainConfig, vocab_size: int):
    import optax

    opt, _ = make_optimizer(tc)
    n = tc.unroll if draft.kind == "eagle" else 1
    loss = _loss_fn(draft, tc.losses, n, vocab_size, tc.prompt_positions)

    def step(state, batch):
        params, opt_state = state
        (l, metrics), g = jax.value_and_grad(loss, has_aux=True)(params, batch)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = dict(metrics, loss=l, grad_norm=optax.tree.norm(g))
        return (params, opt_state), metrics

    return jax.jit(step, donate_argnums=0), opt


def make_eval(draft: Draft, n_steps: int):
    """Held-out exact alpha (temperature 1) and greedy agreement per draft position."""
    eagle = draft.kind == "eagle"
    n = n_steps if eagle else 1
    head = jnp.asarray(draft.head)
    tm = None if draft.token_map is None else jnp.asarray(draft.token_map)

    @jax.jit
    def ev(trainable, toks, lens, plens, hidden, feats=None):
        """``hidden``: the final hidden states (the target's law); ``feats``: what the draft
        reads when it is not ``hidden`` (an EAGLE-3 head's features)."""
        logq, _ = _forward(draft, trainable, toks, hidden if feats is None else feats, n)
        S, B, T, _ = logq.shape
        logp = jax.nn.log_softmax(jnp.einsum("btd,vd->btv", hidden.astype(jnp.float32), head), -1)
        p = jnp.exp(logp)
        pmax = jnp.argmax(logp, -1)
        valid = _valid(lens, plens, T, S, eagle)
        al, gr = [], []
        for j in range(S):
            if tm is None:
                a = jnp.sum(jnp.minimum(p, jnp.exp(logq[j])), -1)
                qa = jnp.argmax(logq[j], -1)
            else:
                a = jnp.sum(jnp.minimum(jnp.take(p, tm, axis=-1), jnp.exp(logq[j])), -1)
                qa = tm[jnp.argmax(logq[j], -1)]
            al.append(jnp.sum(jnp.where(valid[j], a, 0.0)))
            gr.append(jnp.sum(jnp.where(valid[j], qa == pmax, False)))
        return jnp.stack(al), jnp.stack(gr), valid.sum(axis=(1, 2))

    return ev


def evaluate(ev, trainable, data, batch) -> dict:
    n = data["tokens"].shape[0]
    a = g = c = 0.0
    for s in range(0, n, batch):
        sl = slice(s, s + batch)
        toks = data["tokens"][sl]
        lens = data["lengths"][sl]
        hid = data["hidden"][sl]
        pl = data["prompt_lens"][sl]
        ft = data["features"][sl] if "features" in data else None
        if toks.shape[0] < batch:  # pad with empty rows (length 0: nothing counted)
            pad = batch - toks.shape[0]
            toks = np.concatenate([toks, np.zeros((pad,) + toks.shape[1:], toks.dtype)])
            lens = np.concatenate([lens, np.zeros((pad,), lens.dtype)])
            pl = np.concatenate([pl, np.zeros((pad,), pl.dtype)])
            hid = np.concatenate([hid, np.zeros((pad,) + hid.shape[1:], hid.dtype)])
            if ft is not None:
                ft = np.concatenate([ft, np.zeros((pad,) + ft.shape[1:], ft.dtype)])
        ra, rg, rc = jax.device_get(ev(trainable, jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(pl),
                                       jnp.asarray(hid), None if ft is None else jnp.asarray(ft)))
        a, g, c = a + ra, g + rg, c + rc
    c = np.maximum(c, 1)
    return dict(alpha=[round(float(x), 4) for x in a / c], greedy=[round(float(x), 4) for x in g / c])


# --------------------------------------------------------------------------------------
# checkpoints (orbax): the flat leaves of (trainable, opt_state) and the step


def _ckpt_manager(out_dir):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(os.path.join(out_dir, "ckpt")),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


class ResumeError(ValueError):
    """An output folder whose checkpoints belong to a run of another config."""


RESUMABLE = ("train.steps", "train.progress", "train.out_dir")  # what a resumed run may change


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _check_resume(out_dir, cfg: RunConfig) -> Optional[int]:
    """The step of the latest checkpoint in ``out_dir`` (None: none), or :class:`ResumeError`
    when those checkpoints are of a run whose config differs from ``cfg`` in more than
    :data:`RESUMABLE` (a resume would mix two runs, or fail inside orbax on other shapes), or
    are past ``train.steps`` (their weights are not a run of that many steps). Writes nothing."""
    if not os.path.isdir(os.path.join(out_dir, "ckpt")):
        return None
    step = _ckpt_manager(out_dir).latest_step()
    path = os.path.join(out_dir, "config.json")
    if step is None:
        return None
    if not os.path.isfile(path):
        raise ResumeError(f"{out_dir} holds checkpoints (step {step}) but no config.json: they cannot be "
                          "matched to this config; give a new out_dir, or remove it to start over")
    try:
        with open(path) as f:
            old = json.load(f)
        if not isinstance(old, dict):
            raise ValueError("not a mapping")
    except (OSError, ValueError) as e:
        raise ResumeError(f"{path} is unreadable ({e}): the checkpoints in {out_dir} cannot be matched to "
                          "this config; give a new out_dir, or remove it to start over") from None
    old = _flat(old)
    new = _flat(json.loads(json.dumps(cfg.to_dict())))
    diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and k not in RESUMABLE]
    if diff:
        verb = "differs" if len(diff) == 1 else "differ"
        raise ResumeError(f"{out_dir} holds checkpoints of a run with another config ({', '.join(diff[:6])}"
                          f"{' ...' if len(diff) > 6 else ''} {verb}): give a new out_dir, "
                          "or remove it to start over")
    if step > cfg.train.steps:
        raise ResumeError(f"{out_dir} holds a checkpoint at step {step}, past train.steps={cfg.train.steps}: "
                          f"ask for {step} steps or more, or give a new out_dir")
    return step


def finished_run(cfg: RunConfig) -> Optional[dict]:
    """The summary of the complete run of ``cfg`` in its out_dir (its checkpoint at
    ``train.steps`` and its summary.json), else None; :func:`_check_resume`'s errors. A rerun
    of a finished run keeps its results (:func:`train` trains nothing and writes nothing)."""
    out_dir = _path(cfg.train.out_dir)
    if _check_resume(out_dir, cfg) != cfg.train.steps:
        return None
    try:
        with open(os.path.join(out_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):  # killed before the summary: train() evaluates and writes it
        return None
    return summary if isinstance(summary, dict) and summary.get("steps") == cfg.train.steps else None


def make_out_dir(out_dir: str) -> None:
    """Create the output folder (and its parents), or :class:`ConfigError` in one line."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"train.out_dir: cannot create the folder {out_dir} ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK):
        raise ConfigError(f"train.out_dir: {out_dir} is not writable")


def _save(mngr, step, state):
    import orbax.checkpoint as ocp

    leaves = jax.tree.leaves(state)
    tree = {"leaves": {f"{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}, "step": np.asarray(step, np.int64)}
    mngr.save(step, args=ocp.args.StandardSave(tree), force=True)
    mngr.wait_until_finished()


def _restore(mngr, state):
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return None, state
    leaves, treedef = jax.tree.flatten(state)
    abstract = {"leaves": {f"{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}, "step": np.asarray(0, np.int64)}
    got = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    new = [jnp.asarray(got["leaves"][f"{i:05d}"], dtype=x.dtype) for i, x in enumerate(leaves)]
    return int(got["step"]), jax.tree.unflatten(treedef, new)


# --------------------------------------------------------------------------------------
# the run


def batch_indices(seed: int, step: int, batch_size: int, n: int) -> np.ndarray:
    """Rows of step ``step``: a fixed permutation per epoch (a pure function of the step)."""
    out = []
    start = step * batch_size
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        out.append(perm[i])
    return np.array(out)


def _export_at(cfg: RunConfig, draft: Draft, trainable, out_dir, ntrain, heldout, step):
    info = dict(steps=step, of_steps=cfg.train.steps, complete=step == cfg.train.steps, train_tokens=ntrain,
                heldout=heldout, seed=cfg.seed, kind=cfg.draft.kind)
    if cfg.draft.feature_layers:
        info["feature_layers"] = list(cfg.draft.feature_layers)
    export_draft(cfg, dataclasses.replace(draft, trainable=trainable), os.path.join(out_dir, "draft.npz"), info)


def _batch(train_data, keys, idx):
    # crop the padding to a multiple of 64 (a few shapes only): same result, less work
    tlen = min(train_data["tokens"].shape[1], _pad64(train_data["lengths"][idx].max()))
    return {k: jnp.asarray(train_data[k][idx] if k in ("lengths", "prompt_lens") else train_data[k][idx, :tlen])
            for k in keys}


class BudgetError(RuntimeError):
    """A time budget that fits no training run (too few steps)."""


def fit_steps(cfg: RunConfig, draft: Draft, vocab_size: int, train_data, held, keys, deadline: float, log,
              probe: int = 12, reserve_s: float = 30.0, clock=time.time) -> int:
    """The number of steps that ends the run before ``deadline`` (a ``clock()`` reading), from
    timed steps of this very run (on a copy of the state: the run itself is unchanged and
    equals a run with ``--steps N``). At most ``train.steps``; a multiple of 100 (10 below
    1000); an error when not even ``warmup + 10`` steps fit. ``clock`` is a parameter so
    that tests can replace the machine's speed with a fixed one."""
    tc = cfg.train
    step_fn, opt = make_train_step(draft, tc, vocab_size)
    state = (jax.tree.map(jnp.copy, draft.trainable), opt.init(draft.trainable))
    n = train_data["tokens"].shape[0]
    times = []
    for i in range(probe):
        b = _batch(train_data, keys, batch_indices(cfg.seed, i, tc.batch_size, n))
        t0 = clock()
        state, met = step_fn(state, b)
        jax.block_until_ready(met)
        times.append(clock() - t0)
    compile_s = times[0]
    step_s = float(np.median(times[2:])) * 1.15  # host work per step and drift
    ev = make_eval(draft, tc.eval_positions)
    t0 = clock()
    evaluate(ev, state[0], held, tc.eval_batch)
    eval_s = clock() - t0  # includes its compile: an upper bound per evaluation
    left = deadline - clock() - compile_s - reserve_s  # reserve: final checkpoint + export
    per = step_s + eval_s / tc.eval_every
    steps = max(0, int((left - eval_s) / per))
    unit = 100 if steps >= 1000 else 10
    steps = min(tc.steps, steps // unit * unit)
    log(f"[budget] step {step_s * 1e3:.1f} ms (compile {compile_s:.1f} s), eval {eval_s:.1f} s, "
        f"{max(left, 0):.0f} s left -> steps={steps} (reproduce with --steps {steps})")
    if steps < tc.warmup + 10:
        raise BudgetError(f"the time budget fits only {steps} steps (warmup is {tc.warmup}; "
                          f"{reserve_s:.0f} s are kept for the final checkpoint and export)")
    return steps


def train(cfg, *, stop_after: Optional[int] = None, log=None, target=None, tokenizer=None,
          time_budget: Optional[float] = None, reserve_s: float = 30.0, clock=time.time) -> dict:
    """Run (or resume) a training run. ``stop_after`` ends the process-equivalent of a kill
    after that many steps (no final checkpoint). ``time_budget`` (seconds from the call)
    sets ``train.steps`` to what fits (:func:`fit_steps`; reported, so the run can be
    repeated with that fixed step count), keeping ``reserve_s`` for the final checkpoint and
    export (``clock``: see :func:`fit_steps`). Returns a summary dict (with ``params``). A
    rerun of a complete run (:func:`finished_run`) trains and writes nothing and returns the
    recorded summary; checkpoints past ``train.steps`` are refused (:class:`ResumeError`)."""
    t_call = clock()
    if not isinstance(cfg, RunConfig):
        cfg = load_config(cfg)
    tc = cfg.train
    out_dir = _path(tc.out_dir)
    make_out_dir(out_dir)
    log = log or (lambda s: print(s, flush=True))
    done = finished_run(cfg)  # and ResumeError for checkpoints of another config / past train.steps
    if done is None:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
    if target is None:
        target, tokenizer = load_target(cfg.target)
    train_data = build_data(cfg, "train", target, tokenizer, log)
    held = build_data(cfg, "heldout", target, tokenizer, log)
    draft = build_draft(cfg, target, train_data)
    v = target.config.vocab_size
    keys = ["tokens", "lengths", "prompt_lens", "topk_p", "topk_idx"] + ([draft.feature_key] if draft.feature_key else [])
    if time_budget is not None and done is None:
        steps = fit_steps(cfg, draft, v, train_data, held, keys, t_call + time_budget, log,
                          reserve_s=reserve_s, clock=clock)
        tc = dataclasses.replace(tc, steps=steps)
        cfg = dataclasses.replace(cfg, train=tc)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
    step_fn, opt = make_train_step(draft, tc, v)
    _, sched = make_optimizer(tc)
    ev = make_eval(draft, tc.eval_positions)
    state = (draft.trainable, opt.init(draft.trainable))
    mngr = _ckpt_manager(out_dir)
    start, state = _restore(mngr, state)
    start = start or 0
    if done is not None:
        log(f"[train] {out_dir} holds the complete {tc.steps}-step run: nothing to train, its results are kept")
        return dict(done, params=state[0])
    if start > tc.steps:  # a time budget that fits fewer steps than are checkpointed
        raise ResumeError(f"{out_dir} holds a checkpoint at step {start}, past the {tc.steps} steps "
                          "the time budget fits: give a new out_dir")
    mpath = os.path.join(out_dir, "metrics.jsonl")
    kept = []
    if start and os.path.isfile(mpath):  # drop lines past the checkpoint (they will be redone)
        with open(mpath) as f:
            kept = [ln for ln in f if json.loads(ln).get("step", 0) <= start]
    with open(mpath, "w") as f:
        f.writelines(kept)
    if start:
        log(f"[train] resumed from step {start}")
    n = train_data["tokens"].shape[0]
    ntrain = int(train_data["lengths"].sum())
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(total=tc.steps, initial=start, disable=not tc.progress, dynamic_ncols=True) if tqdm else None
    last_eval = None
    t_last = time.time()
    tok_acc = 0
    t_train = 0.0
    with open(mpath, "a") as mf:
        def emit(rec):
            mf.write(json.dumps(rec) + "\n")
            mf.flush()

        if start == 0:
            last_eval = evaluate(ev, state[0], held, tc.eval_batch)
            emit(dict(step=0, eval=last_eval))
            log(f"[eval] step 0: {last_eval}")
        for step in range(start, tc.steps):
            if stop_after is not None and step >= stop_after:
                log(f"[train] stopping at step {step} (stop_after)")
                if bar:
                    bar.close()
                return dict(stopped=step)
            idx = batch_indices(cfg.seed, step, tc.batch_size, n)
            batch = _batch(train_data, keys, idx)
            t0 = time.time()
            state, met = step_fn(state, batch)
            met = {k: float(x) for k, x in jax.device_get(met).items()}
            dt = time.time() - t0
            t_train += dt
            ntok = int(train_data["lengths"][idx].sum())
            tok_acc += ntok
            s1 = step + 1
            rec = dict(step=s1, lr=float(sched(step)), tokens=ntok, **{k: round(v_, 6) for k, v_ in met.items()})
            if s1 % tc.log_every == 0 or s1 == tc.steps:
                el = time.time() - t_last
                rec["tokens_per_s"] = round(tok_acc / max(el, 1e-9), 1)
                t_last, tok_acc = time.time(), 0
            emit(rec)
            if bar:
                bar.set_postfix(loss=f"{met['loss']:.4f}", a_topk=f"{met['alpha_topk']:.3f}",
                                tok_s=f"{ntok / max(dt, 1e-9):.0f}")
                bar.update(1)
            if s1 % tc.eval_every == 0 or s1 == tc.steps:
                last_eval = evaluate(ev, state[0], held, tc.eval_batch)
                emit(dict(step=s1, eval=last_eval))
                log(f"[eval] step {s1}: {last_eval}")
                if s1 < tc.steps:  # a usable draft file at every evaluation, marked partial
                    _export_at(cfg, draft, state[0], out_dir, ntrain, last_eval, s1)
            if s1 % tc.ckpt_every == 0 or s1 == tc.steps:
                _save(mngr, s1, state)
        if last_eval is None:  # nothing was left to train (killed before the summary): evaluate
            last_eval = evaluate(ev, state[0], held, tc.eval_batch)
            log(f"[eval] step {tc.steps}: {last_eval}")
    if bar:
        bar.close()
    draft.trainable = state[0]
    _export_at(cfg, draft, state[0], out_dir, ntrain, last_eval, tc.steps)
    summary = dict(steps=tc.steps, eval=last_eval, train_tokens=ntrain, train_seconds=round(t_train, 1),
                   data_cached=dict(train=bool(train_data["cached"]), heldout=bool(held["cached"])),
                   out_dir=out_dir)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return dict(summary, params=state[0])
