"""What every request passes before a route sees it: a bound on the body's size, and no request
a web page on another site made the browser send.

A cross-site request is how a page the user happens to visit could change the server's adapter
scales or load adapters on 127.0.0.1 (an HTML form or `fetch` with `Content-Type: text/plain`
needs no CORS preflight). Browsers say where such a request comes from (`Origin`,
`Sec-Fetch-Site`); clients that are not browsers (curl, the OpenAI SDKs, llama.cpp's tests) send
neither, and are served whatever `Content-Type` they send, as llama-server serves them.

CORS opens the API to the pages of other origins, and only to those: `--cors-origins` lists them
(`localhost` for any loopback origin on any port, `*` for any). Without it, a server that requires
an API key is open to any origin, as llama-server is by default (a page cannot send a key it does
not know, so there is nothing to forge); one without a key serves its own origin only. A preflight
(OPTIONS with Access-Control-Request-Method) is answered 200 either way, with the CORS headers
only for an allowed origin, as llama-server answers it.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any
from urllib.parse import SplitResult, urlsplit

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


def _split(url: str, port: bool = False) -> SplitResult | None:
    """urlsplit(url), or None where it is malformed (an unclosed bracket, `[::1`; with `port`,
    a port that is not a number): each was a 500."""
    try:
        parts = urlsplit(url)
        if port:
            parts.port  # noqa: B018 (a malformed port raises)
    except ValueError:
        return None
    return parts


_LOOPBACK = ("localhost", "127.0.0.1", "::1")


class Hosts:
    """The names the server answers to (`Host`), against DNS rebinding: a page of
    rebind.attacker.example whose name comes to resolve to 127.0.0.1 is same-origin with the
    server as far as the browser knows, so its requests pass the cross-site check; only its
    `Host` gives it away. `names` None (a server listening on a network address, reachable
    under any name) or holding "*" checks nothing; else the loopback names (and
    `*.localhost`), these names, and IP literals (a rebinding needs a name) pass."""

    def __init__(self, names: tuple[str, ...] | None) -> None:
        self.any = names is None or "*" in names
        self.names = {n.strip("[]").lower().rstrip(".") for n in names or ()} | set(_LOOPBACK)

    def allows(self, host: str | None) -> bool:
        if self.any or host is None:
            return True
        parts = _split(f"//{host}")
        if parts is None:
            return False
        name = (parts.hostname or "").rstrip(".")
        if name in self.names or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


class Cors:
    """Which origins' pages may call the API (see the module's docstring)."""

    def __init__(self, origins: tuple[str, ...] | None, api_key: bool) -> None:
        self.any = (origins is None and api_key) or "*" in (origins or ())
        self.loopback = "localhost" in (origins or ())
        self.exact = {o.rstrip("/").lower() for o in origins or () if o not in ("*", "localhost")}

    def allows(self, origin: str) -> bool:
        if self.any:
            return True
        if origin.rstrip("/").lower() in self.exact:
            return True
        if self.loopback:
            parts = _split(origin, port=True)
            return (
                parts is not None
                and parts.scheme in ("http", "https")
                and parts.hostname in _LOOPBACK
            )
        return False

    @staticmethod
    def headers(origin: str, preflight: bool) -> list[tuple[bytes, bytes]]:
        out = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-credentials", b"true"),
            (b"vary", b"Origin"),
        ]
        if preflight:
            out += [
                (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                (b"access-control-allow-headers", b"*"),
                (b"access-control-max-age", b"600"),
            ]
        return out


def cross_site(scope: Scope) -> str | None:
    """Why a request is cross-site (from a page of another origin), or None."""
    site = _header(scope, b"sec-fetch-site")
    if site == "cross-site":
        return "Sec-Fetch-Site: cross-site"
    origin = _header(scope, b"origin")
    if origin is None:
        return None
    host = _header(scope, b"host") or ""
    parts = _split(origin)  # (None: `http://[::1/`, no origin this server has)
    if origin == "null" or parts is None or parts.netloc.lower() != host.lower():
        return f"Origin {origin[:100]!r} is not this server ({host[:100]!r})"
    return None


def as_json(scope: Scope) -> Scope:
    """The request with its body declared JSON whatever Content-Type it came with (a form type,
    text/plain, none): every body this API takes is JSON, and llama-server reads it so."""
    kind = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
    if kind == "application/json":
        return scope
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def canonical(name: bytes) -> bytes:
    """A header name as llama-server (and most servers) write it: `Access-Control-Allow-Origin`.
    Names are case-insensitive in HTTP, but clients that copy headers into a plain dict (as
    llama.cpp's own server tests do) look them up by that spelling."""
    return b"-".join(part[:1].upper() + part[1:].lower() for part in name.split(b"-"))


def _canonical_names(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(canonical(k), v) for k, v in message.get("headers", ())]
            message = {**message, "headers": headers}
        await send(message)

    return sending


class Guard:
    """ASGI middleware: 403 for a `Host` the server does not answer to, 413 past `max_body`
    bytes (declared or streamed), 403 for a cross-site request. Errors are OpenAI error objects, as every other error of the server."""

    def __init__(
        self, app: ASGIApp, max_body: int, cors: Cors | None = None, hosts: Hosts | None = None
    ) -> None:
        self.app = app
        self.max_body = max_body
        self.cors = cors or Cors(None, api_key=False)
        self.hosts = hosts or Hosts(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _canonical_names(send)
        host = _header(scope, b"host")
        if not self.hosts.allows(host):
            await self._refuse(
                send,
                403,
                f"Host {str(host)[:100]!r} is not a name this server answers to (a DNS "
                "rebinding?); --allowed-hosts adds names",
                "host_not_allowed",
            )
            return
        origin = _header(scope, b"origin")
        allowed = origin is not None and self.cors.allows(origin)
        if scope["method"] == "OPTIONS" and origin is not None:
            if _header(scope, b"access-control-request-method") is not None:
                await self._preflight(send, origin if allowed else None)
                return
        why = cross_site(scope)
        if why is not None and not allowed:
            await self._refuse(send, 403, f"cross-site request refused ({why})", "cross_site")
            return
        if allowed and origin is not None:
            send = self._with_cors(send, origin)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            scope = as_json(scope)
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

    @staticmethod
    def _with_cors(send: Send, origin: str) -> Send:
        extra = Cors.headers(origin, preflight=False)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        return sending

    @staticmethod
    async def _preflight(send: Send, origin: str | None) -> None:
        headers = [(b"content-length", b"0")]
        if origin is not None:
            headers += Cors.headers(origin, preflight=True)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

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
