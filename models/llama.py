"""One decoder for the Llama, Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3 families, in Flax NNX.

One frozen :class:`LlamaConfig` is the single source of truth for shapes and architecture:
the other families are switches of the same module (``qkv_bias``, ``qk_norm``,
``norm_offset``, ``sandwich_norm``, ``embed_scale``, ``mlp_act``, ``attn_scale``,
``attn_softcap``, ``final_softcap``, ``sliding_window`` / ``layer_types``,
``rope_local_theta``), each defaulting to Llama's behaviour. The model keeps
the :class:`specjax.models.base.LanguageModel` contract through :class:`LlamaLM`:

* ``LlamaLM.init(config, seed)``: random weights; ``LlamaLM.from_weights(config, weights)``:
  from the *canonical* weight dict (below) that every loader produces;
* ``lm.init_cache(batch, max_len)`` -> :class:`KVCache`;
* ``lm.apply(params, tokens[B, T], cache, return_hidden=False)`` -> :class:`ModelOutput`,
  a pure function of ``params`` (``lm.params``, the state of one ``nnx.split``);
  ``return_hidden`` may name several layers' hidden states, taken in the same pass
  (:func:`specjax.models.base.hidden_indices`; unrolled and scanned layers alike).

Canonical weights (numpy or jax arrays, PyTorch ``[out, in]`` orientation, per-layer
tensors stacked on a leading ``L`` axis)::

    embed [V, D]   lm_head [V, D] (only if not tied)   final_norm [D]
    attn_norm [L, D]  wq [L, N*H, D]  wk [L, Nkv*H, D]  wv [L, Nkv*H, D]  wo [L, D, N*H]
    mlp_norm [L, D]   w_gate [L, F, D]  w_up [L, F, D]  w_down [L, D, F]
    with qkv_bias: bq [L, N*H]  bk [L, Nkv*H]  bv [L, Nkv*H]
    with qk_norm: q_norm [L, H]  k_norm [L, H]
    with sandwich_norm: post_attn_norm [L, D]  post_mlp_norm [L, D] (mlp_norm is the pre-MLP norm)

RoPE is rotate-half (HF ``rotate_half``): the two halves of a head are the real and
imaginary parts. Loaders convert other conventions (llama.cpp's interleaved Q/K) into it.

Internal parameter layout (chosen for XLA CPU speed, measured with
``scripts/bench_step.py``): every matrix is stored ``[in, out]`` and multiplied as one 2-D
``x @ W`` (XLA CPU's fast gemv/gemm form; an ``[out, in]`` weight or a multi-dimensional
contraction made XLA transpose every weight on every call). Q, K and V are fused per KV
group as ``wqkv [D, Nkv, G+2, H]`` (G = N / Nkv query heads, then the group's K and V
head, so sharding ``kv_heads`` keeps groups whole; on a TPU ``[Nkv, G+2, H, D]``, see
``LlamaConfig.qkv_input_last``), gate and up as ``w_gate_up [D, 2, F]`` (multiplied as one
``[D, 2F]`` matrix; on a TPU ``[2, D, F]``, see ``LlamaConfig.gate_up_first``), ``wo [N, H,
D]`` (on a TPU ``[N*H, D]``, see ``LlamaConfig.wo_flat``), ``w_down [F, D]``; the (tied)
embedding is stored ``[D, V]`` so the LM head is a plain ``x @ E`` and the token lookup
gathers columns. With ``scan_layers`` the per-layer parameters are stacked on a leading
``layers`` axis and run in ``lax.scan``; otherwise each layer is its own module in an
``nnx.List`` and a Python loop unrolls them (faster on CPU). Both give the same logits.
Attention reads the cache in ``attn_chunk`` slot chunks only up to the longest live row
(online softmax), so its cost follows the used length rather than ``max_len``.

Every parameter carries logical axis names (``out_sharding`` metadata, read with
``nnx.get_partition_spec``) from: embed, heads, kv_heads, head_dim, mlp, vocab, layers.
Activations pass through :func:`constrain` at block boundaries: a no-op unless a mesh is
set (``jax.set_mesh``) with logical axis rules (``nnx.logical_axis_rules``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import PartitionSpec as P

from specjax.models.base import KVCache, ModelOutput, TreeAttention, hidden_indices
from specjax.models.cpu_kernels import compute_id as kernels_compute_id
from specjax.models.cpu_kernels import (BLOCK_ROWS, KERNEL_MODES, attention_raw, block_matmul, block_matmul_stacked,
                                        dequantize_blocks, pack_q4, packable_q4, rms_norm_raw, small_matmul,
                                        small_matmul_stacked, unpack_q4,
                                        use_attention, use_block_matmul, use_rms_norm, use_small_matmul,
                                        use_small_matmul_stacked)

# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


ROPE_SCALING_TYPES = ("llama3", "linear")
SCANNED_BACKENDS = ("tpu",)  # where scan_layers="auto" scans whatever the dtypes (CPU: see below)


def default_scan_layers(backend: Optional[str] = None, *, dtype: str = "float32",
                        param_dtype: Optional[str] = None, cpu_kernels: str = "auto") -> bool:
    """The layer mode ``scan_layers="auto"`` picks for ``backend`` (default: JAX's default
    backend) and the model's dtypes: scanned on TPU, and on one CPU device when the float32
    kernels read the stacked weights in place (float32 weights and compute, ``cpu_kernels``
    not ``"xla"``, the kernels built: the test ``Block._mm`` makes); unrolled elsewhere. Measured
    (BENCHMARKS.md): on an NVIDIA H200 unrolled decodes faster (random llama3-8b-shape in bf16:
    4.8 vs 11.9 ms per token), where XLA copies a scanned layer's weights out of the stacked
    parameters on every step, and so do XLA's CPU ops (bf16, ``cpu_kernels="xla"``: 47.5 vs
    27.7 ms for SmolLM2-135M). With the CPU kernels a scanned SmolLM2-135M decodes as fast as
    an unrolled one (27.1 vs 27.7 ms per step) and compiles in half the time. On TPU the scan
    is kept for compile time on large models and pods (its decode speed there is not
    measured here)."""
    backend = backend or jax.default_backend()
    if backend in SCANNED_BACKENDS:
        return True
    if backend != "cpu":
        return False
    # the test Block._mm makes, on a shape the kernel takes (N a multiple of 64)
    x = jax.ShapeDtypeStruct((1, 64), _DTYPES[dtype])
    w = jax.ShapeDtypeStruct((2, 64, 64), _DTYPES[param_dtype or dtype])
    return _stack_read_in_place(cpu_kernels, x, w, _DTYPES[dtype])


# where gate_up_first="auto" stores w_gate_up [2, D, F], qkv_input_last="auto" wqkv
# [Nkv, G+2, H, D] and wo_flat="auto" wo [N*H, D]: the backends that tile an array's two
# minor axes (XLA:TPU)
TILED_LAYOUT_BACKENDS = ("tpu",)
# the LlamaConfig fields of those layouts: speed only, resolved for the machine the config is made on
LAYOUT_FIELDS = ("gate_up_first", "qkv_input_last", "wo_flat")


def default_gate_up_first(backend: Optional[str] = None) -> bool:
    """The layout ``gate_up_first="auto"`` picks for ``backend`` (default: JAX's default
    backend): ``[2, D, F]`` on TPU, ``[D, 2, F]`` elsewhere. XLA:TPU tiles the two minor axes
    of an array, and a second-minor axis of 2 leaves ``[D, 2, F]`` in 2-row tiles that
    every one-token product re-lays out in full (scripts/accel_aot.py, compiled for v5e:
    1.07 GB of copies a step for the llama3-1b shape, none with ``[2, D, F]``); on CPU and GPU
    ``[D, 2, F]`` is one plain ``[D, 2F]`` matrix product (``[2, D, F]`` would be two, or a
    transposed copy of the weight)."""
    return (backend or jax.default_backend()) in TILED_LAYOUT_BACKENDS


def default_qkv_input_last(backend: Optional[str] = None, scan_layers: bool = True) -> bool:
    """The layout ``qkv_input_last="auto"`` picks for ``backend`` and the layer mode:
    ``wqkv [Nkv, G+2, H, D]`` (the input axis last: the canonical rows of Q, K and V grouped
    by KV head) for scanned layers on TPU, ``[D, Nkv, G+2, H]`` elsewhere. ``[D, Nkv, G+2,
    H]`` has a second-minor axis of G+2 (6 for Llama-3-8B, 5 for SmolLM2) in XLA:TPU's
    tiles; compiled for v5p (scripts/accel_aot.py, the llama3-8b shape, scanned) a one-token
    step wrote each layer's slice to HBM and read it back (100 MB a layer), and both the
    step's and a round's program took the weight in another layout than the array's (JAX
    copies such an argument, 1.6 GB, on every call): ``[Nkv, G+2, H, D]`` needs none of it.
    Unrolled, XLA:TPU reads ``[D, Nkv, G+2, H]`` where it lies, and with ``[Nkv, G+2, H, D]``
    the 8B step copied its KV cache to another layout and back (bytes that grow with the
    cache), so unrolled layers keep it. On CPU and GPU ``[D, Nkv, G+2, H]`` is one plain
    ``[D, 3N]`` product, the form their kernels are tuned for."""
    return (backend or jax.default_backend()) in TILED_LAYOUT_BACKENDS and bool(scan_layers)


def default_wo_flat(backend: Optional[str] = None) -> bool:
    """The layout ``wo_flat="auto"`` picks for ``backend``: the output projection stored
    ``[N*H, D]`` on TPU, ``[N, H, D]`` elsewhere (the same bytes in a row-major array; the
    names differ for a mesh: ``heads`` on the merged axis). Compiled for v5p
    (scripts/accel_aot.py, the llama3-8b shape, scanned layers), XLA:TPU copied each layer's
    ``[N, H, D]`` slice out of the stacked weight before the product, whose contraction
    spans two axes, every step and every round (est. 8B step 45.9 -> 43.0M cycles, K=3
    round 22.7 -> 21.0M, 2.1 GB fewer bytes a step); unrolled, the programs are the same."""
    return (backend or jax.default_backend()) in TILED_LAYOUT_BACKENDS


def _stack_read_in_place(mode: str, x2, w3, compute_dtype) -> bool:
    """Whether ``x2[M, K] @ w3[layer]`` of a scanned layer goes to the stacked CPU kernel
    (reading the layer where it lies) rather than to a copy of the layer's slice."""
    return w3.dtype == compute_dtype and use_small_matmul_stacked(mode, x2, w3)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3 style (HF ``rope_type: llama3``) or ``linear``
    (every frequency divided by ``factor``; the low/high/original fields are unused)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"unsupported rope_scaling type {self.rope_type!r}; expected one of {ROPE_SCALING_TYPES}")


MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")
NO_WINDOW = 2 ** 30  # a window no position reaches: "attend to every earlier slot"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"  # compute dtype of activations and the KV cache
    param_dtype: str = "float32"
    # lax.scan over stacked layers (True) or one module per layer, unrolled (False); "auto"
    # (resolved when the config is made): the faster mode of the default backend,
    # see default_scan_layers
    scan_layers: Any = False
    # attention reads the cache in chunks of this many slots, only up to the longest row
    # (a dynamic loop); 0 = one pass over all max_len slots. Pure speed knob.
    attn_chunk: int = 256
    max_position: int = 8192  # informational (context length of the checkpoint)
    name: str = "llama"
    # float32 CPU kernels (models/cpu_kernels.py: small-M matmul, cached attention): "auto"
    # (where they apply), "kernel" (the same, a failed build is an error) or "xla". Speed only.
    cpu_kernels: str = "auto"
    # the layers' matrices and the embedding / LM head kept in a GGUF file's blocks (int8
    # codes, float32 scale and offset per 32 inputs: :class:`BlockWeights`; the GGUF loader
    # sets it for Q8_0 / Q4_0 / Q4_1 files where the CPU kernels apply). The same float32
    # weights, rebuilt in the matmul kernel's registers: the same bits, a third of the bytes.
    weight_blocks: bool = False
    # the fused gate/up weight stored [2, D, F] (True) or [D, 2, F] (False); "auto" (resolved
    # when the config is made): True on TPU, see default_gate_up_first. The same values and
    # logits either way; GGUF blocks keep [D, 2, F]. Speed only.
    gate_up_first: Any = "auto"
    # the fused q/k/v weight stored [Nkv, G+2, H, D] (True) or [D, Nkv, G+2, H] (False); "auto":
    # True for scanned layers on TPU, see default_qkv_input_last. Speed only, as gate_up_first;
    # GGUF blocks keep [D, ...].
    qkv_input_last: Any = "auto"
    # the output projection stored [N*H, D] (True) or [N, H, D] (False); "auto": True on TPU,
    # see default_wo_flat. Speed only; GGUF blocks keep [N, H, D].
    wo_flat: Any = "auto"
    # -- architectural switches of other families (defaults: Llama) --------------------
    qkv_bias: bool = False  # biases on the Q, K and V projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim of each query and key head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + w): Gemma's (1 + w) is 1.0
    sandwich_norm: bool = False  # also norm the attention and MLP outputs before the residual add (Gemma 2/3)
    embed_scale: bool = False  # multiply the token embeddings by sqrt(dim) (Gemma)
    mlp_act: str = "silu"  # gated MLP activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    attn_scale: Optional[float] = None  # attention score scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) before the softmax (Gemma 2); 0: off
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) (Gemma 2); 0: off
    # sliding-window attention: a query at position p sees slots p - sliding_window < s <= p.
    # 0: off. layer_types: per layer "full" or "sliding" (None: every layer "sliding" when
    # sliding_window > 0); a longer tuple is cut to n_layers (so n_layers=k keeps the first k).
    sliding_window: int = 0
    layer_types: Optional[tuple] = None
    rope_local_theta: Optional[float] = None  # RoPE base of the "sliding" layers, unscaled (Gemma 3)

    def __post_init__(self):
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)) or v <= 0:
                raise ValueError(f"LlamaConfig.{f} must be a positive int, got {v!r}")
        for f in ("attn_chunk", "max_position"):  # 0: one pass over the cache / no known context
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)) or v < 0:
                raise ValueError(f"LlamaConfig.{f} must be an int >= 0, got {v!r}")
        for f, low in (("rope_theta", "> 0"), ("norm_eps", ">= 0"), ("rope_local_theta", "> 0")):
            v = getattr(self, f)  # a base of 0 or below (or NaN) turns every RoPE angle into NaN
            if v is None and f == "rope_local_theta":
                continue
            ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
                and math.isfinite(v) and (v > 0 if low == "> 0" else v >= 0)
            if not ok:
                raise ValueError(f"LlamaConfig.{f} must be a finite number {low}, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in _DTYPES:
                raise ValueError(f"LlamaConfig.{f}={getattr(self, f)!r}; expected one of {sorted(_DTYPES)}")
        if self.scan_layers == "auto":
            object.__setattr__(self, "scan_layers", default_scan_layers(
                dtype=self.dtype, param_dtype=self.param_dtype, cpu_kernels=self.cpu_kernels))
        elif not isinstance(self.scan_layers, (bool, np.bool_)):
            raise ValueError(f"LlamaConfig.scan_layers must be true, false or 'auto', got {self.scan_layers!r}")
        object.__setattr__(self, "scan_layers", bool(self.scan_layers))
        for f, default, blocks_layout in (
                ("gate_up_first", default_gate_up_first(), "w_gate_up [D, 2, F]"),
                ("qkv_input_last", default_qkv_input_last(scan_layers=self.scan_layers), "wqkv [D, Nkv, G+2, H]"),
                ("wo_flat", default_wo_flat(), "wo [N, H, D]")):
            v = getattr(self, f)  # the TPU layouts: "auto" resolved here, blocks keep their own
            if isinstance(v, str) and v == "auto":
                v = default and not self.weight_blocks
            elif not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"LlamaConfig.{f} must be true, false or 'auto', got {v!r}")
            object.__setattr__(self, f, bool(v))
            if v and self.weight_blocks:
                raise ValueError(f"LlamaConfig.{f}: GGUF block weights (weight_blocks) keep {blocks_layout}")
        if self.cpu_kernels not in KERNEL_MODES:
            raise ValueError(f"LlamaConfig.cpu_kernels={self.cpu_kernels!r}; expected one of {KERNEL_MODES}")
        if isinstance(self.rope_scaling, Mapping):  # accept a plain dict (e.g. from YAML)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.mlp_act not in MLP_ACTIVATIONS:
            raise ValueError(f"LlamaConfig.mlp_act={self.mlp_act!r}; expected one of {MLP_ACTIVATIONS}")
        if not isinstance(self.sliding_window, (int, np.integer)) or self.sliding_window < 0:
            raise ValueError(f"LlamaConfig.sliding_window must be an int >= 0, got {self.sliding_window!r}")
        for f in ("attn_softcap", "final_softcap"):
            if getattr(self, f) < 0:
                raise ValueError(f"LlamaConfig.{f} must be >= 0 (0: off), got {getattr(self, f)!r}")
        if self.attn_scale is not None and not self.attn_scale > 0:
            raise ValueError(f"LlamaConfig.attn_scale must be > 0 or None, got {self.attn_scale!r}")
        if self.weight_blocks:
            bad = [f"{f}={getattr(self, f)}" for f in ("dim", "head_dim", "ffn_dim") if getattr(self, f) % BLOCK_ROWS]
            if bad or self.param_dtype != "float32" or self.dtype != "float32":
                raise ValueError("LlamaConfig.weight_blocks needs float32 dtype and param_dtype and dim, head_dim "
                                 f"and ffn_dim multiples of {BLOCK_ROWS} (got {', '.join(bad) or 'other dtypes'})")
        if self.layer_types is not None:
            lt = tuple(self.layer_types)
            if len(lt) < self.n_layers:
                raise ValueError(f"LlamaConfig.layer_types has {len(lt)} entries for {self.n_layers} layers")
            bad = sorted(set(lt) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"LlamaConfig.layer_types: unknown types {bad}; expected {LAYER_TYPES}")
            if "sliding" in lt and not self.sliding_window:
                raise ValueError("LlamaConfig.layer_types has 'sliding' layers but sliding_window is 0")
            object.__setattr__(self, "layer_types", lt[: self.n_layers])

    @property
    def sliding_layers(self) -> tuple:
        """Per layer: True where the layer attends through the sliding window."""
        if not self.sliding_window:
            return (False,) * self.n_layers
        if self.layer_types is None:
            return (True,) * self.n_layers
        return tuple(t == "sliding" for t in self.layer_types)

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return _DTYPES[self.param_dtype]

    def replace(self, **changes) -> "LlamaConfig":
        """A copy with ``changes``; turning ``weight_blocks`` on also turns ``gate_up_first``,
        ``qkv_input_last`` and ``wo_flat`` off unless they are given (the blocks' layouts),
        and a new ``scan_layers`` resolves ``qkv_input_last`` again unless it is given."""
        if changes.get("weight_blocks"):
            for f in LAYOUT_FIELDS:
                changes.setdefault(f, False)
        if "scan_layers" in changes:
            changes.setdefault("qkv_input_last", "auto")
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        D, F, H = self.dim, self.ffn_dim, self.head_dim
        per_layer = 2 * D + D * H * (self.n_heads * 2 + self.n_kv_heads * 2) + 3 * D * F
        per_layer += (self.n_heads + 2 * self.n_kv_heads) * H if self.qkv_bias else 0
        per_layer += 2 * H if self.qk_norm else 0
        per_layer += 2 * D if self.sandwich_norm else 0
        head = 0 if self.tie_embeddings else self.vocab_size * D
        return self.vocab_size * D + head + D + self.n_layers * per_layer


