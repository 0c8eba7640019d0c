"""The subcommands of `graftlm`, one module each, and the flags they share."""

from __future__ import annotations

import argparse


def _device(value: str) -> str:
    """A --device value that can run a model: "meta" (which holds no data) is for tests of
    placement only; whether a CUDA device is present is checked when the model loads."""
    if value.split(":")[0] == "meta":
        raise argparse.ArgumentTypeError(
            "'meta' holds no data and cannot generate; use cpu, cuda or cuda:N"
        )
    return value


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """`--device` for the subcommands that load a model (checked when it loads)."""
    p.add_argument(
        "--device",
        default="cpu",
        type=_device,
        help="where the model runs: cpu (default: quantized weights, native kernels), cuda or "
        "cuda:N (dense bfloat16 weights on the GPU, plain PyTorch)",
    )


def add_chat_template_arguments(p: argparse.ArgumentParser) -> None:
    """llama-server's `--chat-template NAME` and `--chat-template-file FILE`."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME",
        help="use this chat template in place of the model's own: chatml (with tools, "
        "Hermes form), llama3 (with tools), gemma, phi3, mistral, or the Jinja text itself",
    )
    g.add_argument(
        "--chat-template-file", default=None, metavar="FILE", help="a Jinja chat template file"
    )
