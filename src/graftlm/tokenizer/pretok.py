"""Pre-tokenizers of `tokenizer.ggml.pre`: the name -> how llama.cpp cuts text into BPE words.

Two kinds. The GPT-2 family runs llama.cpp's hand-written GPT-2 matcher (`bpe.split_gpt2`,
optionally after the digit pass). The Llama 3, Qwen2 and GPT-4o families are regexes; llama.cpp
(`unicode_regex_split` in `src/unicode.cpp`) runs those over a *collapsed* copy of the text, where
each non-ASCII codepoint becomes one byte standing for its class (letter 0xD2, number 0xD1,
whitespace 0x0B, anything else 0xD0-0xD5), and `\\p{L}` / `\\p{N}` in the pattern become
`[\\xD2A-Za-z]` / `[\\xD10-9]`. That is not the same as a Unicode regex engine: for the GPT-4o
pattern a non-ASCII letter counts as both upper and lower case. So we do what llama.cpp does:
collapse the text with llama.cpp's codepoint classes and run the collapsed pattern in Python's
`re` (ASCII mode: `\\s` is the six ASCII spaces, as in C++ `std::regex`). Llama 3's pattern has a
hand-written matcher in llama.cpp (`unicode_regex_split_custom_llama3`); on every codepoint class
it agrees with the regex, which is what we run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from graftlm.tokenizer.bpe import (
    _LETTER,
    _NUMBER,
    _SPACE,
    _char_class,
    pre_tokenize,
)
from graftlm.tokenizer.bpe import (
    PRE_TOKENIZERS as GPT2_PRE_TOKENIZERS,
)

# llama.cpp's regexes (`llm_tokenizer_bpe` in src/llama-vocab.cpp), verbatim.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The collapsed text: one char per codepoint (ASCII kept; the classes the patterns can tell apart).
_COLLAPSED_CLASS = {_LETTER: "\xd2", _NUMBER: "\xd1", _SPACE: "\x0b"}
_COLLAPSED_OTHER = "\xd0"
# ... and what llama.cpp puts for \p{L} and \p{N} in the pattern
_COLLAPSED_CATEGORY = {r"\p{L}": "\xd2A-Za-z", r"\p{N}": "\xd10-9"}


def collapse_text(text: str) -> str:
    """llama.cpp's `text_collapsed`: ASCII as is, every other codepoint its class's stand-in."""
    if text.isascii():
        return text
    return "".join(
        c if c < "\x80" else _COLLAPSED_CLASS.get(_char_class(c), _COLLAPSED_OTHER) for c in text
    )


def collapse_pattern(pattern: str) -> str:
    """llama.cpp's `regex_expr_collapsed`: `\\p{L}` -> `[\\xD2A-Za-z]` (no brackets added inside
    a bracket expression), likewise `\\p{N}`."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "[" and (i == 0 or pattern[i - 1] != "\\"):
            inside = True
        elif inside and ch == "]" and pattern[i - 1] != "\\":
            inside = False
        elif pattern.startswith(r"\p{", i):
            cat = pattern[i : pattern.index("}", i) + 1]
            sub = _COLLAPSED_CATEGORY[cat]  # KeyError: a category llama.cpp would not collapse
            out.append(sub if inside else f"[{sub}]")
            i += len(cat)
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def regex_splitter(pattern: str) -> Callable[[str], list[str]]:
    """A function from raw text to its words, as llama.cpp splits with `pattern` (matches and
    the unmatched stretches between them, in order)."""
    compiled = re.compile(collapse_pattern(pattern), re.ASCII)

    def split(text: str) -> list[str]:
        out: list[str] = []
        at = 0
        for m in compiled.finditer(collapse_text(text)):
            start, end = m.span()
            if start > at:
                out.append(text[at:start])
            if end > start:
                out.append(text[start:end])
            at = end
        if at < len(text):
            out.append(text[at:])
        return out

    return split


@dataclass(frozen=True)
class PreTokenizer:
    """What a `tokenizer.ggml.pre` name sets in llama.cpp's `llama_vocab::impl::load`."""

    split: Callable[[str], list[str]]  # raw text -> words (not yet byte-encoded)
    clean_spaces: bool  # the detokenizer's clean-up pass
    ignore_merges: bool = False  # a word that is a vocabulary entry is that token, unmerged
    add_bos: bool = False  # default of tokenizer.ggml.add_bos_token
    bos_default: int | None = 11  # BOS id when tokenizer.ggml.bos_token_id is absent


def _gpt2(split_numbers: bool, clean_spaces: bool) -> PreTokenizer:
    return PreTokenizer(lambda text: pre_tokenize(text, split_numbers), clean_spaces)


_llama3 = regex_splitter(LLAMA3_REGEX)
_qwen2 = regex_splitter(QWEN2_REGEX)
_gpt4o = regex_splitter(GPT4O_REGEX)

# name -> pre-tokenizer, following llama.cpp's name -> LLAMA_VOCAB_PRE_TYPE_* table.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    name: _gpt2(split_numbers, clean)
    for name, (split_numbers, clean) in GPT2_PRE_TOKENIZERS.items()
}
# LLAMA3: Llama 3.x, Falcon 3, Pixtral, LFM2, ...
for _name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
              "lfm2", "jina-v5-nano"):  # fmt: skip
    PRE_TOKENIZERS[_name] = PreTokenizer(_llama3, True, ignore_merges=True, add_bos=True)
# DBRX, SMAUG: the Llama 3 regex without Llama 3's flags; CHATGLM4: the same, and no default BOS
PRE_TOKENIZERS["dbrx"] = PreTokenizer(_llama3, True)
PRE_TOKENIZERS["smaug-bpe"] = PreTokenizer(_llama3, True)
for _name in ("glm4", "chatglm-bpe"):
    PRE_TOKENIZERS[_name] = PreTokenizer(_llama3, True, bos_default=None)
# QWEN2 (and STABLELM2, HUNYUAN, SOLAR_OPEN, GROK_2: the same regex): Qwen 2/2.5/3, Qwen3-MoE, ...
for _name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"):
    PRE_TOKENIZERS[_name] = PreTokenizer(_qwen2, False)
for _name in ("megrez", "stablelm2"):
    PRE_TOKENIZERS[_name] = PreTokenizer(_qwen2, True)
# GPT4O (and MINIMAX_M2): o200k's regex; gpt-oss, Llama 4, ...
for _name in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"):
    PRE_TOKENIZERS[_name] = PreTokenizer(_gpt4o, False)
