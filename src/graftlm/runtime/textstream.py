"""Generated tokens to text pieces: whole UTF-8 characters only, stop strings cut out.

The one place that turns a request's tokens into what a client sees; streaming and non-streaming
answers, from the Python API and from the server, all come from it.
"""

from __future__ import annotations

from graftlm.tokenizer import StreamDecoder, Tokenizer


class TextStream:
    """One sequence's text. `stopped` is set when a stop string matched, `matched` is that
    string (the earliest in the text; of those, the first listed)."""

    def __init__(
        self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), eog: frozenset[int] = frozenset()
    ) -> None:
        self.decoder = StreamDecoder(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.eog = eog
        self.pending = ""  # text held back: it may be the start of a stop string
        self.text = ""  # everything released so far
        self.stopped = False
        self.matched: str | None = None

    def push(self, token: int) -> str:
        """Text released by this token ("" while held back). Sets `stopped` on a stop string."""
        if self.stopped or token in self.eog:
            return ""
        self.pending += self.decoder.push(token)
        return self._release(final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        self.pending += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = -1
        for s in self.stop:
            i = self.pending.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut, self.matched = i, s
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
        elif final:
            out, self.pending = self.pending, ""
        else:
            hold = 0
            for s in self.stop:
                for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                    if self.pending.endswith(s[:n]):
                        hold = max(hold, n)
                        break
            out = self.pending[: len(self.pending) - hold]
            self.pending = self.pending[len(out) :]
        self.text += out
        return out
