"""GPT-2 style byte-level BPE, as llama.cpp runs it for `tokenizer.ggml.model == "gpt2"`.

Pre-tokenization follows llama.cpp's own splitter (`unicode_regex_split_custom_gpt2` in
`src/unicode.cpp`) rather than a regex engine: it is what produced the reference ids, and it
differs from a literal reading of the regex at the edges (codepoints outside every category,
whitespace runs). The merges themselves run in HF `tokenizers` (Rust) when it is installed and
accepts the vocabulary, else in the pure-Python loop below, which mirrors
`llm_tokenizer_bpe_session`.
"""

from __future__ import annotations

import heapq
import unicodedata
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

# --- byte <-> unicode mapping (GPT-2's bytes_to_unicode) ------------------------------------------


def _byte_to_char() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR: list[str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# Applied to text decoded as latin-1 (one char per byte), this maps raw bytes to BPE symbols.
_LATIN1_TO_SYMBOL = {b: c for b, c in enumerate(BYTE_TO_CHAR)}


def byte_encode(piece: str) -> str:
    """`piece` as GPT-2 byte-level symbols: one printable char per UTF-8 byte."""
    return piece.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_SYMBOL)


def byte_decode(token_text: str) -> bytes:
    """Undo `byte_encode` for one vocabulary entry, as llama.cpp's `llama_decode_text` does,
    including its marker for chars outside the byte alphabet."""
    out = bytearray()
    for ch in token_text:
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            enc = ch.encode("utf-8")
            out += b"[UNK_BYTE_0x" + enc.hex().encode() + token_text.encode("utf-8") + b"]"
    return bytes(out)


# --- codepoint classes (llama.cpp's unicode_cpt_flags, reduced to what the splitter asks) --------

_LETTER, _NUMBER, _SPACE, _OTHER = 1, 2, 3, 4
# Unicode's White_Space property: llama.cpp's `unicode_set_whitespace` (narrower than str.isspace).
_WHITESPACE = frozenset(
    [
        0x09,
        0x0A,
        0x0B,
        0x0C,
        0x0D,
        0x20,
        0x85,
        0xA0,
        0x1680,
        *range(0x2000, 0x200B),
        0x2028,
        0x2029,
        0x202F,
        0x205F,
        0x3000,
    ]
)


# Codepoints that llama.cpp's tables (Unicode 15.1) make letters or numbers but that Python
# 3.11's unicodedata (Unicode 14.0) does not know yet.
_NEWER_THAN_PYTHON = (
    (0x1123F, 0x11240, _LETTER),
    (0x11F02, 0x11F02, _LETTER),
    (0x11F04, 0x11F10, _LETTER),
    (0x11F12, 0x11F33, _LETTER),
    (0x11F50, 0x11F59, _NUMBER),
    (0x1342F, 0x1342F, _LETTER),
    (0x13441, 0x13446, _LETTER),
    (0x1B132, 0x1B132, _LETTER),
    (0x1B155, 0x1B155, _LETTER),
    (0x1D2C0, 0x1D2D3, _NUMBER),
    (0x1DF25, 0x1DF2A, _LETTER),
    (0x1E030, 0x1E06D, _LETTER),
    (0x1E4D0, 0x1E4EB, _LETTER),
    (0x1E4F0, 0x1E4F9, _NUMBER),
    (0x2B739, 0x2B739, _LETTER),
    (0x2EBF0, 0x2EE5D, _LETTER),
    (0x31350, 0x323AF, _LETTER),
)


@lru_cache(maxsize=65536)
def _char_class(ch: str) -> int:
    cp = ord(ch)
    if cp in _WHITESPACE:
        return _SPACE
    if cp >= 0x11000:
        for lo, hi, cls in _NEWER_THAN_PYTHON:
            if lo <= cp <= hi:
                return cls
    cat = unicodedata.category(ch)[0]
    if cat == "L":
        return _LETTER
    if cat == "N":
        return _NUMBER
    # Unassigned codepoints carry llama.cpp's UNDEFINED flag, which is non-zero: they count as
    # "other" like punctuation and symbols.
    return _OTHER


_ASCII_CLASS = [_char_class(chr(c)) for c in range(128)]