def tiny_config(
    vocab_size: int = 8,
    n_layers: int = 1,
    dim: int = 16,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 8,
    ffn_dim: int = 32,
    **kw: Any,
) -> LlamaConfig:
    """A tiny config for tests (V around 8)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        **kw,
    )


# --------------------------------------------------------------------------------------
# Sharding hooks
# --------------------------------------------------------------------------------------


def constrain(x: jax.Array, names: tuple) -> jax.Array:
    """Sharding constraint on logical axis names; a no-op without a mesh.

    Names are mapped to mesh axes with the rules of ``nnx.logical_axis_rules`` (names
    without a rule are replicated); a mesh axis that does not divide its dimension is
    dropped. Auto meshes get ``with_sharding_constraint``, all-Explicit ones ``reshard``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    rules = dict(core_spmd.get_logical_axis_rules() or ())
    sizes = dict(mesh.shape)
    spec = []
    for dim, n in zip(x.shape, names):
        axes = rules.get(n) if n is not None else None
        group = (axes,) if isinstance(axes, str) else tuple(axes or ())
        total = math.prod(sizes.get(a, 1) for a in group)
        spec.append(axes if group and dim % total == 0 else None)
    spec = P(*spec)
    if all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def _param(value, names: tuple) -> nnx.Param:
    assert value.ndim == len(names), (value.shape, names)
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


# --------------------------------------------------------------------------------------
# Pure building blocks
# --------------------------------------------------------------------------------------


def rms_norm(x, w, eps, offset: float = 0.0, cpu_kernels: str = "xla"):
    """RMSNorm over the last axis in float32, scaled by ``w`` (``offset + w`` with an offset:
    Gemma's ``1 + w``), cast back to ``x``'s dtype. ``cpu_kernels`` (``LlamaConfig.cpu_kernels``):
    float32 ``x`` on CPU may go to the FFI kernel, whose per-row sum has a fixed order (XLA's
    reduce changes its order, hence a row's bits, with the number of rows)."""
    if use_rms_norm(cpu_kernels, x):
        return _kernel_rms_norm(x, w, float(eps), float(offset))
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = w.astype(jnp.float32)
    if offset:
        scale = offset + scale
    return (y * scale).astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _kernel_rms_norm(x, w, eps: float, offset: float):
    return rms_norm_raw(x, w, eps, offset)


@_kernel_rms_norm.defjvp
def _kernel_rms_norm_jvp(eps, offset, primals, tangents):
    """The derivative of the XLA form (training never sees the kernel)."""
    return jax.jvp(lambda x, w: rms_norm(x, w, eps, offset), primals, tangents)


