"""A replica of graftlm on Ray Serve: one engine and graftlm's own HTTP app, in-process.

`Replica` holds one server state (the engine, continuous batching, mixed-adapter steps, the
adapter registry and its memory budget) and runs each request the ingress forwards through
graftlm's app. Its adapter loader is `serve.multiplexed`, wired when the replica is made with
the spec's `max_adapters`: Serve keeps an LRU of the adapters it loaded, routes requests for an
adapter to the replicas holding it, and calls the evicted one's `__del__`, which detaches it from
the registry. The replica reports to the directory every REPORT_S and applies the runtime adapter
catalog it gets back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from graftlm.scaleout.forward import (
    REPORT_S,
    RUNTIME_PATHS,
    UNKNOWN_HEADER,
    VERSION_HEADER,
    Forwarded,
    Head,
    body_json,
    run_asgi,
)
from graftlm.scaleout.spec import ScaleSpec

log = logging.getLogger("ray.serve")


class _Resident:
    """What Serve's LRU holds for one adapter. Serve awaits a coroutine `__del__` of the model
    object it evicts: set on the instance (garbage collection looks only at the class), it
    detaches the adapter from the replica's registry."""

    def __init__(self, name: str, evict: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.__del__ = evict


class Replica:
    """One graftlm server: its engine, registry and app."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, spec: ScaleSpec, directory: DeploymentHandle
    ) -> None:
        from graftlm.server.app import create_app

        self.state = spec.build_state()
        self.app = create_app(self.state)
        self.directory = directory
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.actor_name = ctx.replica_id.to_full_id_str()
        self.version = 0
        self.catalog: dict[str, str | None] = {}
        self.router_loads: Counter[str] = Counter()  # multiplexer loads (Serve's view)
        self._sync_lock = asyncio.Lock()
        self._reports: set[asyncio.Future[None]] = set()
        self._reporting = True  # False after a failed report, until one succeeds again

        async def load_adapter(name: str) -> _Resident:
            return await self._load_adapter(name)

        # Serve's multiplexed loader, limited by this application's spec (-1: no limit)
        limit = spec.max_adapters if spec.max_adapters > 0 else -1
        self.adapter: Callable[[str], Awaitable[_Resident]] = serve.multiplexed(
            max_num_models_per_replica=limit
        )(load_adapter)
        self._reporter = asyncio.ensure_future(self._report_loop())

    async def _load_adapter(self, name: str) -> _Resident:
        """Serve's loader: attach the adapter now (a cold load: a read and a transform)."""
        await self.state.registry.warm(name)
        self.router_loads[name] += 1
        log.info("replica %s: adapter %r loaded", self.replica_id, name)
        self._reports.add(asyncio.ensure_future(self._report()))  # told now, not in REPORT_S
        self._reports = {t for t in self._reports if not t.done()}
        registry, replica_id = self.state.registry, self.replica_id

        async def evict() -> None:
            log.info("replica %s: adapter %r evicted", replica_id, name)
            registry.evict(name)

        return _Resident(name, evict)

    async def _report_loop(self) -> None:
        while True:
            await self._report()
            await asyncio.sleep(REPORT_S)

    async def _report(self) -> None:
        try:
            version, catalog = await self.directory.report.remote(self.replica_id, self.info())
            await self._apply(version, catalog)
        except Exception as exc:  # noqa: BLE001 - a missed report is retried
            # said once, not every REPORT_S (a directory shut down before its replicas)
            if self._reporting:
                log.warning(
                    "replica %s: report failed (retrying quietly): %s", self.replica_id, exc
                )
            self._reporting = False
            return
        if not self._reporting:
            log.info("replica %s: reports reach the directory again", self.replica_id)
        self._reporting = True

    def info(self) -> dict[str, Any]:
        """What this replica tells the directory: who it is, its adapters and metrics."""
        reg = self.state.registry
        loads = {
            s.labels["adapter"]: int(s.value)
            for m in self.state.metrics.adapter_loads.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }
        page, _ = self.state.metrics.render()
        return {
            "replica": self.replica_id,
            "actor_name": self.actor_name,
            "pid": os.getpid(),
            "version": self.version,
            "loads": loads,
            "router_loads": dict(self.router_loads),
            "resident": sorted(e.name for e in reg.by_id.values()),
            "metrics": page.decode(),
        }

    async def _apply(self, version: int, catalog: dict[str, str | None]) -> None:
        """Bring the registry to the runtime catalog of this version (loads by another
        replica are known by name here and attached on first use; unloads drop)."""
        async with self._sync_lock:
            if version <= self.version:
                return
            reg = self.state.registry
            for name, path in catalog.items():
                if self.catalog.get(name, "") == path:
                    continue
                if path is None:
                    reg.forget(name)  # (a replica started after the unload: a 404 here too)
                else:
                    reg.rebind(name, path)
            self.catalog, self.version = dict(catalog), version

    async def facts(self) -> dict[str, Any]:
        """What the ingress routes by: the base's names and the pinned adapters'."""
        reg = self.state.registry
        return {
            "base_names": sorted(self.state.base_names),
            "pinned": sorted(n for n, e in reg.names.items() if e.pinned),
        }

    async def handle(self, req: Forwarded) -> AsyncIterator[Head | bytes]:
        """Answer one forwarded request: a head, then body chunks."""
        if req.version > self.version:
            await self._apply(*await self.directory.catalog_now.remote())
        unknown = False
        if req.adapter:
            refused, unknown = await self._warm(req.adapter)
            if refused is not None:
                for piece in refused:
                    yield piece
                return
        runtime = RUNTIME_PATHS.get(req.path)
        if runtime is None:
            async for piece in run_asgi(self.app, req):
                if unknown and isinstance(piece, Head):
                    piece.headers.append((UNKNOWN_HEADER, b"1"))
                yield piece
            return
        for piece in await self._runtime_change(req, runtime):
            yield piece

    async def _warm(self, adapter: str) -> tuple[list[Head | bytes] | None, bool]:
        """Load `adapter` through Serve's multiplexer: (the answer that refuses the request,
        or None; whether the name is unknown and the base answers instead)."""
        from graftlm.server.registry import UnknownModelError
        from graftlm.server.state import ApiError

        try:
            await self.adapter(adapter)
        except UnknownModelError as exc:
            # as graftlm serve: a name it does not know is served by the base model unless
            # --strict-model-names (the app applies the same rule)
            if self.state.config.strict_model_names:
                body = json.dumps(ApiError.of(exc).body()).encode()
                return [Head(404, [(b"content-type", b"application/json")]), body], False
            # (an unloaded name: the app answers its 404, not the base)
            return None, adapter not in self.state.registry.unloaded
        except Exception as exc:  # noqa: BLE001 - answered as the server answers it
            err = ApiError.of(exc)
            body = json.dumps(err.body()).encode()
            return [Head(err.status, [(b"content-type", b"application/json")]), body], False
        return None, False

    async def _runtime_change(self, req: Forwarded, runtime: str) -> list[Head | bytes]:
        """A runtime load or unload: answered here, then told to every replica through the
        directory (the catalog's new version in VERSION_HEADER)."""
        pieces = [p async for p in run_asgi(self.app, req)]
        head = pieces[0]
        assert isinstance(head, Head)
        payload = body_json(req.body)
        if head.status == 200 and isinstance(payload, dict):
            name = str(payload.get("lora_name"))
            entry = self.state.registry.names.get(name)
            path = entry.path if runtime == "load" and entry is not None else None
            version = await self.directory.set_adapter.remote(name, path)
            async with self._sync_lock:
                self.catalog[name] = path
            head.headers.append((VERSION_HEADER, str(version).encode()))
        return pieces

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: no more reports, then the engine
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                reporter.cancel()
        self.state.service.close()
