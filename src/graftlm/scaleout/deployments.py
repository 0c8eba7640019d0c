"""graftlm on Ray Serve: an ingress, N replicas of graftlm's own server, and a directory.

- `Replica`: one engine (continuous batching, mixed-adapter steps, the adapter registry and its
  memory budget) and graftlm's HTTP app, run in-process on each forwarded request. Its
  `adapter` method is `@serve.multiplexed`: Serve keeps an LRU of the adapters it loaded (up to
  `max_adapters`), routes requests for an adapter to the replicas holding it, and calls the
  evicted one's `__del__`, which detaches it from the registry.
- `Ingress`: the HTTP surface. It reads the request, picks its adapter (`forward.route_key`)
  and calls a replica with that adapter as Serve's multiplexed model id, streaming the answer
  back. It answers `/metrics` (every replica's metrics, labelled by replica) and `/replicas`
  itself, and broadcasts vLLM's load/unload through the directory.
- `Directory`: what replicas report (metrics, loads, adapters) and the catalog of adapters
  loaded or unloaded at runtime, which every replica applies.

Ray is imported here only: graftlm without its `ray` extra never imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from graftlm.scaleout.forward import (
    Forwarded,
    Head,
    body_json,
    error_body,
    merge_metrics,
    route_key,
    run_asgi,
    sse_error,
)
from graftlm.scaleout.router import AdapterRouter
from graftlm.scaleout.spec import ScaleSpec

log = logging.getLogger("ray.serve")
REPORT_S = 0.5  # how often a replica reports to the directory
LIVE_S = 3.0  # a replica not heard from for this long is taken for gone
RUNTIME_PATHS = {"/v1/load_lora_adapter": "load", "/v1/unload_lora_adapter": "unload"}
VERSION_HEADER = b"x-graftlm-catalog-version"
UNKNOWN_HEADER = b"x-graftlm-unknown-adapter"  # replica -> ingress: the base answered instead


class Directory:
    """Replicas' reports and the runtime adapter catalog (name -> path; None: unloaded)."""

    def __init__(self) -> None:
        self.version = 0
        self.catalog: dict[str, str | None] = {}
        self.reports: dict[str, tuple[float, dict[str, Any]]] = {}

    async def report(self, replica: str, info: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.reports[replica] = (time.monotonic(), info)
        return self.version, dict(self.catalog)

    async def catalog_now(self) -> tuple[int, dict[str, Any]]:
        return self.version, dict(self.catalog)

    async def set_adapter(self, name: str, path: str | None) -> int:
        self.version += 1
        self.catalog[name] = path
        return self.version

    async def replicas(self) -> dict[str, dict[str, Any]]:
        """The reports of the replicas heard from in the last LIVE_S seconds."""
        now = time.monotonic()
        for k in [k for k, (t, _) in self.reports.items() if now - t > 10 * LIVE_S]:
            del self.reports[k]
        return {k: info for k, (t, info) in self.reports.items() if now - t <= LIVE_S}


class _Resident:
    """What Serve's LRU holds for one adapter. Serve awaits a coroutine `__del__` of the model
    object it evicts: set on the instance (garbage collection looks only at the class), it
    detaches the adapter from the replica's registry."""

    def __init__(self, name: str, evict: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.__del__ = evict


class _First:
    """The first request of a cold start: done once it ended, ok if it was answered 200
    (its replica then holds the adapter, and the others wait until the router knows it)."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.ok = False


class _Asgi:
    """An ASGI 3 app of a coroutine (uvicorn, under Serve, takes a bound method for ASGI 2)."""

    def __init__(self, fn: Callable[[Any, Any, Any], Awaitable[None]]) -> None:
        self.fn = fn

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.fn(scope, receive, send)


def build_app(spec: ScaleSpec) -> Any:
    """The Serve application (`serve.run(build_app(spec), name=spec.name, route_prefix="/")`)."""
    max_adapters = spec.max_adapters if spec.max_adapters > 0 else -1

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
            self._reporter = asyncio.ensure_future(self._report_loop())
            self._reports: set[asyncio.Future[None]] = set()

        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def adapter(self, name: str) -> Any:
            """Serve's loader: attach the adapter now (a cold load: a read and a transform)."""
            await self.state.registry.warm(name)
            self.router_loads[name] += 1
            log.info("replica %s: adapter %r loaded", self.replica_id, name)
            self._reports.add(asyncio.ensure_future(self._report()))  # told now, not in 0.5 s
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
                log.warning("replica %s: report failed: %s", self.replica_id, exc)

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
                        if name in reg.names:
                            await reg.unload(name)
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
                from graftlm.server.registry import UnknownModelError
                from graftlm.server.state import ApiError

                try:
                    await self.adapter(req.adapter)
                except UnknownModelError as exc:
                    # as graftlm serve: a name it does not know is served by the base model
                    # unless --strict-model-names (the app below applies the same rule)
                    if self.state.config.strict_model_names:
                        yield Head(404, [(b"content-type", b"application/json")])
                        yield json.dumps(ApiError.of(exc).body()).encode()
                        return
                    unknown = True
                except Exception as exc:  # noqa: BLE001 - answered as the server answers it
                    err = ApiError.of(exc)
                    yield Head(err.status, [(b"content-type", b"application/json")])
                    yield json.dumps(err.body()).encode()
                    return
            runtime = RUNTIME_PATHS.get(req.path)
            if runtime is None:
                async for piece in run_asgi(self.app, req):
                    if unknown and isinstance(piece, Head):
                        piece.headers.append((UNKNOWN_HEADER, b"1"))
                    yield piece
                return
            # a runtime load or unload: answered here, then told to every replica
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
            for p in pieces:
                yield p

        def __del__(self) -> None:
            self.state.service.close()

    class Ingress:
        """The HTTP surface: routes each request to a replica by its adapter."""

        def __init__(
            self, spec: ScaleSpec, replicas: DeploymentHandle, directory: DeploymentHandle
        ) -> None:
            self.spec = spec
            self.replicas = replicas
            self.directory = directory
            self.version = 0
            self._facts: dict[str, Any] | None = None
            self.died = 0  # requests that lost their replica (answered 503)
            self._cold: dict[str, asyncio.Event] = {}  # adapter -> set once a replica holds it
            self._resident: tuple[float, set[str]] = (0.0, set())
            self._watchers: set[asyncio.Future[None]] = set()
            self._cold_lock = asyncio.Lock()  # one cold start at a time

        def __serve_build_asgi_app__(self) -> Any:
            return _Asgi(self.asgi)

        async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                while True:
                    message = await receive()
                    kind = message["type"].removeprefix("lifespan.")
                    await send({"type": f"lifespan.{kind}.complete"})
                    if kind == "shutdown":
                        return
            if scope["type"] != "http":
                return
            body = b""
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left
                body += message.get("body", b"")
                if len(body) > self.spec.max_body_bytes:
                    return await _answer(
                        send,
                        413,
                        error_body(
                            413,
                            f"the request body has {len(body)} bytes or more, past the limit "
                            f"of {self.spec.max_body_bytes} (--max-body-size)",
                            "body_too_large",
                        ),
                    )
                if not message.get("more_body", False):
                    break
            req = Forwarded(
                scope["method"],
                scope["path"],
                scope.get("query_string", b""),
                [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])],
                body,
            )
            await self.dispatch(req, send)

        async def dispatch(self, req: Forwarded, send: Any) -> None:
            if req.path in ("/metrics", "/replicas") and req.method == "GET":
                why = self._refused(req)
                if why is not None:
                    return await _answer(send, 401, error_body(401, why, "invalid_api_key"))
                reports = await self.directory.replicas.remote()
                if req.path == "/replicas":
                    shown = {
                        k: {f: v for f, v in r.items() if f != "metrics"}
                        for k, r in reports.items()
                    }
                    return await _answer(send, 200, json.dumps(shown).encode())
                page = merge_metrics((k, r["metrics"]) for k, r in sorted(reports.items()))
                page += (
                    "# HELP graftlm_ingress_replica_lost Requests whose replica died (503)\n"
                    f"# TYPE graftlm_ingress_replica_lost counter\n"
                    f"graftlm_ingress_replica_lost_total {self.died}\n"
                )
                return await _answer(send, 200, page.encode(), b"text/plain; version=0.0.4")
            if req.path == "/lora-adapters" and req.method == "POST":
                message = (
                    "POST /lora-adapters sets one server's global scales; replicas are many: "
                    "give each request its scales (`lora`), or start with --lora-scaled"
                )
                return await _answer(send, 501, error_body(501, message, "not_implemented"))
            try:
                facts = await self.facts()
            except RayError as exc:
                return await _answer(send, 503, error_body(503, _lost(exc), "replica_unavailable"))
            req.adapter = route_key(body_json(req.body), facts["base_names"], facts["pinned"])
            req.version = self.version
            await self.forward(req, send)

        async def facts(self) -> dict[str, Any]:
            if self._facts is None:
                self._facts = await self.replicas.facts.remote()
            return self._facts

        def _refused(self, req: Forwarded) -> str | None:
            import hmac

            key = self.spec.api_key
            if key is None:
                return None
            headers = {k.lower(): v.decode("latin-1") for k, v in req.headers}
            auth = headers.get(b"authorization", "")
            given = (
                auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", "")
            )
            if not given:
                return "missing API key: send 'Authorization: Bearer <key>'"
            if not hmac.compare_digest(given.encode(), key.encode()):
                return "invalid API key"
            return None

        async def _held(self) -> set[str]:
            """Adapters some replica reports resident (read at most every REPORT_S)."""
            t, held = self._resident
            if time.monotonic() - t > REPORT_S:
                reports = await self.directory.replicas.remote()
                held = {n for r in reports.values() for n in r["resident"]}
                self._resident = (time.monotonic(), held)
            return held

        async def _cold_start(self, adapter: str) -> _First | None:
            """A burst of requests for an adapter no replica holds goes one request first.

            Serve's routers learn where an adapter is from the replicas (pushed every 0.1 s,
            through the controller); requests sent before they know go to the replicas with the
            fewest adapters, and each would load it. So the first request goes alone and the
            rest wait (up to 10 s) until a replica reports the adapter, then the router
            (`AdapterRouter`) sends them to it; and cold starts of different adapters go one
            after the other, so that the router knows each replica's count when it picks the
            one with the fewest. This only orders a cold start; the router picks."""
            event = self._cold.get(adapter)
            if event is not None:  # before the held check: replicas tell the directory first
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), 10.0)
                return None
            table = _router_table(self.replicas)
            if table is not None and table().get(adapter):
                return None  # the router knows where it is
            if adapter in await self._held():  # loaded, and the router is about to know
                await self._router_learns(adapter)
                return None
            event = self._cold[adapter] = asyncio.Event()
            first = _First()  # the caller says when its request ends, and how
            try:
                await asyncio.wait_for(self._cold_lock.acquire(), 10.0)
                lock: asyncio.Lock | None = self._cold_lock
            except TimeoutError:  # a cold start that takes this long: go on without the order
                lock = None
            except BaseException:
                event.set()
                del self._cold[adapter]
                raise

            async def watch() -> None:
                try:
                    for _ in range(100):  # until a replica holds it, or the request failed
                        await asyncio.sleep(0.1)
                        self._resident = (0.0, set())
                        if adapter in await self._held():
                            await self._router_learns(adapter)
                            break
                        if first.done.is_set() and not first.ok:
                            break  # it failed: the waiters go on (and meet the same answer)
                finally:
                    if lock is not None:
                        lock.release()
                    event.set()
                    del self._cold[adapter]

            self._watchers.add(asyncio.ensure_future(watch()))
            self._watchers = {w for w in self._watchers if not w.done()}
            return first

        async def _router_learns(self, adapter: str) -> None:
            """Wait until this ingress's router knows a replica holds `adapter` (the replica
            tells the controller, the controller pushes to the routers: 0.1 s idle, more on a
            busy machine), up to 5 s. Serve does not expose what a router knows, so this reads
            its request router where Ray 2.4x-2.6x keep it, and waits a fixed 0.5 s where
            that is not found."""
            table = _router_table(self.replicas)
            if table is None:
                await asyncio.sleep(0.5)
                return
            deadline = time.monotonic() + 5.0
            while not table().get(adapter) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

        async def forward(self, req: Forwarded, send: Any) -> None:
            opts: dict[str, Any] = {"stream": True}
            first: _First | None = None
            if self.spec.affinity and req.adapter:
                opts["multiplexed_model_id"] = req.adapter
                first = await self._cold_start(req.adapter)
            status: int | None = None
            try:
                status = await self._forward(req, send, opts)
            finally:
                if first is not None:
                    first.ok = status == 200
                    first.done.set()

        async def _forward(self, req: Forwarded, send: Any, opts: dict[str, Any]) -> int | None:
            """Forward to a replica and stream its answer back: the status sent, or None
            if the replica was lost before its head came (503 sent) or did not know the
            adapter (the base answered)."""
            gen = self.replicas.options(**opts).handle.remote(req)
            head: Head | None = None
            stream, unknown = False, False
            try:
                async for piece in gen:
                    if isinstance(piece, Head):
                        head = piece
                        version = _take_header(head, VERSION_HEADER)
                        if version is not None:
                            await self._await_broadcast(int(version))
                        if _take_header(head, UNKNOWN_HEADER) is not None:
                            unknown = True
                        kind = next(
                            (v for k, v in head.headers if k.lower() == b"content-type"), b""
                        )
                        stream = kind.startswith(b"text/event-stream")
                        await send(
                            {
                                "type": "http.response.start",
                                "status": head.status,
                                "headers": head.headers,
                            }
                        )
                    else:
                        await send({"type": "http.response.body", "body": piece, "more_body": True})
            except RayError as exc:
                self.died += 1
                if head is None:
                    await _answer(send, 503, error_body(503, _lost(exc), "replica_lost"))
                    return None
                if stream:  # the status line is gone: say it in the stream, then end it
                    await send(
                        {
                            "type": "http.response.body",
                            "body": sse_error(_lost(exc), "replica_lost"),
                            "more_body": True,
                        }
                    )
            finally:
                gen.cancel()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if head is None or unknown:
                return None
            return head.status

        async def _await_broadcast(self, version: int) -> None:
            """Wait (up to 10 s) until every live replica applied catalog `version`."""
            self.version = max(self.version, version)
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                reports = await self.directory.replicas.remote()
                if all(r["version"] >= version for r in reports.values()):
                    return
                await asyncio.sleep(0.1)
            log.warning("catalog version %d: not every replica applied it in 10 s", version)

    directory = serve.deployment(
        Directory, name="Directory", num_replicas=1, ray_actor_options={"num_cpus": 0}
    ).bind()
    replica = serve.deployment(
        Replica,
        name="Replica",
        request_router_config=RequestRouterConfig(request_router_class=AdapterRouter),
        **spec.replica_options(),
    ).bind(spec, directory)
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1000,
    )
    return ingress.bind(spec, replica, directory)


