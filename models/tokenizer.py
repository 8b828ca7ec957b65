"""Tokenizer built from GGUF metadata with HF ``tokenizers``, plus the ChatML template.

``tokenizer.ggml.model == "gpt2"`` is byte-level BPE (vocab + merges). The pre-tokenizer
follows llama.cpp's ``tokenizer.ggml.pre``: ``smollm`` (and ``starcoder``/``refact``) split
every digit into its own piece first, then apply the GPT-2 byte-level regex; ``gpt2`` is the
plain GPT-2 regex. Tokens of type CONTROL / USER_DEFINED are special (never split, parsed in
input text, optionally skipped when decoding).

The chat template is ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``); when the GGUF
template injects a default system message (SmolLM2 does), so do we. If jinja2 is
available, :meth:`Tokenizer.render_template` renders the file's own template, which
the tests compare against.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Optional, Sequence

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp token types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_DIGIT_FIRST_PRE = ("smollm", "starcoder", "refact", "default", "gpt2-digits")
_GPT2_PRE = ("gpt2", "gpt-2")


class TokenizerError(ValueError):
    pass


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_FIRST_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    raise TokenizerError(
        f"unsupported pre-tokenizer {pre!r}; supported: {', '.join(_DIGIT_FIRST_PRE + _GPT2_PRE)}"
    )


class Tokenizer:
    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_id: Optional[int],
        eos_id: int,
        pad_id: Optional[int] = None,
        unk_id: Optional[int] = None,
        special_ids: Sequence[int] = (),
        chat_template: Optional[str] = None,
        add_bos: bool = False,
        extra_stop_ids: Sequence[int] = (),
    ):
        self.hf = hf
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = eos_id if pad_id is None else pad_id
        self.unk_id = unk_id
        self.special_ids = tuple(sorted(set(special_ids)))
        self.chat_template = chat_template
        self.add_bos = add_bos
        im_end = hf.token_to_id("<|im_end|>")
        eot = hf.token_to_id("<|endoftext|>")
        self.stop_ids = tuple(sorted({int(i) for i in (eos_id, im_end, eot, *extra_stop_ids)
                                      if i is not None}))
        self.default_system_prompt = _default_system_prompt(chat_template)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path=None) -> "Tokenizer":
        from specjax.models.gguf_loader import open_gguf, read_metadata

        reader = open_gguf(path)
        try:
            return cls.from_gguf_metadata(read_metadata(reader, include_big=True))
        except TokenizerError as e:  # name the file
            raise TokenizerError(f"{path if path is not None else 'the default GGUF'}: {e}") from None

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("GGUF metadata lacks tokenizer.ggml.tokens (a list of token strings)")
        tokens = list(tokens)
        merges = meta.get("tokenizer.ggml.merges", [])
        if not isinstance(merges, (list, tuple)) or not all(isinstance(m, str) and " " in m for m in merges):
            raise TokenizerError("GGUF metadata tokenizer.ggml.merges must be a list of 'left right' strings")
        merges = [tuple(m.split(" ", 1)) for m in merges]
        types = list(meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
        if len(types) != len(tokens):  # a shorter list would leave special tokens unmarked
            raise TokenizerError(f"GGUF metadata has {len(types)} tokenizer.ggml.token_type entries for "
                                 f"{len(tokens)} tokens")
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise TokenizerError("duplicate tokens in GGUF vocabulary")
        for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
            i = meta.get(f"tokenizer.ggml.{key}")
            if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens)):
                raise TokenizerError(f"GGUF metadata tokenizer.ggml.{key} = {i!r} is not a token id of the "
                                     f"{len(tokens)}-token vocabulary")
        try:
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        except Exception as e:  # e.g. a merge of tokens that are not in the vocabulary
            raise TokenizerError(f"GGUF tokenizer: {str(e).splitlines()[0][:200]}") from None
        hf.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt2"))
        hf.decoder = decoders.ByteLevel()
        special = [i for i, ty in enumerate(types) if ty in (_CONTROL, _USER_DEFINED)]
        hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        g = meta.get
        return cls(
            hf,
            bos_id=g("tokenizer.ggml.bos_token_id"),
            eos_id=g("tokenizer.ggml.eos_token_id"),
            pad_id=g("tokenizer.ggml.padding_token_id"),
            unk_id=g("tokenizer.ggml.unknown_token_id"),
            special_ids=special,
            chat_template=g("tokenizer.chat_template"),
            add_bos=bool(g("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_folder(cls, folder) -> "Tokenizer":
        """The tokenizer of an HF checkpoint folder: ``tokenizer.json`` (required),
        ``tokenizer_config.json`` (special tokens, BOS rule, chat template) and the EOS ids of
        ``generation_config.json`` / ``config.json`` (all of them stop generation)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust error says what is wrong with the file
            raise TokenizerError(f"{path}: not a tokenizer file ({str(e).splitlines()[0][:200]})") from None
        tc, gc, mc = (_read_json(folder / n) for n in
                      ("tokenizer_config.json", "generation_config.json", "config.json"))

        def token_id(v):
            content = v.get("content") if isinstance(v, dict) else v
            return hf.token_to_id(content) if isinstance(content, str) else None

        def ids(v):
            return [int(x) for x in (v if isinstance(v, list) else [v]) if isinstance(x, int)]

        eos_ids = ids(gc.get("eos_token_id")) + ids(mc.get("eos_token_id"))
        eos = token_id(tc.get("eos_token"))
        eos = eos if eos is not None else (eos_ids[0] if eos_ids else None)
        if eos is None:
            raise TokenizerError(f"{folder}: no end-of-sequence token (tokenizer_config.json eos_token "
                                 "or generation_config.json eos_token_id)")
        bos = token_id(tc.get("bos_token"))
        if bos is None and ids(mc.get("bos_token_id")):
            bos = ids(mc.get("bos_token_id"))[0]
        add_bos = tc.get("add_bos_token")
        if add_bos and bos is None:  # encode would silently leave the BOS out
            raise TokenizerError(f"{folder}: tokenizer_config.json sets add_bos_token but its bos_token "
                                 f"{tc.get('bos_token')!r} is not a token of tokenizer.json")
        if add_bos is None:  # the tokenizer's own post-processor decides (Llama 3 adds BOS)
            add_bos = bos is not None and hf.encode("a", add_special_tokens=True).ids[:1] == [bos]
        special = [i for i, t in hf.get_added_tokens_decoder().items() if t.special]
        return cls(hf, bos_id=bos, eos_id=eos, pad_id=token_id(tc.get("pad_token")),
                   unk_id=token_id(tc.get("unk_token")), special_ids=special,
                   chat_template=tc.get("chat_template") if isinstance(tc.get("chat_template"), str) else None,
                   add_bos=bool(add_bos), extra_stop_ids=eos_ids)

    # -- encode / decode ---------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
        """Token ids; special tokens written in the text (``<|im_start|>``) map to their ids."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def encode_batch(self, texts: Iterable[str], add_bos: Optional[bool] = None) -> list[list[int]]:
        return [self.encode(t, add_bos) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> Optional[str]:
        return self.hf.id_to_token(int(i))

    def token_to_id(self, t: str) -> Optional[int]:
        return self.hf.token_to_id(t)

    # -- chat ---------------------------------------------------------------------------
    def encode_user(self, text: str) -> list:
        """Token ids of one user message in the chat template, ready for the reply."""
        return self.apply_chat_template([{"role": "user", "content": text}], tokenize=True)

    @property
    def uses_chatml(self) -> bool:
        """The chat template is ChatML (or there is none): built in, no jinja2 needed."""
        return not self.chat_template or "<|im_start|>" in self.chat_template

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False):
        """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, with the
        template's default system message first when the conversation has none, and
        ``<|im_start|>assistant\\n`` at the end if ``add_generation_prompt``. Another
        template (an HF folder's ``chat_template``) is rendered with jinja2, as HF does, and
        its text is encoded without adding BOS again."""
        if isinstance(messages, dict):
            messages = [messages]
        if not self.uses_chatml:
            text = self.render_template(messages, add_generation_prompt)
            return self.encode(text, add_bos=False) if tokenize else text
        parts = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise TokenizerError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
            if i == 0 and m["role"] != "system" and self.default_system_prompt is not None:
                parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        text = "".join(parts)
        return self.encode(text) if tokenize else text

    def render_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Render the file's own jinja chat template (needs jinja2), with the variables HF
        templates use (``bos_token``, ``eos_token``, ``raise_exception``)."""
        try:
            import jinja2
        except ImportError:
            raise TokenizerError("this model's chat template needs jinja2 (pip install jinja2); "
                                 "or give the prompt as raw text") from None

        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template")

        def raise_exception(msg):
            raise TokenizerError(f"chat template: {msg}")

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        tok = lambda i: "" if i is None else (self.id_to_token(i) or "")  # noqa: E731
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=tok(self.bos_id), eos_token=tok(self.eos_id), raise_exception=raise_exception)



