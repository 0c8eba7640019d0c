"""A typed, memory-mapped view of a GGUF file.

Dimensions are reversed from GGML order (ne[0] fastest) to torch order (rows first) here, in one
place: everything above this module speaks torch shapes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from graftlm.errors import ModelFileError
from graftlm.gguf.parse import GGUFFormatError, parse_gguf
from graftlm.gguf.spec import ADAPTER, Metadata

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file: its raw bytes (a view of the memory map) and its torch shape."""

    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: GGML ne reversed
    data: np.ndarray  # raw block bytes (uint8) or a typed array for float types

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """Metadata and tensors of one GGUF file, memory-mapped; nothing is read until used."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.metadata, tensors = _parse(self.path)
        # each key's GGUF value type (and an array's element type): what copying needs
        self.value_types: dict[str, tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]] = (
            self.metadata.types
        )
        if self.file_type == "adapter":
            # (a model's keys are checked where they are read, after their values: config,
            # vocab; an adapter's reader names a string or an array where a number belongs)
            refusal = self.metadata.type_refusal(ADAPTER, numbers_only=True)
            if refusal:
                raise ModelFileError(f"{self.path}: {refusal}")
        self.tensors: dict[str, TensorEntry] = {}
        for name, qtype, ne, data in tensors:
            self.tensors[name] = TensorEntry(name, qtype, tuple(int(d) for d in reversed(ne)), data)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    @property
    def file_type(self) -> str:
        """`general.type`: "model" or "adapter" (older files lack it; they are models)."""
        kind = self.metadata.get("general.type", "model")
        return kind if isinstance(kind, str) else "model"

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def _parse(path: Path) -> tuple[Metadata, list[Any]]:
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    if not path.is_file():  # a FIFO or a device would block the read, or never end
        raise ModelFileError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:  # (the bytes it has are not quoted: they may be a secret's)
        raise ModelFileError(f"{path}: not a GGUF file (no GGUF magic at its start)")
    try:
        return parse_gguf(path)
    except (GGUFFormatError, ValueError, OSError, UnicodeDecodeError) as exc:
        size = path.stat().st_size
        raise ModelFileError(
            f"{path}: truncated or corrupt GGUF file ({size} bytes): {exc}"
        ) from exc
