"""The FastAPI application: routes, the API key, and every error as an OpenAI error object.

`create_app(state)` builds the app over an already running engine service; `ServerThread` runs it
on uvicorn in a background thread (tests, benchmarks); `graftlm serve` runs it in the foreground.
"""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from graftlm.errors import GraftError, RequestError
from graftlm.runtime.idle import settle_heap
from graftlm.runtime.service import EngineService
from graftlm.server import (
    anthropic_routes,
    chat_routes,
    embedding_routes,
    gcp_routes,
    llama_routes,
    openai_routes,
    responses_routes,
    ui,
    vllm_routes,
)
from graftlm.server.guard import Cors, Guard, Hosts
from graftlm.server.metrics import Metrics
from graftlm.server.registry import AdapterRegistry
from graftlm.server.state import ApiError, ServerConfig, ServerState

if TYPE_CHECKING:
    from graftlm.api import Model


def _check_key(request: Request) -> None:
    key = request.app.state.graft.config.api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    given = (
        auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    )
    if not given:
        raise ApiError(
            401, "missing API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
        )
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError(401, "invalid API key", "invalid_api_key")


def _validation_message(exc: RequestValidationError, most: int = 5) -> str:
    problems = []
    errors = exc.errors()
    for e in errors[:most]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", "")
            return f"the request body is not valid JSON{': ' + str(detail) if detail else ''}"
        if not loc and isinstance(e.get("input"), bytes):
            return "the request body is not valid JSON (or not sent as application/json)"
        where = ".".join(loc) or "body"
        got = e.get("input")
        shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
        if e.get("type") == "missing":
            problems.append(f"{where}: field required")
        else:
            problems.append(f"{where}: {e.get('msg', 'invalid')} (got {shown[:60]})")
    more = f" (and {len(errors) - most} more)" if len(errors) > most else ""
    return "invalid request: " + "; ".join(problems) + more


def _error(request: Request, err: ApiError) -> JSONResponse:
    metrics = getattr(getattr(request.app.state, "graft", None), "metrics", None)
    if metrics is not None:
        metrics.errors.labels(str(err.status)).inc()
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


# as llama-server: these read what is known without the model, and do not wake a sleeping one
_READ_ONLY = frozenset(["/health", "/v1/health", "/props", "/models", "/v1/models", "/metrics"])


class KeepAwake:
    """ASGI middleware of the sleep mode: every request but the read-only ones keeps the engine
    awake while it runs (a stream until its last byte), and first wakes it when it sleeps."""

    def __init__(self, app: ASGIApp, service: EngineService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _READ_ONLY:
            await self.app(scope, receive, send)
            return
        self.service.hold()
        try:
            try:
                await self.service.awake()
            except RequestError as exc:
                await _error(Request(scope), ApiError.of(exc))(scope, receive, send)
                return
            await self.app(scope, receive, send)
        finally:
            self.service.unhold()


def create_app(state: ServerState) -> FastAPI:
    """The HTTP app over `state` (whose service must be started before requests arrive)."""
    # the schema is public only where the API is (with --api-key it would list every route)
    openapi = None if state.config.api_key else "/openapi.json"
    app = FastAPI(
        title="graftlm", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=openapi
    )
    cors = Cors(state.config.cors_origins, api_key=state.config.api_key is not None)
    if state.service.sleep_idle_s is not None:
        app.add_middleware(KeepAwake, service=state.service)
    hosts = Hosts(state.config.allowed_hosts)
    app.add_middleware(Guard, max_body=state.config.max_body_bytes, cors=cors, hosts=hosts)
    app.state.graft = state
    state.registry.on_change.append(state.metrics.adapters)
    state.registry.on_attach.append(state.metrics.adapter_loaded)
    registry = state.registry
    state.metrics.adapter_queue.set_function(lambda: registry.queued)
    state.metrics.adapters(len(state.registry.by_id), state.registry.resident_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(request, ApiError(400, _validation_message(exc), "invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(request, ApiError(exc.status_code, message, code))

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        return _error(
            request, ApiError(400, "the request body is nested too deeply", "invalid_json")
        )

    @app.exception_handler(UnicodeEncodeError)
    async def not_unicode(request: Request, exc: UnicodeEncodeError) -> JSONResponse:
        message = f"the request holds text that is not valid Unicode ({exc.reason})"
        return _error(request, ApiError(400, message, "invalid_unicode"))

    @app.exception_handler(GraftError)
    async def graft_error(request: Request, exc: GraftError) -> JSONResponse:
        return _error(request, ApiError.of(exc))

    # anything else is a bug: a 500 with an error object (Starlette logs it and closes the
    # connection); the engine thread is not affected
    @app.exception_handler(Exception)
    async def any_error(request: Request, exc: Exception) -> JSONResponse:
        return _error(request, ApiError.of(exc))

    guarded: list[Any] = [Depends(_check_key)]
    app.include_router(llama_routes.public)
    if state.config.ui:
        app.include_router(ui.router)  # the chat page at / (public: it holds no secret)
    app.include_router(openai_routes.router, dependencies=guarded)
    app.include_router(embedding_routes.router, dependencies=guarded)
    app.include_router(vllm_routes.router, dependencies=guarded)
    app.include_router(chat_routes.router, dependencies=guarded)
    app.include_router(anthropic_routes.router, dependencies=guarded)
    app.include_router(responses_routes.router, dependencies=guarded)
    if state.config.gcp:
        app.include_router(gcp_routes.router, dependencies=guarded)
    app.include_router(llama_routes.router, dependencies=guarded)
    return app


def build_state(
    model: Model,
    config: ServerConfig,
    parallel: int | None = None,
    lora: Sequence[tuple[str, float]] = (),
    lora_modules: Sequence[tuple[str, str]] = (),
    max_lora_bytes: int | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    lora_wait_s: float = 60.0,
    reload: Callable[[], Model] | None = None,
    sleep_idle_s: float | None = None,
) -> ServerState:
    """A started engine service over `model`, its adapters (`lora`: pinned, llama-server's ids in
    order; `lora_modules`: by name, attached on first use) and metrics. The caller closes
    `state.service` when done. Raises AdapterError when a pinned adapter cannot be attached.
    sleep_idle_s: llama-server's sleep, after this many seconds without a request the model and
    its KV cache are let go, and `reload` (the same load again) brings them back on the next."""
    settle_heap()  # (the model's objects leave the collector's full passes; before the idle clock)
    metrics = Metrics()
    service = EngineService(
        model.engine,
        model.prompter,
        model.adapters,
        max_running=parallel,
        observer=metrics,
        reload=None if reload is None else (lambda: reload().engine),
        sleep_idle_s=sleep_idle_s,
    )
    registry = AdapterRegistry(
        service,
        max_bytes=max_lora_bytes,
        max_loras=max_loras,
        max_rank=max_lora_rank,
        room_wait_s=lora_wait_s,
    )
    for path, scale in lora:
        registry.preload(path, scale)
    for name, path in lora_modules:
        registry.add_module(name, path)
    service.start()
    return ServerState(config, service, registry, metrics, model.path)


# uvicorn's h11 protocol writes header names as the app spells them (httptools lowercases them):
# the Guard spells them as llama-server does (`Access-Control-Allow-Origin`)
HTTP_IMPL = "h11"


class ServerThread:
    """uvicorn serving `app` from a background thread, on a port chosen by the OS unless given."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(
            app, log_level=log_level, lifespan="off", http=HTTP_IMPL, timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout / 0.05)):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            deadline.wait(0.05)
        raise RuntimeError(f"uvicorn did not start on {self.url}")

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
