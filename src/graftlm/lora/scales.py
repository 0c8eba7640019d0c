"""What an adapter scale may be, checked the same way wherever one comes in (CLI, API, server)."""

from __future__ import annotations

import math

FLOAT32_MAX = 3.4028234663852886e38


def scale_problem(value: float) -> str | None:
    """Why `value` cannot be an adapter scale, or None. A batch carries its scales in a float32
    table: a value past float32's range would overflow there, in the middle of a step."""
    if not math.isfinite(value):
        return "is not a finite number"
    if abs(value) > FLOAT32_MAX:
        return "is beyond float32's range (|scale| <= 3.4e38)"
    return None
