"""How the adapter registry (registry.py) reads adapters: off the event loop and the engine's
thread, one read at a time, each read shared by the requests that need it, checked against
--max-lora-rank from the header before the factors are read and again after."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from graftlm.errors import AdapterError, RequestError
from graftlm.lora.prepare import AdapterFacts, PreparedAdapter, bytes_floor, one_thread, rank_floor
from graftlm.server.adapter_entries import (
    AdapterEntry,
    FileIdentity,
    Own,
    Read,
    file_identity,
    memory_problem,
    own_overflow,
)

if TYPE_CHECKING:
    from graftlm.lora.adapter_set import AdapterSet
    from graftlm.runtime.service import EngineService


class AdapterReads:
    """The registry's reads (a part of AdapterRegistry, which sets these attributes)."""

    service: EngineService
    max_rank: int | None
    max_bytes: int | None
    load_timeout_s: float  # the longest a request waits for an adapter's read
    read_alone_s: float  # how long a read has the reader to itself (`_read`)
    _reading: asyncio.Semaphore
    by_id: dict[int, AdapterEntry]
    adapters: AdapterSet

    async def _read_all(self, needed: list[AdapterEntry]) -> dict[int, Read]:
        """The adapters of `needed` that are neither resident nor landing, read and checked,
        each read shared by the requests that need it: id(entry) -> (prepared, the seconds its
        read took, when its first request asked)."""
        out: dict[int, Read] = {}
        for e in needed:
            if e.id is not None or e.landing is not None:
                continue
            if e.loading is None:
                e.loading = asyncio.ensure_future(self._read_checked(e))
            task = e.loading
            try:
                out[id(e)] = await asyncio.shield(task)
            except BaseException:  # (a read failed is read again by the next request)
                if task.done() and e.loading is task:
                    e.loading = None
                elif e.loading is task:  # this request went (cancelled): the read goes on
                    task.add_done_callback(functools.partial(_forget, e))
                raise
        return out

    def _check_memory(self, needed: list[AdapterEntry], read: Mapping[int, Read]) -> None:
        """A RequestError (400) when the adapters of `needed` whose sizes are known (resident,
        just read, or attached before) and the pinned ones beside them are over --max-lora-memory:
        no request's end makes that room."""
        if self.max_bytes is None:
            return
        sizes = {}
        for e in needed:
            facts = read[id(e)][0].facts if id(e) in read else e.facts
            if facts is not None:
                sizes[e.name] = facts.nbytes
        problem = memory_problem(
            sizes, needed, self.by_id.values(), self.max_bytes, self.adapters.scales()
        )
        if problem is not None:
            raise RequestError(problem, "adapters_too_large")

    async def _read_checked(self, entry: AdapterEntry) -> Read:
        t0 = time.perf_counter()
        try:
            prepared, read, identity = await self._read(entry)
            self._check_rank(prepared.facts)
        except AdapterError as e:  # the file names the path: the request knows the name
            raise AdapterError(f"adapter {entry.name!r}: {e}") from e
        except RequestError as e:
            raise RequestError(f"adapter {entry.name!r}: {e}", e.code) from e
        # kept, attached or not: a request whose own scales would overflow is refused on them
        # before the adapter takes room or is read again (`_check_own`)
        entry.facts, entry.read_identity = prepared.facts, identity
        return prepared, read, t0

    def _check_own(self, own: Own, read: Mapping[int, Read]) -> None:
        """A RequestError (400 invalid_scale) when a request's own scales overflow on the facts
        known of its adapters (`read`: those just read): before it takes room (evicting
        another) or reads again an adapter whose facts are known (`own_overflow`)."""
        if own and (problem := own_overflow(own, {k: r[0].facts for k, r in read.items()})):
            raise RequestError(problem, "invalid_scale")

    async def _read(
        self, entry: AdapterEntry
    ) -> tuple[PreparedAdapter, float, FileIdentity | None]:
        """The adapter read, checked and packed in a worker thread (off the event loop and the
        engine thread), the seconds the read itself took, and its file's identity
        (`file_identity`) taken before the read.

        One read at a time: reads hold the interpreter's lock most of the time, so side by side
        they only take turns, every one of them ending late (16 arriving together each took
        ~20 times as long as one alone), and each turn they take from the engine's thread slows
        its step. In turn, the first ends as soon as it would alone, and the time a read queued
        behind others is waiting, not reading. A read that takes longer than `read_alone_s`
        (a slow disk, a network mount) lets the next one start beside it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.load_timeout_s
        started: list[float] = []
        identity: list[FileIdentity | None] = []

        def read() -> PreparedAdapter:
            started.append(time.perf_counter())
            identity.append(file_identity(entry.path))  # (one changed while read: no match later)
            with one_thread():  # (the cores are the engine's)
                self._check_rank_floor(entry.path)  # (before the factors are read)
                self._check_bytes_floor(entry.path)
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
        return prepared, time.perf_counter() - started[0], identity[0]

    def _check_rank_floor(self, path: str) -> None:
        if self.max_rank is None:
            return
        floor, tensor = rank_floor(path)
        if floor > self.max_rank:
            raise AdapterError(
                f"{path}: tensor {tensor}: rank {floor} or more (its header) is above "
                f"--max-lora-rank {self.max_rank}"
            )

    def _check_bytes_floor(self, path: str) -> None:
        if self.max_bytes is not None and (floor := bytes_floor(path)) > self.max_bytes:
            raise RequestError(
                f"{path}: {floor} bytes or more once read (its header: its A factors, a byte an "
                f"element at least), more than the whole LoRA budget of {self.max_bytes} bytes "
                "(--max-lora-memory)",
                "adapters_too_large",
            )

    def _check_rank(self, facts: AdapterFacts) -> None:
        if self.max_rank is not None and facts.rank > self.max_rank:
            raise AdapterError(
                f"{facts.path}: rank {facts.rank} is above --max-lora-rank {self.max_rank}"
            )


def _forget(entry: AdapterEntry, task: asyncio.Task[Read]) -> None:
    """A read whose request went is not kept (a prepared adapter is counted in no budget until
    it lands): a request that shared it has it already; the next one reads again."""
    if entry.loading is task and entry.landing is None:
        entry.loading = None
