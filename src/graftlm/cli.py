"""The `graftlm` command: one entry point, subcommands imported lazily."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from graftlm.errors import GraftError


def _run(args: argparse.Namespace) -> int:
    from graftlm.commands.run import run

    return run(args)


def _inspect(args: argparse.Namespace) -> int:
    from graftlm.commands.inspect import inspect

    return inspect(args)


def build_parser() -> argparse.ArgumentParser:
    from graftlm.lora.cli_args import add_lora_arguments

    parser = argparse.ArgumentParser(
        prog="graftlm", description="GGUF language models with LoRA adapters mounted at runtime"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="generate text from a prompt, or chat (-cnv)")
    r.add_argument("-m", "--model", default=None, help="GGUF model (default: embedded SmolLM2-135M-Instruct)")
    r.add_argument("-p", "--prompt", default=None)
    r.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    r.add_argument("-n", "--n-predict", type=int, default=-1, help="tokens to generate (-1: until end)")
    r.add_argument("-c", "--ctx-size", type=int, default=4096)
    r.add_argument("-t", "--threads", type=int, default=None)
    r.add_argument("--temp", type=float, default=0.8)
    r.add_argument("--top-k", type=int, default=40)
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--min-p", type=float, default=0.05)
    r.add_argument("--repeat-penalty", type=float, default=1.0)
    r.add_argument("--repeat-last-n", type=int, default=64)
    r.add_argument("--presence-penalty", type=float, default=0.0)
    r.add_argument("--frequency-penalty", type=float, default=0.0)
    r.add_argument("-s", "--seed", type=int, default=-1, help="-1: random")
    r.add_argument("-cnv", "--conversation", action="store_true", help="interactive chat")
    r.add_argument("-sys", "--system-prompt", default=None)
    r.add_argument("--reference", action="store_true", help="float32 reference path (slow)")
    add_lora_arguments(r)
    r.set_defaults(func=_run)

    i = sub.add_parser("inspect", help="metadata and tensor table of a GGUF file (model or adapter)")
    i.add_argument("file")
    i.add_argument("--all", action="store_true", help="print long arrays in full")
    i.set_defaults(func=_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except GraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # argument values (e.g. --lora-scaled) checked after parsing
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
