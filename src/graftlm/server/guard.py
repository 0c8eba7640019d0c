"""What every request passes before a route sees it: a bound on the body's size, and no request
a web page on another site made the browser send.

A cross-site request is how a page the user happens to visit could change the server's adapter
scales or load adapters on 127.0.0.1 (an HTML form or `fetch` with `Content-Type: text/plain`
needs no CORS preflight). Browsers say where such a request comes from (`Origin`,
`Sec-Fetch-Site`); clients that are not browsers (curl, the OpenAI SDKs, llama.cpp's tests) send
neither, and are served whatever `Content-Type` they send, as llama-server serves them.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _error(status: int, message: str, code: str, kind: str) -> tuple[dict[str, Any], bytes]:
    body = json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
    }
    return start, body


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return str(v.decode("latin-1"))
    return None


def cross_site(scope: Scope) -> str | None:
    """Why a request is cross-site (from a page of another origin), or None."""
    site = _header(scope, b"sec-fetch-site")
    if site == "cross-site":
        return "Sec-Fetch-Site: cross-site"
    origin = _header(scope, b"origin")
    if origin is None:
        return None
    host = _header(scope, b"host") or ""
    parts = urlsplit(origin)
    if origin == "null" or parts.netloc.lower() != host.lower():
        return f"Origin {origin[:100]!r} is not this server ({host[:100]!r})"
    return None


class Guard:
    """ASGI middleware: 413 past `max_body` bytes (declared or streamed), 403 for a cross-site
    request. Errors are OpenAI error objects, as every other error of the server."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        why = cross_site(scope)
        if why is not None:
            await self._refuse(send, 403, f"cross-site request refused ({why})", "cross_site")
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self._refuse(send, 413, self._too_large(int(declared)), "body_too_large")
            return
        # the body is read here, whole and bounded, then handed on: a route never reads past it
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_body:  # a chunked body that runs past the limit
                await self._refuse(send, 413, self._too_large(seen), "body_too_large")
                return
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def body_then_receive() -> Message:
            return replay.pop() if replay else await receive()  # later: disconnects

        await self.app(scope, body_then_receive, send)

    def _too_large(self, n: int) -> str:
        return (
            f"the request body has {n} bytes or more, past the limit of {self.max_body} "
            "(--max-body-size)"
        )

    @staticmethod
    async def _refuse(send: Send, status: int, message: str, code: str) -> None:
        kind = "permission_error" if status == 403 else "invalid_request_error"
        start, body = _error(status, message, code, kind)
        await send(start)
        await send({"type": "http.response.body", "body": body})
