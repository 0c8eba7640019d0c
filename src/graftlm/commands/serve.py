"""`graftlm serve`: an OpenAI- and llama-server-compatible HTTP server over one engine thread.

Its flags are declared in serve_args.py (serve_options.py: the HTTP ones). Heavy imports happen
only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graftlm.commands.serve_args import add_serve_arguments, check_lora_limits, parse_lora_modules
from graftlm.commands.spec_args import spec_config

if TYPE_CHECKING:
    from graftlm.api import Model
    from graftlm.commands.lora_args import LoraSpec
    from graftlm.runtime.speculative import SpecConfig
    from graftlm.server.state import ServerConfig, ServerState


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
    """--chat-template-kwargs, --reasoning and --reasoning-effort as the template variables
    every chat gets."""
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
    if args.reasoning_effort is not None:
        out["reasoning_effort"] = args.reasoning_effort
    return out


@dataclass(frozen=True)
class _Flags:
    """`serve`'s flags checked and read before the model loads (no load time spent on a bad one)."""

    api_key: str | None
    aliases: tuple[str, ...]
    specs: list[LoraSpec]
    modules: list[tuple[str, str]]  # --lora-modules: (name, path)
    kv_type: str
    speculative: SpecConfig | None
    template_kwargs: dict[str, Any]
    pool_tokens: int  # the KV cache pool's positions that -c asks for
    sleep_s: float | None  # --sleep-idle-seconds, None: off


def serving_state(args: argparse.Namespace) -> ServerState:
    """The model loaded and its engine service started from `serve`'s flags, as `graftlm serve`
    runs before it listens (each replica of `graftlm ray-serve` runs it too): a ServerState,
    whose service the caller closes."""
    from graftlm.server.app import build_state

    flags = _checked_flags(args)
    t0 = time.perf_counter()
    model = _load(args, flags, progress=True)
    _print_loaded(model, args, flags.kv_type, t0)
    config = _server_config(args, model, flags)
    if args.allow_runtime_lora:
        dirs = ", ".join(str(d) for d in config.lora_dirs)
        print(f"runtime adapter loads read only under: {dirs} (--lora-dir)", file=sys.stderr)
    sleep_s = flags.sleep_s
    state = build_state(
        model,
        config,
        parallel=args.parallel,
        lora=[(s.path, s.scale) for s in flags.specs],
        lora_modules=flags.modules,
        max_lora_bytes=args.max_lora_memory,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_wait_s=args.lora_wait,
        reload=None if sleep_s is None else (lambda: _load(args, flags, progress=False)),
        sleep_idle_s=sleep_s,
    )
    if sleep_s is not None:
        print(f"sleep: the model is released after {sleep_s:g} s idle", file=sys.stderr)
    for a in state.registry.adapter_list():
        print(f"lora {a['id']} ({a['name']}): {a['path']} scale {a['scale']:g}", file=sys.stderr)
    for name, path in flags.modules:
        print(f"lora module {name}: {path} (loaded on first use)", file=sys.stderr)
    return state


def _checked_flags(args: argparse.Namespace) -> _Flags:
    from graftlm.commands import check_adapters_first
    from graftlm.commands.llama_flags import cache_type, check_llama_flags
    from graftlm.commands.llama_server_flags import llama_server_notes
    from graftlm.commands.lora_args import lora_specs
    from graftlm.commands.serve_options import api_key, split_list
    from graftlm.step.kv_cache import DEFAULT_KV_TYPE

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
    check_lora_limits(args)
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
    sleep_s = getattr(args, "sleep_idle_seconds", None)
    if sleep_s is not None and sleep_s <= 0:  # llama-server: -1, the default, is off
        sleep_s = None
    return _Flags(
        key, aliases, specs, modules, kv_type, speculative, template_kwargs, pool_tokens, sleep_s
    )


def _load(args: argparse.Namespace, flags: _Flags, progress: bool) -> Model:
    import graftlm
    from graftlm.step.kv_cache import BLOCK

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
        cache_type=flags.kv_type,
        cache_blocks=None if args.kv_memory else -(-flags.pool_tokens // BLOCK) + 1,
        cache_bytes=args.kv_memory,
        prefix_cache=args.cache_prompt,
        speculative=flags.speculative,
        draft_model=args.model_draft,
    )
    m.prompter.template_kwargs = flags.template_kwargs
    m.engine.context_shift = args.context_shift
    if args.batch_size is not None:  # llama-server's -b: the prompt tokens a step computes
        m.engine.chunk = args.batch_size
    return m


def _print_loaded(model: Model, args: argparse.Namespace, kv_type: str, t0: float) -> None:
    """What loaded, in how long, what serves, and the KV cache (stderr)."""
    from graftlm.commands import warn_if_slow

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


def _server_config(args: argparse.Namespace, model: Model, flags: _Flags) -> ServerConfig:
    from graftlm.commands.serve_options import http_config
    from graftlm.server.state import ServerConfig

    cache = model.engine.cache
    aliases = flags.aliases
    return ServerConfig(
        # as llama-server: of several aliases the first in sorting order names the model
        model_name=sorted(aliases)[0] if aliases else model.path.name,
        aliases=aliases,
        verbose=args.log_level == "debug",
        api_key=flags.api_key,
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
        write_timeout=args.timeout,
        lora_dirs=tuple(Path(d).resolve() for d in (args.lora_dir or ["."])),
        n_ctx_pool=(cache.n_blocks - 1) * cache.block,
        reasoning_format=args.reasoning_format,
        **http_config(args),
    )


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
