"""EAGLE-style feature head (Flax NNX): a one- or two-layer draft that reads the target's
hidden states; EAGLE-1/2 style (the final hidden states) or EAGLE-3 style (several layers'
hidden states fused), by ``EagleConfig.feature_layers``.

EAGLE-1/2 (``feature_layers == ()``). At sequence position t the head takes the pair ``(h_t, x_{t+1})``: ``h_t`` the target's
final hidden state (after its final norm) once it has read ``s[:t+1]``, and the next token.
It predicts ``h_{t+1}``; the logits of ``s[t+2]`` are the predicted hidden state times the
target's (frozen) output head::

    concat(h_t, embed(x_{t+1}))  [2D] -> fc [2D -> D] -> Llama decoder layer(s) (:class:`Layer`,
    own KV cache, RoPE position t) -> RMSNorm -> h_hat_{t+1} -> h_hat @ head.T -> logits

The target's embedding and head are held as :class:`Frozen` variables (never trained,
never exported: :func:`EagleModel.trainable_weights` is what a draft file holds).
Optionally the head scores only a subset of the vocabulary (``token_map``: the most
frequent tokens); every other token gets probability 0, which keeps speculative sampling
exact (the verifier only needs the true q) and cuts the draft's head cost.

EAGLE-3 (``feature_layers``: hidden-state indices of the target, numbered as
:func:`specjax.models.base.hidden_indices`, e.g. an early, a middle and a late one). The
head's input at position t is the concatenation ``g_t`` of those hidden states [n*D],
fused to the model width, and the next token; the decoder layer's attention reads the
normed token embedding and the normed feature side by side [2D] while its residual
stream carries the feature (Li et al. 2025)::

    f_t = fc(g_t)  [n*D -> D]
    a = concat(RMSNorm_e(embed(x_{t+1})), RMSNorm(f_t))  [2D] -> q, k, v (RoPE position t)
    o_t = f_t + attn(a) ; o_t += MLP(RMSNorm(o_t))     (every layer of the head reads the
                                                         embedding the same way)
    logits = RMSNorm_out(o_t) @ head.T

At later draft positions the head is fed its OWN layer output ``o`` in place of ``f``
(there is no target feature there), as EAGLE-3 does; there is no single target feature
for ``o`` to match, so training uses the token law only. Either way the head's features
live in one space: :meth:`EagleHead.fuse` maps the target's hidden states into it (the
identity for EAGLE-1/2), ``__call__`` / ``tree_call`` / ``unrolled`` take and return
features of that space, and :meth:`EagleHead.logits` reads them out.

:meth:`EagleModel.apply` is the cached step the proposer uses; :meth:`EagleModel.unrolled`
is the teacher-forced training / evaluation pass that also trains (and measures) draft
positions 2..n, where the head is fed its OWN predicted features: step j at position p
attends to the true-feature keys of positions <= p-j+1 and to the keys of steps 2..j along
its own chain (a diagonal mask over an ``n * T``-slot cache), exactly what the proposer
sees at draft position j.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.base import KVCache, embedding_weights
from specjax.models.cpu_kernels import compute_id as kernels_compute_id
from specjax.models.cpu_kernels import use_attention
from specjax.models.llama import (MATRIX_KEYS, LlamaConfig, RopeScaling, _linear, _normal, _over_sqrt_fan_in, apply_rope,
                                  check_size, check_step, init_key,
                                  kernel_attention, rms_norm, rope_tables)

# canonical per-layer tensors (PyTorch [out, in] orientation, stacked on a leading L axis),
# the same names as specjax.models.llama's canonical weights; an EAGLE-3 head adds emb_norm
# (the token embedding's norm) and its wq / wk / wv read [2D] (embedding, then feature)
LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def layer_keys(cfg: "EagleConfig") -> tuple:
    return LAYER_KEYS + (("emb_norm",) if cfg.feature_layers else ())


def _np(x):
    return np.asarray(jax.device_get(x))


def _param(value, names: tuple) -> nnx.Param:
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def _masked_attention(q, k, v, mask):
    """q [B,T,N,H], k/v [B,Nkv,S,H], mask bool[B,T,S] -> [B,T,N,H]."""
    B, T, N, H = q.shape
    nkv = k.shape[1]
    q = q.reshape(B, T, nkv, N // nkv, H)
    s = jnp.einsum("btkgh,bksh->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(H)
    s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bksh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, N, H).astype(q.dtype)


class Layer(nnx.Module):
    """A Llama decoder layer with an explicit attention mask (weights kept [in, out])."""

    def __init__(self, cfg: LlamaConfig, w: Mapping[str, Any]):
        self.cfg = cfg
        pd = cfg.weight_dtype
        t = lambda a: jnp.asarray(np.ascontiguousarray(_np(a).T), pd)
        self.attn_norm = _param(jnp.asarray(w["attn_norm"], pd), ("embed",))
        self.fused_input = "emb_norm" in w  # EAGLE-3: attention reads [embedding, feature]
        if self.fused_input:
            self.emb_norm = _param(jnp.asarray(w["emb_norm"], pd), ("embed",))
        self.mlp_norm = _param(jnp.asarray(w["mlp_norm"], pd), ("embed",))
        self.wq = _param(t(w["wq"]), ("embed", "heads"))
        self.wk = _param(t(w["wk"]), ("embed", "kv_heads"))
        self.wv = _param(t(w["wv"]), ("embed", "kv_heads"))
        self.wo = _param(t(w["wo"]), ("heads", "embed"))
        self.w_gate = _param(t(w["w_gate"]), ("embed", "mlp"))
        self.w_up = _param(t(w["w_up"]), ("embed", "mlp"))
        self.w_down = _param(t(w["w_down"]), ("mlp", "embed"))

    def canonical(self) -> dict:
        out = {k: _np(getattr(self, k)[...]).T.copy() for k in MATRIX_KEYS}
        out["attn_norm"] = _np(self.attn_norm[...])
        out["mlp_norm"] = _np(self.mlp_norm[...])
        if self.fused_input:
            out["emb_norm"] = _np(self.emb_norm[...])
        return out

    def __call__(self, x, k_all, v_all, layer, slots, cos, sin, mask, kernel=None, emb=None):
        """``mask`` [B, T, S]: the visible slots (XLA's attention). ``kernel``: ``(positions,
        tree)`` when the visibility is causal by position (``tree`` None) or a draft tree's
        (``(lengths, mask, region_depth)``, as :func:`specjax.models.llama._tree_visible`):
        then the CPU attention kernel runs where the target's would (float32), else XLA.
        ``emb`` [B, T, D] (EAGLE-3 layers only): the token embeddings, normed and read by the
        attention beside the normed ``x``."""
        cfg = self.cfg
        dt = cfg.compute_dtype
        B, T, D = x.shape
        N, Nkv, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        ck = cfg.cpu_kernels  # small float32 matmuls (the proposer's M <= 16) use the CPU kernel
        h = rms_norm(x, self.attn_norm[...], cfg.norm_eps, cpu_kernels=ck)
        if self.fused_input:
            h = jnp.concatenate([rms_norm(emb, self.emb_norm[...], cfg.norm_eps, cpu_kernels=ck), h], axis=-1)
        q = apply_rope(_linear(h, self.wq[...], ck).reshape(B, T, N, H), cos, sin)
        k = apply_rope(_linear(h, self.wk[...], ck).reshape(B, T, Nkv, H), cos, sin)
        v = _linear(h, self.wv[...], ck).reshape(B, T, Nkv, H)
        b_idx, h_idx = jnp.arange(B)[:, None, None], jnp.arange(Nkv)[None, None, :]
        k_all = k_all.at[layer, b_idx, h_idx, slots[:, :, None]].set(k.astype(k_all.dtype), mode="drop")
        v_all = v_all.at[layer, b_idx, h_idx, slots[:, :, None]].set(v.astype(v_all.dtype), mode="drop")
        q5 = q.reshape(B, T, Nkv, N // Nkv, H)
        if kernel is not None and use_attention(ck, q5, k_all):
            positions, tree = kernel
            o = kernel_attention(q5, k_all, v_all, jnp.asarray(layer, jnp.int32), positions, cfg.attn_chunk,
                                 tree=tree).reshape(B, T, N, H)
        else:
            o = _masked_attention(q, k_all[layer].astype(dt), v_all[layer].astype(dt), mask)
        x = x + _linear(o.reshape(B, T, N * H), self.wo[...], ck)
        h = rms_norm(x, self.mlp_norm[...], cfg.norm_eps, cpu_kernels=ck)
        a = jax.nn.silu(_linear(h, self.w_gate[...], ck)) * _linear(h, self.w_up[...], ck)
        return x + _linear(a, self.w_down[...], ck), k_all, v_all


class Frozen(nnx.Variable):
    """A variable the trainer never differentiates (the target's embedding / head)."""


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Shape of an EAGLE head. ``dim`` and ``vocab_size`` must be the target's."""

    vocab_size: int
    dim: int
    n_layers: int = 1
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 1024
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-5
    vocab_subset: int = 0  # 0: the full vocabulary; else the size of token_map
    dtype: str = "float32"
    param_dtype: str = "float32"
    # () : EAGLE-1/2 (the target's final hidden states); else EAGLE-3: the target's hidden
    # states with these indices (specjax.models.base.hidden_indices), fused by fc
    feature_layers: tuple = ()

    def __post_init__(self):
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"EagleConfig.{f} must be a positive int, got {v!r}")
        fl = self.feature_layers
        if fl is None or isinstance(fl, (str, bytes)) or not hasattr(fl, "__iter__"):
            raise ValueError(f"EagleConfig.feature_layers must be a list of hidden-state indices, got {fl!r}")
        fl = tuple(fl)
        for i in fl:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0:
                raise ValueError(f"EagleConfig.feature_layers must hold hidden-state indices >= 0, got {i!r}")
        if len(set(fl)) != len(fl):
            raise ValueError(f"EagleConfig.feature_layers has a repeated index: {list(fl)}")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in fl))
        if not isinstance(self.vocab_subset, (int, np.integer)) or isinstance(self.vocab_subset, (bool, np.bool_)) \
                or not 0 <= self.vocab_subset <= self.vocab_size:
            raise ValueError(f"EagleConfig.vocab_subset must be in [0, vocab_size={self.vocab_size}], "
                             f"got {self.vocab_subset!r}")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        self.layer_config()  # validates heads / dtypes

    @classmethod
    def for_target(cls, target_cfg: LlamaConfig, **overrides) -> "EagleConfig":
        """Same width, heads, RoPE and norm as the target (one layer by default)."""
        base = dict(
            vocab_size=target_cfg.vocab_size, dim=target_cfg.dim, n_heads=target_cfg.n_heads,
            n_kv_heads=target_cfg.n_kv_heads, head_dim=target_cfg.head_dim, ffn_dim=target_cfg.ffn_dim,
            rope_theta=target_cfg.rope_theta, rope_scaling=target_cfg.rope_scaling,
            norm_eps=target_cfg.norm_eps,
        )
        base.update(overrides)
        return cls(**base)

    def layer_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, ffn_dim=self.ffn_dim,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, norm_eps=self.norm_eps,
            dtype=self.dtype, param_dtype=self.param_dtype, name="eagle",
        )

    @property
    def eagle3(self) -> bool:
        """EAGLE-3 style: fused hidden states of several target layers."""
        return bool(self.feature_layers)

    @property
    def feature_dim(self) -> int:
        """Width of the target features the head reads (``n * dim`` for EAGLE-3)."""
        return self.dim * max(1, len(self.feature_layers))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EagleConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(d) - names)
        if extra:
            raise ValueError(f"unknown EagleConfig fields {extra}")
        return cls(**dict(d))


