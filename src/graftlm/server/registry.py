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
when it ends; that is what keeps its adapters resident.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graftlm.errors import AdapterError, RequestError
from graftlm.lora.prepare import AdapterFacts, PreparedAdapter, one_thread, rank_floor
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.service import EngineService
from graftlm.server.adapter_entries import (
    AdapterEntry,
    Lease,
    UnknownModelError,
    count_problem,
    names_text,
)
from graftlm.server.names import name_problem

__all__ = ["AdapterEntry", "AdapterRegistry", "Lease", "UnknownModelError"]


class AdapterRegistry:
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
        self._attach_lock = asyncio.Lock()  # room is made for one attach at a time
        # attaches on their way to the engine: the room made for them, held until they land
        self._reserved = 0
        self._reserved_bytes = 0
        self._drops: set[asyncio.Future[Any]] = set()

    # -- setup (before serving) --
    def preload(self, path: str, scale: float, name: str | None = None) -> AdapterEntry:
        """Attach a pinned adapter now (blocking; before the server starts). Raises AdapterError."""
        self._check_rank_floor(path)
        prepared = self.service.prepare_adapter(path)
        self._check_rank(prepared.facts)
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
        problem = name_problem(name)
        if problem is not None:
            raise ValueError(f"--lora-modules {name[:300]!r}={path}: {problem}")
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
    @property
    def resident_bytes(self) -> int:
        return sum(e.facts.nbytes for e in self.by_id.values() if e.facts is not None)

    def adapter_list(self) -> list[dict[str, Any]]:
        """llama-server's GET /lora-adapters: the attached adapters and their global scales."""
        out = []
        scales = self.adapters.scales()
        for i, e in sorted(self.by_id.items()):
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
        here, once: RequestError for an id that is not attached or a scale out of range.
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
            extra.append((e, scale))
        needed = [e for e, _ in extra] + ([entry] if entry is not None else [])
        too_many = count_problem(needed, lora, self.by_id, self.max_loras)
        if too_many is not None:  # (before anything is attached or held)
            raise RequestError(too_many, "too_many_adapters")
        held: list[AdapterEntry] = []
        named: dict[int, float] = {}
        listed: dict[int, float] = {}
        try:
            if entry is not None:
                named[await self._ensure(entry)] = 1.0  # acquired: stays resident
                held.append(entry)
            for e, scale in extra:
                listed[await self._ensure(e)] = scale
                held.append(e)
        except BaseException:
            for e in held:
                e.refs -= 1
            raise
        if lora is not None:
            listed.update(lora)  # (a later entry wins, as in the list)
        # from here on nothing awaits: the ids checked below cannot go away before they are held
        try:
            if not listed and lora is None and entry is None:
                settings = self._global_scales()
            else:
                settings = self.adapters.settings(
                    listed if listed or lora is not None else None,
                    base=named,
                    among=self.by_id,
                    where="lora: ",
                )
        except Exception:
            for e in held:
                e.refs -= 1
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
        await asyncio.wrap_future(self.service.set_scales(scales))
        self._freed.set()  # an adapter at global scale 0 may now be evicted

    # -- loading and eviction --
    async def load(self, name: str, path: str) -> AdapterEntry:
        """vLLM's load_lora_adapter: attach now (a broken file fails here); a name already in use
        is replaced, the old adapter staying with the requests that use it."""
        entry = AdapterEntry(name, path)
        await self._ensure(entry, acquire=False)
        old = self.names.get(name)
        self.names[name] = entry
        self.unloaded.discard(name)
        if old is not None:
            self._retire(old)
        return entry

    async def unload(self, name: str) -> None:
        entry = self.names.get(name)
        if entry is None:
            raise UnknownModelError(
                f"no adapter named {name[:200]!r}; loaded: {names_text(sorted(self.names))}"
            )
        del self.names[name]
        self.unloaded.add(name)
        self._retire(entry)

    def forget(self, name: str) -> None:
        """`name` is unloaded elsewhere (another replica): a 404 here too from now on, whether
        or not this registry ever held it."""
        if name in self.names:
            self._retire(self.names.pop(name))
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
            self._retire(old)

    async def warm(self, name: str) -> AdapterEntry:
        """Attach a named adapter now, without a request (a router's load); UnknownModelError
        for a name the registry does not know."""
        entry = self.names.get(name)
        if entry is None:
            what = "was unloaded" if name in self.unloaded else "does not exist"
            known = names_text(sorted(self.names))
            raise UnknownModelError(f"the model {name[:200]!r} {what}; adapters: {known}")
        entry.evicted = False
        await self._ensure(entry, acquire=False)
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

    def _retire(self, entry: AdapterEntry) -> None:
        entry.retired = True
        if entry.resident and entry.refs == 0:
            self._drop_later(entry)

    async def _ensure(self, entry: AdapterEntry, acquire: bool = True) -> int:
        """Attach the entry if needed; with acquire, take a reference in the same breath (nothing
        can evict it between the attach and the reference)."""
        for _ in range(8):
            if entry.id is not None:
                if acquire:
                    entry.refs += 1
                return entry.id
            if entry.loading is None:
                entry.loading = asyncio.ensure_future(self._attach(entry))
            task = entry.loading
            entry.waiting += 1
            try:
                await asyncio.shield(task)
            finally:
                entry.waiting -= 1
                if task.done() and entry.loading is task:
                    entry.loading = None
        raise RequestError(
            f"adapter {entry.name!r} was evicted again and again: too many adapters in use",
            "adapter_memory_busy",
        )

    async def _attach(self, entry: AdapterEntry) -> int:
        t0 = time.perf_counter()
        try:
            prepared, read = await self._read(entry)
            self._check_rank(prepared.facts)
        except AdapterError as e:  # the file names the path: the request knows the name
            raise AdapterError(f"adapter {entry.name!r}: {e}") from e
        nbytes = prepared.facts.nbytes
        async with self._attach_lock:  # the room, made and held for this attach
            await self._make_room(nbytes, entry.name)
            self._reserved += 1
            self._reserved_bytes += nbytes
        t1 = time.perf_counter()  # (before it: waiting for room, or for another attach)
        try:  # outside the lock: attaches that have their room reach the engine together
            adapter_id = await asyncio.wrap_future(self.service.attach(prepared))
        finally:
            self._reserved -= 1
            self._reserved_bytes -= nbytes
        entry.id, entry.facts = adapter_id, prepared.facts
        self.by_id[adapter_id] = entry
        self._changed()
        t2 = time.perf_counter()
        for fn in self.on_attach:
            fn(entry.name, read + t2 - t1, t1 - t0 - read)
        return adapter_id

    async def _read(self, entry: AdapterEntry) -> tuple[PreparedAdapter, float]:
        """The adapter read, checked and packed in a worker thread (off the event loop and the
        engine thread), and the seconds the read itself took.

        One read at a time: reads hold the interpreter's lock most of the time, so side by side
        they only take turns, every one of them ending late (16 arriving together each took
        ~20 times as long as one alone), and each turn they take from the engine's thread slows
        its step. In turn, the first ends as soon as it would alone, and the time a read queued
        behind others is waiting, not reading. A read that takes longer than `read_alone_s`
        (a slow disk, a network mount) lets the next one start beside it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.load_timeout_s
        started: list[float] = []

        def read() -> PreparedAdapter:
            started.append(time.perf_counter())
            with one_thread():  # (the cores are the engine's)
                self._check_rank_floor(entry.path)  # (before the factors are read)
                return self.service.prepare_adapter(entry.path)

        try:
            async with asyncio.timeout_at(deadline):
                await self._reading.acquire()
                try:
                    job = loop.run_in_executor(None, read)
                    await asyncio.wait([job], timeout=self.read_alone_s)
                finally:
                    self._reading.release()
                prepared = await job
        except TimeoutError:  # (the read goes on in its thread; this request no longer waits)
            raise RequestError(
                f"reading adapter {entry.name!r} took more than {self.load_timeout_s:g} s",
                "adapter_load_timeout",
            ) from None
        return prepared, time.perf_counter() - started[0]

    def _check_rank_floor(self, path: str) -> None:
        if self.max_rank is not None and (floor := rank_floor(path)) > self.max_rank:
            raise AdapterError(
                f"{path}: rank {floor} or more (its header) is above --max-lora-rank {self.max_rank}"
            )

    def _check_rank(self, facts: AdapterFacts) -> None:
        if self.max_rank is not None and facts.rank > self.max_rank:
            raise AdapterError(
                f"{facts.path}: rank {facts.rank} is above --max-lora-rank {self.max_rank}"
            )

    async def _make_room(self, nbytes: int, name: str) -> None:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise AdapterError(
                f"adapter {name!r} needs {nbytes} bytes, "
                f"more than the whole LoRA budget of {self.max_bytes} bytes"
            )

        def over() -> bool:  # (counting the room held for attaches on their way)
            held = self.resident_bytes + self._reserved_bytes + nbytes
            too_big = self.max_bytes is not None and held > self.max_bytes
            too_many = (
                self.max_loras is not None and len(self.by_id) + self._reserved + 1 > self.max_loras
            )
            return too_big or too_many

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.room_wait_s
        while over():
            scales = self.adapters.scales()
            idle = [
                e
                for e in self.by_id.values()
                if not e.pinned and e.refs == 0 and e.waiting == 0 and e.id not in scales
            ]
            if idle:
                # unlinked now, detached on the engine's thread at the next step's boundary:
                # nobody waits for a step to end here (the attach this room is for goes in
                # before that when a step is in flight, beside it: the model holds the
                # adapter it replaces until the step ends)
                self._drop_later(min(idle, key=lambda e: e.last_used))
                continue
            left = deadline - loop.time()
            if left <= 0:  # queued as long as we wait: then the client hears why
                raise RequestError(
                    f"no room for adapter {name!r}: the LoRA budget "
                    f"({self._budget_text()}) stayed held by adapters in use for "
                    f"{self.room_wait_s:g} s; retry when requests end",
                    "adapter_memory_busy",
                )
            self._freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), left)

    def _budget_text(self) -> str:
        parts = []
        if self.max_bytes is not None:
            parts.append(f"{self.resident_bytes}/{self.max_bytes} bytes")
        if self.max_loras is not None:
            parts.append(f"{len(self.by_id)}/{self.max_loras} adapters")
        return ", ".join(parts)

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
        task = asyncio.ensure_future(asyncio.wrap_future(self.service.detach(adapter_id)))
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    def _changed(self) -> None:
        for fn in self.on_change:
            fn(len(self.by_id), self.resident_bytes)
