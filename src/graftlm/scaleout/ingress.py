"""The HTTP surface of graftlm on Ray Serve: reads each request, routes it by its adapter.

`Ingress` reads the request (bounded), picks its adapter (`forward.route_key`) and calls a
replica with that adapter as Serve's multiplexed model id, streaming the answer back. It answers
`/metrics` (every replica's metrics, labelled by replica) and `/replicas` itself, and waits for a
runtime load or unload to reach every replica (through the directory) before it answers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle

from graftlm.scaleout.forward import (
    REPORT_S,
    UNKNOWN_HEADER,
    VERSION_HEADER,
    Forwarded,
    Head,
    body_json,
    error_body,
    merge_metrics,
    route_key,
    sse_error,
)
from graftlm.scaleout.known import known_adapters
from graftlm.scaleout.spec import ScaleSpec

log = logging.getLogger("ray.serve")


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
                why = (
                    f"the request body has {len(body)} bytes or more, past the limit "
                    f"of {self.spec.max_body_bytes} (--max-body-size)"
                )
                return await _answer(send, 413, error_body(413, why, "body_too_large"))
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
            return await self._own_page(req, send)
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

    async def _own_page(self, req: Forwarded, send: Any) -> None:
        """/metrics (every replica's, labelled by replica) or /replicas (their reports)."""
        why = self._refused(req)
        if why is not None:
            return await _answer(send, 401, error_body(401, why, "invalid_api_key"))
        reports = await self.directory.replicas.remote()
        if req.path == "/replicas":
            shown = {k: {f: v for f, v in r.items() if f != "metrics"} for k, r in reports.items()}
            return await _answer(send, 200, json.dumps(shown).encode())
        page = merge_metrics((k, r["metrics"]) for k, r in sorted(reports.items()))
        page += (
            "# HELP graftlm_ingress_replica_lost Requests whose replica died (503)\n"
            f"# TYPE graftlm_ingress_replica_lost counter\n"
            f"graftlm_ingress_replica_lost_total {self.died}\n"
        )
        await _answer(send, 200, page.encode(), b"text/plain; version=0.0.4")

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
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", "")
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

    def _router_knows(self, adapter: str) -> bool:
        """This process's router has heard that some replica holds `adapter`."""
        return bool((known_adapters(self.spec.name) or {}).get(adapter))

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
        if self._router_knows(adapter):
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
        self._watchers.add(asyncio.ensure_future(self._watch(adapter, first, event, lock)))
        self._watchers = {w for w in self._watchers if not w.done()}
        return first

    async def _watch(
        self, adapter: str, first: _First, event: asyncio.Event, lock: asyncio.Lock | None
    ) -> None:
        """A cold start's end: a replica holds the adapter and the router knows it, or its
        first request failed (the waiters go on, and meet the same answer); then the next."""
        try:
            for _ in range(100):
                await asyncio.sleep(0.1)
                self._resident = (0.0, set())
                if adapter in await self._held():
                    await self._router_learns(adapter)
                    break
                if first.done.is_set() and not first.ok:
                    break
        finally:
            if lock is not None:
                lock.release()
            event.set()
            del self._cold[adapter]

    async def _router_learns(self, adapter: str) -> None:
        """Wait until this ingress's router knows a replica holds `adapter` (the replica
        tells the controller, the controller pushes to the routers: 0.1 s idle, more on a
        busy machine), up to 5 s."""
        deadline = time.monotonic() + 5.0
        while not self._router_knows(adapter) and time.monotonic() < deadline:
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
                    unknown = _take_header(head, UNKNOWN_HEADER) is not None
                    kind = next((v for k, v in head.headers if k.lower() == b"content-type"), b"")
                    stream = kind.startswith(b"text/event-stream")
                    start = {"status": head.status, "headers": head.headers}
                    await send({"type": "http.response.start", **start})
                else:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
        except RayError as exc:
            self.died += 1
            if head is None:
                await _answer(send, 503, error_body(503, _lost(exc), "replica_lost"))
                return None
            if stream:  # the status line is gone: say it in the stream, then end it
                body = sse_error(_lost(exc), "replica_lost")
                await send({"type": "http.response.body", "body": body, "more_body": True})
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
