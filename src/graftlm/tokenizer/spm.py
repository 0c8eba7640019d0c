"""SentencePiece-style BPE by score, as llama.cpp runs it for `tokenizer.ggml.model == "llama"`
(`llm_tokenizer_spm_session` in `src/llama-vocab.cpp`).

The text is split into UTF-8 characters; adjacent pairs whose concatenation is a vocabulary entry
are merged, highest score first (leftmost on ties), until none is left; symbols that are not
vocabulary entries fall back to `<0xXX>` byte tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from graftlm.errors import RequestError

ESCAPED_SPACE = "\u2581"  # "▁", SentencePiece's stand-in for " "


class SPMEncoder:
    """Merges one fragment of (already space-escaped) text into token ids."""

    def __init__(self, token_to_id: dict[str, int], scores: Sequence[float]) -> None:
        self.token_to_id = token_to_id
        self.scores = scores
        self.byte_ids: list[int | None] = []
        for b in range(256):
            tid = token_to_id.get(f"<0x{b:02X}>")
            if tid is None:
                # llama.cpp's fallback: the byte itself as a one-char token.
                tid = token_to_id.get(chr(b)) if b < 128 else None
            self.byte_ids.append(tid)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (spaces already replaced by "▁" where the model wants it)."""
        n = len(text)
        if n == 0:
            return []
        vocab = self.token_to_id
        scores = self.scores
        syms = list(text)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []
        push = heapq.heappush

        for i in range(n - 1):
            tid = vocab.get(text[i : i + 2])
            if tid is not None:
                push(heap, (-scores[tid], i, i + 1, 2))

        while heap:
            _, left, right, size = heapq.heappop(heap)
            ls, rs = syms[left], syms[right]
            # A pair is outdated once either side merged elsewhere; their lengths then no
            # longer add up to the length recorded when the pair was queued.
            if not ls or not rs or len(ls) + len(rs) != size:
                continue
            merged = ls + rs
            syms[left] = merged
            syms[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                t = syms[before] + merged
                tid = vocab.get(t)
                if tid is not None:
                    push(heap, (-scores[tid], before, left, len(t)))
            if after >= 0:
                t = merged + syms[after]
                tid = vocab.get(t)
                if tid is not None:
                    push(heap, (-scores[tid], left, after, len(t)))

        out: list[int] = []
        byte_ids = self.byte_ids
        i = 0
        while i != -1:
            sym = syms[i]
            tid = vocab.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                for b in sym.encode("utf-8"):
                    bid = byte_ids[b]
                    if bid is None:
                        raise RequestError(
                            f"the text has a character this model's vocabulary cannot encode: "
                            f"{sym[:1]!r} needs byte 0x{b:02X}, and the vocabulary has no "
                            f"<0x{b:02X}> token"
                        )
                    out.append(bid)
            i = nxt[i]
        return out
