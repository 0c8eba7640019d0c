"""Incremental detokenization: text released token by token, never half a UTF-8 character.

A token may end inside a multi-byte character (byte-fallback tokens, GPT-2 byte symbols), so the
decoder keeps raw bytes and releases only whole characters. What it releases over a sequence,
plus `flush()`, equals `Tokenizer.decode` of that sequence.
"""

from __future__ import annotations

from graftlm.tokenizer.tokenizer import Tokenizer, clean_spaces

# Tails that `clean_spaces` may still rewrite once more bytes arrive (" ," loses its space,
# " 's" too, ...): held back until the next token decides.
_CLEAN_TAILS = (b" 'r", b" 'v", b" '", b" ")


class StreamDecoder:
    """Turns a stream of token ids into text pieces, one `push` per token."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._pending = b""
        self._first = True

    def push(self, id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        tok = self.tokenizer
        piece = tok.token_to_piece(id, special=not self.skip_special)
        if self._first:
            # Mirrors the detokenizer's removal of the SentencePiece space prefix.
            if tok.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            self._first = False
        buf = self._pending + piece
        cut = len(buf)
        if tok.clean_spaces:
            cut = _clean_cut(buf, cut)
        cut = _utf8_cut(buf, cut)
        if cut == 0:
            self._pending = buf
            return ""
        ready, self._pending = buf[:cut], buf[cut:]
        if tok.clean_spaces:
            ready = clean_spaces(ready)
        return ready.decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Everything still held back, with invalid or truncated UTF-8 replaced by U+FFFD."""
        buf, self._pending = self._pending, b""
        if self.tokenizer.clean_spaces:
            buf = clean_spaces(buf)
        return buf.decode("utf-8", errors="replace")

    def reset(self) -> None:
        """Forget held-back bytes and start a new sequence."""
        self._pending = b""
        self._first = True


def _clean_cut(buf: bytes, cut: int) -> int:
    """The largest cut <= `cut` where no space clean-up pattern can straddle the boundary."""
    while cut > 0:
        head = buf[:cut]
        for tail in _CLEAN_TAILS:
            if head.endswith(tail):
                cut -= len(tail)
                break
        else:
            return cut
    return cut


def _utf8_cut(buf: bytes, cut: int) -> int:
    """`cut`, moved back before a trailing UTF-8 sequence that is incomplete but could still be
    completed by later bytes. Anything else (complete or already invalid) can be released: a
    decoder treats it the same whatever follows."""
    # Look back at most 3 bytes for the lead byte of the last sequence.
    for back in range(1, min(4, cut) + 1):
        b = buf[cut - back]
        if b & 0xC0 == 0x80:
            continue  # continuation byte: keep looking for the lead
        if b < 0x80:
            return cut
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 0
        if need > back and _could_continue(buf[cut - back : cut]):
            return cut - back
        return cut
    return cut


def _could_continue(prefix: bytes) -> bool:
    """Whether some continuation makes `prefix` (a lead byte and fewer continuation bytes than it
    announces) valid UTF-8; overlong forms, surrogates and values past U+10FFFF cannot be."""
    for tail in (b"\x80\x80\x80", b"\xbf\xbf\xbf", b"\x90\x80\x80", b"\xa0\x80\x80"):
        candidate = prefix + tail[: _expected_len(prefix[0]) - len(prefix)]
        try:
            candidate.decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def _expected_len(lead: int) -> int:
    return 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4
