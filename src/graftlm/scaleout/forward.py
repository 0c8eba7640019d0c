"""What the ingress and the replicas exchange, with no Ray in it: one HTTP request as data, the
replica's run of it through graftlm's own app (ASGI, in-process), the routing rule that picks a
request's adapter, the merge of every replica's Prometheus metrics into one page, and the
headers and timings the ingress, the replicas and their directory agree on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

Header = tuple[bytes, bytes]

REPORT_S = 0.5  # how often a replica reports to the directory
LIVE_S = 3.0  # a replica not heard from for this long is taken for gone
RUNTIME_PATHS = {"/v1/load_lora_adapter": "load", "/v1/unload_lora_adapter": "unload"}
VERSION_HEADER = b"x-graftlm-catalog-version"  # replica -> ingress: the catalog it changed
UNKNOWN_HEADER = b"x-graftlm-unknown-adapter"  # replica -> ingress: the base answered instead


@dataclass
class Forwarded:
    """One HTTP request as the ingress received it (body read whole, bounded), and what the
    ingress decided about it."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[Header] = field(default_factory=list)
    body: bytes = b""
    adapter: str = ""  # the adapter it routes by ("": the base, or only pinned adapters)
    version: int = 0  # the runtime adapter catalog's version the replica must have applied


@dataclass
class Head:
    """The status line and headers of a replica's answer (its body follows as bytes)."""

    status: int
    headers: list[Header]


async def run_asgi(app: ASGIApp, req: Forwarded) -> AsyncIterator[Head | bytes]:
    """Run `req` through `app` in this process: its head, then its body as it is sent. Closing
    the iterator early (the client left, the caller was cancelled) cancels the request."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "query_string": req.query_string,
        "root_path": "",
        "headers": req.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }
    out: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await out.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while True:
            message = await out.get()
            if message is None:
                task.result()  # the app's own failure (it answers every error itself)
                return
            if message["type"] == "http.response.start":
                yield Head(message["status"], [(bytes(k), bytes(v)) for k, v in message["headers"]])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def body_json(body: bytes) -> Any:
    """The body as JSON, or None when it is not (the replica then answers the 400)."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def route_key(payload: Any, base_names: Collection[str], pinned: Collection[str]) -> str:
    """The adapter a request routes by ("": any replica).

    1. The adapter `model` names, when it names one.
    2. Else the heaviest entry of its `lora` list that names an adapter by `name` (the largest
       |scale|; the first of equals). The list's other adapters are attached on the same
       replica, by its registry (within its --max-loras / --max-lora-memory), not through
       Serve's LRU.
    Pinned adapters (`--lora`, by id or name) are on every replica at the same ids: they route
    nowhere in particular, and neither does the base."""
    if not isinstance(payload, dict):
        return ""
    model = payload.get("model")
    if isinstance(model, str) and model and model not in base_names:
        return "" if model in pinned else model
    best, weight = "", 0.0
    lora = payload.get("lora")
    for item in lora if isinstance(lora, list) else []:
        if not isinstance(item, dict):
            continue
        name, scale = item.get("name"), item.get("scale")
        if not isinstance(name, str) or name in pinned or not isinstance(scale, int | float):
            continue
        if abs(scale) > weight:
            best, weight = name, abs(float(scale))
    return best


def error_body(status: int, message: str, code: str) -> bytes:
    kind = {503: "unavailable_error", 401: "authentication_error", 404: "not_found_error"}
    err = {"message": message, "type": kind.get(status, "invalid_request_error"), "code": code}
    return json.dumps({"error": err | {"param": None}}).encode()


def sse_error(message: str, code: str) -> bytes:
    """An error event for a stream whose status line is already sent."""
    return b"data: " + error_body(503, message, code) + b"\n\n"


def merge_metrics(pages: Iterable[tuple[str, str]]) -> str:
    """One Prometheus text page from each replica's (replica id, page): every sample labelled
    with its `replica`, each family's HELP and TYPE once."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, page in pages:
        for fam in text_string_to_metric_families(page):
            kind = "untyped" if fam.type == "unknown" else fam.type
            # (the parser names a counter without its _total; the text format names it with)
            shown = fam.name + "_total" if kind == "counter" else fam.name
            _, _, lines = families.setdefault(shown, (fam.documentation, kind, []))
            for s in fam.samples:
                labels = {**s.labels, "replica": replica}
                text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
                lines.append(f"{s.name}{{{text}}} {_number(s.value)}")
    out = []
    for name, (doc, kind, lines) in families.items():
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(lines)
    return "\n".join(out) + "\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    return repr(float(v)) if v == v and abs(v) != float("inf") else str(v).replace("inf", "Inf")