def _classes(s: str) -> list[int]:
    ascii_class = _ASCII_CLASS
    return [ascii_class[o] if (o := ord(c)) < 128 else _char_class(c) for c in s]


def split_digits(pieces: list[str]) -> list[str]:
    """The `\\p{N}` pass: every number codepoint becomes a piece of its own."""
    out: list[str] = []
    for s in pieces:
        cls = _classes(s)
        start = 0
        for i, c in enumerate(cls):
            if c == _NUMBER:
                if i > start:
                    out.append(s[start:i])
                out.append(s[i])
                start = i + 1
        if start < len(s):
            out.append(s[start:])
    return out


def split_gpt2(pieces: list[str]) -> list[str]:
    """llama.cpp's hand-written matcher for
    `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)`, applied
    within each piece (matches never cross piece boundaries)."""
    out: list[str] = []
    for s in pieces:
        n = len(s)
        cls = _classes(s)
        cls.append(0)  # sentinel: "out of range", belongs to no class
        pos = 0
        while pos < n:
            start = pos
            ch = s[pos]
            if ch == "'" and pos + 1 < n:
                nxt = s[pos + 1]
                if nxt in "stmd":
                    out.append(s[pos : pos + 2])
                    pos += 2
                    continue
                if pos + 2 < n and s[pos + 1 : pos + 3] in ("re", "ve", "ll"):
                    out.append(s[pos : pos + 3])
                    pos += 3
                    continue
            c2 = cls[pos + 1] if ch == " " else cls[pos]
            if c2 == _LETTER or c2 == _NUMBER or c2 == _OTHER:
                if ch == " ":
                    pos += 1
                while cls[pos] == c2:
                    pos += 1
                out.append(s[start:pos])
                continue
            n_space = 0
            while cls[pos + n_space] == _SPACE:
                n_space += 1
            if n_space > 1 and pos + n_space < n:
                # \s+(?!\S): leave the last whitespace to start the next word.
                pos += n_space - 1
            elif n_space > 0:
                pos += n_space
            else:
                pos += 1
            out.append(s[start:pos])
    return out


# llama.cpp's pre-tokenizer names that use the GPT-2 matcher, with or without the digit pass,
# and whether their detokenizer cleans spaces before punctuation (`clean_spaces`).
PRE_TOKENIZERS: dict[str, tuple[bool, bool]] = {
    # name: (split digits first, clean_spaces)
    "smollm": (True, False),
    "starcoder": (True, True),
    "refact": (True, True),
    "command-r": (True, False),
    "codeshell": (True, True),
    "exaone": (True, True),
    "minerva-7b": (True, True),
    "mellum2": (True, True),
    "gpt-2": (False, True),
    "phi-2": (False, True),
    "jina-es": (False, True),
    "jina-de": (False, True),
    "gigachat": (False, True),
    "jina-v2-es": (False, True),
    "jina-v2-de": (False, True),
    "a.x-4.0": (False, True),
    "mellum": (False, True),
    "modern-bert": (False, True),
    "exaone4": (False, True),
    "mpt": (False, True),
    "olmo": (False, True),
    "jais": (False, True),
    "trillion": (False, False),
    "granite-docling": (False, False),
}


def pre_tokenize(text: str, split_numbers: bool) -> list[str]:
    """Raw text -> the words BPE merges run within (not yet byte-encoded)."""
    pieces = [text]
    if split_numbers:
        pieces = split_digits(pieces)
    return split_gpt2(pieces)


# --- merges --------------------------------------------------------------------------------------


def parse_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    """GGUF merges are "left right"; llama.cpp splits at the first space after the first char
    (a left part may itself be a space symbol in exotic vocabularies)."""
    pairs: list[tuple[str, str]] = []
    for m in merges:
        cut = m.find(" ", 1)
        pairs.append((m[:cut], m[cut + 1 :]) if cut >= 0 else ("", ""))
    return pairs


