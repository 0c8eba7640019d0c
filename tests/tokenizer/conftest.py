"""Fixtures for the tokenizer tests: the tokenizer metadata of the two real GGUF files, the
tokenizers built from it, and small hand-made vocabularies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from graftlm.gguf import GGUFFile
from graftlm.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_file: Path) -> Path:
    return smollm2_file


@pytest.fixture(scope="session")
def gemma3_gguf(gemma3_file: Path) -> Path:
    return gemma3_file


def _tokenizer_metadata(path: Path) -> dict[str, Any]:
    return {k: v for k, v in GGUFFile(path).metadata.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="session")
def smollm2_meta(smollm2_gguf: Path) -> dict[str, Any]:
    return _tokenizer_metadata(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3_meta(gemma3_gguf: Path) -> dict[str, Any]:
    return _tokenizer_metadata(gemma3_gguf)


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_metadata(smollm2_meta)


@pytest.fixture(scope="session")
def gemma3_tok(gemma3_meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_metadata(gemma3_meta)


@pytest.fixture
def tokenizer_for(request: pytest.FixtureRequest) -> Callable[[str], Tokenizer]:
    """For tests parametrized by model name: "smollm2" or "gemma3" -> its session tokenizer."""

    def get(model: str) -> Tokenizer:
        tok: Tokenizer = request.getfixturevalue(f"{model}_tok")
        return tok

    return get


# -- small hand-made vocabularies: no model file needed ------------------------------------------

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def spm_metadata(
    pieces: dict[str, float], extra: Sequence[tuple[str, int]] = (), **keys: Any
) -> dict[str, Any]:
    """A "llama" (SentencePiece) vocabulary: <unk> <s> </s>, the 256 byte tokens, `extra`
    (text, token type) entries, then `pieces` (text -> score) as normal tokens."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [UNKNOWN, CONTROL, CONTROL]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(BYTE)
        scores.append(0.0)
    for text, kind in extra:
        tokens.append(text)
        types.append(kind)
        scores.append(0.0)
    for text, score in pieces.items():
        tokens.append(text)
        types.append(NORMAL)
        scores.append(score)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    meta.update({f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    return meta


def gpt2_metadata(
    merges: list[str], extra: Sequence[tuple[str, int]] = (), pre: str = "gpt-2", **keys: Any
) -> dict[str, Any]:
    """A "gpt2" vocabulary: the 256 byte symbols, every merge result, then `extra` entries."""
    from graftlm.tokenizer.bpe import BYTE_TO_CHAR

    tokens = list(BYTE_TO_CHAR)
    for m in merges:
        a, b = m.split(" ")
        if a + b not in tokens:
            tokens.append(a + b)
    types = [NORMAL] * len(tokens)
    for text, kind in extra:
        tokens.append(text)
        types.append(kind)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    meta.update({f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    return meta


@pytest.fixture
def make_spm() -> Callable[..., Tokenizer]:
    return lambda *a, **k: Tokenizer.from_metadata(spm_metadata(*a, **k))


@pytest.fixture
def make_gpt2() -> Callable[..., Tokenizer]:
    return lambda *a, **k: Tokenizer.from_metadata(gpt2_metadata(*a, **k))


@pytest.fixture
def spm_meta() -> Callable[..., dict[str, Any]]:
    return spm_metadata


@pytest.fixture
def gpt2_meta() -> Callable[..., dict[str, Any]]:
    return gpt2_metadata
