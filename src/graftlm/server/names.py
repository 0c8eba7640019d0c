"""Adapter names as /v1/models, /metrics and the logs show them: the rule a name follows, for
runtime loads and --lora-modules alike."""

from __future__ import annotations

import unicodedata

MAX_NAME = 256
# control characters, line and paragraph separators: not shown as themselves
_UNSHOWN = ("Cc", "Zl", "Zp")
# format characters that make a name show as another (bidirectional controls) or as the same
# name without them (zero-width space, word joiner, byte order mark); other format characters
# stay allowed: Persian and other scripts spell with the zero-width (non-)joiner, emoji
# sequences and tag flags are made of them
_HIDING = {0x061C, 0x200B, 0x200E, 0x200F, 0x2060, 0xFEFF, *range(0x202A, 0x202F)}
_HIDING |= set(range(0x2066, 0x206A))


def name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter (None where it can): empty, over MAX_NAME characters,
    holding characters that are not shown as themselves, or blank or padded with white space."""
    if not name:
        return "an adapter name may not be empty"
    if len(name) > MAX_NAME:
        return f"an adapter name has at most {MAX_NAME} characters, got {len(name)}"
    bad = sorted(
        {
            f"U+{ord(c):04X}"
            for c in name
            if unicodedata.category(c) in _UNSHOWN or ord(c) in _HIDING
        }
    )
    if bad:
        return (
            "an adapter name may not hold control, separator or bidirectional characters "
            f"({', '.join(bad[:8])})"
        )
    if name != name.strip():
        return "an adapter name may not be blank or start or end with white space"
    return None


def module_problem(name: str, path: str) -> str | None:
    """Why `--lora-modules name=path` cannot be registered under its name (None where it can)."""
    problem = name_problem(name)
    return None if problem is None else f"--lora-modules {name[:300]!r}={path}: {problem}"
