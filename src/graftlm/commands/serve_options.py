"""`graftlm serve`'s HTTP options beyond the model: CORS, which endpoints are on, the names the
base answers to, and how an unknown `model` is treated. They end up in the ServerConfig (the HTTP
layer never reads arguments itself)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from graftlm.commands.llama_server_flags import given
from graftlm.errors import GraftError


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP (as llama-server where it has the flag)")
    g.add_argument(
        "--cors-origins",
        default=None,
        metavar="ORIGINS",
        help="comma-separated origins whose web pages may call the API (`localhost`: any "
        "loopback origin, `*`: any). Default: same origin only, or any origin with --api-key",
    )
    g.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="comma-separated Host names answered besides loopback ones and IP addresses "
        "(against DNS rebinding; `*`: any). Default: the --host names; no check when listening "
        "on a network address",
    )
    g.add_argument(
        "--metrics",
        dest="metrics",
        action="store_true",
        default=True,
        help="serve Prometheus /metrics (the default)",
    )
    g.add_argument(
        "--no-metrics", dest="metrics", action="store_false", help="/metrics answers 501"
    )
    g.add_argument(
        "--slots", dest="slots", action="store_true", default=True, help="serve /slots (default)"
    )
    g.add_argument("--no-slots", dest="slots", action="store_false", help="/slots answers 501")
    g.add_argument(
        "--no-ui",
        "--no-webui",
        dest="ui",
        action="store_false",
        default=True,
        help="no chat page at /",
    )
    g.add_argument(
        "--tags", default=None, metavar="TAGS", help="comma-separated tags shown in /v1/models"
    )
    g.add_argument(
        "--strict-model-names",
        action="store_true",
        help="answer 404 for a request whose `model` names neither the base nor an adapter "
        "(vLLM); by default the base model serves it (llama-server)",
    )


def split_list(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, or the first line of --api-key-file."""
    if getattr(args, "api_key_file", None):
        try:
            lines = Path(args.api_key_file).read_text().split()
        except OSError as exc:
            raise GraftError(f"--api-key-file {args.api_key_file}: {exc.strerror}") from None
        if not lines:
            raise GraftError(f"--api-key-file {args.api_key_file}: the file is empty")
        return lines[0]
    key: str | None = args.api_key
    return key


def vertex_port(args: argparse.Namespace) -> int:
    """As llama-server: under Vertex AI (AIP_MODE=PREDICTION) the port is AIP_HTTP_PORT."""
    if os.environ.get("AIP_MODE") == "PREDICTION" and os.environ.get("AIP_HTTP_PORT"):
        return int(os.environ["AIP_HTTP_PORT"])
    port: int = args.port
    return port


def http_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerConfig fields these options set (and AIP_MODE from the environment)."""
    return {
        "gcp": os.environ.get("AIP_MODE") == "PREDICTION",
        "cors_origins": cors_origins(args),
        "allowed_hosts": allowed_hosts(args),
        "metrics": args.metrics,
        "slots": args.slots,
        "ui": args.ui,
        "tags": split_list(args.tags),
        "strict_model_names": args.strict_model_names,
        "pooling": pooling(args),
    }


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The Host names answered besides loopback ones and IP literals: --allowed-hosts, and the
    names --host listens on; None (no check) when it listens on a network address and no
    --allowed-hosts is given (reachable under any name of the machine)."""
    import ipaddress

    given = split_list(args.allowed_hosts)
    hosts = split_list(args.host) or ("127.0.0.1",)  # (as serve listens)
    exposed = False
    for h in hosts:
        try:
            exposed |= not ipaddress.ip_address(h.strip("[]")).is_loopback
        except ValueError:  # a name: answered under it
            exposed |= h.lower() != "localhost"
    return None if exposed and not given else given + hosts  # (loopback names: always)


def cors_origins(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--cors-origins; without it, as llama-server: loopback pages only where --tools was given
    (graftlm has no built-in tools, but the command line keeps llama-server's safer default)."""
    if args.cors_origins:
        return split_list(args.cors_origins)
    return ("localhost",) if given(args, "--tools") else None


# llama-server's --pooling values: Scorer.embedding's POOLINGS (not imported: it would bring
# torch into the command line's parser), "none" and "rank"
POOLING = ("mean", "cls", "last", "none", "rank")


def pooling(args: argparse.Namespace) -> str:
    """--pooling as llama-server takes it (rank: /rerank is always served; embeddings stay
    mean-pooled); a value llama-server does not know is refused."""
    value = given(args, "--pooling") or "mean"
    if value not in POOLING:
        raise ValueError(f"--pooling {value}: not one of {', '.join(POOLING)}")
    return "mean" if value == "rank" else str(value)
