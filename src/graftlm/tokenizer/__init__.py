"""Tokenizers built from GGUF metadata that reproduce llama.cpp token for token, incremental
detokenization, and chat-template rendering."""

from graftlm.tokenizer.chat import ChatTemplateError, chatml, render_chat
from graftlm.tokenizer.stream import StreamDecoder
from graftlm.tokenizer.tokenizer import SUPPORTED_MODELS, Tokenizer
from graftlm.tokenizer.vocab import TokenAttr

__all__ = [
    "SUPPORTED_MODELS",
    "ChatTemplateError",
    "StreamDecoder",
    "TokenAttr",
    "Tokenizer",
    "chatml",
    "render_chat",
]
