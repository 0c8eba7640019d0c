"""The server's adapters: names, ids, and which are resident under a memory budget. The global
scales are the model's adapter set's (`service.adapters`): this registry asks it, keeps no copy.

Lives on the asyncio side and is only touched from the event loop (no locks); the model itself
changes through the service (`attach`, `detach`): on the engine thread, or, for an adapter
attached while a step is in flight, beside the step (`EngineService.attach`).

- `--lora`/`--lora-scaled` adapters are pinned: loaded at start with llama-server's ids, never
  evicted. They are also reachable by name (their file stem).
- `--lora-modules` adapters (and those loaded at runtime) are attached on first use and may be
  evicted, least recently used first, when the budget (`max_bytes`, `max_loras`) needs room; never
  one that a running request uses or that has a nonzero global scale.
- Loading a new adapter under a name in use retires the old one: requests already running keep
  it (and its id) until they end; new requests get the new one under a new id.
- A name unloaded is remembered until it is loaded again: a request for it is a 404, never the
  base's answer (which a name never registered gets without --strict-model-names).

A request takes a `Lease` (the adapter scales it runs with, fixed at admission) and releases it
when it ends; that is what keeps its adapters resident. It takes all of its adapters at once or
none (`_take`): room is made for one request at a time, in arrival order, for all it lacks
together, so no request waits holding part of what it needs (two such could wait on each other
until both got 503s), and one waiting for room is not overtaken by another that needs room (one
whose adapters are all resident takes them at once, unless one waiting for room has waited
past a quarter of --lora-wait and it would take an adapter that one could evict: then it waits
for that one's wait to end, `AdapterRoom.yields`). A request that can never fit
(more adapters than --max-loras, more bytes than --max-lora-memory, beside the pinned ones) is
a 400 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from graftlm.errors import AdapterError, RequestError
from graftlm.lora.prepare import PreparedAdapter
from graftlm.lora.scales import GLOBAL, checked_scale, together_overflow
from graftlm.lora.settings import NO_ADAPTERS, AdapterSettings
from graftlm.runtime.service import EngineService
from graftlm.server.adapter_entries import (
    AdapterEntry,
    Lease,
    Own,
    Read,
    UnknownModelError,
    adapter_list,
    count_problem,
    file_identity,
    names_text,
    own_scales,
)
from graftlm.server.adapter_reads import AdapterReads
from graftlm.server.adapter_room import AdapterRoom
from graftlm.server.names import module_problem

__all__ = ["AdapterEntry", "AdapterRegistry", "Lease", "UnknownModelError"]


class AdapterRegistry(AdapterReads, AdapterRoom):
    def __init__(
        self,
        service: EngineService,
        max_bytes: int | None = None,
        max_loras: int | None = None,
        max_rank: int | None = None,
        room_wait_s: float = 60.0,
        load_timeout_s: float = 300.0,
    ) -> None:
        self.service = service
        # how long a request waits for adapters in use to be released before its 503
        self.room_wait_s = room_wait_s
        # the share of room_wait_s the request making room waits before it stops others from
        # taking the adapters it could evict (`AdapterRoom.yields`)
        self.starve_share = 0.25
        self._room_wait: tuple[asyncio.Event, float, float] | None = None  # (end, start, deadline)
        # requests waiting for their adapters: for reads, for the admission, room or attaches,
        # or held back by the one waiting for room (`yields`); load() and warm() among them
        self.queued = 0
        self.load_timeout_s = load_timeout_s  # the longest a request waits for an adapter's read
        self.read_alone_s = 1.0  # how long a read has the reader to itself (`_read`)
        self._reading = asyncio.Semaphore(1)
        self._freed = asyncio.Event()  # set whenever an adapter may have become evictable
        self.adapters = service.adapters  # the global scales live there
        self.max_bytes = max_bytes
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.names: dict[str, AdapterEntry] = {}  # current name -> entry
        # unloaded, not loaded again: a 404, never the base's answer (as an unknown name's)
        self.unloaded: set[str] = set()
        self.by_id: dict[int, AdapterEntry] = {}  # every attached adapter, retired ones included
        self.on_change: list[Any] = []  # callables(resident, nbytes) told after each change
        # callables(name, load, wait) told after each attach on first use: the seconds it took to
        # read, check, pack and attach, and those it waited for room (or for another attach)
        self.on_attach: list[Any] = []
        # room is made for one request at a time, in arrival order (asyncio.Lock is FIFO)
        self._admission = asyncio.Lock()
        self.admitting = 0  # requests in the admission (at most one) or queued for it
        # attaches on their way to the engine: the room made for them, held until they land
        self._reserved = 0
        self._reserved_bytes = 0
        self._drops: set[asyncio.Future[Any]] = set()

    # -- setup (before serving) --
    def preload(self, path: str, scale: float, name: str | None = None) -> AdapterEntry:
        """Attach a pinned adapter now (blocking; before the server starts). Raises AdapterError."""
        pinned = sum(1 for e in self.by_id.values() if e.pinned)
        if self.max_loras is not None and pinned >= self.max_loras:
            raise AdapterError(
                f"--lora {path}: more pinned adapters (--lora, --lora-scaled) than --max-loras "
                f"{self.max_loras}; pinned adapters are never evicted"
            )
        self._check_rank_floor(path)
        prepared = self.service.prepare_adapter(path)
        self._check_rank(prepared.facts)
        # (with the adapters at global scales before it: they apply together)
        at_scale = [
            (f"--lora-scaled {self.by_id[i].path}", self.by_id[i].facts, s)
            for i, s in self.adapters.scales().items()
        ]
        scaled = [*at_scale, (f"--lora-scaled {path}", prepared.facts, float(scale))]
        if (problem := together_overflow(scaled)) is not None:
            raise AdapterError(problem)
        adapter_id = self.service.attach(prepared, float(scale)).result()
        entry = AdapterEntry(
            self._free_name(name or Path(path).name.removesuffix(".gguf")), path, pinned=True
        )
        entry.id, entry.facts = adapter_id, prepared.facts
        self.names[entry.name] = entry
        self.by_id[adapter_id] = entry
        self._changed()
        return entry

    def add_module(self, name: str, path: str) -> AdapterEntry:
        """Register a named adapter (vLLM's --lora-modules); it is attached on first use."""
        if (problem := module_problem(name, path)) is not None:
            raise ValueError(problem)
        if name in self.names:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        if not Path(path).exists():
            raise AdapterError(f"--lora-modules {name}={path}: no such file or directory")
        entry = AdapterEntry(name, path)
        self.names[name] = entry
        return entry

    def _free_name(self, name: str) -> str:
        out, k = name, 1
        while out in self.names:
            out, k = f"{name}-{k}", k + 1
        return out

    # -- facts --
    def adapter_list(self) -> list[dict[str, Any]]:
        """llama-server's GET /lora-adapters: the attached adapters and their global scales."""
        return adapter_list(self.by_id, self.adapters.scales())

    # -- requests --
    async def lease(
        self,
        model: str | None,
        lora: Mapping[int, float] | None,
        base_names: set[str],
        by_name: Mapping[str, float] | None = None,
    ) -> Lease:
        """The adapter settings of one request, with its adapters held resident until `release`.

        model: None or a base name -> the base with the global scales (or `lora` if given); an
        adapter's name -> that adapter at scale 1 (plus `lora`, if given). `lora` is checked
        here, once: RequestError for an id that is not attached or a scale out of range, or
        (invalid_scale) scales whose deltas leave float16's range, alone or together.
        `by_name`: more adapters by name -> scale (attached on first use, as `model`'s)."""
        entry: AdapterEntry | None = None
        if model is not None and model not in base_names:
            entry = self.names.get(model)
            if entry is None:
                known = names_text(sorted(base_names) + sorted(self.names))
                what = "was unloaded" if model in self.unloaded else "does not exist"
                raise UnknownModelError(f"the model {model[:200]!r} {what}; available: {known}")
        extra: list[tuple[AdapterEntry, float]] = []
        for name, scale in (by_name or {}).items():
            e = self.names.get(name)
            if e is None:
                what = " (it was unloaded)" if name in self.unloaded else ""
                raise UnknownModelError(
                    f"lora: no adapter named {name[:200]!r}{what}; adapters: "
                    f"{names_text(sorted(self.names))}"
                )
            try:  # (before anything is read or evicted for it)
                checked_scale(scale, f"adapter {name[:200]!r}")
            except AdapterError as exc:
                raise RequestError(f"lora: {exc}") from None
            extra.append((e, scale))
        needed = [e for e, _ in extra] + ([entry] if entry is not None else [])
        too_many = count_problem(needed, lora, self.by_id, self.max_loras, self.adapters.scales())
        if too_many is not None:  # (before anything is attached or held)
            raise RequestError(too_many, "too_many_adapters")
        # the adapters `lora` names by id are taken with the others (an unknown id refused now)
        if lora:
            self.adapters.settings(lora, among=self.by_id, where="lora: ")
        by_id = [(self.by_id[i], s) for i, s in (lora or {}).items()]
        held = list({id(e): e for e in needed + [e for e, _ in by_id]}.values())
        # all of them resident and held, or none held (its own scales checked on what is known
        # of those not resident before they take room: `_take`)
        await self._take(held, own=lambda: own_scales(entry, extra, by_id))
        named = {entry.id: 1.0} if entry is not None and entry.id is not None else {}
        listed = {e.id: scale for e, scale in extra if e.id is not None}
        # (a later entry wins, as in the list; one evicted and attached again meanwhile: its new id)
        listed.update({e.id: s for e, s in by_id if e.id is not None})
        # from here on nothing awaits: the ids checked below cannot go away before they are held
        try:
            if not listed and lora is None and entry is None:
                settings = self._global_scales()  # (checked together when they were set)
            else:  # (the request's own: they replace the global scales, every other at 0)
                settings = self.adapters.settings(
                    listed if listed or lora is not None else None,
                    base=named,
                    among=self.by_id,
                    where="lora: ",
                )
                self._check_scales(settings, "this request")
        except Exception:
            self.release(Lease(NO_ADAPTERS, held))  # (attached they stay, as after a request)
            raise
        for i in settings:
            e = self.by_id[i]
            if not any(e is h for h in held):
                e.refs += 1
                held.append(e)
        now = time.monotonic()
        for e in held:
            e.last_used = now
        labels = sorted({self.by_id[i].name for i in settings})
        return Lease(settings, held, labels)

    def _check_scales(self, settings: AdapterSettings, who: str = GLOBAL) -> None:
        """Adapter scales that apply together (the global ones, or a request's own, which replace
        them in its rows): RequestError invalid_scale naming the adapters, their scales and the
        rows where their deltas leave float16's range, alone or together (`together_overflow`)."""
        scaled = [(self.by_id[i].label(), self.by_id[i].facts, s) for i, s in settings.items()]
        if (problem := together_overflow(scaled, who)) is not None:
            raise RequestError(f"lora: {problem}", "invalid_scale")

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        now = time.monotonic()
        for e in lease.entries:
            e.refs -= 1
            e.last_used = now
            if e.refs == 0:
                self._freed.set()
            if (e.retired or e.evicted) and e.refs == 0 and e.resident:
                self._drop_later(e)

    def _global_scales(self) -> AdapterSettings:
        """The adapter set's global scales, without an adapter already on its way out (dropped
        here, not yet detached on the engine thread)."""
        scales = self.adapters.scales()
        if all(i in self.by_id for i in scales):
            return scales
        return AdapterSettings((i, s) for i, s in scales.items() if i in self.by_id)

    async def set_scales(self, items: Mapping[int, float]) -> None:
        """POST /lora-adapters: these scales, every other adapter at 0 (checked here, once)."""
        scales = self.adapters.settings(items, among=self.by_id, where="lora: ")
        self._check_scales(scales)  # (they apply together)
        await asyncio.wrap_future(self.service.set_scales(scales))
        self._freed.set()  # an adapter at global scale 0 may now be evicted

    # -- loading and eviction --
    async def load(self, name: str, path: str) -> AdapterEntry:
        """vLLM's load_lora_adapter: attach now (a broken file fails here); a name already in use
        is replaced, the old adapter staying with the requests that use it. A file another name
        loaded (same resolved path, size and mtime) is not read again: the names share its one
        resident copy (its id, its global scale, and the first name in metrics' labels)."""
        ident = file_identity(path)
        same = [e for e in self.names.values() if ident and e.identity == ident and not e.retired]
        entry = same[0] if same else AdapterEntry(name, path, identity=ident)
        await self._take([entry], hold=False)
        entry.retired = False  # (the name sharing it may have been unloaded meanwhile)
        old = self.names.get(name)
        self.names[name] = entry
        if self.names.get(entry.name) is not entry:  # (its first name unloaded meanwhile)
            entry.name = name
        self.unloaded.discard(name)
        if old is not None:
            self._unname(old)
        return entry

    async def unload(self, name: str) -> None:
        entry = self.names.get(name)
        if entry is None:
            raise UnknownModelError(
                f"no adapter named {name[:200]!r}; loaded: {names_text(sorted(self.names))}"
            )
        del self.names[name]
        self.unloaded.add(name)
        self._unname(entry)

    def forget(self, name: str) -> None:
        """`name` is unloaded elsewhere (another replica): a 404 here too from now on, whether
        or not this registry ever held it."""
        if name in self.names:
            self._unname(self.names.pop(name))
        self.unloaded.add(name)

    def rebind(self, name: str, path: str) -> None:
        """`name` is `path` from now on, attached on first use (an adapter under the name is
        retired: the requests using it keep it)."""
        old = self.names.get(name)
        if old is not None and old.path == path and not old.retired:
            return
        self.names[name] = AdapterEntry(name, path)
        self.unloaded.discard(name)
        if old is not None:
            self._unname(old)

    async def warm(self, name: str) -> AdapterEntry:
        """Attach a named adapter now, without a request (a router's load); UnknownModelError
        for a name the registry does not know."""
        entry = self.names.get(name)
        if entry is None:
            what = "was unloaded" if name in self.unloaded else "does not exist"
            known = names_text(sorted(self.names))
            raise UnknownModelError(f"the model {name[:200]!r} {what}; adapters: {known}")
        entry.evicted = False
        await self._take([entry], hold=False)
        self._drop_if_unused(entry)  # (unloaded meanwhile)
        return entry

    def evict(self, name: str) -> None:
        """Detach a named adapter now, or when the last request using it ends (a router's
        eviction); the name stays known and is attached again on its next use. Pinned adapters
        and unknown names are left alone."""
        entry = self.names.get(name)
        if entry is None or entry.pinned or not entry.resident:
            return
        if entry.refs > 0:
            entry.evicted = True
            return
        self._drop_later(entry)

    def _unname(self, entry: AdapterEntry) -> None:
        """A name no longer maps to `entry`: retired unless another name shares it, which then
        names it (metrics' labels, /lora-adapters, the errors)."""
        others = [n for n, e in self.names.items() if e is entry]
        if not others:
            self._retire(entry)
        elif entry.name not in others:
            entry.name = others[0]

    def _retire(self, entry: AdapterEntry) -> None:
        entry.retired = True
        if entry.resident and entry.refs == 0:
            self._drop_later(entry)

    async def _take(
        self, needed: list[AdapterEntry], hold: bool = True, own: Callable[[], Own] | None = None
    ) -> None:
        """Every adapter of `needed` resident and, with hold, held (a reference each): all at
        once or none. A request that held some while it waited for room for the others could
        wait on another doing the same, both until their 503s. The reads go first, holding
        nothing; then room is made for all of a request's adapters together, one request at a
        time in arrival order (`_admission`). A request whose adapters are all resident takes
        them at once, with no await, even while another waits for room (throughput first: one
        for the base or for adapters in use never queues behind a read or an eviction).

        Unless the rule holds it back (`yields`: the one waiting for room has waited past its
        share of --lora-wait and could evict one of `needed`): then it waits for that one's
        wait to end, holding nothing, outside the admission (not behind the requests queued
        there for room), and is taken again from the start (`_held_back`). The order kept: it
        is not served before that one; after it, it is served at once if its adapters are
        still resident, and otherwise it is read again and joins the admission behind those
        that arrived while it waited, as a new request would (its place is not kept). Read
        again, an adapter whose file was removed or broken since its first read fails this
        request (a 4xx/5xx naming the adapter and the file, as any read), where it would have
        been served had it not been held back.

        `own()`, asked only when one of `needed` is not resident: the request's own scales,
        checked on the facts known of its adapters (kept from their last reads while their files
        are unchanged) before any read, and on those just read before they take room: one that
        would overflow is a 400 that evicts nobody (`_check_own`)."""
        if hold and self.yields(needed):
            with self._queued():
                await self._held_back(needed)
        if any(e.id is None for e in needed):
            scales = own() if own is not None else ()
            self._check_own(scales, {})
            with self._queued():
                await self._arrive(needed, scales)
        if hold:  # (no await since every one of them was seen resident)
            for e in needed:
                e.refs += 1

    @contextlib.contextmanager
    def _queued(self) -> Iterator[None]:
        """A request counted in `queued` (graftlm_lora_requests_waiting) while it waits."""
        self.queued += 1
        try:
            yield
        finally:
            self.queued -= 1

    async def _arrive(self, needed: list[AdapterEntry], own: Own) -> None:
        """Every adapter of `needed` read and attached, through the admission at least once;
        returns (no await after) when all of them are resident."""
        for _ in range(8):
            try:
                read = await self._read_all(needed)
                self._check_own(own, read)
                self._check_memory(needed, read)
                await self._bring(needed, read)
            finally:
                for e in needed:  # (a prepared adapter not attached is not kept)
                    if e.loading is not None and e.loading.done() and e.id is None:
                        e.loading = None
            if all(e.id is not None for e in needed):
                return
        raise RequestError(
            f"adapters {names_text([e.name for e in needed])} were evicted again and again: "
            "too many adapters in use",
            "adapter_memory_busy",
        )

    def _drop_if_unused(self, entry: AdapterEntry) -> None:
        """Detach an adapter retired while it was read or landing, once nobody holds it."""
        if entry.retired and entry.resident and entry.refs == 0 and entry.waiting == 0:
            self._drop_later(entry)

    async def _bring(self, needed: list[AdapterEntry], read: Mapping[int, Read]) -> None:
        """Room for the adapters of `needed` just read, made at once, and their attaches
        (landings) started; returns when every landing of `needed` has ended. Those resident are
        kept from eviction meanwhile (`waiting`)."""
        marked = False
        try:
            self.admitting += 1
            try:
                async with self._admission:
                    for e in needed:  # (marked only here: one queued must not hold what it needs)
                        e.waiting += 1
                    marked = True
                    missing = [
                        e for e in needed if e.id is None and e.landing is None and id(e) in read
                    ]
                    sizes = [read[id(e)][0].facts.nbytes for e in missing]
                    if missing:
                        await self._make_room(len(missing), sum(sizes), [e.name for e in missing])
                    for e, nbytes in zip(missing, sizes, strict=True):
                        self._reserved += 1
                        self._reserved_bytes += nbytes
                        e.loading = None
                        e.landing = asyncio.ensure_future(self._land(e, *read[id(e)], nbytes))
            finally:
                self.admitting -= 1
            # outside the admission: attaches that have their room reach the engine together
            landings = [e.landing for e in needed if e.landing is not None]
            if landings:
                await asyncio.gather(*(asyncio.shield(t) for t in landings))
        finally:
            for e in needed if marked else ():
                e.waiting -= 1

    async def _land(
        self, entry: AdapterEntry, prepared: PreparedAdapter, read: float, t0: float, nbytes: int
    ) -> int:
        """Attach a prepared adapter in the room held for it."""
        t1 = time.perf_counter()  # (from t0 to here, less the read: waiting)
        try:
            adapter_id = await asyncio.wrap_future(self.service.attach(prepared))
        except BaseException:
            self._freed.set()  # (its room is free again)
            raise
        finally:
            self._reserved -= 1
            self._reserved_bytes -= nbytes
            entry.landing = None
        entry.id, entry.facts = adapter_id, prepared.facts
        self.by_id[adapter_id] = entry
        self._changed()
        self._drop_if_unused(entry)  # (retired meanwhile, its requests gone)
        t2 = time.perf_counter()
        for fn in self.on_attach:
            fn(entry.name, read + t2 - t1, t1 - t0 - read)
        return adapter_id
