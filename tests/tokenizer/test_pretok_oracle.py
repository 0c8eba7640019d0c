"""Every `tokenizer.ggml.pre` name against llama.cpp's own tokenizer, without llama.cpp.

`pretok_oracle.json` holds what llama-server (the build in ../shared/llama.cpp) answered, recorded
by `scripts/pretok_oracle.py` from tiny model files that carry the vocabulary built here, once per
name: the ids of each text, the ids of a probe with special tokens added (BOS by default or not),
and the names it refused. The vocabulary is GPT-2's 256 byte symbols plus, for every word any of
our splitters makes of the texts, a chain of merges joining it into one token: a word boundary in
another place than llama.cpp's shows as other ids. Two entries no merge builds (" zzzq", "zzzq")
show whether a name takes vocabulary words whole (ignore_merges).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from graftlm.tokenizer import Tokenizer
from graftlm.tokenizer.bpe import BYTE_TO_CHAR, byte_encode
from graftlm.tokenizer.pretok import NOT_SERVED, PRE_TOKENIZERS, collapse_text

DATA = Path(__file__).parent / "pretok_oracle.json"
UNMERGED = ["zzzq", " zzzq"]  # vocabulary entries without merges (byte-encoded when written)
BOS = "<s>"


def _merge_chain(word: str, merges: list[str], seen: set[str], add: Callable[[str], None]) -> None:
    """The merges joining `word`'s symbols left to right, and each step's token."""
    left = word[0]
    for right in word[1:]:
        merge = f"{left} {right}"
        left += right
        if merge not in seen:
            seen.add(merge)
            merges.append(merge)
        add(left)


def _metadata(pre: str, tokens: list[str], types: list[int], merges: list[str]) -> dict[str, Any]:
    """The vocabulary's GGUF keys, BOS (a control token, also EOS) appended last."""
    tokens, types = [*tokens, BOS], [*types, 3]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": len(tokens) - 1,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }


def oracle_metadata(words: list[str], pre: str) -> dict[str, Any]:
    """The recorded vocabulary: byte symbols, merge chains joining each of `words`, the
    unmerged entries, then BOS (a control token)."""
    tokens = list(BYTE_TO_CHAR)
    known = set(tokens)

    def add(token: str) -> None:
        if token not in known:
            known.add(token)
            tokens.append(token)

    merges: list[str] = []
    seen: set[str] = set()
    for word in words:
        _merge_chain(byte_encode(word), merges, seen, add)
    for text in UNMERGED:
        add(byte_encode(text))
    return _metadata(pre, tokens, [1] * len(tokens), merges)


RAW_UNMERGED = [
    "zzzq",
    " zzzq",
    "\n\n\n\n\n",
]  # the same for the raw UTF-8 (Gemma 4 style) vocabulary
ESCAPED_SPACE = "\u2581"


def raw_oracle_metadata(words: list[str], pre: str) -> dict[str, Any]:
    """The recorded vocabulary of the Gemma 4 style names: the 256 `<0xXX>` byte tokens, the
    characters of `words` (none from U+3000 on: those fall back to bytes) and merge chains
    joining each word, the unmerged entries, then BOS."""
    tokens = [f"<0x{b:02X}>" for b in range(256)]
    types = [6] * 256
    known = set(tokens)

    def add(token: str) -> None:
        if token not in known:
            known.add(token)
            tokens.append(token)
            types.append(1)

    merges: list[str] = []
    seen: set[str] = set()
    for word in words:
        if any(c >= "\u3000" for c in word):
            continue
        for c in word:
            add(c)
        _merge_chain(word, merges, seen, add)
    for text in RAW_UNMERGED:
        text = text.replace(" ", ESCAPED_SPACE)
        for c in text:
            add(c)
        add(text)
    return _metadata(pre, tokens, types, merges)


