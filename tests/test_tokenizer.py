"""The SmolLM2 tokenizer rebuilt from GGUF metadata, and the ChatML template."""
import json

import pytest

from specjax.models import gguf_loader
from specjax.models.tokenizer import Tokenizer, TokenizerError

@pytest.fixture(scope="module")
def tok():
    try:
        gguf_loader.default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return Tokenizer.from_gguf()


TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Café crème, naïve façade, Ærøskøbing, Straße",
    "日本語のテキストと中文文本",
    "emoji: 🚀🔥👍🏽 and 👨‍👩‍👧‍👦 family",
    "spaces:    four\ttab\n\nnewlines   \n  trailing   ",
    "digits 1234567890 and 3.14159 and 2024-11-29",
    "",
    " leading space",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.real_model
def test_vocab_and_special_ids(tok):
    assert tok.vocab_size == 49152
    assert tok.eos_id == 2 and tok.bos_id == 1 and tok.id_to_token(2) == "<|im_end|>"
    assert set(tok.stop_ids) == {0, 2}  # <|endoftext|>, <|im_end|>
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"
    assert not tok.add_bos and tok.encode("hi")[0] != tok.bos_id


@pytest.mark.real_model
def test_digits_split_individually(tok):
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]
    pieces = [tok.decode([i]) for i in tok.encode("in 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]


@pytest.mark.real_model
def test_known_encoding(tok):
    # GPT-2 byte-level merges: common words are single tokens with the leading space
    ids = tok.encode("What is the capital of France?")
    assert [tok.decode([i]) for i in ids] == ["What", " is", " the", " capital", " of", " France", "?"]


@pytest.mark.real_model
def test_chat_template_matches_gguf_jinja(tok):
    pytest.importorskip("jinja2")
    convs = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Ça va? 🚀"}],
    ]
    for msgs in convs:
        for gen in (True, False):
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == tok.render_template(msgs, gen)


@pytest.mark.real_model
def test_chat_template_shape(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert tok.encode_user("Hi") == ids
    assert ids[0] == 1 and ids[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([{"content": "no role"}])


def test_unsupported_tokenizer_model():
    with pytest.raises(TokenizerError, match="unsupported GGUF tokenizer model 'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="unsupported pre-tokenizer 'qwen2'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
                                      "tokenizer.ggml.pre": "qwen2"})


# ---------------------------------------------------------------------------- streaming text


@pytest.mark.real_model
@pytest.mark.parametrize("text", [t for t in TEXTS if t and "<|" not in t])
def test_text_stream_holds_back_incomplete_characters(tok, text):
    """Token by token, the stream never prints a broken character, and the pieces join to
    the decoded text (the stop token is dropped)."""
    from specjax.models.tokenizer import TextStream

    ids = tok.encode(text) + [tok.eos_id]
    s = TextStream(tok, drop_ids=tok.stop_ids)
    pieces = [s.push([i]) for i in ids] + [s.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert TextStream.text(tok, ids, tok.stop_ids) == text


@pytest.mark.real_model
def test_text_stream_waits_for_a_split_character_and_drops_it_if_cut(tok):
    from specjax.models.tokenizer import TextStream

    ids = tok.encode("go 🚀")
    assert "\ufffd" in tok.decode(ids[:-1])  # the rocket's bytes span several tokens
    s = TextStream(tok)
    assert s.push(ids[:-1]) == "go "  # the rocket is held back: it is not complete yet
    assert s.push(ids[-1:]) == "🚀"
    cut = TextStream(tok)
    assert cut.push(ids[:-1]) + cut.finish() == "go "  # a generation cut mid-character


@pytest.mark.real_model
def test_tokenizer_from_an_hf_folder(tok, tmp_path):
    from specjax.models.hf_checkpoint import tokenizer_config

    tok.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    t2 = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert t2.encode(text) == tok.encode(text)
    assert t2.encode_user("hi") == tok.encode_user("hi")
    assert t2.eos_id == tok.eos_id and set(t2.stop_ids) == set(tok.stop_ids) | {7}
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizer file"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