def target_head(target) -> np.ndarray:
    """The target's output head [V, D] (its embedding when tied)."""
    w = embedding_weights(target)
    return w["embed"] if target.config.tie_embeddings else w["lm_head"]


def trainable_shapes(cfg: EagleConfig) -> dict:
    """The shape of every trainable weight of a head: fc ([in, out]: [2D, D], EAGLE-3
    [n*D, D]), out_norm [D], and the canonical layer tensors (stacked over layers; EAGLE-3:
    wq / wk / wv read [2D] and emb_norm [L, D])."""
    lcfg = cfg.layer_config()
    D, F, L = cfg.dim, cfg.ffn_dim, cfg.n_layers
    NH, KH = lcfg.n_heads * lcfg.head_dim, lcfg.n_kv_heads * lcfg.head_dim
    A = 2 * D if cfg.eagle3 else D  # the attention's input width
    out = dict(wq=(L, NH, A), wk=(L, KH, A), wv=(L, KH, A), wo=(L, D, NH), w_gate=(L, F, D),
               w_up=(L, F, D), w_down=(L, D, F), attn_norm=(L, D), mlp_norm=(L, D),
               fc=(cfg.feature_dim if cfg.eagle3 else 2 * D, D), out_norm=(D,))
    if cfg.eagle3:
        out["emb_norm"] = (L, D)
    return out