def rope_inv_freq(cfg: LlamaConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [H/2]; ``local``: those of the sliding layers (``rope_local_theta``,
    no scaling) when the config sets one."""
    H = cfg.head_dim
    if local and cfg.rope_local_theta is not None:
        inv = 1.0 / (cfg.rope_local_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
        return inv.astype(np.float32)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "linear":
        return (inv / rs.factor).astype(np.float32)
    if rs is not None:  # HF _compute_llama3_parameters
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * np.pi / inv
        inv_l = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * inv_l / rs.factor + smooth * inv_l
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(is_medium, smoothed, inv_l)
    return inv.astype(np.float32)


def rope_tables(positions: jax.Array, cfg: LlamaConfig, local: bool = False):
    """cos, sin: float32[B, T, H/2] for integer positions [B, T]."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg, local))
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE. x: [B, T, ..., H]; cos/sin: [B, T, H/2]."""
    h = x.shape[-1] // 2
    extra = x.ndim - 3
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[-1:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[-1:])
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :h], xf[..., h:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _write_cache(c_all, layer, new, positions):
    """Write new [B, T, Nkv, H] into c_all [L, B, Nkv, S, H] at (layer, b, :, positions[b, t]).

    Positions >= S are dropped (never clamped onto other slots)."""
    B, T = positions.shape
    new = new.astype(c_all.dtype)
    if B == 1:
        # a single row: a dynamic_update_slice (in place) is cheaper than a scatter
        upd = jnp.transpose(new, (0, 2, 1, 3))[None]  # [1, 1, Nkv, T, H]
        S = c_all.shape[3]
        start = positions[0, 0]
        ok = start + T <= S
        # out of room: keep the old content (drop), like the scatter below
        at = (layer, 0, 0, jnp.minimum(start, S - T), 0)
        cur = jax.lax.dynamic_slice(c_all, at, upd.shape)
        return jax.lax.dynamic_update_slice(c_all, jnp.where(ok, upd, cur), at)
    Nkv = new.shape[2]
    b_idx = jnp.arange(B)[:, None, None]
    h_idx = jnp.arange(Nkv)[None, None, :]
    return c_all.at[layer, b_idx, h_idx, positions[:, :, None]].set(new, mode="drop")


def _heads_first(q):
    """q [B, T, Nkv, G, H] -> [B, Nkv, T*G, H] (row index t*G + g)."""
    B, T, Nkv, G, H = q.shape
    return jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(B, Nkv, T * G, H)


def _heads_last(o, T):
    """[B, Nkv, T*G, H] -> [B, T, Nkv, G, H]."""
    B, Nkv, TG, H = o.shape
    return jnp.transpose(o.reshape(B, Nkv, T, TG // T, H), (0, 2, 1, 3, 4))


def _softcap(s, cap: float):
    """``cap * tanh(s / cap)`` (Gemma 2's soft-capping); ``cap == 0``: ``s`` unchanged."""
    return jnp.tanh(s / cap) * cap if cap else s


def _visible(slots, qpos, window):
    """Causal (and with ``window``, sliding-window) visibility of ``slots`` from positions
    ``qpos`` (broadcast): ``qpos - window < slot <= qpos``. ``window`` may be traced."""
    ok = slots <= qpos
    if window is not None:
        ok = ok & (slots > qpos - window)
    return ok


def _tree_visible(slots, qpos, tree, window):
    """Visibility [B, T, C] of cache ``slots`` [C] from the tree tokens at positions
    ``qpos`` [B, T] (``tree``: ``(lengths [B], mask [B, T, W], region_depth [B, W])``):
    prefix slots (``< lengths``) are visible, region slots where the mask says so; with a
    ``window`` a slot is also visible only if its position (a region slot's: ``lengths +``
    its depth) is ``> qpos - window``. Slots past the region are never visible."""
    lengths, mask, region_depth = tree
    B, T, W = mask.shape
    rel = slots[None, :] - lengths[:, None]  # [B, C]
    in_reg = (rel >= 0) & (rel < W)
    relc = jnp.clip(rel, 0, W - 1)
    m = jnp.take_along_axis(mask, jnp.broadcast_to(relc[:, None, :], (B, T, relc.shape[1])), axis=2)
    ok = (rel < 0)[:, None, :] | (in_reg[:, None, :] & m)
    if window is not None:
        spos = jnp.where(in_reg, lengths[:, None] + jnp.take_along_axis(region_depth, relc, axis=1),
                         slots[None, :])
        ok = ok & (spos[:, None, :] > qpos[:, :, None] - window)
    return ok


def attention(q, k, v, mask, scale=None, softcap: float = 0.0):
    """One pass. q [B,T,Nkv,G,H], k/v [B,Nkv,S,H], mask bool[B,T,S] -> [B,T,Nkv,G,H]."""
    B, T, _, G, _ = q.shape
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bkqh,bksh->bkqs", _heads_first(q), k, preferred_element_type=jnp.float32) * scale
    s = _softcap(s, softcap)
    qmask = jnp.repeat(mask, G, axis=1)  # [B, T*G, S]
    s = jnp.where(qmask[:, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkqs,bksh->bkqh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _heads_last(o, T).astype(q.dtype)


_NEG = -1e30  # finite "minus infinity": a fully masked chunk gives exp(_NEG - m) = 0, never NaN


def cached_attention(q, k_all, v_all, layer, positions, chunk: int, window=None, scale=None,
                     softcap: float = 0.0, tree=None):
    """Causal attention of q [B,T,Nkv,G,H] (at ``positions`` [B,T]) over layer ``layer`` of
    the cache ``[L,B,Nkv,S,H]``: slot s is visible to position p iff s <= p, and with a
    ``window`` (an int, possibly traced; None: off) also iff s > p - window. ``scale``: the
    score scale (None: ``H ** -0.5``); ``softcap``: Gemma 2's score soft-capping (0: off).

    With ``0 < chunk < S`` only the chunks of slots from the lowest visible one (0 without a
    window) to ``max(positions)`` are read (a ``fori_loop`` with dynamic bounds and an online
    softmax), so the cost follows the longest live row (and the window), not ``max_len``.
    The first chunk read holds a visible slot of some row, so the running max is finite
    after it; a chunk fully masked for a row contributes exactly zero (with a window, a row's
    first chunks may all be masked: their terms are zeroed explicitly). The cache keeps each
    head's slots contiguous ([.., Nkv, S, H]), so a chunk is a plain slice and both products
    are batched over (row, kv head) without transposing the cache.

    ``tree`` (``(lengths, mask, region_depth)``, see :class:`specjax.models.base.TreeAttention`):
    tree attention instead of causal; visibility by :func:`_tree_visible`. ``None`` leaves
    the causal computation exactly as it is."""
    L, B, Nkv, S, H = k_all.shape
    T, G = q.shape[1], q.shape[3]
    dt = q.dtype
    if chunk <= 0 or chunk >= S:
        slots = jnp.arange(S, dtype=jnp.int32)
        if tree is None:
            mask = _visible(slots[None, None, :], positions[:, :, None], window)
        else:
            mask = _tree_visible(slots, positions, tree, window)
        return attention(q, k_all[layer].astype(dt), v_all[layer].astype(dt), mask, scale, softcap)

    scale = 1.0 / math.sqrt(H) if scale is None else scale
    qh = _heads_first(q) * jnp.asarray(scale, dt)  # [B, Nkv, TG, H]
    qpos = jnp.repeat(positions, G, axis=1)  # [B, TG]
    if tree is None:
        n_chunks = (jnp.max(positions) + chunk) // chunk  # chunks holding slots 0..max position
    else:  # chunks holding slots 0..the last region slot (at most every chunk)
        last = jnp.max(tree[0]) + tree[1].shape[-1] - 1
        n_chunks = jnp.minimum((last + chunk) // chunk, -(-S // chunk))
    first = 0
    if window is not None:  # chunks below every row's window hold no visible slot
        low = jnp.min(positions) - window + 1
        if tree is not None:  # region slots sit at or after the prefix
            low = jnp.minimum(low, jnp.min(tree[0]))
        first = jnp.maximum(low, 0) // chunk

    def body(c, carry):
        m, l, acc = carry  # [B,Nkv,TG], [B,Nkv,TG], [B,Nkv,TG,H] (float32)
        nominal = c * chunk
        start = jnp.minimum(nominal, S - chunk)  # the last chunk may overlap the previous one
        kc = jax.lax.dynamic_slice(k_all, (layer, 0, 0, start, 0), (1, B, Nkv, chunk, H))[0].astype(dt)
        vc = jax.lax.dynamic_slice(v_all, (layer, 0, 0, start, 0), (1, B, Nkv, chunk, H))[0].astype(dt)
        slots = start + jnp.arange(chunk, dtype=jnp.int32)
        if tree is None:
            ok = _visible(slots[None, None, :], qpos[:, :, None], window)
        else:
            ok = jnp.repeat(_tree_visible(slots, positions, tree, window), G, axis=1)
        ok = ok & (slots >= nominal)[None, None, :]  # [B,TG,C]
        s = jnp.einsum("bkqh,bkch->bkqc", qh, kc, preferred_element_type=jnp.float32)
        s = _softcap(s, softcap)
        s = jnp.where(ok[:, None], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        if window is not None or tree is not None:  # a row with no visible slot yet has m_new = _NEG and p = 1
            p = jnp.where(ok[:, None], p, 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        pv = jnp.einsum("bkqc,bkch->bkqh", p.astype(dt), vc, preferred_element_type=jnp.float32)
        return m_new, l, acc * corr[..., None] + pv

    TG = T * G
    init = (
        jnp.full((B, Nkv, TG), _NEG, jnp.float32),
        jnp.zeros((B, Nkv, TG), jnp.float32),
        jnp.zeros((B, Nkv, TG, H), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(first, n_chunks, body, init)
    return _heads_last(acc / l[..., None], T).astype(dt)


def kernel_attention(q, k_all, v_all, layer, positions, chunk: int, window=None, scale=None,
                     softcap: float = 0.0, tree=None):
    """:func:`cached_attention` by the FFI kernel (models/kernels/attention.cc), float32 CPU,
    causal or (``tree``: ``(lengths, mask, region_depth)``, as there) over a draft tree.
    Its derivative is that of :func:`cached_attention` (XLA), so training is unaffected."""
    w = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)
    scale = None if scale is None else float(scale)
    if tree is not None:
        lengths, mask, region_depth = tree
        return _kernel_tree_attention(q, k_all, v_all, layer, positions, w, jnp.asarray(lengths, jnp.int32),
                                      jnp.asarray(mask, bool), jnp.asarray(region_depth, jnp.int32), chunk,
                                      scale, float(softcap))
    return _kernel_attention(q, k_all, v_all, layer, positions, w, chunk, scale, float(softcap))


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 7, 8))
def _kernel_attention(q, k_all, v_all, layer, positions, window, chunk: int, scale, softcap):
    return attention_raw(q, k_all, v_all, layer, positions, window, scale=scale, softcap=softcap)


@_kernel_attention.defjvp
def _kernel_attention_jvp(chunk, scale, softcap, primals, tangents):
    q, k_all, v_all, layer, positions, window = primals
    dq, dk, dv = tangents[:3]
    return jax.jvp(lambda q, k, v: cached_attention(q, k, v, layer, positions, chunk, window, scale, softcap),
                   (q, k_all, v_all), (dq, dk, dv))


@functools.partial(jax.custom_jvp, nondiff_argnums=(9, 10, 11))
def _kernel_tree_attention(q, k_all, v_all, layer, positions, window, lengths, mask, region_depth, chunk: int,
                           scale, softcap):
    return attention_raw(q, k_all, v_all, layer, positions, window, scale=scale, softcap=softcap,
                         tree=(lengths, mask, region_depth))


@_kernel_tree_attention.defjvp
def _kernel_tree_attention_jvp(chunk, scale, softcap, primals, tangents):
    q, k_all, v_all, layer, positions, window, lengths, mask, region_depth = primals
    dq, dk, dv = tangents[:3]
    tree = (lengths, mask, region_depth)
    return jax.jvp(lambda q, k, v: cached_attention(q, k, v, layer, positions, chunk, window, scale, softcap,
                                                    tree=tree),
                   (q, k_all, v_all), (dq, dk, dv))


# --------------------------------------------------------------------------------------
# Layout conversion: canonical (HF-like) <-> internal fused
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockWeights:
    """A canonical weight matrix ``[..., out, in]`` as a GGUF file stores it: ``code`` int8
    ``[..., out, in]`` and float32 ``scale`` / ``offset`` ``[..., out, in / 32]``, the weight
    being ``code * scale + offset`` per block of 32 inputs (Q8_0: offset -0.0; Q4_0: code q - 8;
    Q4_1: code q, offset m). The product is exact in float32 (a float16 scale times a code
    of at most 8 bits), so :meth:`dequantize` is gguf's own dequantization, bit for bit."""

    code: np.ndarray
    scale: np.ndarray
    offset: np.ndarray

    @property
    def shape(self) -> tuple:
        return tuple(self.code.shape)

    @property
    def ndim(self) -> int:
        return self.code.ndim

    def __getitem__(self, idx) -> "BlockWeights":
        """Index the leading (e.g. layer) axes of all three arrays alike."""
        return BlockWeights(self.code[idx], self.scale[idx], self.offset[idx])

    def dequantize(self) -> np.ndarray:
        code = np.asarray(self.code)
        w = code.reshape(code.shape[:-1] + (-1, BLOCK_ROWS)).astype(np.float32)  # one buffer, in place below
        np.multiply(w, np.asarray(self.scale, np.float32)[..., None], out=w)
        np.add(w, np.asarray(self.offset, np.float32)[..., None], out=w)
        return w.reshape(code.shape)


def _dense(w) -> Any:
    """A canonical weight as float32 values (BlockWeights dequantized)."""
    return w.dequantize() if isinstance(w, BlockWeights) else w


# a layer's weight matrices: canonical names, and the fused ones (internal layout) that hold
# them, which keep GGUF blocks with ``name + "_scale"`` / ``"_offset"`` beside them
MATRIX_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_FUSED_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


def _fuse_block_params(cfg: LlamaConfig, w: Mapping[str, Any], lead: tuple) -> dict:
    """Scales (or offsets) of a layer's block matrices, canonical ``[..., out, in / 32]``, in
    :func:`fuse_layer`'s layout with the input axis 32 times shorter (its steps, with the
    block counts in place of the input sizes)."""
    D, H, Nkv, G, N = cfg.dim, cfg.head_dim, cfg.n_kv_heads, cfg.group_size, cfg.n_heads
    n, d = len(lead), D // BLOCK_ROWS
    q = w["wq"].reshape(lead + (Nkv, G, H, d))
    k = w["wk"].reshape(lead + (Nkv, 1, H, d))
    v = w["wv"].reshape(lead + (Nkv, 1, H, d))
    qkv = np.concatenate([q, k, v], axis=-3)
    gu = np.stack([w["w_gate"], w["w_up"]], axis=n)
    c = np.ascontiguousarray
    return {"wqkv": c(np.moveaxis(qkv, -1, n)),  # [.., D/32, Nkv, G+2, H]
            "wo": c(np.swapaxes(w["wo"], -1, -2)).reshape(lead + (N, H // BLOCK_ROWS, D)),
            "w_gate_up": c(np.moveaxis(gu, -1, n)),  # [.., D/32, 2, F]
            "w_down": c(np.swapaxes(w["w_down"], -1, -2))}  # [.., F/32, D]


def fuse_blocks(cfg: LlamaConfig, w: Mapping[str, Any]) -> dict:
    """:func:`fuse_layer` for a layer whose matrices are :class:`BlockWeights`: the fused
    codes under each matrix's name and its scales / offsets under ``name + "_scale"`` /
    ``"_offset"``, in the fused layout with the input axis 32 times shorter. Fused codes all
    in 0..15 (Q4_1) are packed two per byte (:func:`~specjax.models.cpu_kernels.pack_q4`:
    uint8, the last axis half as long), the same weights at half the bytes."""
    mats = MATRIX_KEYS
    missing = [k for k in mats if not isinstance(w[k], BlockWeights)]
    if missing:
        raise ValueError(f"weight_blocks: {missing} are not BlockWeights")
    plain = {k: v for k, v in w.items() if k not in mats}
    out = fuse_layer(cfg, {**plain, **{k: w[k].code for k in mats}})
    out.update({k: pack_q4(out[k]) for k in _FUSED_MATRICES if packable_q4(out[k])})
    lead = np.shape(w["attn_norm"])[:-1]
    for part in ("scale", "offset"):
        fused = _fuse_block_params(cfg, {k: np.asarray(getattr(w[k], part), np.float32) for k in mats}, lead)
        out.update({f"{name}_{part}": a for name, a in fused.items()})
    return out


def unfuse_blocks(cfg: LlamaConfig, w: Mapping[str, Any]) -> dict:
    """Inverse of :func:`fuse_blocks`: canonical weights with :class:`BlockWeights` matrices."""
    w = {k: _np(v) for k, v in w.items()}
    w.update({k: unpack_q4(w[k]) for k in _FUSED_MATRICES if w[k].dtype == np.uint8})
    codes = unfuse_layer(cfg, {k: v for k, v in w.items() if not k.endswith(("_scale", "_offset"))})
    lead = np.shape(w["attn_norm"])[:-1]
    n, d = len(lead), cfg.dim // BLOCK_ROWS
    D, H, Nkv, G, N = cfg.dim, cfg.head_dim, cfg.n_kv_heads, cfg.group_size, cfg.n_heads
    c = np.ascontiguousarray
    parts = {}
    for part in ("scale", "offset"):  # the steps of _fuse_block_params, undone
        qkv = np.moveaxis(w[f"wqkv_{part}"], n, -1)  # [.., Nkv, G+2, H, D/32]
        gu = np.moveaxis(w[f"w_gate_up_{part}"], n, -1)  # [.., 2, F, D/32]
        parts[part] = {
            "wq": c(qkv[..., :G, :, :]).reshape(lead + (Nkv * G * H, d)),
            "wk": c(qkv[..., G, :, :]).reshape(lead + (Nkv * H, d)),
            "wv": c(qkv[..., G + 1, :, :]).reshape(lead + (Nkv * H, d)),
            "wo": c(np.swapaxes(w[f"wo_{part}"].reshape(lead + (N * H // BLOCK_ROWS, D)), -1, -2)),
            "w_gate": c(gu[(slice(None),) * n + (0,)]),
            "w_up": c(gu[(slice(None),) * n + (1,)]),
            "w_down": c(np.swapaxes(w[f"w_down_{part}"], -1, -2)),
        }
    out = dict(codes)
    for k in MATRIX_KEYS:
        out[k] = BlockWeights(codes[k], parts["scale"][k], parts["offset"][k])
    return out


LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
# per-layer tensors of the architectural switches (LlamaConfig.qkv_bias / qk_norm / sandwich_norm)
OPTIONAL_LAYER_KEYS = {"qkv_bias": ("bq", "bk", "bv"), "qk_norm": ("q_norm", "k_norm"),
                       "sandwich_norm": ("post_attn_norm", "post_mlp_norm")}


def layer_keys(cfg: LlamaConfig) -> tuple:
    """Canonical per-layer tensor names for ``cfg`` (LAYER_KEYS plus its switches' tensors)."""
    extra = tuple(k for flag, ks in OPTIONAL_LAYER_KEYS.items() if getattr(cfg, flag) for k in ks)
    return LAYER_KEYS + extra


def _np(x):
    if isinstance(x, jax.core.Tracer):  # traced construction (specjax.sharding): stay in jax
        return x
    return np.asarray(jax.device_get(x))


def fuse_layer(cfg: LlamaConfig, w: Mapping[str, Any]) -> dict:
    """Canonical per-layer weights (any leading axes) -> internal fused ``[in, out]`` layout."""
    D, H, Nkv, G, N = cfg.dim, cfg.head_dim, cfg.n_kv_heads, cfg.group_size, cfg.n_heads
    # traced inputs (jax.jit / nnx.eval_shape: specjax.sharding builds params directly into
    # their shardings) use jax.numpy; concrete inputs take the numpy path unchanged
    xp = jnp if any(isinstance(a, jax.core.Tracer) for a in w.values()) else np
    contig = np.ascontiguousarray if xp is np else (lambda a: a)
    w = {k: (_np(v) if xp is np else v) for k, v in w.items()}
    lead = w["attn_norm"].shape[:-1]
    n = len(lead)
    q = w["wq"].reshape(lead + (Nkv, G, H, D))
    k = w["wk"].reshape(lead + (Nkv, 1, H, D))
    v = w["wv"].reshape(lead + (Nkv, 1, H, D))
    qkv = xp.concatenate([q, k, v], axis=-3)  # [.., Nkv, G+2, H, D]
    gu = xp.stack([w["w_gate"], w["w_up"]], axis=n)  # [.., 2, F, D]
    gu = xp.swapaxes(gu, -1, -2) if cfg.gate_up_first else xp.moveaxis(gu, -1, n)
    out = {
        "attn_norm": w["attn_norm"],
        # [.., D, Nkv, G+2, H], or as it is (qkv_input_last)
        "wqkv": contig(qkv if cfg.qkv_input_last else xp.moveaxis(qkv, -1, n)),
        "wo": contig(xp.swapaxes(w["wo"], -1, -2)).reshape(lead + ((N * H,) if cfg.wo_flat else (N, H)) + (D,)),
        "mlp_norm": w["mlp_norm"],
        "w_gate_up": contig(gu),  # [.., D, 2, F], or [.., 2, D, F] (gate_up_first)
        "w_down": contig(xp.swapaxes(w["w_down"], -1, -2)),  # [.., F, D]
    }
    if cfg.qkv_bias:  # the same grouping as wqkv: [.., Nkv, G+2, H]
        out["bqkv"] = contig(xp.concatenate([w["bq"].reshape(lead + (Nkv, G, H)),
                                             w["bk"].reshape(lead + (Nkv, 1, H)),
                                             w["bv"].reshape(lead + (Nkv, 1, H))], axis=-2))
    for k in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"):
        if k in w:
            out[k] = w[k]
    return out


def unfuse_layer(cfg: LlamaConfig, w: Mapping[str, Any]) -> dict:
    """Inverse of :func:`fuse_layer` (numpy out)."""
    D, H, Nkv, G, N = cfg.dim, cfg.head_dim, cfg.n_kv_heads, cfg.group_size, cfg.n_heads
    w = {k: _np(v) for k, v in w.items()}
    lead = w["attn_norm"].shape[:-1]
    n = len(lead)
    qkv = w["wqkv"] if cfg.qkv_input_last else np.moveaxis(w["wqkv"], n, -1)  # [.., Nkv, G+2, H, D]
    gu = w["w_gate_up"]
    gu = np.swapaxes(gu, -1, -2) if cfg.gate_up_first else np.moveaxis(gu, n, -1)  # [.., 2, F, D]
    c = np.ascontiguousarray
    out = {
        "attn_norm": w["attn_norm"],
        "wq": c(qkv[..., :G, :, :]).reshape(lead + (Nkv * G * H, D)),
        "wk": c(qkv[..., G, :, :]).reshape(lead + (Nkv * H, D)),
        "wv": c(qkv[..., G + 1, :, :]).reshape(lead + (Nkv * H, D)),
        "wo": c(np.swapaxes(w["wo"].reshape(lead + (N * H, D)), -1, -2)),  # [N, H, D] or [N*H, D]
        "mlp_norm": w["mlp_norm"],
        "w_gate": c(np.take(gu, 0, axis=n)),
        "w_up": c(np.take(gu, 1, axis=n)),
        "w_down": c(np.swapaxes(w["w_down"], -1, -2)),
    }
    if "bqkv" in w:
        b = w["bqkv"]  # [.., Nkv, G+2, H]
        out["bq"] = c(b[..., :G, :]).reshape(lead + (Nkv * G * H,))
        out["bk"] = c(b[..., G, :]).reshape(lead + (Nkv * H,))
        out["bv"] = c(b[..., G + 1, :]).reshape(lead + (Nkv * H,))
    for k in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"):
        if k in w:
            out[k] = w[k]
    return out


# internal parameter layout: every matrix is [in, out] (x @ W, what XLA CPU multiplies
# fastest, see scripts/bench_step.py); logical axis names per dimension
_LAYER_NAMES = {
    "attn_norm": ("embed",),
    "wqkv": ("embed", "kv_heads", None, "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "mlp_norm": ("embed",),
    "w_gate_up": ("embed", None, "mlp"),
    "w_down": ("mlp", "embed"),
}
_OPTIONAL_NAMES = {
    "qkv_bias": {"bqkv": ("kv_heads", None, "head_dim")},
    "qk_norm": {"q_norm": ("head_dim",), "k_norm": ("head_dim",)},
    "sandwich_norm": {"post_attn_norm": ("embed",), "post_mlp_norm": ("embed",)},
}


def layer_param_names(cfg: LlamaConfig) -> dict:
    """Internal per-layer parameters for ``cfg`` -> their logical axis names."""
    out = dict(_LAYER_NAMES)
    if cfg.gate_up_first:
        out["w_gate_up"] = (None, "embed", "mlp")
    if cfg.qkv_input_last:
        out["wqkv"] = ("kv_heads", None, "head_dim", "embed")
    if cfg.wo_flat:
        out["wo"] = ("heads", "embed")
    for flag, names in _OPTIONAL_NAMES.items():
        if getattr(cfg, flag):
            out.update(names)
    return out


def expected_shapes(cfg: LlamaConfig) -> dict:
    """Shapes of the canonical weight dict."""
    V, D, L, N, Nkv, H, F = (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                             cfg.head_dim, cfg.ffn_dim)
    s = {
        "embed": (V, D),
        "final_norm": (D,),
        "attn_norm": (L, D),
        "wq": (L, N * H, D),
        "wk": (L, Nkv * H, D),
        "wv": (L, Nkv * H, D),
        "wo": (L, D, N * H),
        "mlp_norm": (L, D),
        "w_gate": (L, F, D),
        "w_up": (L, F, D),
        "w_down": (L, D, F),
    }
    if cfg.qkv_bias:
        s.update(bq=(L, N * H), bk=(L, Nkv * H), bv=(L, Nkv * H))
    if cfg.qk_norm:
        s.update(q_norm=(L, H), k_norm=(L, H))
    if cfg.sandwich_norm:
        s.update(post_attn_norm=(L, D), post_mlp_norm=(L, D))
    if not cfg.tie_embeddings:
        s["lm_head"] = (V, D)
    return s


def stack_layers(layers: Mapping[str, list], unit: str = "layers") -> dict:
    """Stack per-layer arrays (``name -> [array or None] * L``) into ``[L, ...]`` arrays, with a
    ValueError that names missing layers or shapes that differ across layers (the loaders
    turn it into their own error type)."""
    out = {}
    for k, per in layers.items():
        missing = [i for i, a in enumerate(per) if a is None]
        if missing:
            raise ValueError(f"missing {k} for {unit} {missing[:5]}{'...' if len(missing) > 5 else ''}")
        shapes = {a.shape for a in per}
        if len(shapes) != 1:
            raise ValueError(f"{k} has different shapes across {unit}: {sorted(shapes)}")
        out[k] = np.stack(per)
    return out


def check_weights(cfg: LlamaConfig, weights: Mapping[str, Any], source: str = "weights") -> None:
    exp = expected_shapes(cfg)
    missing = sorted(set(exp) - set(weights))
    extra = sorted(set(weights) - set(exp))
    if missing or extra:
        raise ValueError(f"{source}: missing tensors {missing}, unexpected tensors {extra}")
    for k, shp in exp.items():
        got = tuple(np.shape(weights[k]))
        if got != shp:
            raise ValueError(f"{source}: tensor {k!r} has shape {got}, config expects {shp}")


# --------------------------------------------------------------------------------------
# NNX modules
# --------------------------------------------------------------------------------------


class Block(nnx.Module):
    """One decoder layer; with ``stacked=True`` every parameter has a leading layers axis."""

    def __init__(self, cfg: LlamaConfig, w: Mapping[str, Any], stacked: bool = False):
        self.cfg = cfg
        self.stacked = stacked  # every parameter [L, ...]; a call reads layer `layer` of it
        pd = cfg.weight_dtype
        lead = ("layers",) if stacked else ()
        for k, names in layer_param_names(cfg).items():
            if cfg.weight_blocks and k in _FUSED_MATRICES:  # codes: int8, or packed Q4 (uint8)
                dt = jnp.uint8 if w[k].dtype == np.uint8 else jnp.int8
            else:
                dt = pd
            setattr(self, k, _param(jnp.asarray(w[k], dt), lead + names))
        if cfg.weight_blocks:  # the blocks' scales and offsets: the weight's axes, input 32x shorter
            for k in _FUSED_MATRICES:
                for part in ("scale", "offset"):
                    setattr(self, f"{k}_{part}", _param(jnp.asarray(w[f"{k}_{part}"], jnp.float32),
                                                        lead + _LAYER_NAMES[k]))

    def _p(self, name, layer):
        """This layer's parameter ``name``: sliced out of the stack if stacked."""
        v = getattr(self, name)[...]
        return jax.lax.dynamic_index_in_dim(v, layer, 0, keepdims=False) if self.stacked else v

    def _mm(self, x, name, layer):
        """x @ this layer's weight ``name``: a stacked weight is read in place by the CPU kernel
        where it applies (no per-layer copy out of the stack), else the layer's slice goes to
        :func:`_linear`."""
        dt = self.cfg.compute_dtype
        if self.cfg.weight_blocks:
            return self._mm_blocks(x, name, layer)
        if self.stacked:
            w = getattr(self, name)[...]
            B, T, D = x.shape
            w3, x2 = w.reshape(w.shape[0], D, -1), x.reshape(B * T, D)
            if _stack_read_in_place(self.cfg.cpu_kernels, x2, w3, dt):
                return small_matmul_stacked(x2, w3, layer).reshape(B, T, -1)
        return _linear(x, self._p(name, layer).astype(dt), self.cfg.cpu_kernels)

    def _contract(self, x, name, layer, axis: int):
        """x [B, T, D] times this layer's weight ``name`` contracted on its axis ``axis``, as
        it is stored (the TPU layouts: ``w_gate_up [2, D, F]``, ``wqkv [Nkv, G+2, H, D]``)
        -> [B*T, the weight's other axes]."""
        B, T, D = x.shape
        w = self._p(name, layer).astype(self.cfg.compute_dtype)
        return _product(x.reshape(B * T, D), w, axis)

    def _mm_blocks(self, x, name, layer):
        """:meth:`_mm` for GGUF block weights: the block kernel where it applies (a stacked
        layer read in place), else the weights rebuilt in float32 for :func:`_linear` (the
        same values)."""
        B, T, D = x.shape
        x2 = x.reshape(B * T, D)
        parts = [getattr(self, name)[...], getattr(self, f"{name}_scale")[...], getattr(self, f"{name}_offset")[...]]
        if self.stacked:
            code3 = parts[0].reshape(parts[0].shape[0], D, -1)
            if use_block_matmul(self.cfg.cpu_kernels, x2, code3):
                s3, o3 = (a.reshape(a.shape[0], D // BLOCK_ROWS, -1) for a in parts[1:])
                return block_matmul_stacked(x2, code3, s3, o3, layer).reshape(B, T, -1)
            parts = [jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False) for a in parts]
        code, scale, offset = parts
        c2 = code.reshape(D, -1)
        s2, o2 = (a.reshape(D // BLOCK_ROWS, -1) for a in (scale, offset))
        if use_block_matmul(self.cfg.cpu_kernels, x2, c2):
            return block_matmul(x2, c2, s2, o2).reshape(B, T, -1)
        w = dequantize_blocks(c2, s2, o2).reshape(code.shape[:-1] + (-1,))  # packed: twice the last axis
        return _linear(x, w, self.cfg.cpu_kernels)

    def __call__(self, x, k_all, v_all, layer, positions, cos, sin, window=None, tree=None):
        """``layer``: this layer's index (into the cache, and into the parameters when
        stacked). ``window``: this layer's sliding window (an int, traced in the scanned path)
        or None for full causal attention. ``tree``: ``(slots [B, T], lengths, mask,
        region_depth)`` for tree attention (new KV written at ``slots``; the attention kernel
        where the causal call would use it, else XLA's)."""
        cfg = self.cfg
        dt = cfg.compute_dtype
        B, T, D = x.shape
        Nkv, G, H = cfg.n_kv_heads, cfg.group_size, cfg.head_dim
        off, eps, ck = cfg.norm_offset, cfg.norm_eps, cfg.cpu_kernels

        h = rms_norm(x, self._p("attn_norm", layer), eps, off, ck)
        qkv = self._contract(h, "wqkv", layer, 3) if cfg.qkv_input_last else self._mm(h, "wqkv", layer)
        qkv = qkv.reshape(B, T, Nkv, G + 2, H)
        if cfg.qkv_bias:
            qkv = qkv + self._p("bqkv", layer).astype(dt)
        q, k, v = qkv[:, :, :, :G], qkv[:, :, :, G], qkv[:, :, :, G + 1]
        if cfg.qk_norm:
            q = rms_norm(q, self._p("q_norm", layer), eps, off, ck)
            k = rms_norm(k, self._p("k_norm", layer), eps, off, ck)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        slots = positions if tree is None else tree[0]
        k_all = _write_cache(k_all, layer, k, slots)
        v_all = _write_cache(v_all, layer, v, slots)
        attn = dict(window=window, scale=cfg.attn_scale, softcap=cfg.attn_softcap)
        tv = None if tree is None else tree[1:]  # (lengths, mask, region_depth)
        if use_attention(cfg.cpu_kernels, q, k_all):
            o = kernel_attention(q, k_all, v_all, jnp.asarray(layer, jnp.int32), positions, cfg.attn_chunk,
                                 tree=tv, **attn)
        else:
            o = cached_attention(q, k_all, v_all, layer, positions, cfg.attn_chunk, tree=tv, **attn)  # [B,T,Nkv,G,H]
        h = self._mm(o.reshape(B, T, cfg.n_heads * H), "wo", layer)
        if cfg.sandwich_norm:
            h = rms_norm(h, self._p("post_attn_norm", layer), eps, off, ck)
        x = x + h
        x = constrain(x, ("batch", None, "embed"))

        h = rms_norm(x, self._p("mlp_norm", layer), eps, off, ck)
        gu = self._contract(h, "w_gate_up", layer, 1) if cfg.gate_up_first else self._mm(h, "w_gate_up", layer)
        gu = gu.reshape(B, T, 2, cfg.ffn_dim)
        if cfg.mlp_act == "gelu_tanh":
            a = jax.nn.gelu(gu[:, :, 0], approximate=True) * gu[:, :, 1]
        else:
            a = jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]
        h = self._mm(a, "w_down", layer)
        if cfg.sandwich_norm:
            h = rms_norm(h, self._p("post_mlp_norm", layer), eps, off, ck)
        x = x + h
        x = constrain(x, ("batch", None, "embed"))
        return x, k_all, v_all


def _linear(x, w, cpu_kernels: str = "xla"):
    """x [B, T, in] times a weight stored [*in, *out] -> [B, T, prod(out)].

    Both operands are flattened to 2-D first (free reshapes) so XLA sees one plain
    matmul; a multi-dimensional operand makes XLA CPU transpose the weight every call.
    ``cpu_kernels`` is ``LlamaConfig.cpu_kernels``: small float32 matmuls on CPU may go to the
    streaming FFI kernel (models/cpu_kernels.py), same result up to float32 rounding. A
    weight in another dtype than ``x`` (a float16 draft head) goes to the kernel as it is
    where the kernel takes it, else it is cast to ``x``'s dtype first."""
    B, T, D = x.shape
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        # on a mesh (specjax.sharding): merge only the input axes of the weight. Merging a
        # sharded minor output axis (w_gate_up [D, 2, F] with F split) is not a sharding
        # XLA can express, so it would all-gather the weight on every call.
        k = next(i for i in range(1, w.ndim + 1) if math.prod(w.shape[:i]) == D)
        y = _matmul(x.reshape(B * T, D), w.reshape((D,) + w.shape[k:]).astype(x.dtype))
        return y.reshape((B, T) + w.shape[k:])  # [B, T, *out]: callers reshape as they need
    x2, w2 = x.reshape(B * T, D), w.reshape(D, -1)
    if use_small_matmul(cpu_kernels, x2, w2):
        return small_matmul(x2, w2).reshape(B, T, -1)
    return _matmul(x2, w2.astype(x2.dtype)).reshape(B, T, -1)


# backends whose compilers rewrite a one-row weight product (a vector times a matrix) into an
# elementwise multiply and a reduction (see _product)
ONE_ROW_AS_TWO = ("gpu", "tpu")


def one_row_as_two(backend: Optional[str] = None) -> bool:
    """Whether a one-row weight product is computed as two rows (:func:`_product`): on the
    backends of :data:`ONE_ROW_AS_TWO`, or as ``$SPECJAX_TWO_ROWS`` says (1 / 0 / auto; read
    when a program is traced), so that a device can time both forms."""
    env = os.environ.get("SPECJAX_TWO_ROWS", "").strip().lower()
    if env in ("1", "on", "true"):
        return True
    if env in ("0", "off", "false"):
        return False
    if env not in ("", "auto"):
        raise ValueError(f"SPECJAX_TWO_ROWS must be 1, 0 or auto, got {env!r}")
    return (backend or jax.default_backend()) in ONE_ROW_AS_TWO


def _product(x2, w, axis: int = 0, preferred=None):
    """``x2 [M, D]`` times ``w`` contracted on its axis ``axis`` -> ``[M, w's other axes]``.

    On a GPU and a TPU one row is computed as two, so that the compiler keeps a matrix
    product, which reads the weight once. Both rewrite a vector-matrix product into a
    multiply and a reduction: XLA's GPU compiler below ~10M multiply-adds
    (``DotStrengthReduction``), and where the output is narrow (SmolLM2's o and down
    projections, Llama-3.2-1B's o projection) it first writes the transposed products, a
    weight-sized array, and reads them back; XLA:TPU at every size, on the vector units
    instead of the matrix unit, at 2.2-4.3x the cycles of the two-row product by its own
    estimate (the llama3-8b shape's layers and LM head). ``scripts/accel_aot.py``, batch 1,
    bf16: a SmolLM2-135M decode step on the H200 names 282 MB instead of 424; the llama3-8b
    shape's step on a TPU v5p is estimated at 18.3M cycles instead of 43.5M (BENCHMARKS.md).
    The second row: on a GPU the same row (a zero row adds a kernel per product), on a TPU a
    zero row (the same row is estimated 17% dearer). Elsewhere (the CPU) one plain product;
    ``$SPECJAX_TWO_ROWS`` overrides (:func:`one_row_as_two`)."""
    dims = (((1,), (axis,)), ((), ()))
    backend = jax.default_backend()
    if x2.shape[0] == 1 and one_row_as_two(backend):
        two = jnp.broadcast_to(x2, (2,) + x2.shape[1:]) if backend == "gpu" else jnp.pad(x2, ((0, 1), (0, 0)))
        return jax.lax.dot_general(two, w, dims, preferred_element_type=preferred)[:1]
    return jax.lax.dot_general(x2, w, dims, preferred_element_type=preferred)


def _matmul(x2, w):
    """``x2 [M, D] @ w [D, *out]`` (:func:`_product`)."""
    return _product(x2, w)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, weights: Mapping[str, Any]):
        check_weights(cfg, weights)
        self.cfg = cfg
        pd = cfg.weight_dtype
        head_name = "embed" if cfg.tie_embeddings else "lm_head"
        if not cfg.weight_blocks:
            weights = {k: _dense(v) for k, v in weights.items()}
        elif not isinstance(weights[head_name], BlockWeights):
            raise ValueError(f"LlamaConfig.weight_blocks: {head_name} is not BlockWeights (a GGUF block tensor)")
        for name in ("embed", "lm_head"):
            if name not in weights:
                continue
            w = weights[name]
            if isinstance(w, BlockWeights) and name == head_name:
                # stored [D, V] so that the LM head is a plain x @ E (the token lookup gathers
                # columns); scales and offsets [D / 32, V]
                setattr(self, name, _param(jnp.asarray(np.ascontiguousarray(w.code.T)), ("embed", "vocab")))
                for part in ("scale", "offset"):
                    setattr(self, f"{name}_{part}", _param(
                        jnp.asarray(np.ascontiguousarray(np.asarray(getattr(w, part), np.float32).T)), ("embed", "vocab")))
            else:
                setattr(self, name, _param(jnp.asarray(_np(_dense(w)).T, pd), ("embed", "vocab")))
        self.final_norm = _param(jnp.asarray(weights["final_norm"], pd), ("embed",))
        layer_w = {k: weights[k] for k in layer_keys(cfg)}
        fused = fuse_blocks(cfg, layer_w) if cfg.weight_blocks else fuse_layer(cfg, layer_w)
        if cfg.scan_layers:
            self.layers = Block(cfg, fused, stacked=True)
        else:
            self.layers = nnx.List([Block(cfg, {k: v[i] for k, v in fused.items()}) for i in range(cfg.n_layers)])

    def canonical_weights(self, blocks: bool = False) -> dict:
        """Canonical weights; ``blocks``: keep GGUF block matrices as :class:`BlockWeights`
        (else float32 values, the same either way)."""
        cfg = self.cfg
        names = list(layer_param_names(cfg))
        if cfg.weight_blocks:
            names += [f"{k}_{p}" for k in _FUSED_MATRICES for p in ("scale", "offset")]
        if cfg.scan_layers:
            fused = {k: getattr(self.layers, k)[...] for k in names}
        else:
            fused = {k: jnp.stack([getattr(b, k)[...] for b in self.layers]) for k in names}
        out = unfuse_blocks(cfg, fused) if cfg.weight_blocks else unfuse_layer(cfg, fused)
        out.update(self._embeddings(), final_norm=_np(self.final_norm[...]))
        if not blocks:
            out = {k: _dense(v) for k, v in out.items()}
        return out

    def _embeddings(self) -> dict:
        """Canonical ``embed`` (and ``lm_head`` when untied), [V, D]: numpy, or BlockWeights."""
        out = {}
        for name in ("embed", "lm_head"):
            if not hasattr(self, name):
                continue
            parts = (name, f"{name}_scale", f"{name}_offset") if hasattr(self, f"{name}_scale") else (name,)
            arrays = [np.ascontiguousarray(_np(getattr(self, n)[...]).T) for n in parts]
            out[name] = BlockWeights(*arrays) if len(arrays) == 3 else arrays[0]
        return out

    def embedding_weights(self) -> dict:
        """``{"embed": [V, D]}`` (and ``"lm_head"`` when untied) as float32 numpy arrays: the
        part of :meth:`canonical_weights` a draft built on the target needs, without
        rebuilding the layers' blocks."""
        return {k: _dense(v) for k, v in self._embeddings().items()}

    def _head_weights(self):
        """(code or float weights [D, V], scale, offset or None) of the LM head."""
        name = "embed" if self.cfg.tie_embeddings else "lm_head"
        if hasattr(self, f"{name}_scale"):
            return (getattr(self, name)[...], getattr(self, f"{name}_scale")[...],
                    getattr(self, f"{name}_offset")[...])
        return getattr(self, name)[...], None, None

    def _embed(self, tokens):
        """The embeddings of ``tokens`` [B, T] as [B, T, D] (GGUF blocks: rebuilt, the same values)."""
        if hasattr(self, "embed_scale"):
            cols = [jnp.take(getattr(self, n)[...], tokens, axis=1) for n in ("embed", "embed_scale", "embed_offset")]
            x = dequantize_blocks(*(jnp.moveaxis(c, 0, -2) for c in cols))  # [B, D, T]
            return jnp.transpose(x, (0, 2, 1))
        return jnp.transpose(jnp.take(self.embed[...], tokens, axis=1), (1, 2, 0))

    def __call__(self, tokens, cache: KVCache, return_hidden=False,
                 tree: Optional[TreeAttention] = None) -> ModelOutput:
        """``return_hidden``: False, True (the final hidden states) or a tuple of hidden-state
        indices (:func:`specjax.models.base.hidden_indices`), concatenated on the feature axis."""
        cfg = self.cfg
        dt = cfg.compute_dtype
        B, T = tokens.shape
        L = cfg.n_layers
        want = hidden_indices(return_hidden, L)
        # indices inside the stack (0: the embeddings; 1..L-1: after that layer); L is the
        # final norm's output, taken at the end
        inner = sorted({i for i in (want or ()) if i < L})
        states = {}
        lengths = cache.lengths.astype(jnp.int32)
        if tree is None:
            positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
            tv = None
        else:  # tree nodes: positions by depth, KV at their region slots
            positions = lengths[:, None] + jnp.asarray(tree.depth, jnp.int32)
            tv = (lengths[:, None] + jnp.asarray(tree.offset, jnp.int32)[:, None]
                  + jnp.arange(T, dtype=jnp.int32)[None], lengths,
                  jnp.asarray(tree.mask, bool), jnp.asarray(tree.region_depth, jnp.int32))
        cos, sin = rope_tables(positions, cfg)
        sliding = cfg.sliding_layers
        # sliding layers with their own RoPE base (Gemma 3) get their own tables
        local = cfg.rope_local_theta is not None and any(sliding)
        cos_l, sin_l = rope_tables(positions, cfg, local=True) if local else (cos, sin)

        x = self._embed(tokens).astype(dt)  # [B,T,D]
        if cfg.embed_scale:
            x = x * jnp.asarray(math.sqrt(cfg.dim), dt)
        x = constrain(x, ("batch", None, "embed"))
        if 0 in inner:
            states[0] = x
        k_all, v_all = cache.k, cache.v
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)
            mixed = len(set(sliding)) > 1  # per-layer window / tables chosen from a scanned flag
            # hidden states after layers inside the stack: an [n, B, T, D] slot per index in
            # the carry, set at its layer (a select per layer; no [L, B, T, D] stack)
            taken = [i for i in inner if i > 0]
            grab = jnp.asarray(taken, jnp.int32)

            def body(carry, xs):
                if taken:
                    (x, k_all, v_all), acc = carry
                else:
                    x, k_all, v_all = carry
                i, is_sliding = xs
                blk = nnx.merge(graphdef, state)  # the whole stack: it reads layer i itself
                if mixed:
                    window = jnp.where(is_sliding, cfg.sliding_window, NO_WINDOW)
                    c, s = (jnp.where(is_sliding, cos_l, cos), jnp.where(is_sliding, sin_l, sin)) if local else (cos, sin)
                elif sliding[0]:
                    window, c, s = cfg.sliding_window, cos_l, sin_l
                else:
                    window, c, s = None, cos, sin
                out = blk(x, k_all, v_all, i, positions, c, s, window, tv)
                if taken:
                    acc = jnp.where((grab == i + 1)[:, None, None, None], out[0][None], acc)
                    return (out, acc), None
                return out, None

            carry = (x, k_all, v_all)
            if taken:
                carry = (carry, jnp.zeros((len(taken),) + x.shape, x.dtype))
            carry, _ = jax.lax.scan(
                body, carry,
                (jnp.arange(cfg.n_layers, dtype=jnp.int32), jnp.asarray(sliding, bool)),
            )
            if taken:
                carry, acc = carry
                states.update({j: acc[n] for n, j in enumerate(taken)})
            x, k_all, v_all = carry
        else:
            for i, blk in enumerate(self.layers):
                if sliding[i]:
                    x, k_all, v_all = blk(x, k_all, v_all, i, positions, cos_l, sin_l, cfg.sliding_window, tv)
                else:
                    x, k_all, v_all = blk(x, k_all, v_all, i, positions, cos, sin, None, tv)
                if i + 1 in inner:
                    states[i + 1] = x

        x = rms_norm(x, self.final_norm[...], cfg.norm_eps, cfg.norm_offset, cfg.cpu_kernels)
        states[L] = x
        head, head_scale, head_offset = self._head_weights()
        x2 = x.reshape(B * T, -1)
        if head_scale is not None:  # GGUF blocks
            if use_block_matmul(cfg.cpu_kernels, x2, head):
                logits = block_matmul(x2, head, head_scale, head_offset).reshape(B, T, -1)
            else:
                logits = jnp.einsum("btd,dv->btv", x, dequantize_blocks(head, head_scale, head_offset).astype(dt),
                                    preferred_element_type=jnp.float32)
        elif use_small_matmul(cfg.cpu_kernels, x2, head):  # float32 x and head only
            logits = small_matmul(x2, head).reshape(B, T, -1)
        elif B * T == 1 and one_row_as_two():  # one row as two (_product)
            logits = _product(x2, head.astype(dt), 0, jnp.float32).reshape(B, T, -1)
        else:
            logits = jnp.einsum("btd,dv->btv", x, head.astype(dt), preferred_element_type=jnp.float32)
        if cfg.final_softcap:
            logits = _softcap(logits.astype(jnp.float32), cfg.final_softcap)
        new_cache = KVCache(k=k_all, v=v_all, lengths=lengths + T if tree is None else lengths)
        hidden = None
        if want is not None:
            hidden = states[want[0]] if len(want) == 1 else jnp.concatenate([states[i] for i in want], axis=-1)
        return ModelOutput(logits=logits.astype(jnp.float32), cache=new_cache, hidden=hidden)


# --------------------------------------------------------------------------------------
# LanguageModel implementation
# --------------------------------------------------------------------------------------


_FLAT_DRAW_MAX = 1 << 20  # tensors of at most this many values: drawn flat (see _normal)


def _normal(key, shape) -> Any:
    """``jax.random.normal(key, shape)`` (float32), the same values. Outside a trace a
    tensor of at most 2**20 values is the start of a flat draw of a power-of-two size,
    reshaped on the host: with threefry's partitionable counters value i of a draw depends
    only on the key and i (tests/test_model.py compares), so a process compiles one
    normal program per size bucket instead of one per shape (~0.3 s each, which made a
    tiny model's init take seconds). Traced (``init_model``'s jit) or larger: as is."""
    n = math.prod(shape)
    if (isinstance(key, jax.core.Tracer) or n > _FLAT_DRAW_MAX or not jax.config.jax_threefry_partitionable
            or jax.config.jax_default_prng_impl != "threefry2x32"):
        return jax.random.normal(key, shape, jnp.float32)
    size = 1 << max(8, (n - 1).bit_length())
    return np.asarray(jax.random.normal(key, (size,), jnp.float32))[:n].reshape(shape)


def _over_sqrt_fan_in(x):
    """``x / sqrt(x.shape[-1])`` as XLA computes it for a jax array, also for a numpy one
    (XLA divides by a constant as x * (1 / c), with 1 / c in float32)."""
    c = math.sqrt(x.shape[-1])
    return x * (np.float32(1) / np.float32(c)) if isinstance(x, np.ndarray) else x / c


INIT_SEED_BITS = 64  # init seeds are integers in [0, 2**64), as specjax.keys' seeds


def init_key(seed) -> jax.Array:
    """The base key of a weight-init ``seed`` (an integer in [0, 2**64), else ValueError):
    exactly ``jax.random.key(seed)`` below 2**32; above, the key of both 32-bit words (as
    :func:`specjax.keys.seed_key`), where ``jax.random.key`` would keep the low 32 bits only
    (2**32 would be seed 0's weights, -1 seed 2**32 - 1's)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= int(seed) < 2 ** INIT_SEED_BITS:
        raise ValueError(f"seed must be an integer in [0, 2**{INIT_SEED_BITS}), got {seed!r}")
    seed = int(seed)
    if seed < 2 ** 32:
        return jax.random.key(seed)
    if jax.config.jax_default_prng_impl != "threefry2x32":
        raise ValueError(f"seed {seed} needs the threefry2x32 PRNG (seeds below 2**32 work with any)")
    return jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))


def random_weights(cfg: LlamaConfig, seed: int = 0) -> dict:
    """Canonical weights with a scaled-normal init (std 1/sqrt(fan_in); embeddings std 1).
    float32 jax arrays, or numpy ones for small tensors (:func:`_normal`; the same values:
    the scaling is the float32 arithmetic XLA does). ``seed``: :func:`init_key`."""
    shapes = expected_shapes(cfg)
    keys = jax.random.split(init_key(seed), len(shapes))
    out = {}
    for key, (name, shp) in zip(keys, sorted(shapes.items())):
        x = _normal(key, shp)
        if name.endswith("norm"):  # effective scale (norm_offset + w) around 1
            out[name] = (1.0 - cfg.norm_offset) + 0.1 * x
        elif name in ("bq", "bk", "bv"):
            out[name] = 0.1 * x
        elif name == "embed":
            out[name] = x
        else:
            out[name] = _over_sqrt_fan_in(x)
    return out


def check_size(name: str, value, low: int = 1) -> int:
    """``value`` as a Python int >= ``low`` (numpy's integers accepted), else ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _concrete(x) -> bool:
    """``x`` holds values (not a tracer inside jit / vmap / scan): they can be checked."""
    return not isinstance(x, jax.core.Tracer)


def check_step(tokens, cache: KVCache, vocab_size: int, where: str, tree=None):
    """The host-side checks of one cached step (``apply``) of ``tokens`` [B, T] on ``cache``:
    ValueError / TypeError (one line, before any work) unless ``tokens`` is a 2-D integer array
    with the cache's batch. Where the values are known (an eager call, not a trace: the
    engine's jitted programs pay nothing), also unless every token id lies in [0, V) (the
    embedding gather would read a NaN row or wrap -1 to V-1) and every row's T new positions
    fit in the cache (a write past its end is dropped, and the step's output reads slots it
    never wrote). Returns ``tokens`` (a host list as a numpy array)."""
    if not isinstance(tokens, (jax.Array, np.ndarray)):
        tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"{where}: tokens must be [batch, T], got shape {tuple(tokens.shape)}")
    if not (jnp.issubdtype(tokens.dtype, jnp.integer)):
        raise TypeError(f"{where}: tokens must be integer token ids, got dtype {tokens.dtype}")
    b, t = tokens.shape
    lengths = cache.lengths
    if tuple(lengths.shape) != (b,) or cache.k.shape[1] != b:
        raise ValueError(f"{where}: tokens have batch {b}, the cache {cache.k.shape[1]} rows "
                         f"(lengths of shape {tuple(lengths.shape)})")
    if _concrete(tokens) and tokens.size:
        ids = np.asarray(tokens)
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
    if _concrete(lengths):
        lens = np.asarray(lengths).astype(np.int64)
        end = lens + t
        if tree is not None:
            offset = getattr(tree, "offset", None)
            if offset is None or not _concrete(offset):
                return tokens
            end = end + np.asarray(offset).astype(np.int64)
        s = cache.max_len
        if lens.size and (lens.min() < 0 or end.max() > s):
            raise ValueError(f"{where}: cache lengths {lens.min()}..{lens.max()} + {t} new positions "
                             f"do not fit the cache of {s} slots (lengths must be >= 0)")
    return tokens


class LlamaLM:
    """A Llama-family model behind the :class:`specjax.models.base.LanguageModel` contract."""

    def __init__(self, config: LlamaConfig, graphdef, params):
        self.config = config
        self.graphdef = graphdef
        self.params = params

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_weights(cls, config: LlamaConfig, weights: Mapping[str, Any]) -> "LlamaLM":
        module = Llama(config, weights)
        graphdef, params = nnx.split(module)
        return cls(config, graphdef, params)

    @classmethod
    def init(cls, config: LlamaConfig, seed: int = 0) -> "LlamaLM":
        return cls.from_weights(config, random_weights(config, seed))

    def canonical_weights(self, blocks: bool = False) -> dict:
        """numpy canonical weights (see module docstring), e.g. for export; float32 values
        unless ``blocks``, which keeps GGUF block matrices as :class:`BlockWeights`."""
        return self.module(self.params).canonical_weights(blocks)

    def embedding_weights(self) -> dict:
        """The float32 embedding (and untied LM head), canonical [V, D]: see :meth:`Llama.embedding_weights`."""
        return self.module(self.params).embedding_weights()

    def with_config(self, **changes) -> "LlamaLM":
        """Same weights, new config (e.g. ``scan_layers=True``, ``dtype='bfloat16'``;
        ``weight_blocks=False``: the GGUF blocks rebuilt in float32, the same values; so too
        when the change leaves no room for blocks, e.g. ``dtype='bfloat16'``)."""
        cfg = self.config
        try:
            new = cfg.replace(**changes)
        except ValueError:
            if not cfg.weight_blocks or "weight_blocks" in changes:
                raise
            new = cfg.replace(**changes, weight_blocks=False)
        return LlamaLM.from_weights(new, self.canonical_weights(blocks=True))

    def module(self, params=None) -> Llama:
        return nnx.merge(self.graphdef, self.params if params is None else params)

    # -- contract ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        c = self.config
        batch, max_len = check_size("batch", batch), check_size("max_len", max_len)
        shape = (c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim)
        dt = c.compute_dtype if dtype is None else dtype
        return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), lengths=jnp.zeros((batch,), jnp.int32))

    supports_tree = True  # apply(..., tree=TreeAttention): see specjax.models.base

    def compute_id(self) -> str:
        """The build of the CPU kernels this model's forward may run (see
        :func:`specjax.models.base.compute_id`)."""
        return kernels_compute_id(self.config.cpu_kernels)

    def apply(self, params, tokens: jax.Array, cache: KVCache, return_hidden=False,
              tree: Optional[TreeAttention] = None) -> ModelOutput:
        """``return_hidden``: False, True (final hidden states) or a tuple of hidden-state
        indices (:func:`specjax.models.base.hidden_indices`). ``tree``: tree attention (:class:`specjax.models.base.TreeAttention`; lengths
        unchanged), through the CPU attention kernel where a causal call would use it.
        ``tokens`` [B, T] int token ids, checked by :func:`check_step` (their values and
        the cache's room only in an eager call: a jitted caller checks its own input)."""
        tokens = check_step(tokens, cache, self.vocab_size, "LlamaLM.apply", tree=tree)
        return nnx.merge(self.graphdef, params)(jnp.asarray(tokens, jnp.int32), cache, return_hidden,
                                                tree)

    def __call__(self, tokens, cache: KVCache, return_hidden=False) -> ModelOutput:
        return self.apply(self.params, tokens, cache, return_hidden)

    def __repr__(self) -> str:
        return f"LlamaLM({self.config})"
