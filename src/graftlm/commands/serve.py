"""`graftlm serve`: an OpenAI- and llama-server-compatible HTTP server over one engine thread.

Flags follow llama-server where it has them (-m, --host, --port, -c, -t, -np, --lora,
--lora-scaled, --lora-init-without-apply, --api-key, --temp, --seed, -n) and vLLM for named
adapters (--lora-modules, --max-loras, --max-lora-rank); --max-lora-memory and
--allow-runtime-lora are ours. Heavy imports happen only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graftlm.commands import add_chat_template_arguments, add_device_argument
from graftlm.commands.lora_args import add_lora_arguments
from graftlm.commands.serve_options import add_http_arguments
from graftlm.commands.spec_args import add_spec_arguments, spec_config

if TYPE_CHECKING:
    from graftlm.server.state import ServerState

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
    return out


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
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
    add_lora_arguments(p)
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
        help="how long a request waits for adapter memory held by other requests (then a 503)",
    )
    p.add_argument(
        "--max-body-size",
        type=_size_arg,
        default=8 << 20,
        metavar="SIZE",
        help="largest request body accepted (default 8M; larger: 413)",
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
    add_spec_arguments(p)
    add_http_arguments(p)
    from graftlm.commands.llama_flags import VersionAction, add_llama_flags

    p.add_argument("--version", action=VersionAction)
    add_llama_flags(p, server=True)
    from graftlm.commands.llama_server_flags import add_llama_server_flags

    add_llama_server_flags(p)  # last: only the flags not declared above


def _configuration(model: Any, args: argparse.Namespace) -> str:
    """One line of what serves: types of the weights, device, native kernels, threads, slots
    (the KV cache has a line of its own)."""
    import torch

    from graftlm.native import build

    types: dict[str, int] = {}
    for t in model.file.tensors.values():
        types[t.type_name] = types.get(t.type_name, 0) + 1
    quant = ", ".join(f"{k} x{v}" for k, v in sorted(types.items(), key=lambda kv: -kv[1]))
    reason = build.unavailable_reason() if model.device.type == "cpu" else "not on the CPU"
    return (
        f"serving {model.path.name} ({quant}) on {model.device}, native kernels "
        f"{'on' if reason is None else 'off'}, {torch.get_num_threads()} threads, "
        f"{args.parallel} slots"
    )


def serve(args: argparse.Namespace) -> int:
    from graftlm.errors import GraftError

    try:
        import uvicorn

        from graftlm.server.app import HTTP_IMPL, create_app
    except ImportError as exc:
        raise GraftError(
            f"the server needs its extras ({exc.name}): pip install 'graftlm[server]'"
        ) from None

    from graftlm.commands.serve_options import split_list, vertex_port

    hosts = split_list(args.host) or ("127.0.0.1",)
    args.port = vertex_port(args)
    state = serving_state(args)
    try:
        sockets = listen(hosts, args.port)
        print(
            "listening on " + ", ".join(f"http://{_shown(h)}:{args.port}" for h in hosts),
            file=sys.stderr,
        )
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(state),
                log_level=args.log_level,
                http=HTTP_IMPL,
                timeout_graceful_shutdown=5,  # streams still open are cut after 5 s on Ctrl-C
            )
        )
        server.run(sockets=sockets)
    finally:
        state.service.close()
    return 0


def chat_template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--chat-template-kwargs and --reasoning as the template variables every chat gets."""
    from graftlm.tokenizer.chat import check_template_kwargs

    out: dict[str, Any] = {}
    if args.chat_template_kwargs is not None:
        try:
            out = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--chat-template-kwargs: not JSON ({exc})") from None
        if not isinstance(out, dict):
            raise ValueError(
                f"--chat-template-kwargs: expected a JSON object, got {args.chat_template_kwargs}"
            )
        try:
            check_template_kwargs(out)  # (the rule a request's chat_template_kwargs meet)
        except ValueError as exc:
            raise ValueError(f"--chat-template-kwargs: {exc}") from None
    if args.reasoning is not None:
        out["enable_thinking"] = args.reasoning != "off"
    return out


