"""Which device a model runs on: "cpu" (the product, with its native kernels), "cuda" / "cuda:N"
(dense bfloat16 weights, plain PyTorch), or "meta" (no data: tests check tensor placement on it)."""

from __future__ import annotations

import torch

from graftlm.errors import GraftError

DEVICE_TYPES = ("cpu", "cuda", "meta")


def resolve_device(spec: str | torch.device) -> torch.device:
    """The torch.device for a --device value, checked: GraftError naming the device when it is not
    one graftlm runs on or is not present. A bare "cuda" becomes the current CUDA device, so
    every tensor of the model compares equal to it."""
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise GraftError(
            f"device {str(spec)!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if dev.type not in DEVICE_TYPES:
        raise GraftError(f"device {str(spec)!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = "a CUDA build" if torch.backends.cuda.is_built() else "a CPU-only build"
            raise GraftError(
                f"device {str(spec)!r} was asked for, but CUDA is not available "
                f"(torch {torch.__version__}, {built}); use --device cpu"
            )
        n = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= n:
            raise GraftError(
                f"device {str(spec)!r} was asked for, but there are {n} CUDA device(s) "
                f"(cuda:0..cuda:{n - 1})"
            )
        dev = torch.device("cuda", index)
    return dev