class PythonBPE:
    """The merge loop of `llm_tokenizer_bpe_session::tokenize`, one word at a time."""

    def __init__(
        self, token_to_id: dict[str, int], merges: list[tuple[str, str]], raw: bool = False
    ) -> None:
        """`raw`: words are raw UTF-8 text, not GPT-2 byte symbols (Gemma 4 style), and a symbol
        missing from the vocabulary becomes its bytes' `<0xXX>` tokens."""
        self.token_to_id = token_to_id
        self.raw = raw
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, pair in enumerate(merges):
            self.ranks.setdefault(pair, rank)
        self._cache: dict[str, list[int]] = {}

    def word_ids(self, word: str) -> list[int]:
        """Ids of one byte-encoded (or, `raw`, escaped UTF-8) word."""
        ids = self._cache.get(word)
        if ids is None:
            ids = self._merge(word)
            if len(self._cache) < 50000:
                self._cache[word] = ids
        return ids

    def _merge(self, word: str) -> list[int]:
        ranks = self.ranks
        syms: list[str] = list(word)
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            rank = ranks.get((syms[left], syms[right]))
            if rank is not None:
                heapq.heappush(heap, (rank, left, right, syms[left] + syms[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != text:
                continue  # outdated: one side has merged with something else since
            syms[left] = text
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])

        out: list[int] = []
        vocab = self.token_to_id
        i = 0
        while i != -1:
            sym = syms[i]
            tid = vocab.get(sym)
            if tid is not None:
                out.append(tid)
            elif self.raw:
                for b in sym.encode("utf-8"):
                    t = vocab.get(f"<0x{b:02X}>")
                    if t is not None:
                        out.append(t)
            else:
                # llama.cpp looks the symbol's raw bytes up as one-byte strings; only ASCII
                # bytes can be vocabulary entries, the rest is dropped.
                for b in sym.encode("utf-8"):
                    t = vocab.get(chr(b)) if b < 0x80 else None
                    if t is not None:
                        out.append(t)
            i = nxt[i]
        return out


def make_merger(
    token_to_id: dict[str, int], merges: list[tuple[str, str]]
) -> tuple[Callable[[list[str]], list[int]], str]:
    """A function from byte-encoded words to ids, and the name of the backend that runs it.

    HF `tokenizers` (Rust) runs the merges when it is installed and the vocabulary holds every
    merge result; words with a byte symbol missing from the vocabulary (llama.cpp drops those
    bytes, HF would not) and vocabularies HF refuses go through `PythonBPE`."""
    py = PythonBPE(token_to_id, merges)

    def merge_py(words: list[str]) -> list[int]:
        out: list[int] = []
        for w in words:
            out += py.word_ids(w)
        return out

    hf = _hf_model(token_to_id, merges)
    if hf is None:
        return merge_py, "python"
    missing = frozenset(c for c in BYTE_TO_CHAR if c not in token_to_id)
    encode = hf.encode

    def merge_hf(words: list[str]) -> list[int]:
        if not words:
            return []
        if missing and any(not missing.isdisjoint(w) for w in words):
            out: list[int] = []
            for w in words:
                if missing.isdisjoint(w):
                    out += encode([w], is_pretokenized=True, add_special_tokens=False).ids
                else:
                    out += py.word_ids(w)
            return out
        # words merge independently: in slices, so that a large text does not hold the GIL
        # (and the server's event loop) for the whole of one Rust call
        ids: list[int] = []
        for at in range(0, len(words), MERGE_SLICE):
            piece = words[at : at + MERGE_SLICE]
            ids += encode(piece, is_pretokenized=True, add_special_tokens=False).ids
        return ids

    return merge_hf, "tokenizers"


MERGE_SLICE = 8192  # words per call into HF tokenizers (~10 ms)


def _hf_model(token_to_id: dict[str, int], merges: list[tuple[str, str]]) -> Any:
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import BPE
    except ImportError:
        return None
    seen: set[tuple[str, str]] = set()
    for a, b in merges:
        # HF rejects merges whose result is no vocabulary entry; llama.cpp would still merge
        # and then fall back to bytes. Duplicates would take the later rank in HF.
        if (a, b) in seen or not a or not b or (a + b) not in token_to_id:
            return None
        seen.add((a, b))
    try:
        return HFTokenizer(BPE(vocab=token_to_id, merges=merges, cache_capacity=20000))
    except Exception:  # any refusal means "not equivalent here"; the Python path takes over
        return None
