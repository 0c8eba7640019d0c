"""How llama.cpp's `unicode_regex_split` (`src/unicode.cpp`) cuts text with a list of regexes.

Each regex cuts every piece the ones before it made (the unmatched stretches between matches are
pieces too). Four patterns have hand-written matchers there, picked by the pattern's exact text:
GPT-2's (`bpe.split_gpt2`), Llama 3's (it agrees with the regex on every codepoint class, so we run
the regex), Kimi-K2's `\\p{Han}+` and AFMoE's digit grouping (also used for Tiny Aya's digit
regex). The others run in C++ `std::regex`, in one of two ways, which we copy:

- a pattern with Unicode categories (`\\p{L}`, `\\p{N}`, `\\p{P}`, `\\p{M}`, `\\p{S}`; `\\p{Lu}` and
  the other letter subclasses count as all letters) runs over a *collapsed* copy of the text, where
  each non-ASCII codepoint becomes one byte standing for its class (letter 0xD2, number 0xD1,
  punctuation 0xD3, mark 0xD4, symbol 0xD5, whitespace 0x0B, anything else 0xD0), and each
  category in the pattern becomes that byte plus its ASCII members (`\\p{L}` -> `[\\xD2A-Za-z]`).
  That is not what a Unicode regex engine does: for the GPT-4o pattern a non-ASCII letter counts
  as both upper and lower case;
- a pattern without categories runs over the codepoints themselves, non-ASCII whitespace made
  0x0B.

Both run here in Python's `re` in ASCII mode (`\\s`, `\\d`, `\\b` are ASCII, as in `std::regex`
with the C locale), each piece matched on its own as `std::regex_iterator` does.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from functools import lru_cache

from graftlm.tokenizer.bpe import _LETTER, _NUMBER, _SPACE, _char_class, _classes, split_gpt2

# the pattern llama.cpp hands to its GPT-2 matcher (by its exact text)
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

# --- the collapsed text ---------------------------------------------------------------------------

# One char per codepoint: ASCII kept, the others their class's stand-in (see the docstring).
_COLLAPSED_CLASS = {_LETTER: "\xd2", _NUMBER: "\xd1", _SPACE: "\x0b"}
_COLLAPSED_OTHER = "\xd0"
_COLLAPSED_CATEGORY_CHAR = {"P": "\xd3", "M": "\xd4", "S": "\xd5"}
# ... and what llama.cpp puts for each category in the pattern (`k_ucat_map` in unicode.cpp)
_ASCII_LETTERS = "A-Za-z"
_COLLAPSED_CATEGORY = {
    r"\p{L}": "\xd2" + _ASCII_LETTERS,
    r"\p{N}": "\xd10-9",
    r"\p{P}": "\xd3" + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    r"\p{M}": "\xd4",
    r"\p{S}": "\xd5" + r"\$\+<->^`\|\~",
    # the letter subclasses are all letters there
    r"\p{Lu}": "\xd2" + _ASCII_LETTERS,
    r"\p{Ll}": "\xd2" + _ASCII_LETTERS,
    r"\p{Lt}": "\xd2" + _ASCII_LETTERS,
    r"\p{Lm}": "\xd2" + _ASCII_LETTERS,
    r"\p{Lo}": "\xd2" + _ASCII_LETTERS,
}
_FINE_CATEGORIES = (r"\p{P}", r"\p{M}", r"\p{S}")
# Marks, punctuation and symbols of llama.cpp's tables (Unicode 15.1) that Python 3.11's
# unicodedata (Unicode 14.0) does not know yet (its letters and numbers: bpe._NEWER_THAN_PYTHON).
_NEWER_THAN_PYTHON = (
    *((lo, hi, "M") for lo, hi in ((0x0CF3, 0x0CF3), (0x0ECE, 0x0ECE), (0x10EFD, 0x10EFF),
      (0x11241, 0x11241), (0x11F00, 0x11F01), (0x11F03, 0x11F03), (0x11F34, 0x11F3A),
      (0x11F3E, 0x11F42), (0x13440, 0x13440), (0x13447, 0x13455), (0x1E08F, 0x1E08F),
      (0x1E4EC, 0x1E4EF))),
    *((lo, hi, "P") for lo, hi in ((0x11B00, 0x11B09), (0x11F43, 0x11F4F))),
    *((lo, hi, "S") for lo, hi in ((0x2FFC, 0x2FFF), (0x31EF, 0x31EF), (0x1F6DC, 0x1F6DC),
      (0x1F774, 0x1F776), (0x1F77B, 0x1F77F), (0x1F7D9, 0x1F7D9), (0x1FA75, 0x1FA77),
      (0x1FA87, 0x1FA88), (0x1FAAD, 0x1FAAF), (0x1FABB, 0x1FABD), (0x1FABF, 0x1FABF),
      (0x1FACE, 0x1FACF), (0x1FADA, 0x1FADB), (0x1FAE8, 0x1FAE8), (0x1FAF7, 0x1FAF8))),
)  # fmt: skip


def collapse_text(text: str, fine: bool = False) -> str:
    """llama.cpp's `text_collapsed`: ASCII as is, every other codepoint its class's stand-in.
    Without `fine`, punctuation, marks and symbols share 0xD0 (patterns without `\\p{P}`,
    `\\p{M}` or `\\p{S}` cannot tell them apart)."""
    if text.isascii():
        return text
    if fine:
        return "".join(c if c < "\x80" else _fine_char(c) for c in text)
    return "".join(
        c if c < "\x80" else _COLLAPSED_CLASS.get(_char_class(c), _COLLAPSED_OTHER) for c in text
    )


@lru_cache(maxsize=65536)
def _fine_char(c: str) -> str:
    cls = _char_class(c)
    if cls in _COLLAPSED_CLASS:
        return _COLLAPSED_CLASS[cls]
    cat = unicodedata.category(c)
    if cat == "Cn":
        cp = ord(c)
        cat = next((kind for lo, hi, kind in _NEWER_THAN_PYTHON if lo <= cp <= hi), cat)
    return _COLLAPSED_CATEGORY_CHAR.get(cat[0], _COLLAPSED_OTHER)


def widen_text(text: str) -> str:
    """The codepoints a category-free pattern runs over: non-ASCII whitespace made 0x0B."""
    if text.isascii():
        return text
    return "".join("\x0b" if c >= "\x80" and _char_class(c) == _SPACE else c for c in text)


def collapse_pattern(pattern: str) -> str:
    """llama.cpp's `regex_expr_collapsed`: `\\p{L}` -> `[\\xD2A-Za-z]` (no brackets added inside
    a bracket expression), likewise the other categories."""
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
    """A function from raw text to its words, as llama.cpp splits with `pattern` alone (one that
    names only `\\p{L}` and `\\p{N}`): matches and the unmatched stretches between them."""
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


# --- lists of regexes -----------------------------------------------------------------------------

# A cut: (the text it reads, start, end) -> the spans it makes of [start, end), in order.
Cut = Callable[[str, int, int], list[tuple[int, int]]]


def _regex_cut(compiled: re.Pattern[str]) -> Cut:
    def cut(view: str, start: int, end: int) -> list[tuple[int, int]]:
        # the piece on its own, as std::regex_iterator sees [start, end): no text before or after
        piece = view[start:end]
        spans: list[tuple[int, int]] = []
        at = 0
        for m in compiled.finditer(piece):
            s, e = m.span()
            if s > at:
                spans.append((start + at, start + s))
            if e > s:
                spans.append((start + s, start + e))
            at = e
        if at < len(piece):
            spans.append((start + at, end))
        return spans

    return cut


def _lengths_to_spans(start: int, lengths: list[int]) -> list[tuple[int, int]]:
    spans = []
    for n in lengths:
        spans.append((start, start + n))
        start += n
    return spans


def _gpt2_cut(text: str, start: int, end: int) -> list[tuple[int, int]]:
    return _lengths_to_spans(start, [len(w) for w in split_gpt2([text[start:end]])])


def _is_han(c: str) -> bool:
    """`unicode_cpt_is_han`: the CJK ideograph blocks."""
    cp = ord(c)
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2EBEF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def _contraction_len(text: str, pos: int, end: int) -> int:
    """Length of a (case-insensitive) 's 't 're 've 'm 'll 'd at `pos`, else 0."""
    if pos + 1 >= end or text[pos] != "'":
        return 0
    if text[pos + 1].lower() in ("s", "t", "m", "d"):
        return 2
    if pos + 2 < end and text[pos + 1 : pos + 3].lower() in ("re", "ve", "ll"):
        return 3
    return 0


