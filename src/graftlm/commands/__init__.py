"""The subcommands of `graftlm`, one module each, and the flags they share."""

from __future__ import annotations

import argparse


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """`--device` for the subcommands that load a model (checked when it loads)."""
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: cpu (default: quantized weights, native kernels), cuda or "
        "cuda:N (dense bfloat16 weights on the GPU, plain PyTorch)",
    )
