"""Meshes, logical-axis rules and parameter placement (data x model parallelism).

A mesh has two named axes, ``data`` (batch rows and their KV cache) and ``model``
(tensor parallelism: heads, kv heads, MLP width, vocabulary). Models name the
dimensions of their parameters and activations with *logical* axes (embed, heads,
kv_heads, head_dim, mlp, vocab, layers, batch, ...); a rule table maps each logical name
to a mesh axis (or to nothing: replicated). Rules are data, in ``configs/mesh/*.yaml``::

    name: tp
    mesh: {data: -1, model: 8}        # -1: whatever the other axes leave
    rules:
      target: {batch: data, vocab: model, heads: model, kv_heads: model, mlp: model}
      draft:  {batch: data}           # replicated over `model`; `draft: target` = same rules

loaded with :func:`load_sharding_config` into frozen dataclasses. A :class:`MeshPlan`
(mesh + rules) does the rest:

* ``plan.spec(names, shape, role)``: a ``PartitionSpec``; a dimension that a mesh axis
  does not divide is replicated instead (recorded in ``plan.fallbacks``), and a mesh axis
  is used at most once per array (the first dimension that asks for it wins);
* ``param_shardings`` / ``plan.place_params`` / ``put_host_params``: the shardings of any
  model's parameters (from their logical names) and their placement (host weights shard
  by shard with ``jax.make_array_from_callback``); building models in place is
  ``specjax.build`` (``init_model``, ``load_model``);
* ``plan.context()``: ``jax.set_mesh`` + ``nnx.logical_axis_rules`` around tracing, so
  the models' ``constrain()`` hooks apply; ``plan.constrain*``: constraints inside jit
  (caches [L, B, Nkv, S, H] as (layers, batch, kv_heads, cache_seq, head_dim), logits
  [B, T, V] as (batch, None, vocab));
* ``plan.put(array, names)``: a host array as a global array (multi-host safe).

Multi-host: :func:`initialize_distributed` (``jax.distributed.initialize()`` when asked
or when ``JAX_COORDINATOR_ADDRESS`` is set) and :func:`log` (prints from process 0 only).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax.configs import load_config
from specjax.models.base import KVCache

__all__ = [
    "AXES", "CACHE_NAMES", "LOGITS_NAMES", "ENGINE_NAMES", "MeshConfig", "AxisRules", "ShardingConfig",
    "MeshPlan", "load_sharding_config", "sharding_from_dict", "make_mesh", "make_plan",
    "param_shardings", "unused_rules", "put_host_params",
    "initialize_distributed", "is_main_process", "log", "shard_bytes",
    "tree_bytes_per_device", "cache_bytes_per_device",
]

AXES = ("data", "model")
ROLES = ("target", "draft")
# logical names of the engine's arrays (the models name their parameters themselves)
CACHE_NAMES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")  # KVCache.k / .v
LOGITS_NAMES = ("batch", None, "vocab")  # [B, T, V]
ENGINE_NAMES = frozenset(n for n in CACHE_NAMES + LOGITS_NAMES if n is not None)

AxisSpec = Union[None, str, tuple]


# --------------------------------------------------------------------------------------
# config (frozen dataclasses, loaded from YAML)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; at most one may be -1 (= the devices the others leave).

    ``dcn_data`` > 1 splits ``data`` across slices (multi-slice: data over DCN, model
    inside a slice over ICI)."""

    data: int = -1
    model: int = 1
    dcn_data: int = 1

    def __post_init__(self):
        for f in ("data", "model"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
                raise ValueError(f"mesh.{f} must be a positive int or -1, got {v!r}")
        if self.data == -1 and self.model == -1:
            raise ValueError("at most one mesh axis may be -1")
        if isinstance(self.dcn_data, bool) or not isinstance(self.dcn_data, int) or self.dcn_data < 1:
            raise ValueError(f"mesh.dcn_data must be a positive int, got {self.dcn_data!r}")

    def sizes(self, n_devices: int) -> tuple:
        if n_devices < 1:
            raise ValueError(f"a mesh needs at least one device, got {n_devices}")
        data, model = self.data, self.model
        fixed = (data if data != -1 else 1) * (model if model != -1 else 1)
        if -1 not in (data, model) and fixed != n_devices:
            raise ValueError(f"mesh {data}x{model} (data x model) needs {fixed} devices, "
                             f"have {n_devices}")
        if n_devices % fixed:
            raise ValueError(f"mesh {data}x{model} (data x model) does not divide {n_devices} devices")
        if data == -1:
            data = n_devices // fixed
        if model == -1:
            model = n_devices // fixed
        if data * model != n_devices:
            raise ValueError(f"mesh {data}x{model} (data x model) needs {data * model} devices, "
                             f"have {n_devices}")
        if data % self.dcn_data:
            raise ValueError(f"mesh.dcn_data={self.dcn_data} does not divide data={data}")
        return data, model


def _norm_axis(name: str, value) -> AxisSpec:
    if value is None or value == "null":
        return None
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) for a in value):
        raise ValueError(f"rule {name!r} -> {value!r}: a mesh axis name, a list of them, or null")
    value = tuple(value)
    for a in value:
        if a not in AXES:
            raise ValueError(f"rule {name!r} -> {a!r}: unknown mesh axis (known: {AXES})")
    if len(set(value)) != len(value):
        raise ValueError(f"rule {name!r} repeats a mesh axis: {value}")
    return value[0] if len(value) == 1 else value


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis name -> mesh axis (a name, a tuple of names, or None = replicated).

    Names without a rule are replicated."""

    pairs: tuple = ()

    @classmethod
    def from_mapping(cls, m: Optional[Mapping[str, Any]]) -> "AxisRules":
        if m is not None and not isinstance(m, Mapping):
            raise ValueError(f"axis rules must be a mapping of logical names to mesh axes, got {m!r}")
        m = dict(m or {})
        return cls(tuple((str(k), _norm_axis(k, v)) for k, v in m.items()))

    def get(self, name: Optional[str]) -> AxisSpec:
        if name is None:
            return None
        for k, v in self.pairs:
            if k == name:
                return v
        return None

    def as_dict(self) -> dict:
        return dict(self.pairs)

    def flax_rules(self) -> tuple:
        """For ``nnx.logical_axis_rules`` (what the models' ``constrain`` reads)."""
        return tuple(self.pairs)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    name: str = "replicated"
    mesh: MeshConfig = MeshConfig()
    target: AxisRules = AxisRules()
    draft: AxisRules = AxisRules()
    # what to do when a mesh axis does not divide a dimension: replicate it, or raise
    indivisible: str = "replicate"

    def __post_init__(self):
        if self.indivisible not in ("replicate", "error"):
            raise ValueError(f"indivisible must be 'replicate' or 'error', got {self.indivisible!r}")

    def rules(self, role: str) -> AxisRules:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.target if role == "target" else self.draft


def sharding_from_dict(d: Mapping[str, Any], name: str = "<dict>") -> ShardingConfig:
    d = dict(d or {})
    unknown = set(d) - {"name", "mesh", "rules", "indivisible"}
    if unknown:
        raise ValueError(f"sharding config {name}: unknown keys {sorted(unknown)}")
    mesh_d = d.get("mesh") or {}
    if not isinstance(mesh_d, Mapping):
        raise ValueError(f"sharding config {name}: mesh must be a mapping (data, model, dcn_data), got {mesh_d!r}")
    bad = sorted(set(mesh_d) - {f.name for f in dataclasses.fields(MeshConfig)})
    if bad:
        raise ValueError(f"sharding config {name}: unknown mesh keys {bad} (known: data, model, dcn_data)")
    mesh = MeshConfig(**dict(mesh_d))
    rules = d.get("rules") or {}
    if not isinstance(rules, Mapping):
        raise ValueError(f"sharding config {name}: rules must be a mapping (target, draft), got {rules!r}")
    rules = dict(rules)
    bad = set(rules) - set(ROLES)
    if bad:
        raise ValueError(f"sharding config {name}: unknown rule sets {sorted(bad)} (known: {ROLES})")
    for role in ROLES:
        r = rules.get(role)
        if r is not None and not isinstance(r, Mapping) and not (role == "draft" and r == "target"):
            raise ValueError(f"sharding config {name}: rules.{role} must be a mapping of logical names to "
                             f"mesh axes{' or the word target' if role == 'draft' else ''}, got {r!r}")
    target = AxisRules.from_mapping(rules.get("target"))
    draft = target if rules.get("draft") == "target" else AxisRules.from_mapping(rules.get("draft"))
    return ShardingConfig(name=str(d.get("name", name)), mesh=mesh, target=target, draft=draft,
                          indivisible=d.get("indivisible", "replicate"))


def load_sharding_config(name_or_path: Union[str, os.PathLike], **mesh_overrides) -> ShardingConfig:
    """A ``configs/mesh/<name>.yaml`` stem or a path; ``mesh_overrides`` (data=, model=)
    replace mesh sizes."""
    d, p = load_config(name_or_path, "mesh", what="sharding config")
    cfg = sharding_from_dict(d, name=p.stem)
    if mesh_overrides:
        cfg = dataclasses.replace(cfg, mesh=_override_mesh(cfg.mesh, mesh_overrides))
    return cfg


def _override_mesh(mesh: MeshConfig, overrides: Mapping) -> MeshConfig:
    bad = sorted(set(overrides) - {f.name for f in dataclasses.fields(MeshConfig)})
    if bad:
        raise TypeError(f"unknown mesh overrides {bad} (known: data, model, dcn_data)")
    return dataclasses.replace(mesh, **overrides)


# --------------------------------------------------------------------------------------
# mesh


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: Optional[Sequence] = None) -> Mesh:
    """A ('data', 'model') mesh with Auto axes (sharding propagation by XLA)."""
    devices = list(jax.devices() if devices is None else devices)
    data, model = cfg.sizes(len(devices))
    types = (AxisType.Auto, AxisType.Auto)
    if cfg.dcn_data > 1:
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_hybrid_device_mesh((data // cfg.dcn_data, model), (cfg.dcn_data, 1),
                                                   devices)
        return Mesh(arr, AXES, axis_types=types)
    return jax.make_mesh((data, model), AXES, axis_types=types, devices=devices)


# --------------------------------------------------------------------------------------
# the plan: mesh + rules


class MeshPlan:
    """A mesh with its rules: specs, shardings, constraints and the tracing context."""

    def __init__(self, mesh: Mesh, config: ShardingConfig):
        self.mesh = mesh
        self.config = config
        self.fallbacks: dict = {}  # (role, names, shape) -> message, for reports

    # -- specs ---------------------------------------------------------------------
    @property
    def data_size(self) -> int:
        return self.mesh.shape["data"]

    @property
    def model_size(self) -> int:
        return self.mesh.shape["model"]

    def spec(self, names: Sequence[Optional[str]], shape: Optional[Sequence[int]] = None,
             role: str = "target") -> P:
        rules = self.config.rules(role)
        names = tuple(names)
        if shape is not None and len(names) > len(shape):
            raise ValueError(f"{role}: {len(names)} logical names {names} for an array of rank {len(shape)} "
                             f"(shape {tuple(shape)})")
        used: set = set()
        out = []
        for i, n in enumerate(names):
            ax = rules.get(n)
            axes = () if ax is None else ((ax,) if isinstance(ax, str) else tuple(ax))
            axes = tuple(a for a in axes if a not in used)
            if axes and shape is not None:
                size = math.prod(self.mesh.shape[a] for a in axes)
                if shape[i] % size:
                    msg = (f"{role}: dimension {i} ({n}) of shape {tuple(shape)} is not divisible "
                           f"by mesh axes {axes} (size {size})")
                    if self.config.indivisible == "error":
                        raise ValueError(msg)
                    self.fallbacks[(role, tuple(names), tuple(shape))] = msg + ": replicated"
                    axes = ()
            used.update(axes)
            out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    def sharding(self, names, shape=None, role: str = "target") -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names, shape, role))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # -- inside jit --------------------------------------------------------------------
    def constrain(self, x, names, role: str = "target"):
        return jax.lax.with_sharding_constraint(x, self.sharding(names, x.shape, role))

    def constrain_cache(self, cache: KVCache, role: str = "target") -> KVCache:
        return KVCache(k=self.constrain(cache.k, CACHE_NAMES, role),
                       v=self.constrain(cache.v, CACHE_NAMES, role),
                       lengths=self.constrain(cache.lengths, ("batch",), role))

    def constrain_caches(self, tree, role: str = "draft"):
        """Every KVCache inside a pytree (e.g. a proposer's state)."""
        return jax.tree.map(lambda c: self.constrain_cache(c, role) if isinstance(c, KVCache) else c,
                            tree, is_leaf=lambda c: isinstance(c, KVCache))

    def constrain_replicated(self, tree):
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, self.replicated()), tree)

    def _axes(self, name: str, role: str = "target") -> tuple:
        ax = self.config.rules(role).get(name)
        return () if ax is None else ((ax,) if isinstance(ax, str) else tuple(ax))

    def top_values(self, z, m: int):
        """The m largest values of each row of z [N, V] (descending) without gathering V.

        Runs per device (``shard_map``): each ``vocab`` shard takes its own top
        min(m, V/s) and only those s * min(m, V/s) candidates per row are gathered; their
        top m are the global top m (the same values, so the sampling law is unchanged).
        Rows stay split over ``batch``'s axes. The engines pass it to the sampling
        pipeline (``process_rows(..., top_values=plan.top_values)``)."""
        if getattr(z, "ndim", None) != 2:
            raise ValueError(f"top_values: z must be [N, V], got shape {getattr(z, 'shape', None)}")
        n, v = z.shape
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= v:
            raise ValueError(f"top_values: m must be an integer in [1, V={v}], got {m!r}")

        def size(axes):
            return math.prod(self.mesh.shape[a] for a in axes) if axes else 1

        def spec(axes):
            return None if not axes else (axes[0] if len(axes) == 1 else axes)

        vaxes = self._axes("vocab")
        if size(vaxes) == 1 or v % size(vaxes):
            vaxes = ()
        raxes = tuple(a for a in self._axes("batch") if a not in vaxes)
        if size(raxes) == 1 or n % size(raxes):
            raxes = ()
        if not vaxes and not raxes:
            return jax.lax.top_k(z, m)[0]
        ml = min(m, v // size(vaxes))

        def local(zs):  # [N/r, V/s] on one device
            cand = jax.lax.top_k(zs, ml)[0]
            if vaxes:
                cand = jax.lax.all_gather(cand, vaxes, axis=1, tiled=True)  # [N/r, s * ml]
                cand = jax.lax.top_k(cand, m)[0]
            return cand

        return jax.shard_map(local, mesh=self.mesh, in_specs=P(spec(raxes), spec(vaxes)),
                             out_specs=P(spec(raxes), None), check_vma=False)(z)

    @contextlib.contextmanager
    def context(self, role: str = "target"):
        """For tracing: the mesh and the role's rules (the models' ``constrain`` hooks).
        The engines pass :meth:`top_values` to the sampling pipeline themselves."""
        with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.config.rules(role).flax_rules()):
            yield self

    @contextlib.contextmanager
    def role(self, role: str):
        """Switch the logical rules (inside a trace), e.g. around the draft's calls."""
        with nnx.logical_axis_rules(self.config.rules(role).flax_rules()):
            yield self

    def place_params(self, params, role: str = "target"):
        """Parameters in the shardings the rules give: arrays already there stay, others
        are moved (``device_put``), abstract ``jax.ShapeDtypeStruct``s (AOT lowering) get
        the sharding attached."""

        def place(a, sh):
            if getattr(a, "sharding", None) == sh:
                return a
            if isinstance(a, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
            return jax.device_put(a, sh)

        return jax.tree.map(place, params, param_shardings(params, self, role))

    # -- host -> global arrays -----------------------------------------------------------
    def put(self, x, names=None, role: str = "target") -> jax.Array:
        """A host array (the same on every host) as a global array, one shard at a time.

        ``names=None``: leading axis over ``batch``, the rest replicated. Typed PRNG keys
        are placed through their key data."""
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            data = self.put(np.asarray(jax.random.key_data(x)),
                            None if names is None else tuple(names) + (None,), role)
            return jax.random.wrap_key_data(data, impl=impl)
        x = np.asarray(x)
        if names is None:
            names = ("batch",) + (None,) * (x.ndim - 1) if x.ndim else ()
        sh = self.sharding(names, x.shape, role)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    def put_rows(self, tree, role: str = "target"):
        return jax.tree.map(lambda a: self.put(a, None, role), tree)

    def put_replicated(self, tree):
        return jax.tree.map(lambda a: self.put(a, ()), tree)


def make_plan(config: Union[ShardingConfig, str, os.PathLike, None] = None,
              devices: Optional[Sequence] = None, **mesh_overrides) -> MeshPlan:
    """A plan from a config (object, YAML stem or path; None = all devices on ``data``)."""
    if config is None:
        config = ShardingConfig()
    if not isinstance(config, ShardingConfig):
        config = load_sharding_config(config)
    if mesh_overrides:
        config = dataclasses.replace(config, mesh=_override_mesh(config.mesh, mesh_overrides))
    return MeshPlan(make_mesh(config.mesh, devices), config)


# --------------------------------------------------------------------------------------
# parameters


def _names_of(meta_spec) -> tuple:
    return tuple(meta_spec) if meta_spec is not None else ()


def unused_rules(rules: AxisRules, names) -> list:
    """The logical names that ``rules`` map to mesh axes but that neither ``names`` (a
    model's parameter names) nor the engines' arrays (:data:`ENGINE_NAMES`) have: a typo
    such as ``vocabb: model`` shards nothing."""
    used = set(names) | ENGINE_NAMES
    return [k for k, v in rules.pairs if v is not None and k not in used]


def param_shardings(abstract_state, plan: MeshPlan, role: str = "target"):
    """NamedShardings (a pytree matching the state's leaves) from the parameters' logical
    names (``nnx.get_partition_spec``) and the role's rules; works on abstract states.
    Warns (once per message) when the rules map a name that no parameter of this model and
    no engine array has (:func:`unused_rules`): activations a model constrains by names of
    its own may use such a rule, so it is not an error."""
    specs = nnx.get_partition_spec(abstract_state)  # same structure, P leaves
    flat_vals, treedef = jax.tree.flatten(abstract_state)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(flat_vals) == len(flat_specs), (len(flat_vals), len(flat_specs))
    unused = unused_rules(plan.config.rules(role), {n for s in flat_specs for n in _names_of(s) if n})
    if unused:
        warnings.warn(f"sharding config {plan.config.name}: rules.{role} map {unused} to mesh axes, but no "
                      f"parameter of this model and no engine array has such an axis (a typo?): they shard "
                      f"nothing", stacklevel=2)
    shardings = []
    for v, s in zip(flat_vals, flat_specs):
        names = _names_of(s)
        names = names + (None,) * (len(v.shape) - len(names))
        shardings.append(plan.sharding(names, v.shape, role))
    return jax.tree.unflatten(treedef, shardings)


def put_host_params(params, plan: MeshPlan, role: str = "target"):
    """Parameters that live on the host (or anywhere) placed shard by shard
    (``jax.make_array_from_callback``: each device gets only its slice; on several hosts
    each host fills its own devices)."""
    shardings = param_shardings(params, plan, role)

    def put(a, sh):
        host = np.asarray(jax.device_get(a)) if not isinstance(a, np.ndarray) else a
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    return jax.tree.map(put, params, shardings)


# --------------------------------------------------------------------------------------
# memory accounting


def shard_bytes(shape, dtype, sharding) -> int:
    """Bytes of one device's shard of an array of this shape/dtype/sharding."""
    shp = sharding.shard_shape(tuple(shape)) if sharding is not None else tuple(shape)
    return int(math.prod(shp)) * np.dtype(dtype).itemsize


def tree_bytes_per_device(tree, shardings=None) -> int:
    """Bytes one device holds of a pytree of (sharded) arrays / ShapeDtypeStructs."""
    leaves = jax.tree.leaves(tree)
    shs = jax.tree.leaves(shardings) if shardings is not None else [getattr(a, "sharding", None)
                                                                      for a in leaves]
    return sum(shard_bytes(a.shape, a.dtype, sh) for a, sh in zip(leaves, shs))


def cache_bytes_per_device(cfg, batch: int, cache_len: int, plan: "MeshPlan", role: str,
                           dtype=None) -> int:
    """K + V cache [L, B, Nkv, S, H] bytes on one device under the role's rules."""
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, cache_len, cfg.head_dim)
    dt = dtype or cfg.compute_dtype
    return 2 * shard_bytes(shape, dt, plan.sharding(CACHE_NAMES, shape, role))


# --------------------------------------------------------------------------------------
# multi-host helpers


def initialize_distributed(multihost: Optional[bool] = None, **kwargs) -> bool:
    """``jax.distributed.initialize()`` when asked (``multihost=True``) or when the
    environment names a coordinator (``JAX_COORDINATOR_ADDRESS``); a no-op otherwise.
    Call before any other JAX call. Returns whether it initialized."""
    if multihost is None:
        multihost = bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
    if not multihost:
        return False
    addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if addr and "coordinator_address" not in kwargs:
        kwargs["coordinator_address"] = addr
        if os.environ.get("JAX_NUM_PROCESSES"):
            kwargs.setdefault("num_processes", int(os.environ["JAX_NUM_PROCESSES"]))
        if os.environ.get("JAX_PROCESS_ID"):
            kwargs.setdefault("process_id", int(os.environ["JAX_PROCESS_ID"]))
    jax.distributed.initialize(**kwargs)  # on TPU pods the arguments are auto-detected
    return True


def is_main_process() -> bool:
    return jax.process_index() == 0


def log(*args, **kwargs) -> None:
    """``print`` on process 0 only."""
    if is_main_process():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
