"""`graftlm inspect FILE`: what a GGUF file holds."""

from __future__ import annotations

import argparse
from typing import Any

from graftlm.gguf import GGUFFile


def _short(v: Any, full: bool) -> str:
    if isinstance(v, list) and not full and len(v) > 8:
        head = ", ".join(repr(x) for x in v[:5])
        return f"[{head}, ...] ({len(v)} items)"
    s = repr(v)
    if not full and len(s) > 120:
        s = s[:117] + "..."
    return s


def inspect(args: argparse.Namespace) -> int:
    f = GGUFFile(args.file)
    print(
        f"{f.path}: {f.file_type}, architecture {f.architecture}, {len(f.tensors)} tensors, {f.size:,} bytes"
    )
    print("\nmetadata:")
    for k, v in f.metadata.items():
        print(f"  {k} = {_short(v, args.all)}")
    print("\ntensors:")
    width = max((len(n) for n in f.tensors), default=4)
    print(f"  {'name':<{width}}  {'type':<6}  shape (torch order)   ne (GGML order)")
    for t in f.tensors.values():
        shape = "x".join(str(d) for d in t.shape)
        ne = ", ".join(str(d) for d in reversed(t.shape))
        print(f"  {t.name:<{width}}  {t.type_name:<6}  {shape:<20}  [{ne}]")
    return 0