def random_trainable(cfg: EagleConfig, seed: int = 0, copy_feature: bool = True) -> dict:
    """Random trainable weights (shapes: :func:`trainable_shapes`).

    ``copy_feature``: fc starts as "pass the feature through" (the head first predicts
    h_{t+1} ~ h_t; EAGLE-3: fc passes the deepest of the feature layers through); otherwise
    fc is a plain random matrix."""
    D, L = cfg.dim, cfg.n_layers
    shapes = {k: v for k, v in trainable_shapes(cfg).items()
              if k in MATRIX_KEYS}
    keys = jax.random.split(init_key(seed), len(shapes) + 1)
    layers = {n: _over_sqrt_fan_in(_normal(kk, s)) for kk, (n, s) in zip(keys[1:], sorted(shapes.items()))}
    layers["attn_norm"] = np.ones((L, D), np.float32)
    layers["mlp_norm"] = np.ones((L, D), np.float32)
    k = keys[0]
    # fc starts as "take the feature half" plus a small embedding contribution
    fc = np.concatenate([np.eye(D, dtype=np.float32),
                         np.asarray(_normal(k, (D, D))) * (0.1 / math.sqrt(D))])
    out = {n: _np(layers[n]) for n in LAYER_KEYS}
    # small residual branches at the start: the head begins close to "copy the feature"
    out["wo"] = out["wo"] * 0.1
    out["w_down"] = out["w_down"] * 0.1
    out["attn_norm"] = np.ones_like(out["attn_norm"])
    out["mlp_norm"] = np.ones_like(out["mlp_norm"])
    if cfg.eagle3:
        n = len(cfg.feature_layers)
        fc = np.asarray(_normal(k, (n * D, D))) * (0.1 / math.sqrt(n * D))
        deepest = int(np.argmax(cfg.feature_layers))
        fc[deepest * D:(deepest + 1) * D] += np.eye(D, dtype=np.float32)
        out["emb_norm"] = np.ones((L, D), np.float32)
    if not copy_feature:
        fc = np.asarray(_normal(jax.random.fold_in(k, 1), fc.shape)) / math.sqrt(fc.shape[0])
    out["fc"] = fc
    out["out_norm"] = np.ones((D,), np.float32)
    return out


