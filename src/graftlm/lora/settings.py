"""The adapter settings one request (or one scoring call) runs with: adapter id -> scale.

One frozen value from the boundary to the batch: the Python API and the HTTP server build it once
(`AdapterSet.settings`, which checks every id and scale), and the job, the request, the
scheduler's sequence and the engine's per-row scale table all read that same object. Zero
scales are dropped (an adapter at 0 costs nothing and is not "in use"), entries are ordered by
id, and the value is hashable, so equal settings compare and hash equal wherever they come from
(a prefix cache keyed by tokens and settings can use it as it is).

Room for activated LoRA (aLoRA): an aLoRA adapter applies only from its invocation tokens on.
Its entry would grow a third field, the position (or the invocation token sequence the engine
finds) where the adapter starts, `None` meaning from the first token as today; `items()` stays
id -> scale, a new `activations()` view gives id -> start, and the engine, which today builds
one scale per row, would build per-token scales for the rows that straddle a start. The prefix
cache keys stay right because the start is part of the value's hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any


class AdapterSettings(Mapping[int, float]):
    """Adapter id -> scale, zeros dropped, ordered by id; immutable and hashable.

    Building one checks nothing (callers inside graftlm and tests build them from known ids);
    settings that come from outside go through `AdapterSet.settings`, which does."""

    __slots__ = ("_map", "_pairs")
    _pairs: tuple[tuple[int, float], ...]
    _map: dict[int, float]

    def __init__(self, scales: Mapping[int, float] | Iterable[tuple[int, float]] = ()) -> None:
        merged = dict(scales.items() if isinstance(scales, Mapping) else scales)  # last one wins
        pairs = tuple(sorted((int(i), float(s)) for i, s in merged.items() if s != 0.0))
        object.__setattr__(self, "_pairs", pairs)
        object.__setattr__(self, "_map", dict(pairs))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"AdapterSettings is immutable (cannot set {name!r})")

    @property
    def pairs(self) -> tuple[tuple[int, float], ...]:
        """((id, scale), ...) ascending by id: the entries without a mapping view around them."""
        return self._pairs

    def __getitem__(self, adapter_id: int) -> float:
        return self._map[adapter_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._pairs)

    def __hash__(self) -> int:
        return hash(self._pairs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AdapterSettings):
            return self._pairs == other._pairs
        return super().__eq__(other)  # equal to a plain mapping with the same entries

    def __repr__(self) -> str:
        return f"AdapterSettings({dict(self._pairs)})"

    def __reduce__(self) -> tuple[type[AdapterSettings], tuple[tuple[tuple[int, float], ...]]]:
        return (AdapterSettings, (self._pairs,))


NO_ADAPTERS = AdapterSettings()