def serving_state(args: argparse.Namespace) -> ServerState:
    """The model loaded and its engine service started from `serve`'s flags, as `graftlm serve`
    runs before it listens (each replica of `graftlm ray-serve` runs it too): a ServerState,
    whose service the caller closes."""
    import graftlm
    from graftlm.commands import check_adapters_first, warn_if_slow
    from graftlm.commands.llama_flags import cache_type, check_llama_flags
    from graftlm.commands.llama_server_flags import llama_server_notes
    from graftlm.commands.lora_args import lora_specs
    from graftlm.commands.serve_options import api_key, http_config, split_list
    from graftlm.server.app import build_state
    from graftlm.server.state import ServerConfig
    from graftlm.step.kv_cache import BLOCK, DEFAULT_KV_TYPE

    check_llama_flags(args, maps_batch=True)
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"-b {args.batch_size}: must be at least 1")
    for note in llama_server_notes(args):
        print(f"note: {note}", file=sys.stderr)
    key = api_key(args)
    aliases = split_list(args.alias)

    specs = lora_specs(args.lora, args.lora_scaled, args.lora_init_without_apply)
    modules = parse_lora_modules(args.lora_modules)
    if args.parallel < 1:
        raise ValueError(f"--parallel {args.parallel}: must be at least 1")
    kv_type = cache_type(args) or DEFAULT_KV_TYPE  # -ctk / -ctv, checked before the load
    speculative = spec_config(args)  # checked before the load too
    template_kwargs = chat_template_kwargs(args)
    pool_tokens = args.ctx_size
    if pool_tokens <= 0:  # -c 0: the model's context, for the pool too
        from graftlm.gguf import GGUFFile
        from graftlm.models import context_size
        from graftlm.resources import default_model_path

        pool_tokens = context_size(GGUFFile(args.model or default_model_path()), 0)
    check_adapters_first(args.model, [s.path for s in specs] + [path for _, path in modules])
    t0 = time.perf_counter()
    sleep_s = getattr(args, "sleep_idle_seconds", None)
    if sleep_s is not None and sleep_s <= 0:  # llama-server: -1, the default, is off
        sleep_s = None

    def load(progress: bool) -> graftlm.Model:
        # one sequence slot more than --parallel: scoring requests (echo + logprobs) never wait
        m = graftlm.load(
            args.model,
            threads=args.threads,
            ctx_size=args.ctx_size,
            n_seq=args.parallel + 1,
            progress=progress,
            device=args.device,
            chat_template=args.chat_template,
            chat_template_file=args.chat_template_file,
            cache_type=kv_type,
            cache_blocks=None if args.kv_memory else -(-pool_tokens // BLOCK) + 1,
            cache_bytes=args.kv_memory,
            prefix_cache=args.cache_prompt,
            speculative=speculative,
            draft_model=args.model_draft,
        )
        m.prompter.template_kwargs = template_kwargs
        if args.batch_size is not None:  # llama-server's -b: the prompt tokens a step computes
            m.engine.chunk = args.batch_size
        return m

    model = load(progress=True)
    cache = model.engine.cache
    print(
        f"loaded {model.path.name}: {model.config.arch}, context {model.engine.n_ctx} a sequence, "
        f"{args.parallel} parallel, "
        f"{model.resident_bytes / 2**20:.0f} MiB resident, {time.perf_counter() - t0:.2f} s",
        file=sys.stderr,
    )
    warn_if_slow(args.device)
    print(_configuration(model, args), file=sys.stderr)
    print(
        f"KV cache: {kv_type}, {cache.n_blocks - 1} blocks of {cache.block} tokens "
        f"({(cache.n_blocks - 1) * cache.block} tokens, {cache.nbytes / 2**20:.0f} MiB), "
        f"prefix cache {'on' if args.cache_prompt else 'off'}",
        file=sys.stderr,
    )
    config = ServerConfig(
        # as llama-server: of several aliases the first in sorting order names the model
        model_name=sorted(aliases)[0] if aliases else model.path.name,
        aliases=aliases,
        verbose=args.log_level == "debug",
        api_key=key,
        allow_runtime_lora=args.allow_runtime_lora,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        n_predict=args.n_predict,
        extra_model_names=(*aliases, model.path.name, model.path.stem)
        if aliases
        else (model.path.stem,),
        max_body_bytes=args.max_body_size,
        lora_dirs=tuple(Path(d).resolve() for d in (args.lora_dir or ["."])),
        n_ctx_pool=(cache.n_blocks - 1) * cache.block,
        **http_config(args),
    )
    if args.allow_runtime_lora:
        dirs = ", ".join(str(d) for d in config.lora_dirs)
        print(f"runtime adapter loads read only under: {dirs} (--lora-dir)", file=sys.stderr)
    state = build_state(
        model,
        config,
        parallel=args.parallel,
        lora=[(s.path, s.scale) for s in specs],
        lora_modules=modules,
        max_lora_bytes=args.max_lora_memory,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_wait_s=args.lora_wait,
        reload=None if sleep_s is None else (lambda: load(progress=False)),
        sleep_idle_s=sleep_s,
    )
    if sleep_s is not None:
        print(f"sleep: the model is released after {sleep_s:g} s idle", file=sys.stderr)
    for a in state.registry.adapter_list():
        print(f"lora {a['id']} ({a['name']}): {a['path']} scale {a['scale']:g}", file=sys.stderr)
    for name, path in modules:
        print(f"lora module {name}: {path} (loaded on first use)", file=sys.stderr)
    return state


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def listen(hosts: Sequence[str], port: int) -> list[socket.socket]:
    """One listening socket per address (--host 127.0.0.1,::1 listens on both)."""
    out = []
    for host in hosts:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise ValueError(f"--host {host} --port {port}: {exc.strerror}") from None
        sock.listen(2048)
        sock.set_inheritable(True)
        out.append(sock)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m graftlm.commands.serve ...` (the same as `graftlm serve ...`)."""
    from graftlm.errors import GraftError

    parser = argparse.ArgumentParser(prog="graftlm serve", description=__doc__.splitlines()[0])
    add_serve_arguments(parser)
    try:
        return serve(parser.parse_args(argv))
    except (GraftError, ValueError) as exc:
        from graftlm.commands import short_error

        print(f"error: {short_error(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
