"""The `graftlm` command: one entry point, subcommands imported lazily."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from graftlm.errors import GraftError

if TYPE_CHECKING:  # what add_subparsers returns (argparse's own, private, name for it)
    _Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _run(args: argparse.Namespace) -> int:
    from graftlm.commands.run import run

    return run(args)


def _inspect(args: argparse.Namespace) -> int:
    from graftlm.commands.inspect import inspect

    return inspect(args)


def _serve(args: argparse.Namespace) -> int:
    from graftlm.commands.serve import serve

    return serve(args)


def _ray_serve(args: argparse.Namespace) -> int:
    from graftlm.commands.ray_serve import ray_serve

    return ray_serve(args)


def _convert_lora(args: argparse.Namespace) -> int:
    from graftlm.lora.convert import gguf_to_peft, peft_to_gguf

    if args.to_peft:
        notes = gguf_to_peft(args.input, args.base, args.outfile)
    else:
        if not args.base:
            raise GraftError(
                "convert-lora: --base MODEL.gguf is required to convert a PEFT directory"
            )
        notes = peft_to_gguf(args.input, args.base, args.outfile, args.outtype)
    for note in notes:
        print(note)  # the last says what was written
    return 0


def _export_lora(args: argparse.Namespace) -> int:
    from graftlm.commands.lora_args import lora_specs
    from graftlm.lora.export import export_lora

    specs = lora_specs(args.lora, args.lora_scaled)
    if not specs:
        raise GraftError("export-lora: give at least one adapter with --lora or --lora-scaled")
    notes = export_lora(
        args.model, [(s.path, s.scale) for s in specs], args.output, args.outtype, progress=True
    )
    for note in notes:
        print(note)  # the last says what was written
    return 0


def _bench(args: argparse.Namespace) -> int:
    from graftlm.commands.bench import bench
    from graftlm.commands.llama_flags import check_llama_flags

    check_llama_flags(args)

    return bench(args)


def build_parser() -> argparse.ArgumentParser:
    from graftlm.commands.llama_flags import VersionAction

    parser = argparse.ArgumentParser(
        prog="graftlm", description="GGUF language models with LoRA adapters mounted at runtime"
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_inspect(sub)
    _add_serve(sub)
    _add_convert_lora(sub)
    _add_export_lora(sub)
    _add_bench(sub)
    return parser


def _add_run(sub: _Subparsers) -> None:
    from graftlm.commands import add_chat_template_arguments, add_device_argument
    from graftlm.commands.llama_flags import VersionAction, add_llama_flags
    from graftlm.commands.lora_args import add_lora_arguments
    from graftlm.commands.spec_args import add_spec_arguments

    r = sub.add_parser("run", help="generate text from a prompt, or chat (-cnv)")
    r.add_argument(
        "-m", "--model", default=None, help="GGUF model (default: embedded SmolLM2-135M-Instruct)"
    )
    r.add_argument("-p", "--prompt", default=None)
    r.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    r.add_argument(
        "-n", "--n-predict", type=int, default=-1, help="tokens to generate (-1: until end)"
    )
    r.add_argument("-c", "--ctx-size", type=int, default=4096)
    r.add_argument("-t", "--threads", type=int, default=None)
    _add_run_sampling(r)
    _add_run_conversation(r)
    r.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens"
    )
    r.add_argument("--version", action=VersionAction)
    r.add_argument("-sys", "--system-prompt", default=None)
    r.add_argument("--reference", action="store_true", help="float32 reference path (slow)")
    add_device_argument(r)
    add_chat_template_arguments(r)
    add_lora_arguments(r)
    add_llama_flags(r)
    add_spec_arguments(r)
    r.set_defaults(func=_run)


def _add_run_sampling(r: argparse.ArgumentParser) -> None:
    """llama-cli's sampling flags, with its defaults."""
    r.add_argument("--temp", type=float, default=0.8)
    r.add_argument("--top-k", type=int, default=40)
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--min-p", type=float, default=0.05)
    r.add_argument("--repeat-penalty", type=float, default=1.0)
    r.add_argument("--repeat-last-n", type=int, default=64)
    r.add_argument("--presence-penalty", type=float, default=0.0)
    r.add_argument("--frequency-penalty", type=float, default=0.0)
    r.add_argument("-s", "--seed", type=int, default=-1, help="-1: random")


def _add_run_conversation(r: argparse.ArgumentParser) -> None:
    r.add_argument(
        "-cnv",
        "--conversation",
        action="store_true",
        help="interactive chat (/help inside lists its commands)",
    )
    r.add_argument(
        "-no-cnv",
        "--no-conversation",
        dest="conversation",
        action="store_false",
        help="complete the prompt (the default)",
    )
    r.add_argument(
        "--reasoning-format",
        choices=("none", "deepseek", "deepseek-legacy", "auto"),  # runtime/reasoning.py's
        default="auto",
        help="-cnv: how a reply's reasoning (gpt-oss's analysis, a <think> block) is shown, as "
        "llama-cli shows it: auto and deepseek apart, between [Start thinking] and [End "
        "thinking], and not kept in the conversation; deepseek-legacy in the reply between "
        "<think> tags; none unparsed, as llama-server's none (gpt-oss's analysis with its tags)",
    )