def metadata_for(pre: str, data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The recorded vocabulary for `pre` and the texts recorded with it."""
    if pre in PRE_TOKENIZERS and PRE_TOKENIZERS[pre].raw_utf8:
        return raw_oracle_metadata(data["raw_words"], pre), data["texts"] + RAW_UNMERGED
    return oracle_metadata(data["words"], pre), data["texts"] + UNMERGED


def _load() -> dict[str, Any]:
    if not DATA.exists():
        return {"texts": [], "words": [], "raw_words": [], "ids": [], "names": {}, "refused": {}}
    data: dict[str, Any] = json.loads(DATA.read_text(encoding="utf-8"))
    return data


RECORDED = _load()
NAMES = sorted(RECORDED["names"])
SERVED_NAMES = [n for n in NAMES if n not in NOT_SERVED]


def _ids(key: int) -> list[int]:
    return [int(x) for x in RECORDED["ids"][key].split()]


@pytest.fixture(scope="module")
def words() -> list[str]:
    return list(RECORDED["words"])


@pytest.mark.parametrize("pre", SERVED_NAMES)
def test_ids_equal_llama_cpps(pre: str) -> None:
    """Every text, every name llama.cpp loads: our ids are the ones llama-server gave."""
    meta, texts = metadata_for(pre, RECORDED)
    tok = Tokenizer.from_metadata(meta)
    got = RECORDED["names"][pre]
    bad = []
    for text, key in zip(texts, got["ids"], strict=True):
        ours = tok.encode(text, add_special=False)
        if ours != _ids(key):
            bad.append((text, ours, _ids(key)))
    assert not bad, f"{pre}: {len(bad)} texts differ, first: {bad[0]!r}"
    # with special tokens: BOS where llama.cpp's default for the name adds it
    assert tok.encode(RECORDED["special_text"], add_special=True) == _ids(got["special"])


def test_every_name_llama_cpp_loads_is_served() -> None:
    """The names llama-server loaded are the names we serve, and those it refused we refuse."""
    assert NAMES, "no recorded data"
    served = set(PRE_TOKENIZERS) - {"default"}
    loaded = set(NAMES) - {"default"}
    assert loaded - set(NOT_SERVED) == served
    for name in RECORDED["refused"]:
        assert name not in PRE_TOKENIZERS, name


@pytest.mark.parametrize("pre", sorted(NOT_SERVED))
def test_names_we_cannot_serve_are_refused_with_the_reason(pre: str, words: list[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(NOT_SERVED[pre])):
        Tokenizer.from_metadata(oracle_metadata(words[:10], pre))


def test_a_file_without_a_name_gets_llama_cpps_default(words: list[str]) -> None:
    meta = oracle_metadata(words, "default")
    del meta["tokenizer.ggml.pre"]
    tok = Tokenizer.from_metadata(meta)
    want = RECORDED["names"]["default"]["ids"]
    for text, key in zip(RECORDED["texts"], want, strict=False):
        assert tok.encode(text, add_special=False) == _ids(key), repr(text)


def test_kimi_k2_goes_without_merges(words: list[str]) -> None:
    """llama.cpp loads a Kimi-K2 file without merges: every byte symbol its own token (ids as
    llama-server gave them for such a file)."""
    meta = oracle_metadata(words, "kimi-k2")
    del meta["tokenizer.ggml.merges"]
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("Hello world", add_special=False) == [72, 101, 108, 108, 111, 32, 119, 111,
                                                            114, 108, 100]  # fmt: skip
    meta = oracle_metadata(words, "gpt-2")
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(ValueError, match="merges"):
        Tokenizer.from_metadata(meta)


def test_collapsed_classes_with_punctuation_marks_and_symbols() -> None:
    """Patterns naming \\p{P}, \\p{M} or \\p{S} read those classes apart, Unicode 15.1's too
    (U+0CF3 a mark, U+11F43 punctuation, U+1FA75 a symbol, U+11F04 a letter)."""
    text = "a\u00e91\u0663 \u00a0!\u0301\U0001f600\u0cf3\U00011f43\U0001fa75\U00011f04\u200b"
    assert collapse_text(text, fine=True) == "a\xd21\xd1 \x0b!\xd4\xd5\xd4\xd3\xd5\xd2\xd0"
    assert collapse_text(text) == "a\xd21\xd1 \x0b!\xd0\xd0\xd0\xd0\xd0\xd2\xd0"


@pytest.mark.parametrize("pre", ["sarvam-moe", "gemma4"])
def test_raw_utf8_names_decode_back_to_the_text(pre: str) -> None:
    """U+2581 renders as a space, `<0xXX>` tokens as their byte (CJK and emoji here)."""
    tok = Tokenizer.from_metadata(raw_oracle_metadata(RECORDED["raw_words"], pre))
    for text in RECORDED["texts"]:
        if pre == "gemma4" and any(p in text for p in (" ?", " !", " .", " ,", " '")):
            continue  # its clean_spaces pass changes those
        assert tok.decode(tok.encode(text, add_special=False)) == text, repr(text)
