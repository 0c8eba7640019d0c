"""Adapter names as /v1/models, /metrics and the logs show them: the rule a name follows, for
runtime loads and --lora-modules alike."""

from __future__ import annotations

import unicodedata

MAX_NAME = 256
# control, format (a right-to-left override), line and paragraph separators: shown as other text
_UNSHOWN = ("Cc", "Cf", "Zl", "Zp")


def name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter (None where it can): empty, over MAX_NAME characters,
    holding characters that are not shown as themselves, or blank or padded with white space."""
    if not name:
        return "an adapter name may not be empty"
    if len(name) > MAX_NAME:
        return f"an adapter name has at most {MAX_NAME} characters, got {len(name)}"
    bad = sorted({f"U+{ord(c):04X}" for c in name if unicodedata.category(c) in _UNSHOWN})
    if bad:
        return f"an adapter name may not hold control characters ({', '.join(bad[:8])})"
    if name != name.strip():
        return "an adapter name may not be blank or start or end with white space"
    return None
