"""A fast GGUF header parser: metadata as Python values, tensors as memory-map views.

gguf.GGUFReader builds a numpy memmap for every part of every field, which takes ~50 s for
gemma-3's 262k-token vocabulary on this machine; this parser reads the same header in well under
a second. Types and layouts come from the gguf package (GGMLQuantizationType, GGML_QUANT_SIZES,
GGUFValueType); only the walk over the header is ours.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

V = gguf.GGUFValueType
_SCALAR = {
    V.UINT8: ("<B", 1),
    V.INT8: ("<b", 1),
    V.UINT16: ("<H", 2),
    V.INT16: ("<h", 2),
    V.UINT32: ("<I", 4),
    V.INT32: ("<i", 4),
    V.FLOAT32: ("<f", 4),
    V.BOOL: ("<?", 1),
    V.UINT64: ("<Q", 8),
    V.INT64: ("<q", 8),
    V.FLOAT64: ("<d", 8),
}
_NP = {
    V.UINT8: np.uint8,
    V.INT8: np.int8,
    V.UINT16: np.uint16,
    V.INT16: np.int16,
    V.UINT32: np.uint32,
    V.INT32: np.int32,
    V.FLOAT32: np.float32,
    V.BOOL: np.bool_,
    V.UINT64: np.uint64,
    V.INT64: np.int64,
    V.FLOAT64: np.float64,
}
_FLOAT_NP = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    pass


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(f"unexpected end of file at byte {self.pos} (needed {n} more)")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def unpack(self, fmt: str, size: int) -> Any:
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("<Q", 8)
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        t = V(vtype)
        if t in _SCALAR:
            fmt, size = _SCALAR[t]
            return self.unpack(fmt, size)
        if t == V.STRING:
            return self.string()
        if t == V.ARRAY:
            etype = V(self.unpack("<I", 4))
            n = self.unpack("<Q", 8)
            if etype in _NP:
                dt = np.dtype(_NP[etype]).newbyteorder("<")
                return np.frombuffer(self.take(n * dt.itemsize), dtype=dt).tolist()
            if etype == V.STRING:
                out = []
                buf, pos = self.buf, self.pos
                for _ in range(n):
                    (ln,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8
                    out.append(bytes(buf[pos : pos + ln]).decode("utf-8", errors="replace"))
                    pos += ln
                if pos > len(buf):
                    raise GGUFFormatError("unexpected end of file in a string array")
                self.pos = pos
                return out
            return [self.value(etype) for _ in range(n)]
        raise GGUFFormatError(f"unknown metadata value type {vtype}")


def parse_gguf(
    path: Path,
) -> tuple[
    dict[str, Any], list[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...], np.ndarray]]
]:
    """Metadata and (name, type, ne, data) per tensor; data is a read-only view of a memory map."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = memoryview(mm)
    c = _Cursor(buf)
    if bytes(c.take(4)) != b"GGUF":
        raise GGUFFormatError("bad magic")
    version = c.unpack("<I", 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors = c.unpack("<Q", 8)
    n_kv = c.unpack("<Q", 8)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.unpack("<I", 4))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.unpack("<I", 4)
        ne = tuple(c.unpack("<Q", 8) for _ in range(n_dims))
        try:
            qtype = gguf.GGMLQuantizationType(c.unpack("<I", 4))
        except ValueError as exc:
            raise GGUFFormatError(f"tensor {name!r}: {exc}") from None
        offset = c.unpack("<Q", 8)
        infos.append((name, qtype, ne, offset))
    align = int(meta.get("general.alignment", 32))
    start = (c.pos + align - 1) // align * align
    # np.memmap (not frombuffer): kernels that repack a tensor can then tell the pages are clean
    # file-backed ones and drop them from this process's resident set
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, qtype, ne, offset in infos:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(ne)) if ne else 1
        nbytes = n // block * type_size
        begin = start + offset
        if begin + nbytes > len(raw):
            raise GGUFFormatError(
                f"tensor {name!r} needs bytes {begin}..{begin + nbytes} but the file has {len(raw)}"
            )
        data = raw[begin : begin + nbytes]
        rows = list(reversed(ne))
        if qtype in _FLOAT_NP:
            data = data.view(_FLOAT_NP[qtype]).reshape(rows)
        elif qtype == gguf.GGMLQuantizationType.BF16:
            data = data.view(np.uint16).reshape(rows)
        else:
            rows[-1] = rows[-1] // block * type_size
            data = data.reshape(rows)
        tensors.append((name, qtype, ne, data))
    return meta, tensors
