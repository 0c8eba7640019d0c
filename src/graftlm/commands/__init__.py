"""The subcommands of `graftlm`, one module each, and the flags they share."""

from __future__ import annotations

import argparse

from graftlm.errors import shortened


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


def warn_if_slow(device: str) -> None:
    """One line on stderr where the CPU path runs without its native kernels, naming why."""
    import sys

    from graftlm.native import build

    if device.split(":")[0] != "cpu":
        return
    reason = build.unavailable_reason()
    if reason is not None:
        print(
            f"warning: native kernels are off ({reason}): graftlm runs several times slower "
            "on torch's own kernels",
            file=sys.stderr,
        )


def check_adapters_first(model_path: str | None, adapter_paths: list[str]) -> None:
    """Refuse a GGUF adapter made for another architecture before the base spends its load time
    (AdapterError); everything else is checked when the adapter attaches."""
    from graftlm.errors import GraftError
    from graftlm.gguf import GGUFFile
    from graftlm.lora.gguf_adapter import check_base
    from graftlm.resources import default_model_path

    try:
        base = GGUFFile(model_path or default_model_path())
    except GraftError:
        return  # the load names what is wrong with the model
    for path in adapter_paths:
        check_base(path, base)


SHOWN_PROBLEMS = 2  # an adapter for another base has a problem per tensor: a few tell the story


def short_error(message: str, shown: int = SHOWN_PROBLEMS) -> str:
    """An error for the terminal: `errors.shortened` to its first `shown` problems; the Python
    API keeps them all."""
    return shortened(message, shown)