class EagleHead(nnx.Module):
    def __init__(self, cfg: EagleConfig, embed, head, trainable: Mapping[str, Any],
                 token_map: Optional[np.ndarray] = None):
        self.cfg = cfg
        lcfg = cfg.layer_config()
        pd = lcfg.weight_dtype
        V, D = cfg.vocab_size, cfg.dim
        if tuple(np.shape(embed)) != (V, D):
            raise ValueError(f"embedding shape {np.shape(embed)} does not match the head config (V={V}, D={D})")
        self.embed = Frozen(jnp.asarray(embed, pd))
        self.tied = head is None
        if head is not None:
            self.head = Frozen(jnp.asarray(head, pd))
        if cfg.vocab_subset:
            if token_map is None or np.shape(token_map) != (cfg.vocab_subset,):
                raise ValueError(f"vocab_subset={cfg.vocab_subset} needs a token_map of that length")
            tm = np.asarray(token_map, np.int64)
            if tm.min() < 0 or tm.max() >= V or np.unique(tm).size != tm.size:
                raise ValueError("token_map must hold distinct token ids in [0, V)")
            self.token_map = Frozen(jnp.asarray(tm, jnp.int32))
            # the scored rows of the head, gathered once and stored [D, Vs] (a plain x @ W):
            # gathering them per call cost more than the product itself
            hm = _np(embed if head is None else head)
            self.head_sub = Frozen(jnp.asarray(np.ascontiguousarray(hm[tm].T), pd))
        self.fc = _param(jnp.asarray(trainable["fc"], pd), (None, "embed"))
        self.out_norm = _param(jnp.asarray(trainable["out_norm"], pd), ("embed",))
        keys = layer_keys(cfg)
        for k in keys:
            if np.shape(trainable[k])[0] != cfg.n_layers:
                raise ValueError(f"layer tensor {k} has {np.shape(trainable[k])[0]} layers, "
                                 f"config says {cfg.n_layers}")
        self.layers = nnx.List([Layer(lcfg, {k: trainable[k][i] for k in keys})
                                for i in range(cfg.n_layers)])

    # ------------------------------------------------------------------ pieces
    def fuse(self, target_hidden):
        """The target's hidden states (``[..., feature_dim]``: what the engine's
        ``return_hidden`` gives for the proposer) -> the head's feature [..., D]: the identity
        for EAGLE-1/2, ``fc`` of the concatenated layers for EAGLE-3."""
        if not self.cfg.eagle3:
            return target_hidden
        lcfg = self.cfg.layer_config()
        x = target_hidden.astype(lcfg.compute_dtype)
        lead = x.shape[:-1]
        y = _linear(x.reshape(1, -1, x.shape[-1]), self.fc[...], lcfg.cpu_kernels)
        return y.reshape(lead + (y.shape[-1],))

    def readout(self, h):
        """A feature -> the hidden state the output head reads (EAGLE-3: the output norm;
        EAGLE-1/2 features are already normed)."""
        if not self.cfg.eagle3:
            return h
        return rms_norm(h, self.out_norm[...], self.cfg.norm_eps, cpu_kernels=self.cfg.layer_config().cpu_kernels)

    def logits(self, h):
        """[..., D] features -> [..., Vs] float32 logits over the scored tokens."""
        h = self.readout(h)
        if self.cfg.vocab_subset:
            w = self.head_sub[...]
            lead = h.shape[:-1]
            out = _linear(h.reshape(1, -1, h.shape[-1]), w, self.cfg.layer_config().cpu_kernels)
            return out.reshape(lead + (w.shape[1],)).astype(jnp.float32)
        full = self.embed[...] if self.tied else self.head[...]
        return jnp.einsum("...d,vd->...v", h, full.astype(h.dtype), preferred_element_type=jnp.float32)

    def full_logits(self, h):
        """[..., D] -> [..., V] float32 logits, -inf outside the token subset."""
        lg = self.logits(h)
        if not self.cfg.vocab_subset:
            return lg
        full = jnp.full(lg.shape[:-1] + (self.cfg.vocab_size,), -jnp.inf, jnp.float32)
        return full.at[..., self.token_map[...]].set(lg)

    def _inputs(self, hidden, tokens):
        """The layers' input: EAGLE-1/2 ``fc(concat(h, embed(x)))``; EAGLE-3 the pair
        (feature, embedding), read side by side by each layer's attention."""
        dt = self.cfg.layer_config().compute_dtype
        e = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        if self.cfg.eagle3:
            return hidden.astype(dt), e
        x = jnp.concatenate([hidden.astype(dt), e], axis=-1)
        return _linear(x, self.fc[...], self.cfg.layer_config().cpu_kernels)

    def _layers(self, x, k_all, v_all, slots, cos, sin, mask, kernel=None):
        """-> (the head's output feature, caches): EAGLE-1/2 normed (a predicted final hidden
        state), EAGLE-3 the last layer's residual stream (:meth:`readout` norms it)."""
        x, emb = x if self.cfg.eagle3 else (x, None)
        for i, blk in enumerate(self.layers):
            x, k_all, v_all = blk(x, k_all, v_all, i, slots, cos, sin, mask, kernel, emb)
        if self.cfg.eagle3:
            return x, k_all, v_all
        return rms_norm(x, self.out_norm[...], self.cfg.norm_eps, cpu_kernels=self.cfg.layer_config().cpu_kernels), k_all, v_all

    # ------------------------------------------------------------------ cached step
    def __call__(self, hidden, tokens, cache: KVCache):
        """hidden [B, T, D] (features at positions lengths+t: the target's through
        :meth:`fuse`, or the head's own), tokens [B, T] (the token after each) -> the head's
        next feature [B, T, D] (its logits: :meth:`logits`), new cache."""
        lcfg = self.cfg.layer_config()
        B, T = tokens.shape
        S = cache.max_len
        lengths = cache.lengths.astype(jnp.int32)
        positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        cos, sin = rope_tables(positions, lcfg)
        mask = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
        x = self._inputs(hidden, tokens)
        h, k_all, v_all = self._layers(x, cache.k, cache.v, positions, cos, sin, mask, (positions, None))
        return h, KVCache(k=k_all, v=v_all, lengths=lengths + T)

    def tree_call(self, hidden, tokens, cache: KVCache, tree):
        """:meth:`__call__` for tree nodes (``tree``: a
        :class:`specjax.models.base.TreeAttention` over the pairs after ``cache.lengths``):
        pair t sits at position ``lengths + tree.depth[:, t]``, is written to region slot
        ``tree.offset + t`` and attends to the prefix and the region slots its mask names.
        The returned cache keeps ``lengths``."""
        from specjax.models.llama import _tree_visible

        lcfg = self.cfg.layer_config()
        B, T = tokens.shape
        lengths = cache.lengths.astype(jnp.int32)
        positions = lengths[:, None] + tree.depth.astype(jnp.int32)
        slots = lengths[:, None] + tree.offset[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        cos, sin = rope_tables(positions, lcfg)
        mask = _tree_visible(jnp.arange(cache.max_len, dtype=jnp.int32), positions,
                             (lengths, tree.mask, tree.region_depth), None)
        x = self._inputs(hidden, tokens)
        h, k_all, v_all = self._layers(x, cache.k, cache.v, slots, cos, sin, mask,
                                       (positions, (lengths, tree.mask, tree.region_depth)))
        return h, KVCache(k=k_all, v=v_all, lengths=lengths)

    # ------------------------------------------------------------------ training pass
    def unrolled(self, hidden, tokens, n_steps: int):
        """Teacher-forced pass over whole sequences for draft positions 1..n_steps.

        hidden [B, T, feature_dim]: the target's hidden states at p (fused by :meth:`fuse`);
        tokens [B, T]: s_{p+1} (the token after position p). Returns [n_steps, B, T, D]: entry
        (j-1, b, p) is the head's output feature after position p at draft position j (its
        logits are the law of s_{p+2}), i.e. fed true features up to position p-j+1 and its
        own outputs after that (valid for p >= j-1)."""
        lcfg = self.cfg.layer_config()
        dt = lcfg.compute_dtype
        B, T = tokens.shape
        n = int(n_steps)
        S = n * T
        shape = (self.cfg.n_layers, B, lcfg.n_kv_heads, S, lcfg.head_dim)
        k_all = jnp.zeros(shape, dt)
        v_all = jnp.zeros(shape, dt)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        cos, sin = rope_tables(pos, lcfg)
        p = jnp.arange(T)[:, None]  # query position
        q = jnp.arange(T)[None, :]  # key position within a step block
        outs = []
        feat = self.fuse(hidden)
        for j in range(1, n + 1):
            blocks = []
            for m in range(1, n + 1):
                if m == 1:
                    blocks.append(q <= p - j + 1)
                elif m <= j:
                    blocks.append(q == p - j + m)
                else:
                    blocks.append(jnp.zeros((T, T), bool))
            mask = jnp.broadcast_to(jnp.concatenate(blocks, axis=1)[None], (B, T, S))
            x = self._inputs(feat, tokens)
            h, k_all, v_all = self._layers(x, k_all, v_all, pos + (j - 1) * T, cos, sin, mask)
            outs.append(h)
            # next step's feature at position p is this step's prediction at p-1
            feat = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
        return jnp.stack(outs)

    # ------------------------------------------------------------------ export
    def trainable_weights(self) -> dict:
        per = [b.canonical() for b in self.layers]
        out = {k: np.stack([p[k] for p in per]) for k in layer_keys(self.cfg)}
        out["fc"] = _np(self.fc[...])
        out["out_norm"] = _np(self.out_norm[...])
        return out


class EagleModel:
    """An EAGLE head bound to a target's embedding / head, with a pure ``apply``."""

    def __init__(self, config: EagleConfig, graphdef, params):
        self.config = config
        self.graphdef = graphdef
        self.params = params

    @classmethod
    def build(cls, config: EagleConfig, embed, head=None, trainable=None, token_map=None,
              seed: int = 0) -> "EagleModel":
        """``embed`` [V, D] the target's embedding; ``head`` its untied head or None (tied)."""
        if trainable is None:
            trainable = random_trainable(config, seed)
        module = EagleHead(config, embed, head, trainable, token_map)
        graphdef, params = nnx.split(module)
        return cls(config, graphdef, params)

    @classmethod
    def for_target(cls, target, config: Optional[EagleConfig] = None, trainable=None, token_map=None,
                   seed: int = 0) -> "EagleModel":
        tcfg = target.config
        if config is None:
            config = EagleConfig.for_target(tcfg)
        if config.vocab_size != tcfg.vocab_size or config.dim != tcfg.dim:
            raise ValueError(
                f"EAGLE head (V={config.vocab_size}, D={config.dim}) does not fit the target "
                f"(V={tcfg.vocab_size}, D={tcfg.dim})")
        if any(i > tcfg.n_layers for i in config.feature_layers):
            raise ValueError(f"EAGLE head feature_layers {list(config.feature_layers)} do not fit the "
                             f"target's {tcfg.n_layers} layers (hidden-state indices 0..{tcfg.n_layers})")
        w = embedding_weights(target)
        head = None if tcfg.tie_embeddings else w["lm_head"]
        return cls.build(config, w["embed"], head, trainable, token_map, seed)

    def module(self, params=None) -> EagleHead:
        return nnx.merge(self.graphdef, self.params if params is None else params)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def compute_id(self) -> str:
        """The build of the CPU kernels this head may run (see
        :func:`specjax.models.base.compute_id`)."""
        return kernels_compute_id(self.config.layer_config().cpu_kernels)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        lc = self.config.layer_config()
        batch, max_len = check_size("batch", batch), check_size("max_len", max_len)
        shape = (lc.n_layers, batch, lc.n_kv_heads, max_len, lc.head_dim)
        dt = lc.compute_dtype
        return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def hidden_layers(self) -> Optional[tuple]:
        """The target hidden states the head reads, as ``return_hidden`` takes them: None for
        the final ones (EAGLE-1/2, ``return_hidden=True``), else the feature layers."""
        return self.config.feature_layers or None

    def apply(self, params, hidden, tokens, cache: KVCache):
        """The cached step on head features (:meth:`EagleHead.__call__`): ``hidden`` [B, T, dim],
        ``tokens`` [B, T] (checked as :func:`specjax.models.llama.check_step` checks a model's)."""
        tokens = check_step(tokens, cache, self.vocab_size, "EagleModel.apply")
        if tuple(hidden.shape) != tuple(tokens.shape) + (self.config.dim,):
            raise ValueError(f"EagleModel.apply: hidden must be [batch, T, dim] = "
                             f"{tuple(tokens.shape) + (self.config.dim,)} (the head's features: "
                             f"fuse the target's), got {tuple(hidden.shape)}")
        return self.module(params)(hidden, jnp.asarray(tokens, jnp.int32), cache)

    def fuse(self, params, target_hidden):
        """The target's hidden states -> head features (:meth:`EagleHead.fuse`)."""
        if target_hidden.shape[-1] != self.config.feature_dim:
            raise ValueError(f"EagleModel.fuse: the target's hidden states must have "
                             f"{self.config.feature_dim} features (feature_layers "
                             f"{list(self.config.feature_layers)} of dim {self.config.dim}), "
                             f"got shape {tuple(target_hidden.shape)}")
        return self.module(params).fuse(target_hidden)

    def full_logits(self, params, h):
        return self.module(params).full_logits(h)

    def trainable_weights(self) -> dict:
        w = self.module().trainable_weights()
        return w

    def token_map(self) -> Optional[np.ndarray]:
        if not self.config.vocab_subset:
            return None
        return _np(self.module().token_map[...])
