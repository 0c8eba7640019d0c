"""What the adapter registry (registry.py) keeps for each adapter and each request, and how it
words what it refuses."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from graftlm.errors import RequestError
from graftlm.lora.prepare import AdapterFacts, PreparedAdapter
from graftlm.lora.scales import scale_problem, together_overflow
from graftlm.lora.settings import AdapterSettings


class UnknownModelError(RequestError):
    """The `model` field names neither the base nor an adapter (HTTP 404)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "model_not_found")


# an adapter file as `file_identity` knows it: (resolved path, device, inode, size, mtime, ctime)
FileIdentity = tuple[str, int, int, int, int, int]


def file_identity(path: str) -> FileIdentity | None:
    """(resolved path, device, inode, size, mtime and ctime in ns) of an adapter file, or None (a
    PEFT folder, a path that cannot be read: the read says why). A file replaced by a rename is
    another inode, one written in place a later ctime (which no tool sets back, as `cp -p` or
    `rsync -a` set the mtime): either is another identity, whatever its size and mtime."""
    try:
        p = Path(path).resolve()
        st = p.stat()
    except OSError:
        return None
    if not p.is_file():
        return None
    return (str(p), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def names_text(names: list[str], most: int = 20) -> str:
    """The first `most` names (each cut to 64 characters) and how many more: short however many."""
    shown = ", ".join(n if len(n) <= 64 else n[:61] + "..." for n in names[:most])
    more = f" (and {len(names) - most} more: GET /v1/models)" if len(names) > most else ""
    return (shown or "none") + more


# an adapter read and checked: (it, the seconds its read took, when its request asked for it)
Read = tuple[PreparedAdapter, float, float]


@dataclass
class AdapterEntry:
    name: str
    path: str
    pinned: bool = False
    id: int | None = None  # slot id while attached
    facts: AdapterFacts | None = None
    refs: int = 0  # running requests using it
    last_used: float = 0.0
    retired: bool = False  # replaced or unloaded: dropped when its last request ends
    evicted: bool = False  # `evict`ed while in use: detached when its last request ends
    loading: asyncio.Task[Read] | None = None  # its read, until it lands
    landing: asyncio.Task[int] | None = None  # its attach, its room held
    # requests waiting for its attach: it is not evicted until they hold it (or it came and
    # went before they woke up, again and again, under a budget thrashed by other adapters)
    waiting: int = 0
    # (`file_identity`) of a runtime load's file: another name loading the same file
    # shares this entry, one resident copy
    identity: FileIdentity | None = None
    # (`file_identity`) of the file `facts` were last read from (None: a PEFT folder, or not
    # read here): kept when it is evicted, they speak for the file while it is unchanged
    read_identity: FileIdentity | None = None

    @property
    def resident(self) -> bool:
        return self.id is not None

    def known_facts(self) -> AdapterFacts | None:
        """Its facts where they speak for what a request would get: its resident (or landing)
        copy's, or its last read's while its file is unchanged; None for one never read here,
        whose file changed since, or a PEFT folder not resident (a stat, off the hot path: only
        for an adapter a request would read)."""
        if self.id is not None or self.landing is not None:
            return self.facts
        if self.read_identity is None or file_identity(self.path) != self.read_identity:
            return None
        return self.facts

    def label(self) -> str:
        """How a refusal names it: "adapter ID (NAME)" while attached, else "adapter 'NAME'"."""
        name = self.name[:64]
        return f"adapter {self.id} ({name})" if self.id is not None else f"adapter {name!r}"


# a request's own adapters and their scales (as the settings it would run with: zeros left out)
Own = Sequence[tuple[AdapterEntry, float]]


def own_scales(
    named: AdapterEntry | None,
    extra: Iterable[tuple[AdapterEntry, object]],
    by_id: Iterable[tuple[AdapterEntry, object]],
) -> list[tuple[AdapterEntry, float]]:
    """The adapters a request sets its own scales on, as `AdapterRegistry.lease` lays them out
    (the adapter named as the model at 1, then `lora` by name, then by id: a later one wins),
    zeros and scales that are no valid number left out (`AdapterSet.settings` refuses those)."""
    out: dict[int, tuple[AdapterEntry, float]] = {}
    for e, s in [*([(named, 1.0)] if named is not None else []), *extra, *by_id]:
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            out[id(e)] = (e, float(s))
    return [(e, s) for e, s in out.values() if s != 0.0 and scale_problem(s) is None]


def own_overflow(own: Own, facts: Mapping[int, AdapterFacts] | None = None) -> str | None:
    """`together_overflow` on a request's own scales, each adapter's facts those of `facts`
    (id(entry) -> facts, a read just made) or known (`AdapterEntry.known_facts`; unknown:
    reach 0, so only what is known is refused): RequestError invalid_scale's words, or None."""
    got = facts or {}
    # first on every kept fact, unchecked (no file is looked at): the usual request passes here,
    # its checked facts being these or fewer (an unknown one reaches 0); only one that would be
    # refused has its kept facts checked against its file (a stat each: `known_facts`)
    scaled = [(e.label(), got.get(id(e)) or e.facts, s) for e, s in own]
    if together_overflow(scaled, "this request") is None:
        return None
    scaled = [(e.label(), got.get(id(e)) or e.known_facts(), s) for e, s in own]
    problem = together_overflow(scaled, "this request")
    return None if problem is None else f"lora: {problem}"


@dataclass
class Lease:
    """The adapter settings one request runs with and the adapters it holds."""

    lora: AdapterSettings
    entries: list[AdapterEntry] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # names of the adapters in use ([]: the base)
    released: bool = False


def kept(entry: AdapterEntry, scales: Mapping[int, float]) -> bool:
    """Whether a resident adapter is never evicted: pinned, or at a nonzero global scale (until
    the scales change). One unloaded leaves when its requests end."""
    at_scale = entry.id is not None and scales.get(entry.id, 0.0) != 0.0
    return not entry.retired and (entry.pinned or at_scale)


def _kept_beside(
    entries: Iterable[AdapterEntry], need: Iterable[AdapterEntry], scales: Mapping[int, float]
) -> list[AdapterEntry]:
    """The adapters of `entries` that a request needing `need` does not use and that are never
    evicted (`kept`): they hold their places beside it for good."""
    used = {id(e) for e in need}
    return [e for e in entries if kept(e, scales) and id(e) not in used]


def count_problem(
    named: Iterable[AdapterEntry],
    lora: Mapping[int, float] | None,
    by_id: Mapping[int, AdapterEntry],
    max_loras: int | None,
    scales: Mapping[int, float],
) -> str | None:
    """Why a request that needs the adapters `named` and those of ids `lora` at once can never
    have them resident under `max_loras` (those it does not use that are never evicted hold their
    places: `kept`), or None: it would wait for room that no request's end makes."""
    if max_loras is None:
        return None
    need = {id(e): e for e in named}
    need |= {id(e): e for i in lora or {} if (e := by_id.get(i)) is not None}
    pinned = len(_kept_beside(by_id.values(), need.values(), scales))
    if len(need) + pinned <= max_loras:
        return None
    beside = f" beside {pinned} pinned or at a global scale, never evicted" if pinned else ""
    return (
        f"this request uses {len(need)} adapters at once "
        f"({names_text(sorted(e.name for e in need.values()))}); "
        f"at most {max_loras - pinned} can be attached{beside} (--max-loras {max_loras})"
    )


def budget_text(nbytes: int, max_bytes: int | None, count: int, max_loras: int | None) -> str:
    """How much of the LoRA budget is held: "N/M bytes, n/m adapters" (the limits set)."""
    parts = []
    if max_bytes is not None:
        parts.append(f"{nbytes}/{max_bytes} bytes")
    if max_loras is not None:
        parts.append(f"{count}/{max_loras} adapters")
    return ", ".join(parts)


def memory_problem(
    sizes: Mapping[str, int],
    named: Iterable[AdapterEntry],
    resident: Iterable[AdapterEntry],
    max_bytes: int,
    scales: Mapping[int, float],
) -> str | None:
    """Why a request whose adapters take `sizes` bytes (name -> bytes, those known) can never
    have them resident at once under `max_bytes` beside the adapters it does not use that are
    never evicted (`kept`), or None."""
    pinned = sum(e.facts.nbytes for e in _kept_beside(resident, named, scales) if e.facts)
    total = sum(sizes.values())
    if total + pinned <= max_bytes:
        return None
    each = ", ".join(f"{n[:64]}: {b} bytes" for n, b in sorted(sizes.items())[:20])
    beside = (
        f" beside {pinned} bytes of adapters pinned or at a nonzero global scale" if pinned else ""
    )
    return (
        f"this request's adapters take {total} bytes at once ({each}){beside}; "
        f"the LoRA budget is {max_bytes} bytes (--max-lora-memory)"
    )


def adapter_list(by_id: Mapping[int, AdapterEntry], scales: Mapping[int, float]) -> list[dict]:
    """llama-server's GET /lora-adapters: the attached adapters and their global scales."""
    out = []
    for i, e in sorted(by_id.items()):
        f = e.facts
        out.append(
            {
                "id": i,
                "path": e.path,
                "scale": scales.get(i, 0.0),
                "task_name": f.task_name if f else "",
                "prompt_prefix": f.prompt_prefix if f else "",
                "alora_invocation_tokens": list(f.invocation_tokens) if f else [],
                "name": e.name,
            }
        )
    return out
