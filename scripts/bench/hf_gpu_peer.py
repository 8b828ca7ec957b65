"""Hugging Face transformers on the accelerator, the peer of the GPU section (issue 14).

    python scripts/bench/hf_gpu_peer.py [--new-tokens 128] [--models smollm2,llama3-8b-shape]
    python scripts/bench/hf_gpu_peer.py --smoke      # a tiny random model, CPU or GPU

Greedy ``generate`` at batch 1, EOS off, every run exactly ``--new-tokens`` tokens, for
each model in two settings: eager (dynamic cache) and transformers' strongest single-GPU
decode setting, a static cache with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs),
whose compilation is timed apart and may be cut by ``--compile-limit``. Models: SmolLM2-135M
from the GGUF (float32, dequantized by transformers, as ``scripts/hf_peer.py``) and a
random ``llama3-8b-shape`` in bfloat16 made on the device. One JSON line per measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class _Timeout(Exception):
    pass


def _alarm(seconds: float):
    def handler(signum, frame):
        raise _Timeout()
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _model(name: str, device: str, smoke: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if name == "smollm2" and not smoke:
        from scripts import hf_peer

        return hf_peer.load_hf_model("float32").to(device), "float32"
    if smoke:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        dt = torch.float32
    else:
        from specjax.models.config import load_model_config

        c = load_model_config(name)
        cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
                          num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                          num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                          tie_word_embeddings=c.tie_embeddings, max_position_embeddings=8192)
        dt = torch.bfloat16
    with torch.device(device):
        m = LlamaForCausalLM(cfg).to(dt)
    return m.eval().requires_grad_(False), str(dt).replace("torch.", "")


def _timed(model, ids, n: int, repeats: int, **kw) -> list:
    import torch

    out = []
    for _ in range(repeats):
        if ids.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        if ids.is_cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="smollm2,llama3-8b-shape")
    ap.add_argument("--compile-limit", type=float, default=150.0, help="seconds for torch.compile's first calls")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"hf_gpu_peer: {e}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = ["tiny-random"] if a.smoke else [m.strip() for m in a.models.split(",") if m.strip()]
    for name in names:
        model, dtype = _model(name, device, a.smoke)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        ids = torch.randint(1, model.config.vocab_size, (1, 64), device=device)
        base = dict(peer="hf_gpu_peer", model=name, dtype=dtype, device=device,
                    gpu=torch.cuda.get_device_name() if device == "cuda" else None,
                    torch=torch.__version__, transformers=transformers.__version__, new_tokens=a.new_tokens)
        _timed(model, ids, a.new_tokens, 1)  # warm-up
        t = min(_timed(model, ids, a.new_tokens, a.repeats))
        print(json.dumps(dict(base, setting="eager", tok_per_s=round(a.new_tokens / t, 1),
                              ms_per_token=round(t / a.new_tokens * 1e3, 3))), flush=True)
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        t0 = time.perf_counter()
        try:
            _alarm(a.compile_limit)
            _timed(model, ids, a.new_tokens, 2, cache_implementation="static")  # compiles, then replays
            signal.setitimer(signal.ITIMER_REAL, 0)
        except _Timeout:
            print(json.dumps(dict(base, setting="static+compile", error=f"compile over {a.compile_limit:.0f}s")),
                  flush=True)
            continue
        except Exception as e:  # a compile failure is a result of this peer, not of the script
            signal.setitimer(signal.ITIMER_REAL, 0)
            print(json.dumps(dict(base, setting="static+compile", error=f"{type(e).__name__}: {e}"[:300])),
                  flush=True)
            continue
        compile_s = time.perf_counter() - t0
        t = min(_timed(model, ids, a.new_tokens, a.repeats, cache_implementation="static"))
        print(json.dumps(dict(base, setting="static+compile", compile_s=round(compile_s, 1),
                              tok_per_s=round(a.new_tokens / t, 1), ms_per_token=round(t / a.new_tokens * 1e3, 3))),
              flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
