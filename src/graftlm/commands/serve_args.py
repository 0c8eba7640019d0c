"""`graftlm serve`'s flags (and so `ray-serve`'s), and the parsing of their values.

They follow llama-server where it has them (-m, --host, --port, -c, -t, -np, --lora,
--lora-scaled, --lora-init-without-apply, --api-key, --temp, --seed, -n) and vLLM for named
adapters (--lora-modules, --max-loras, --max-lora-rank); --max-lora-memory and
--allow-runtime-lora are ours. The HTTP options are serve_options.py's, llama-server's flags that
graftlm only notes are llama_server_flags.py's.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path

from graftlm.commands import add_chat_template_arguments, add_device_argument
from graftlm.commands.lora_args import add_lora_arguments
from graftlm.commands.serve_options import add_http_arguments
from graftlm.commands.spec_args import add_spec_arguments
from graftlm.server.names import module_problem

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512M', '1.5G', '64MiB', '1000000' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(
            f"--max-lora-memory {text!r}: expected a size such as 512M, 2G or a number of bytes"
        )
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * 1024 ** " kmgt".index(unit or " "))


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_lora_limits(args: argparse.Namespace) -> None:
    """The adapter budget's flags, before the model loads: a limit below 1 let the server start
    and then refused or held up every adapter request; a --lora-dir that is no directory 403'd
    every runtime load."""
    for flag, value in (
        ("--max-loras", args.max_loras),
        ("--max-lora-rank", args.max_lora_rank),
        ("--max-lora-memory", args.max_lora_memory),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if not args.lora_wait >= 0:  # (nan too)
        raise ValueError(f"--lora-wait {args.lora_wait}: must be 0 or more seconds")
    if args.allow_runtime_lora:
        for d in args.lora_dir:
            if not Path(d).is_dir():
                raise ValueError(f"--lora-dir {d}: no such directory")


def parse_lora_modules(groups: Sequence[Sequence[str]]) -> list[tuple[str, str]]:
    """vLLM's --lora-modules: 'name=path' or '{"name": ..., "path": ...}', several per flag."""
    out: list[tuple[str, str]] = []
    for group in groups:
        for item in group:
            if item.lstrip().startswith("{"):
                try:
                    obj = json.loads(item)
                    out.append((str(obj["name"]), str(obj["path"])))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(
                        f"--lora-modules {item!r}: expected JSON with 'name' and 'path'"
                    ) from None
                continue
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected name=path")
            out.append((name, path))
    for name, path in out:  # (before the model loads, and before Ray starts for ray-serve)
        if (problem := module_problem(name, path)) is not None:
            raise ValueError(problem)
    return out


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_and_address(p)
    _add_kv_cache_arguments(p)
    p.add_argument("-t", "--threads", type=int, default=None)
    add_device_argument(p)
    add_chat_template_arguments(p)
    p.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=4,
        help="sequences generated at once (continuous batching)",
    )
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every API call"
    )
    p.add_argument("--api-key-file", default=None, metavar="FILE", help="the API key, from a file")
    _add_sampling_defaults(p)
    add_lora_arguments(p)
    _add_named_adapter_arguments(p)
    _add_body_and_log_arguments(p)
    _add_template_variable_arguments(p)
    add_spec_arguments(p)
    add_http_arguments(p)
    from graftlm.commands.llama_flags import VersionAction, add_llama_flags

    p.add_argument("--version", action=VersionAction)
    add_llama_flags(p, server=True)
    from graftlm.commands.llama_server_flags import add_llama_server_flags

    add_llama_server_flags(p)  # last: only the flags not declared above