def _default_system_prompt(template: Optional[str]) -> Optional[str]:
    if not template:
        return None
    m = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, flags=re.S)
    return m.group(1) if m and "messages[0]['role'] != 'system'" in template else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: {e}") from None
    return d if isinstance(d, dict) else {}


class TextStream:
    """Incremental detokenization for streaming: :meth:`push` token ids as they come, get
    back the text that is now final. Text is held back while it ends in an incomplete UTF-8
    character (decoded as U+FFFD) until a later token completes it; :meth:`finish` drops
    an incomplete character left at the end (a generation cut by its token limit).
    ``drop_ids`` (e.g. the stop tokens) are not printed. The pieces joined equal
    :meth:`text` of all the ids pushed."""

    def __init__(self, tokenizer: "Tokenizer", drop_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.drop = frozenset(int(i) for i in drop_ids)
        self.ids: list = []
        self._sent = 0  # characters of the decoded text already returned

    def _stable(self) -> str:
        return self.tokenizer.decode(self.ids).rstrip("\ufffd")

    def push(self, ids: Iterable[int]) -> str:
        self.ids += [int(i) for i in ids if int(i) not in self.drop]
        text = self._stable()
        out, self._sent = text[self._sent:], max(self._sent, len(text))
        return out

    def finish(self) -> str:
        """The rest of the text (nothing more will be pushed)."""
        return self.push([])

    @classmethod
    def text(cls, tokenizer: "Tokenizer", ids: Iterable[int], drop_ids: Iterable[int] = ()) -> str:
        """The whole text of ``ids`` as a stream would print it."""
        s = cls(tokenizer, drop_ids)
        return s.push(ids) + s.finish()