def _router_table(handle: DeploymentHandle) -> Callable[[], dict[str, Any]] | None:
    """A reader of the handle's router's table (adapter -> replicas holding it), or None
    where this Ray keeps it elsewhere. The table is read, never written."""
    router = getattr(handle, "_router", None)
    inner = getattr(router, "_asyncio_router", None)
    if inner is None or not hasattr(inner, "request_router"):
        return None

    def table() -> dict[str, Any]:
        request_router = inner.request_router
        found = getattr(request_router, "_multiplexed_model_id_to_replica_ids", None)
        return found if isinstance(found, dict) else {}

    return table


def _take_header(head: Head, name: bytes) -> bytes | None:
    for k, (key, value) in enumerate(head.headers):
        if key.lower() == name:  # names are case-insensitive (the app spells them title-case)
            del head.headers[k]
            return value
    return None


def _lost(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"the replica serving this request is gone ({type(exc).__name__}: {first[:200]}); retry"


async def _answer(send: Any, status: int, body: bytes, kind: bytes = b"application/json") -> None:
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def start(spec: ScaleSpec, host: str = "127.0.0.1", port: int = 8000) -> str:
    """Deploy the application on the Ray cluster this process is connected to (`ray.init`
    first) with Serve's HTTP proxy on host:port; returns its URL once every replica is up."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(spec), name=spec.name, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"
