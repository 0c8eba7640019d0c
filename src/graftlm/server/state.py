"""What every route shares: the server's settings, its engine service, adapters and metrics, and
the one error type routes raise (rendered as an OpenAI error object)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graftlm.errors import AdapterError, GraftError, RequestError, shortened
from graftlm.runtime.prompting import Prompter
from graftlm.runtime.service import EngineService
from graftlm.server.metrics import Metrics
from graftlm.server.registry import AdapterRegistry

SHOWN_PROBLEMS = 5  # of an adapter's problems in an answer (one a tensor for another base)

if TYPE_CHECKING:
    from fastapi import Request


@dataclass(frozen=True)
class ServerConfig:
    """Settings the command line chose; the HTTP layer never reads arguments itself."""

    model_name: str
    api_key: str | None = None
    allow_runtime_lora: bool = False
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1  # -1: a random seed per request
    n_predict: int = -1  # -1: until an end token or the context is full
    extra_model_names: tuple[str, ...] = ()  # other names accepted for the base (its file name)
    max_body_bytes: int = 8 << 20  # larger request bodies are refused with a 413
    # a stream whose client accepts nothing for this long is ended and its sequences cancelled
    # (their slots freed); llama-server's -to/--timeout
    write_timeout: float = 60.0
    # where /v1/load_lora_adapter may read (resolved, symlinks followed); () = nowhere
    lora_dirs: tuple[Path, ...] = ()
    n_ctx_pool: int | None = None  # the KV pool's tokens over all sequences (-c), for /props
    # web pages of these origins may call the API (`localhost`: any loopback origin, `*`: any);
    # None: the same origin only, or any origin where an API key is required
    cors_origins: tuple[str, ...] | None = None
    # the Host names answered besides loopback ones and IP literals (DNS rebinding); None:
    # any (a server listening on a network address); "*" in it: any
    allowed_hosts: tuple[str, ...] | None = ()
    metrics: bool = True  # /metrics served (else 501, as llama-server without --metrics)
    slots: bool = True  # /slots served (else 501, as llama-server with --no-slots)
    ui: bool = True  # the chat page at /
    tags: tuple[str, ...] = ()  # shown in /v1/models
    aliases: tuple[str, ...] = ()  # --alias a,b,c: every name of the base (shown in /v1/models)
    verbose: bool = False  # answers carry llama-server's __verbose (the rendered prompt)
    gcp: bool = False  # Vertex AI's POST /predict (AIP_MODE=PREDICTION, as llama-server)
    # a `model` that names neither the base nor an adapter: 404 (vLLM) or the base (llama-server)
    strict_model_names: bool = False
    # llama-server's --pooling of embeddings: mean, cls, last, or none (/embedding only)
    pooling: str = "mean"
    # llama-server's --reasoning-format: where a chat answer's reasoning goes (a request's
    # reasoning_format goes over it; runtime/reasoning.py)
    reasoning_format: str = "auto"


@dataclass
class ServerState:
    config: ServerConfig
    service: EngineService
    registry: AdapterRegistry
    metrics: Metrics = field(default_factory=Metrics)
    model_path: Path = field(default_factory=Path)  # the base model's file

    @property
    def prompter(self) -> Prompter:
        """The model's text rules (tokenizing, ids, templates, token text)."""
        return self.service.prompter

    @property
    def base_names(self) -> set[str]:
        return {self.config.model_name, *self.config.extra_model_names}


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    501: "not_implemented_error",
    503: "unavailable_error",
}


class ApiError(Exception):
    """An error answer: HTTP status plus OpenAI's {"error": {"message", "type", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        err_type: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.extra = extra or {}
        self.status = status
        self.message = message
        self.code = code
        self.type = err_type or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": None,
                **self.extra,
            }
        }

    @classmethod
    def of(cls, exc: BaseException) -> ApiError:
        """The answer for any exception a request can raise."""
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, RequestError):
            status = (
                503
                if exc.code
                in (
                    "server_busy",
                    "server_shutdown",
                    "adapter_memory_busy",
                    "adapter_load_timeout",
                    "model_unavailable",
                )
                else 400
            )
            return cls(status, str(exc), exc.code)
        if isinstance(exc, AdapterError):  # a few of its problems, not one a tensor
            return cls(400, shortened(str(exc), SHOWN_PROBLEMS), "invalid_adapter")
        if isinstance(exc, GraftError):
            return cls(400, str(exc), "invalid_request_error")
        return cls(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


async def json_body(request: Request) -> Any:
    """The request's body as JSON, or a 400 that says why it is not."""
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    except ValueError:  # a number of more digits than Python converts (it was a 500)
        raise ApiError(
            400, "the request body holds a number of more than 4300 digits", "invalid_json"
        ) from None


def state_of(request: Request) -> ServerState:
    """The server's state, as the app holds it for every route."""
    state: ServerState = request.app.state.graft
    return state