def _kimi_k2_cut(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """`unicode_regex_split_custom_kimi_k2`: Han runs, then words (Han excluded, contraction
    attached), digits in threes, punctuation runs, whitespace as Llama 3."""
    cls = _classes(text[start:end]) + [0, 0]  # 0: out of range
    spans: list[tuple[int, int]] = []
    prev = start

    def flag(p: int) -> int:
        return cls[p - start] if p < end else 0

    def word_letter(p: int) -> bool:
        return p < end and cls[p - start] == _LETTER and not _is_han(text[p])

    def add(p: int) -> None:
        nonlocal prev
        if p > prev:
            spans.append((prev, p))
        prev = p

    pos = start
    while pos < end:
        c = text[pos]
        f = cls[pos - start]
        if _is_han(c):
            while pos < end and _is_han(text[pos]):
                pos += 1
            add(pos)
            continue
        lead = not (c in "\r\n" or f in (_LETTER, _NUMBER))
        if word_letter(pos) or (lead and word_letter(pos + 1)):
            pos += lead
            while word_letter(pos):
                pos += 1
            pos += _contraction_len(text, pos, end)
            add(pos)
            continue
        if f == _NUMBER:
            first = pos
            while flag(pos) == _NUMBER:
                pos += 1
                if pos - first >= 3:
                    add(pos)
                    first = pos
            add(pos)
            continue
        f2 = flag(pos + 1) if c == " " else f
        if f2 not in (_SPACE, _LETTER, _NUMBER, 0):
            pos += c == " "
            while flag(pos) not in (_SPACE, _LETTER, _NUMBER, 0):
                pos += 1
            while pos < end and text[pos] in "\r\n":
                pos += 1
            add(pos)
            continue
        n_space = 0
        last_newline = 0
        while flag(pos + n_space) == _SPACE:
            if text[pos + n_space] in "\r\n":
                last_newline = pos + n_space + 1
            n_space += 1
        if last_newline:
            pos = last_newline
        elif n_space > 1 and pos + n_space < end:
            pos += n_space - 1
        elif n_space:
            pos += n_space
        else:
            pos += 1
        add(pos)
    return spans


def _afmoe_digits_cut(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """`unicode_regex_split_custom_afmoe`: each digit run ends a piece (which also holds whatever
    came before it), its first len % 3 digits apart, then threes."""
    cls = _classes(text[start:end])
    spans: list[tuple[int, int]] = []
    prev = start
    pos = start
    while pos < end:
        if cls[pos - start] != _NUMBER:
            pos += 1
            continue
        first = pos
        while pos < end and cls[pos - start] == _NUMBER:
            pos += 1
        for p in range(first + ((pos - first) % 3 or 3), pos + 1, 3):
            if p > prev:
                spans.append((prev, p))
                prev = p
    if prev < end:
        spans.append((prev, end))
    return spans


# patterns llama.cpp hands to its own matchers instead of std::regex (by their exact text)
_CUSTOM: dict[str, Cut] = {
    GPT2_REGEX: _gpt2_cut,
    r"\p{Han}+": _kimi_k2_cut,
    r"\p{AFMoE_digits}": _afmoe_digits_cut,
    r"\d{1,3}(?=(?:\d{3})*\b)": _afmoe_digits_cut,  # Tiny Aya's: not the regex (any digits, no \b)
}
_RAW, _COARSE, _FINE, _WIDE = "raw", "coarse", "fine", "wide"
_VIEWS: dict[str, Callable[[str], str]] = {
    _RAW: lambda text: text,
    _COARSE: collapse_text,
    _FINE: lambda text: collapse_text(text, fine=True),
    _WIDE: widen_text,
}


def _step(pattern: str) -> tuple[str, Cut]:
    """Which text a pattern reads and how it cuts, as `unicode_regex_split` decides."""
    if pattern in _CUSTOM:
        return _RAW, _CUSTOM[pattern]
    if r"\p{" in pattern:
        view = _FINE if any(c in pattern for c in _FINE_CATEGORIES) else _COARSE
        return view, _regex_cut(re.compile(collapse_pattern(pattern), re.ASCII))
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"  # ECMAScript's $ is the end only, Python's also before \n
    return _WIDE, _regex_cut(re.compile(pattern, re.ASCII))


def chain_splitter(patterns: Sequence[str]) -> Callable[[str], list[str]]:
    """A function from raw text to its words, as llama.cpp splits with a list of regexes: each
    one cuts every piece the ones before it made. The patterns compile at the first call (the
    table holds some forty, most of them never used in one process)."""
    steps: list[tuple[str, Cut]] = []
    views: dict[str, Callable[[str], str]] = {}

    def split(text: str) -> list[str]:
        if not steps:
            steps.extend(_step(p) for p in patterns)
            views.update((view, _VIEWS[view]) for view, _ in steps)
        seen = {name: make(text) for name, make in views.items()}
        spans = [(0, len(text))]
        for view, cut in steps:
            read = seen[view]
            spans = [s for a, b in spans if b > a for s in cut(read, a, b)]
        return [text[a:b] for a, b in spans if b > a]

    return split
