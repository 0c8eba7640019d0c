"""What an adapter scale may be, checked the same way wherever one comes in (CLI, API, server):
a number within float32's range (`scale_problem`), and, on the adapters it applies to, one whose
delta stays within float16's range, alone or together with the others set beside it
(`scale_overflow`, `together_overflow`: the server's registry and the Python API ask both)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from graftlm.errors import AdapterError
from graftlm.lora.adapter import F16_MAX

FLOAT32_MAX = 3.4028234663852886e38


def scale_problem(value: float) -> str | None:
    """Why `value` cannot be an adapter scale, or None. A batch carries its scales in a float32
    table: a value past float32's range would overflow there, in the middle of a step."""
    if not math.isfinite(value):
        return "is not a finite number"
    if abs(value) > FLOAT32_MAX:
        return "is beyond float32's range (|scale| <= 3.4e38)"
    return None


def checked_scale(scale: object, what: str) -> float:
    """`scale` as a float where it is a number that `scale_problem` passes; AdapterError naming
    `what` (the adapter) and the value otherwise."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise AdapterError(f"{what}: scale must be a number, got {scale!r}")
    if (problem := scale_problem(float(scale))) is not None:
        raise AdapterError(f"{what}: scale {scale!r} {problem}")
    return float(scale)


def fits_by_reach(scaled: Iterable[tuple[Reaches | None, float]]) -> bool:
    """Whether the sum of |scale| x largest reach of these (facts, scale) stays within float16's
    range: it bounds every site's sum, so where it does no site can overflow (the usual case,
    settled without a name made or a look at the sites; unknown facts reach 0)."""
    return sum(abs(s) * f.reach for f, s in scaled if f is not None) <= F16_MAX


class Reaches(Protocol):
    """What the overflow checks read of an adapter: its reach, each projection's, and the rows
    each delta reaches (a ResolvedAdapter's, or its AdapterFacts' once it is read)."""

    @property
    def reach(self) -> float: ...

    @property
    def reaches(self) -> Mapping[str, float]: ...

    @property
    def rows(self) -> Mapping[str, tuple[int, int]]: ...


GLOBAL = "every request at the global scales"  # (those a global scale past range hurts)


def scale_overflow(what: str, facts: Reaches | None, scale: float, who: str = GLOBAL) -> str | None:
    """Why `scale` cannot be an adapter's scale, or None: past F16_MAX / its reach, its delta on
    an input of +-1 values leaves float16's range, and every request at the global scales would
    end in a 400 'logits not finite' until they were reset (llama-server and PEFT take any
    number). `who` names those that would overflow: a request's (or an API call's) own scales
    are checked too (`AdapterRegistry.lease`, `AdapterSet.call_settings`), a clear refusal
    before its prompt is computed."""
    reach = facts.reach if facts is not None else 0.0
    if abs(scale) * reach <= F16_MAX:
        return None
    return (
        f"{what}: scale {scale:g} takes its delta to "
        f"{abs(scale) * reach:.3g} on an input of +-1 values, past float16's range "
        f"({F16_MAX:g}): {who} would overflow; on such an input its scale stays within range "
        f"up to {F16_MAX / reach:.4g} in magnitude (a bound for one input of +-1 values, not a "
        "guarantee for every input)"
    )


def together_overflow(
    scaled: Sequence[tuple[str, Reaches | None, float]], who: str = GLOBAL
) -> str | None:
    """Why adapters cannot have these scales together ((what names one, its facts, its scale)),
    or None: one past its own range (`scale_overflow`), or where several apply together, a
    projection (or the embedding) where the sum of their reaches times their scales' magnitudes
    leaves float16's range (each alone may be within it): `who` (every request at the global
    scales, or the one request whose own scales they are) would overflow there. The sum bounds
    their summed deltas on the input each reach is measured on, as each reach does one delta's;
    only deltas that reach the same output rows add up (a Q-only and a V-only adapter on one
    fused QKV projection do not: `Reaches.rows`)."""
    for what, facts, scale in scaled:
        if (problem := scale_overflow(what, facts, scale, who)) is not None:
            return problem
    if fits_by_reach((f, s) for _, f, s in scaled):  # (every request with its own scales)
        return None
    # site -> (lo, hi, |scale| x reach, which adapter at which scale)
    spans: dict[str, list[tuple[float, float, float, str]]] = {}
    for what, facts, scale in scaled:
        if facts is None or scale == 0.0:
            continue
        label = f"{what} at scale {scale:g}"
        for site, reach in facts.reaches.items():
            lo, hi = facts.rows.get(site, (0, math.inf))
            spans.setdefault(site, []).append((lo, hi, abs(scale) * reach, label))
    worst = {site: _most_on_one_row([p[:3] for p in parts]) for site, parts in spans.items()}
    where = max(worst, key=lambda k: worst[k][0], default=None)
    if where is None or worst[where][0] <= F16_MAX:
        return None
    total, row = worst[where]
    on = [p for p in spans[where] if p[0] <= row < p[1] and p[2] > 0.0]
    first, end = max(p[0] for p in on), min(p[1] for p in on)  # (the rows all of `on` reach)
    rows = f"rows [{first:g}, {end:g}) of {where}" if end < math.inf else where
    return (
        f"{', '.join(p[3] for p in on)}: together their deltas on {rows} reach {total:.3g} on "
        f"an input of +-1 values (their reaches there times their scales, summed), past "
        f"float16's range ({F16_MAX:g}): {who} would overflow, though each is within range "
        "alone (a bound for one input of +-1 values, not a guarantee for every input)"
    )


def _most_on_one_row(parts: list[tuple[float, float, float]]) -> tuple[float, float]:
    """The largest sum of the values of the spans [lo, hi) that share a row, and that row (the
    first of the rows with that sum): (0, 0) for none."""
    starts = sorted({lo for lo, hi, _ in parts if lo < hi})
    sums = [(sum(v for lo, hi, v in parts if lo <= x < hi), x) for x in starts]
    return max(sums, key=lambda s: s[0], default=(0.0, 0.0))