def _add_inspect(sub: _Subparsers) -> None:
    i = sub.add_parser(
        "inspect", help="metadata and tensor table of a GGUF file (model or adapter)"
    )
    i.add_argument("file")
    i.add_argument("--all", action="store_true", help="print long arrays in full")
    i.set_defaults(func=_inspect)


def _add_serve(sub: _Subparsers) -> None:
    """`serve` and `ray-serve` (the same flags, and Ray's)."""
    from graftlm.commands.ray_serve import add_ray_serve_arguments
    from graftlm.commands.serve_args import add_serve_arguments

    s = sub.add_parser(
        "serve", help="OpenAI- and llama-server-compatible HTTP server with LoRA adapters"
    )
    add_serve_arguments(s)
    s.set_defaults(func=_serve)

    rs = sub.add_parser("ray-serve", help="`serve` as replicas on Ray Serve, routed by adapter")
    add_ray_serve_arguments(rs)
    rs.set_defaults(func=_ray_serve)


def _add_convert_lora(sub: _Subparsers) -> None:
    c = sub.add_parser("convert-lora", help="PEFT directory <-> llama.cpp GGUF LoRA adapter")
    c.add_argument("input", help="PEFT directory, or with --to-peft a GGUF adapter")
    c.add_argument(
        "--base",
        help="base model GGUF (needed for PEFT -> GGUF, and for gpt-oss expert adapters to PEFT)",
    )
    c.add_argument("-o", "--outfile", required=True)
    c.add_argument(
        "--outtype",
        choices=["f32", "f16", "bf16", "q8_0"],
        default="f32",
        help="the GGUF adapter's tensor type (default f32)",
    )
    c.add_argument("--to-peft", action="store_true", help="GGUF adapter -> PEFT directory")
    c.set_defaults(func=_convert_lora)


def _add_export_lora(sub: _Subparsers) -> None:
    from graftlm.commands.lora_args import add_lora_arguments

    e = sub.add_parser(
        "export-lora", help="merge LoRA adapters into a base GGUF (llama-export-lora)"
    )
    e.add_argument("-m", "--model", required=True)
    e.add_argument("-o", "--output", required=True)
    e.add_argument(
        "--outtype",
        choices=["f16", "f32", "q8_0", "same"],
        default="f16",
        help="the merged weights' type (default f16, as llama-export-lora; same: each base "
        "weight's own type where it can be written, else f16)",
    )
    add_lora_arguments(e)
    e.set_defaults(func=_export_lora)


def _add_bench(sub: _Subparsers) -> None:
    from graftlm.commands import add_device_argument
    from graftlm.commands.llama_flags import add_llama_flags
    from graftlm.commands.lora_args import add_lora_arguments

    b = sub.add_parser("bench", help="prompt and generation speed (llama-bench style)")
    b.add_argument("-m", "--model", default=None)
    b.add_argument("-p", "--n-prompt", type=int, nargs="+", default=[512], help="prompt lengths")
    b.add_argument("-n", "--n-gen", type=int, nargs="+", default=[128], help="generation lengths")
    b.add_argument(
        "-d",
        "--n-depth",
        type=int,
        nargs="+",
        default=[0],
        help="tokens already in the context before each test (llama-bench's -d)",
    )
    b.add_argument("-t", "--threads", type=int, default=None)
    b.add_argument("-r", "--repetitions", type=int, default=3)
    add_device_argument(b)
    b.add_argument(
        "--no-llama-cpp", action="store_true", help="do not run llama-cpp-python even if installed"
    )
    add_lora_arguments(b)
    add_llama_flags(b)  # llama-bench's -ngl, -fa, -b, -ub, -ctk, -ctv: never read as -n or -p
    b.set_defaults(func=_bench)


def _unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """Exit naming the arguments the command does not take, with its usage and the flags
    closest to each unknown one (`run --tmep 0`: did you mean --temp?)."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        args.command
    ]
    flags = [o for a in sub._actions for o in a.option_strings]
    hints = []
    for word in extra:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=3, cutoff=0.6)
            if close:
                hints.append(f"{word}: did you mean {' or '.join(close)}?")
    sub.error(f"unrecognized arguments: {' '.join(extra)}" + "".join(f"\n  {h}" for h in hints))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown(parser, args, extra)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        rc = func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return rc
    except GraftError as exc:
        from graftlm.commands import short_error

        print(f"error: {short_error(str(exc))}", file=sys.stderr)
        return 1
    except ValueError as exc:  # argument values (e.g. --lora-scaled) checked after parsing
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`graftlm inspect FILE | head`): not an error
        import os

        # what is still buffered for the closed pipe goes nowhere at exit (Python's advice)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # files the user named: unwritable output folder, full disk, ...
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
