"""Errors a user can act on. The CLI prints them as one line; the server turns them into 4xx."""

from __future__ import annotations


class GraftError(Exception):
    """Base class: a problem with the user's input, described well enough to fix it."""


class ModelFileError(GraftError):
    """A model file that cannot be used: missing, not GGUF, truncated, or of the wrong kind."""


class UnsupportedArchitectureError(ModelFileError):
    """The GGUF's general.architecture has no implementation here."""


class AdapterError(GraftError):
    """An adapter that cannot be attached to this base. Nothing was attached."""


class RequestError(GraftError):
    """A request that cannot be served as asked (bad ids, context too long, ...)."""

    def __init__(self, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code = code


def shortened(message: str, shown: int) -> str:
    """A message's first line and the first `shown` of the problems listed under it
    ("  - ..."), then how many more (an adapter for another base has one a tensor: the terminal
    and the server's answers show a few; the exception keeps them all)."""
    head, *rest = message.splitlines() or [""]
    items = [ln for ln in rest if ln.startswith("  - ")]
    if len(items) <= shown + 1 or len(items) != len(rest):
        return message
    return "\n".join([head, *items[: shown - 1], f"  - and {len(items) - shown + 1} more"])
