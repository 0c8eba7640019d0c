"""`graftlm ray-serve`: `graftlm serve` as replicas on Ray Serve, routed by adapter.

Takes every flag of `graftlm serve` (each replica is one such server, `-t` threads each) and
Ray's: how many replicas (or an autoscaling range), and which cluster (`--address`; default a
local one started here). Heavy imports happen only when the command runs.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from graftlm.commands.serve_args import add_serve_arguments, check_lora_limits, parse_lora_modules


def add_ray_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_serve_arguments(p)
    g = p.add_argument_group("Ray Serve")
    g.add_argument(
        "--replicas", type=int, default=2, help="replicas (fixed, or autoscaling's start)"
    )
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale from this many")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=4.0,
        help="autoscaling's target of requests in progress per replica",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=64,
        help="requests one replica takes at once (its engine batches -np of them)",
    )
    g.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to join ('auto': the one `ray start --head` runs here); default: "
        "start a local one",
    )
    g.add_argument(
        "--no-affinity",
        dest="affinity",
        action="store_false",
        help="route requests without their adapter (Serve's default routing): for comparison",
    )


def _replica_args(args: argparse.Namespace) -> argparse.Namespace:
    """The flags as a replica's server takes them: every path absolute (replicas do not run in
    this folder), and --host the proxy's concern: a replica sits behind Serve's proxy, which
    listens on --host (under KubeRay not even that), so its Host check is --allowed-hosts alone
    (without it none), never the loopback names of a server listening on its own."""
    from graftlm.commands.lora_args import lora_specs

    out = copy.copy(args)
    out.host = "0.0.0.0"  # (serve_options.allowed_hosts: a network address, no check unless given)
    if args.model:
        out.model = os.path.abspath(args.model)
    specs = lora_specs(args.lora, args.lora_scaled, args.lora_init_without_apply)
    out.lora, out.lora_init_without_apply = [], False
    out.lora_scaled = [f"{os.path.abspath(s.path)}:{s.scale!r}" for s in specs]
    modules = parse_lora_modules(args.lora_modules)
    out.lora_modules = [[f"{name}={os.path.abspath(path)}" for name, path in modules]]
    out.lora_dir = [os.path.abspath(d) for d in (args.lora_dir or ["."])]
    if args.chat_template_file:
        out.chat_template_file = os.path.abspath(args.chat_template_file)
    return out


def spec_of(args: argparse.Namespace) -> Any:
    """The application's settings from the flags (checked here, before Ray starts)."""
    from graftlm.commands.serve import serving_state
    from graftlm.scaleout.spec import ScaleSpec

    threads = args.threads if args.threads and args.threads > 0 else 1
    check_lora_limits(args)
    spec = ScaleSpec(
        build_state=partial(serving_state, _replica_args(args)),
        threads=threads,
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        max_adapters=args.max_loras or -1,
        max_ongoing_requests=args.max_ongoing_requests,
        affinity=args.affinity,
        api_key=args.api_key,
        max_body_bytes=args.max_body_size,
    )
    spec.replica_options()  # the replica counts, checked now
    return spec


def app_builder(args: dict[str, str]) -> Any:
    """Serve's application builder, for `serve run` and KubeRay's RayService:
    `import_path: graftlm.commands.ray_serve:app_builder`, `args: {flags: "<ray-serve flags>"}`
    (the flags `graftlm ray-serve` takes; --host, --port and --address are Serve's there)."""
    import shlex

    from graftlm.scaleout.deployments import build_app

    parser = argparse.ArgumentParser(prog="graftlm ray-serve")
    add_ray_serve_arguments(parser)
    return build_app(spec_of(parser.parse_args(shlex.split(args.get("flags", "")))))


class _Stopped(Exception):
    """SIGTERM or SIGINT: stop serving."""


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT end the serving wait with `_Stopped`, once; what follows shuts Serve
    and Ray down. Set after `ray.init`, whose own handlers they replace: on SIGTERM those print
    a native stack and abort, and the agents of the Ray instance started here live on."""

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one shutdown (a second TERM: ignored)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends it at once
        raise _Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def ray_serve(args: argparse.Namespace) -> int:
    from graftlm.errors import GraftError

    try:
        import ray
        from ray import serve

        from graftlm.scaleout.deployments import start
    except ImportError as exc:
        raise GraftError(
            f"ray-serve needs the ray extra ({exc.name}): pip install 'graftlm[ray]'"
        ) from None
    from graftlm.commands.llama_flags import check_llama_flags

    check_llama_flags(args, maps_batch=True)
    spec = spec_of(args)
    ray.init(address=args.address, include_dashboard=False, ignore_reinit_error=True)
    _stop_on_signals()
    try:
        url = start(spec, args.host, args.port)
        shape = (
            f"{spec.replicas} replicas"
            if spec.min_replicas is None and spec.max_replicas is None
            else f"{spec.min_replicas or 1}..{spec.max_replicas or spec.replicas} replicas"
        )
        print(
            f"graftlm on Ray Serve at {url}: {shape} of {spec.threads} threads, "
            f"{'up to ' + str(spec.max_adapters) if spec.max_adapters > 0 else 'any number of'} "
            f"adapters each, routing by adapter {'on' if spec.affinity else 'off'}",
            file=sys.stderr,
        )
        while True:
            time.sleep(3600)
    except (_Stopped, KeyboardInterrupt) as why:
        print(f"graftlm on Ray Serve: {why or 'SIGINT'}, shutting down", file=sys.stderr)
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()  # the Ray instance started here, its agents included


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m graftlm.commands.ray_serve ...` (the same as `graftlm ray-serve ...`)."""
    from graftlm.errors import GraftError

    parser = argparse.ArgumentParser(prog="graftlm ray-serve", description=__doc__.splitlines()[0])
    add_ray_serve_arguments(parser)
    try:
        return ray_serve(parser.parse_args(argv))
    except (GraftError, ValueError) as exc:
        from graftlm.commands import short_error

        print(f"error: {short_error(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
