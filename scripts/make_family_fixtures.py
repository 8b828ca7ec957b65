"""Write ``tests/fixtures/families/<family>.npz``: a tiny random checkpoint of each Hugging
Face model family specjax loads, with transformers' outputs for it, so that
``tests/test_families.py`` checks parity without torch.

Needs torch and transformers (not specjax dependencies); run by hand::

    pip install torch==2.13.0 transformers
    python scripts/make_family_fixtures.py [--out tests/fixtures/families] [--only qwen3 ...]

Per family: a config with 2 layers, width 32, vocabulary 256 (the family's switches set so
that they matter: a sliding window shorter than the prompts, strong soft-capping, a
head_dim different from hidden/heads, ...), weights drawn afresh so that logits are O(1-10)
(transformers' 0.02-std init gives near-flat logits, against which a 1e-4 check says little),
``save_pretrained`` in float32, then with the eager attention implementation:

* ``config_json``: config.json as written; ``t:<name>``: every tensor of model.safetensors
* ``prompt`` [12] random tokens, ``greedy`` [32]: ``generate(do_sample=False)`` with the KV
  cache, checked here against a cache-free greedy loop
* ``input_ids`` [2, 44]: row 0 the prompt and the greedy tokens, row 1 random tokens;
  ``logits`` [2, 44, V]: one full forward (row 0 holds the logits at the 32 decision points,
  positions 11..42); ``min_margin``: the smallest top-1 / top-2 gap at those points
* ``versions``: transformers and torch versions

The script then loads each checkpoint with specjax's ``load_hf``, writes it back with
``save_hf`` and loads that folder with transformers again: same logits (so save_hf's
config.json is one transformers reads as intended).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

V, PROMPT, NEW = 256, 12, 32
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)

FAMILIES = {
    # name: (config class name, extra config, seed)
    "llama": ("LlamaConfig", dict(head_dim=8, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16}), 1),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=5,
                                  max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 2),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 3),
    "mistral": ("MistralConfig", dict(head_dim=16, tie_word_embeddings=False, sliding_window=5,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4}), 4),
    "gemma2": ("Gemma2Config", dict(head_dim=16, tie_word_embeddings=True, sliding_window=5, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=10.0,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e4}), 5),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, tie_word_embeddings=True, sliding_window=5,
                                        query_pre_attn_scalar=16, final_logit_softcapping=None,
                                        layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), 6),
}


def make_model(family: str, seed: int):
    import torch
    import transformers

    cls_name, extra, _ = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    gemma = family.startswith("gemma")
    g = torch.Generator().manual_seed(seed)
    # with tied embeddings the residual's copy of the last token's embedding makes greedy
    # repeat it: the layers' outputs are drawn 3x larger there
    boost = 3.0 if cfg.tie_word_embeddings else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")) and gemma:
                p.copy_(boost - 1.0 + 0.3 * torch.randn(p.shape, generator=g))  # Gemma's output norms
            elif name.endswith("norm.weight"):  # effective scale around 1 (Gemma: 1 + w)
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("o_proj.weight", "down_proj.weight")) and not gemma:
                p.copy_(boost * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:  # tied: smaller, or greedy repeats the last token
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if cfg.tie_word_embeddings else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def draw(family: str, seed: int):
    """A model and transformers' outputs for it (see the module docs)."""
    import torch

    model = make_model(family, seed)
    rng = np.random.default_rng(100 + seed)
    prompt = rng.integers(0, V, (PROMPT,), dtype=np.int64)
    with torch.no_grad():
        # an explicit mask: generate() would otherwise mask the prompt's pad_token_id tokens
        gen = model.generate(torch.as_tensor(prompt[None]), attention_mask=torch.ones((1, PROMPT), dtype=torch.long),
                             max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, num_beams=1,
                             eos_token_id=None, pad_token_id=V - 1)
    greedy = gen[0, PROMPT:].numpy()
    ids = np.stack([np.concatenate([prompt, greedy]), rng.integers(0, V, (PROMPT + NEW,), dtype=np.int64)])
    logits = hf_logits(model, ids)
    full = logits[0, PROMPT - 1:-1]  # [NEW, V]: the decision points
    nocache = full.argmax(-1)
    assert np.array_equal(nocache, greedy), f"{family}: generate() and the cache-free greedy loop disagree"
    top2 = np.sort(full, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    return model, ids, prompt, logits, greedy, margin


def make(family: str, out: Path) -> dict:
    import torch
    import transformers
    from safetensors.numpy import load_file

    # the first draw whose greedy path is neither a repetition of a few tokens nor a near tie
    for attempt in range(50):
        seed = FAMILIES[family][2] + 1000 * attempt
        model, ids, prompt, logits, greedy, margin = draw(family, seed)
        if len(set(greedy.tolist())) >= 12 and margin >= 2e-3:
            break
    else:
        raise RuntimeError(f"{family}: no draw with a varied, untied greedy path")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        files = sorted(Path(d).glob("*.safetensors"))
        assert len(files) == 1, files
        tensors = load_file(str(files[0]))
        config_json = (Path(d) / "config.json").read_text()
    arrays = {f"t:{k}": np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}
    path = out / f"{family}.npz"
    np.savez_compressed(
        path, config_json=np.array(config_json), input_ids=ids.astype(np.int32), logits=logits.astype(np.float32),
        prompt=prompt.astype(np.int32), greedy=greedy.astype(np.int32),
        min_margin=np.float32(margin), seed=np.int64(seed), versions=np.array(f"transformers {transformers.__version__}, "
                                                         f"torch {torch.__version__}"), **arrays)
    return dict(path=path, model=model, ids=ids, logits=logits, margin=margin)


def check_save_hf(family: str, path: Path, model, ids, logits) -> float:
    """specjax load_hf -> save_hf -> transformers from_pretrained: same logits as the original."""
    import transformers
    from safetensors.numpy import save_file

    from specjax.models.hf_checkpoint import load_hf, save_hf

    z = np.load(path)
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "src", Path(d) / "dst"
        src.mkdir()
        (src / "config.json").write_text(str(z["config_json"]))
        save_file({k[2:]: z[k] for k in z.files if k.startswith("t:")}, str(src / "model.safetensors"))
        save_hf(load_hf(src), dst)
        back = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager")
        assert type(back) is type(model), (type(back), type(model))
        return float(np.abs(hf_logits(back.eval(), ids) - logits).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "families"))
    ap.add_argument("--only", nargs="*", choices=sorted(FAMILIES))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for family in args.only or FAMILIES:
        r = make(family, out)
        err = check_save_hf(family, r["path"], r["model"], r["ids"], r["logits"])
        print(f"{family}: {r['path']} ({r['path'].stat().st_size / 1024:.0f} KiB), |logits| max "
              f"{np.abs(r['logits']).max():.2f}, greedy min margin {r['margin']:.4f}, "
              f"save_hf -> transformers max |dlogits| {err:.2e}")


if __name__ == "__main__":
    main()
