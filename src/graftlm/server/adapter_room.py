"""How the adapter registry (registry.py) makes room under its budget: idle adapters evicted,
least recently used first; a request that needs room waits for adapters in use to be released,
and, once it has waited past a share of that wait (`starve_share`), is not starved by requests
that keep taking the adapters it could evict (they wait for its wait to end: `yields`,
`_held_back`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from graftlm.errors import RequestError
from graftlm.server.adapter_entries import AdapterEntry, budget_text, names_text

if TYPE_CHECKING:
    from graftlm.lora.adapter_set import AdapterSet
    from graftlm.runtime.service import EngineService


def evictable(entry: AdapterEntry, scales: Mapping[int, float]) -> bool:
    """Whether a resident adapter may be evicted once no request holds it: not pinned, at no
    nonzero global scale, and not waited for by the request making room (`waiting`)."""
    return not entry.pinned and entry.waiting == 0 and entry.id not in scales


class AdapterRoom:
    """The registry's room (a part of AdapterRegistry, which sets these attributes)."""

    service: EngineService
    adapters: AdapterSet
    max_bytes: int | None
    max_loras: int | None
    room_wait_s: float  # how long a request waits for room before its 503
    # the share of room_wait_s the request making room waits before requests for adapters it
    # could evict queue behind it (`yields`)
    starve_share: float
    by_id: dict[int, AdapterEntry]
    on_change: list[Any]
    _freed: asyncio.Event  # set whenever an adapter may have become evictable
    _reserved: int
    _reserved_bytes: int
    _drops: set[asyncio.Future[Any]]
    # the wait of the request making room (at most one: it holds the admission) for adapters in
    # use to be released: its end (set however it ends: room, 503 or cancellation, for the
    # requests it holds back: `_held_back`), when it began and its deadline; None while none waits
    _room_wait: tuple[asyncio.Event, float, float] | None

    @property
    def room_wait_since(self) -> float | None:
        """When the request making room began to wait for adapters in use; None while none waits."""
        return None if self._room_wait is None else self._room_wait[1]

    @property
    def resident_bytes(self) -> int:
        return sum(e.facts.nbytes for e in self.by_id.values() if e.facts is not None)

    def yields(self, needed: list[AdapterEntry]) -> bool:
        """Whether a request for the adapters `needed` is held back by the request making room
        instead of taking them at once: the rule that bounds that one's wait. Never while one
        of `needed` is not resident (that request reads it and queues for the admission).

        It is when that request has waited for room more than `starve_share` (a quarter) of
        --lora-wait and one of `needed` is an adapter it could evict (`evictable`): from then on
        no new request holds such an adapter, so those in use drain as their requests end and
        room appears, however steady the traffic on them. A request for the base, or for
        adapters pinned, at a nonzero global scale or those the waiting request needs itself,
        is never held back; before the threshold none is (throughput first: one for adapters
        in use never waits behind a read or an eviction)."""
        since = self.room_wait_since
        if since is None or any(e.id is None for e in needed):
            return False
        if asyncio.get_running_loop().time() - since < self.room_wait_s * self.starve_share:
            return False
        scales = self.adapters.scales()
        return any(evictable(e, scales) for e in needed)

    async def _held_back(self, needed: list[AdapterEntry]) -> None:
        """Wait while `yields(needed)` holds the request back: until the wait for room that holds
        it ends (room made, its 503, or its request gone), at most until that wait's deadline,
        holding nothing (the adapters stay evictable) and outside the admission (it does not
        wait out the requests queued there for room). Then it is asked again from the start:
        a wait for room begun since can hold it back in turn, once past its own share; the
        same wait never holds it twice. Returns (no await after) when it is not held back, or
        when one of `needed` is no longer resident (evicted for that room: it is read again
        and queues for the admission as a new request would)."""
        loop = asyncio.get_running_loop()
        seen: asyncio.Event | None = None
        while self.yields(needed):
            assert self._room_wait is not None  # (room_wait_since is its start)
            ended, _, deadline = self._room_wait
            if ended is seen:  # (past its deadline, its end not yet run: it ends now)
                return
            seen = ended
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), max(0.0, deadline - loop.time()))

    async def _make_room(self, count: int, nbytes: int, names: list[str]) -> None:
        """Room for `count` more adapters of `nbytes` together, evicting idle ones (least
        recently used first); waits up to room_wait_s for requests to release theirs."""
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise RequestError(
                f"adapters {names_text(names)} need {nbytes} bytes, "
                f"more than the whole LoRA budget of {self.max_bytes} bytes",
                "adapters_too_large",
            )

        def over() -> bool:  # (counting the room held for attaches on their way)
            held = self.resident_bytes + self._reserved_bytes + nbytes
            too_big = self.max_bytes is not None and held > self.max_bytes
            n = len(self.by_id) + self._reserved + count
            return too_big or (self.max_loras is not None and n > self.max_loras)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.room_wait_s
        try:
            while over():
                scales = self.adapters.scales()
                idle = [e for e in self.by_id.values() if e.refs == 0 and evictable(e, scales)]
                if idle:
                    # unlinked now, detached on the engine's thread at the next step's boundary:
                    # nobody waits for a step to end here (the attach this room is for goes in
                    # before that when a step is in flight, beside it: the model holds the
                    # adapter it replaces until the step ends)
                    self._drop_later(min(idle, key=lambda e: e.last_used))
                    continue
                left, k = deadline - loop.time(), self.max_loras
                if left <= 0:  # queued as long as we wait: then the client hears why
                    held = budget_text(self.resident_bytes, self.max_bytes, len(self.by_id), k)
                    raise RequestError(
                        f"no room for adapters {names_text(names)}: the LoRA budget "
                        f"({held}) stayed held by adapters in use for "
                        f"{self.room_wait_s:g} s; retry when requests end",
                        "adapter_memory_busy",
                    )
                if self._room_wait is None:
                    self._room_wait = (asyncio.Event(), loop.time(), deadline)
                self._freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), left)
        finally:
            if self._room_wait is not None:  # (the requests it held back go on)
                self._room_wait[0].set()
                self._room_wait = None

    def _unlink(self, entry: AdapterEntry) -> int | None:
        """Take the entry out of the resident set at once (nobody can lease it from here on);
        its slot id, still to be detached, or None when it was not attached."""
        adapter_id = entry.id
        if adapter_id is None:
            return None
        entry.id = None
        entry.evicted = False
        del self.by_id[adapter_id]
        self._changed()
        return adapter_id

    def _drop_later(self, entry: AdapterEntry) -> None:
        # unlinked now, not when the task first runs: a lease in between would take it
        adapter_id = self._unlink(entry)
        if adapter_id is None:
            return
        self._freed.set()  # (a request waiting for room may now have it)
        task = asyncio.ensure_future(asyncio.wrap_future(self.service.detach(adapter_id)))
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    def _changed(self) -> None:
        for fn in self.on_change:
            fn(len(self.by_id), self.resident_bytes)
