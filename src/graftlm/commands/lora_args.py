"""llama.cpp's adapter flags, parsed in one place for `run`, `serve` and `export-lora`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from graftlm.lora.scales import scale_problem


@dataclass(frozen=True)
class LoraSpec:
    path: str
    scale: float


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FNAME",
        help="LoRA adapter (GGUF file or PEFT directory) at scale 1; comma-separated, repeatable",
    )
    g.add_argument(
        "--lora-scaled",
        action="append",
        default=[],
        metavar="FNAME:SCALE",
        help="LoRA adapter with a scale; comma-separated, repeatable; split on the last colon",
    )
    g.add_argument(
        "--lora-init-without-apply",
        action="store_true",
        help="load every adapter at scale 0 (enable later per request or with POST /lora-adapters)",
    )


def parse_lora_scaled(item: str) -> LoraSpec:
    """'FNAME:SCALE', split on the LAST colon so 'C:/x/a.gguf:0.5' works."""
    path, sep, scale = item.rpartition(":")
    if not sep:
        raise ValueError(f"--lora-scaled {item!r}: expected FNAME:SCALE")
    if not path:
        raise ValueError(f"--lora-scaled {item!r}: the file name is empty")
    try:
        value = float(scale)
    except ValueError:
        raise ValueError(f"--lora-scaled {item!r}: scale {scale!r} is not a number") from None
    problem = scale_problem(value)
    if problem is not None:
        raise ValueError(f"--lora-scaled {item!r}: scale {scale!r} {problem}")
    return LoraSpec(path, value)


def lora_specs(
    lora: list[str], lora_scaled: list[str], init_without_apply: bool = False
) -> list[LoraSpec]:
    """Adapters in id order: every --lora, then every --lora-scaled (llama.cpp's order)."""
    specs: list[LoraSpec] = []
    for group in lora:
        for item in group.split(","):
            if not item:
                raise ValueError(f"--lora {group!r}: empty file name")
            specs.append(LoraSpec(item, 1.0))
    for group in lora_scaled:
        for item in group.split(","):
            specs.append(parse_lora_scaled(item))
    if init_without_apply:
        specs = [LoraSpec(s.path, 0.0) for s in specs]
    return specs