def _add_model_and_address(p: argparse.ArgumentParser) -> None:
    """The model, its names, where it listens, its context."""
    p.add_argument(
        "-m", "--model", default=None, help="GGUF model (default: embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "-a",
        "--alias",
        default=None,
        help="the base model's name in the API (default: its file name); a comma-separated "
        "list gives it several names, the first one shown",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; a comma-separated list listens on each (e.g. 127.0.0.1,::1)",
    )
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=4096,
        help="tokens the KV cache holds, over all sequences (as llama-server); one sequence may "
        "use all of it, up to the model's context (0: the model's context)",
    )
    p.add_argument(
        "--context-shift",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a sequence that fills its context drops half of it and goes on (llama-server's "
        "context shift, the dropped half recomputed away); off (the default), it ends there",
    )


def _add_kv_cache_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache")
    g.add_argument(
        "--kv-memory",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="size the KV cache pool in bytes instead of by -c (e.g. 1G); room past what the "
        "running requests hold keeps cached prefixes",
    )
    g.add_argument(
        "--no-cache-prompt",
        dest="cache_prompt",
        action="store_false",
        help="turn the prefix cache off (every prompt computed in full)",
    )
    g.add_argument("--cache-prompt", dest="cache_prompt", action="store_true", default=True)
    g.add_argument(
        "--sleep-idle-seconds",
        type=float,
        default=None,
        metavar="S",
        help="after S seconds without a request, release the model and its KV cache (the next "
        "request loads them again; /health, /props, /models and /metrics do not wake it)",
    )


def _add_sampling_defaults(p: argparse.ArgumentParser) -> None:
    """What a request that does not say gets (llama-server's flags and defaults)."""
    p.add_argument("--temp", "--temperature", type=float, default=0.8, help="default temperature")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("-s", "--seed", type=int, default=-1, help="default seed (-1: random)")
    p.add_argument(
        "-n",
        "--n-predict",
        "--predict",
        type=int,
        default=-1,
        help="default tokens to generate (-1: until the end)",
    )


def _add_named_adapter_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's adapters by name, their limits, and runtime loads."""
    g = p.add_argument_group("named adapters (vLLM)")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="adapters selected by the request's `model` field; loaded on first use",
    )
    g.add_argument("--max-loras", type=int, default=None, help="most adapters attached at once")
    g.add_argument(
        "--max-lora-rank", type=int, default=None, help="refuse adapters of a higher rank"
    )
    g.add_argument(
        "--max-lora-memory",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="LoRA weight budget (e.g. 512M); idle adapters are evicted, least recently used first",
    )
    g.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    g.add_argument(
        "--lora-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="where runtime loads may read adapters from (repeatable; default with "
        "--allow-runtime-lora: the current directory)",
    )
    g.add_argument(
        "--lora-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long a request waits for adapter memory held by other requests (then a 503); "
        "past a quarter of it, new requests for adapters it could evict wait for it; one whose "
        "adapter it evicted is read again and queues behind each request that needed room "
        "meanwhile, each waiting up to this long (the worst case: several such waits)",
    )


def _add_body_and_log_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-body-size",
        type=_size_arg,
        default=8 << 20,
        metavar="SIZE",
        help="largest request body accepted (default 8M; larger: 413)",
    )
    p.add_argument(
        "-to",
        "--timeout",
        type=_positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="a stream whose client reads nothing for this long is ended and its slot freed "
        "(default 60; llama-server's read/write timeout, 600 there)",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.add_argument(
        "-v",
        "--verbose",
        "--log-verbose",
        dest="log_level",
        action="store_const",
        const="debug",
        help="the same as --log-level debug",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0")
    return value


# llama-server's --reasoning-format values (runtime/reasoning.py's REASONING_FORMATS; not imported:
# the server's modules are not loaded to read a command line)
REASONING_FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")


def _add_template_variable_arguments(p: argparse.ArgumentParser) -> None:
    """The chat template's variables every chat gets (`chat_template_kwargs` reads them)."""
    g = p.add_argument_group("chat templates")
    g.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help='more variables for the chat template, a JSON object (e.g. \'{"enable_thinking": '
        "false}'); a request's chat_template_kwargs go over them",
    )
    g.add_argument(
        "-rea",
        "--reasoning",
        choices=["on", "off", "auto"],
        default=None,
        help="off renders chats with enable_thinking false (the model answers without thinking); "
        "on and auto (the default) with it true",
    )
    g.add_argument(
        "--reasoning-format",
        choices=REASONING_FORMATS,
        default="auto",
        help="where a chat answer's reasoning goes (llama-server's): auto and deepseek put it "
        "in reasoning_content, deepseek-legacy in the content too between <think> tags, none "
        "leaves it in the content as the model wrote it; a request's reasoning_format goes over "
        "it",
    )
    g.add_argument(
        "--reasoning-effort",
        default=None,
        metavar="LEVEL",
        help="the template's reasoning_effort (gpt-oss: low, medium, high); a request's "
        "reasoning_effort or chat_template_kwargs go over it",
    )
