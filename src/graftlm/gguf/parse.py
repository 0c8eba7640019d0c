"""A fast GGUF header parser: metadata as Python values, tensors as memory-map views.

gguf.GGUFReader builds a numpy memmap for every part of every field, which takes ~50 s for
gemma-3's 262k-token vocabulary on this machine; this parser reads the same header in well under
a second. Types and layouts come from the gguf package (GGMLQuantizationType, GGML_QUANT_SIZES,
GGUFValueType); only the walk over the header is ours.

The file is untrusted: every count and length is checked against the bytes left before anything
is allocated from it, nesting is bounded, keys and tensor names are unique, the alignment is a
power of two, and every tensor's data is whole blocks inside the file, laid out as llama.cpp
lays it (in order, each where the one before ends). Any failure is a GGUFFormatError naming the field or tensor and what was expected.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from graftlm.gguf.spec import GENERAL, Metadata, type_problem

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


MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DEPTH = 8  # arrays of arrays: deeper nesting is refused (llama.cpp reads none at all)
# What a model can use, far past any real one (gemma's 262,144 tokens, a few MB of template):
# a sparse file can hold any declared size, and 9e9 entries made a list that never finished.
MAX_ARRAY = 1 << 24  # entries of one metadata array
MAX_STRING = 1 << 26  # bytes of one metadata string
# strings and arrays in all of the header's arrays, each a Python object made one at a time
# (16M empty strings, their lengths a hole in a sparse file, took 12 s to read): a tokenizer's
# tokens and merges are under a million
MAX_ITEMS = 1 << 21
_MIN_SIZE = {**{t: size for t, (_, size) in _SCALAR.items()}, V.STRING: 8, V.ARRAY: 12}


class GGUFFormatError(ValueError):
    pass


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0
        self.items = 0  # strings and arrays read from arrays so far (MAX_ITEMS)

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int) -> memoryview:
        if n < 0 or n > self.left:
            raise GGUFFormatError(
                f"unexpected end of file at byte {self.pos}: needed {n} more, {self.left} left"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, size: int) -> Any:
        return struct.unpack(fmt, self.take(size))[0]

    def count(self, what: str, min_size: int) -> int:
        """A uint64 count of items of at least min_size bytes each, checked against the bytes
        left (so nothing is allocated from a count the file cannot hold)."""
        n = self.unpack("<Q", 8)
        if n * max(min_size, 1) > self.left:
            raise GGUFFormatError(
                f"{what}: declares {n} entries of at least {min_size} bytes at byte {self.pos}, "
                f"but only {self.left} bytes are left"
            )
        return int(n)

    def string(self, what: str = "string") -> str:
        n = self.count(what, 1)
        if n > MAX_STRING:
            raise GGUFFormatError(f"{what}: a string of {n} bytes, past the limit of {MAX_STRING}")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        try:
            t = V(vtype)
        except ValueError:
            raise GGUFFormatError(f"{what}: unknown metadata value type {vtype}") from None
        if t in _SCALAR:
            fmt, size = _SCALAR[t]
            return self.unpack(fmt, size)
        if t == V.STRING:
            return self.string(what)
        assert t == V.ARRAY
        if depth >= MAX_DEPTH:
            raise GGUFFormatError(f"{what}: arrays nested deeper than {MAX_DEPTH}")
        raw_type = self.unpack("<I", 4)
        try:
            etype = V(raw_type)
        except ValueError:
            raise GGUFFormatError(f"{what}: unknown array element type {raw_type}") from None
        n = self.count(what, _MIN_SIZE[etype])
        if n > MAX_ARRAY:
            raise GGUFFormatError(
                f"{what}: an array of {n} entries, past the limit of {MAX_ARRAY} (no model has one)"
            )
        if etype in _NP:
            dt = np.dtype(_NP[etype]).newbyteorder("<")
            return np.frombuffer(self.take(n * dt.itemsize), dtype=dt).tolist()
        self.items += n
        if self.items > MAX_ITEMS:
            raise GGUFFormatError(
                f"{what}: {n} strings or arrays, past the limit of {MAX_ITEMS} in all of the "
                "metadata's arrays (no model has as many)"
            )
        if etype == V.STRING:
            out = []
            buf, pos, end = self.buf, self.pos, len(self.buf)
            for i in range(n):
                if pos + 8 > end:
                    raise GGUFFormatError(f"{what}: string {i} of {n} runs past the end of file")
                (ln,) = struct.unpack_from("<Q", buf, pos)
                pos += 8
                if ln > MAX_STRING:
                    raise GGUFFormatError(
                        f"{what}: string {i} of {n} declares {ln} bytes, past the limit of "
                        f"{MAX_STRING}"
                    )
                if ln > end - pos:
                    raise GGUFFormatError(
                        f"{what}: string {i} of {n} declares {ln} bytes, {end - pos} are left"
                    )
                out.append(bytes(buf[pos : pos + ln]).decode("utf-8", errors="replace"))
                pos += ln
            self.pos = pos
            return out
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(n)]


def parse_gguf(
    path: Path,
) -> tuple[Metadata, list[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...], np.ndarray]]]:
    """Metadata and (name, type, ne, data) per tensor; data is a read-only view of a memory map.
    The metadata keeps each key's GGUF value type (and an array's element type) in `.types`,
    which Python values lose (an int may have been UINT32 or INT64): what a writer needs to copy
    the metadata as it was, and what the loaders check against the spec (graftlm.gguf.spec)."""
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
    n_kv = c.count("metadata", 8 + 4 + 1)  # key length, value type, the smallest value
    if n_tensors * (8 + 4 + 4 + 8) > c.left:  # name length, n_dims, type, offset
        raise GGUFFormatError(
            f"the header declares {n_tensors} tensors; {c.left} bytes cannot describe them"
        )
    meta = Metadata()
    for _ in range(n_kv):
        key = c.string("a metadata key")
        if key in meta:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        vtype = c.unpack("<I", 4)
        element = (
            struct.unpack_from("<I", c.buf, c.pos)[0] if vtype == V.ARRAY and c.left >= 4 else None
        )
        meta[key] = c.value(vtype, f"metadata {key!r}")
        meta.types[key] = (V(vtype), None if element is None else V(element))
    infos = _tensor_infos(c, n_tensors)
    names = [i[0] for i in infos]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise GGUFFormatError(f"tensor names appear twice: {twice[:5]}")
    align = _alignment(meta)
    start = (c.pos + align - 1) // align * align
    # np.memmap (not frombuffer): kernels that repack a tensor can then tell the pages are clean
    # file-backed ones and drop them from this process's resident set
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    spans = []
    tensors = []
    for name, qtype, ne, offset in infos:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if ne and ne[0] % block:
            raise GGUFFormatError(
                f"tensor {name!r}: {qtype.name} rows are blocks of {block} values, but ne[0] = "
                f"{ne[0]} (shape ne = {list(ne)})"
            )
        n = math.prod(ne) if ne else 1
        nbytes = n // block * type_size
        begin = start + offset
        if begin + nbytes > len(raw):
            raise GGUFFormatError(
                f"tensor {name!r} ({qtype.name}, ne = {list(ne)}) needs bytes "
                f"{begin}..{begin + nbytes} but the file has {len(raw)}"
            )
        spans.append((name, offset, nbytes))
        data: np.ndarray = raw[begin : begin + nbytes]
        rows = list(reversed(ne))
        if qtype in _FLOAT_NP:
            data = data.view(_FLOAT_NP[qtype]).reshape(rows)
        elif qtype == gguf.GGMLQuantizationType.BF16:
            data = data.view(np.uint16).reshape(rows)
        else:
            rows[-1] = rows[-1] // block * type_size
            data = data.reshape(rows)
        tensors.append((name, qtype, ne, data))
    _check_layout(spans, align)
    return meta, tensors


_QTYPES = {int(t): t for t in gguf.GGMLQuantizationType if t in gguf.GGML_QUANT_SIZES}


def _tensor_infos(
    c: _Cursor, n: int
) -> list[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...], int]]:
    """n tensor infos from the cursor, as _tensor_info reads them one by one: a tensor whose info
    passes every check at a glance is read in a few struct calls (an adapter's hundred tensors
    are most of its header); from the first that does not, _tensor_info reads on and names what
    is wrong, as it always did."""
    out: list[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...], int]] = []
    buf, pos, end = c.buf, c.pos, len(c.buf)
    unpack_from, qtypes = struct.unpack_from, _QTYPES
    while len(out) < n:
        if pos + 8 > end:
            break
        (ln,) = unpack_from("<Q", buf, pos)
        at = pos + 8 + ln
        if ln > MAX_STRING or at + 4 > end:
            break
        (n_dims,) = unpack_from("<I", buf, at)
        if not 1 <= n_dims <= MAX_DIMS or at + 4 + 8 * n_dims + 12 > end:
            break
        ne = unpack_from(f"<{n_dims}Q", buf, at + 4)
        qtype, offset = unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
        if qtype not in qtypes or math.prod(ne) >= 1 << 62:
            break
        name = bytes(buf[pos + 8 : at]).decode("utf-8", errors="replace")
        out.append((name, qtypes[qtype], ne, offset))
        pos = at + 16 + 8 * n_dims
    c.pos = pos
    out += [_tensor_info(c) for _ in range(n - len(out))]
    return out


def _tensor_info(c: _Cursor) -> tuple[str, gguf.GGMLQuantizationType, tuple[int, ...], int]:
    name = c.string("a tensor name")
    n_dims = c.unpack("<I", 4)
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFFormatError(f"tensor {name!r}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    ne = tuple(int(c.unpack("<Q", 8)) for _ in range(n_dims))
    if math.prod(ne) >= 1 << 62:
        raise GGUFFormatError(f"tensor {name!r}: shape ne = {list(ne)} is too large")
    raw_type = c.unpack("<I", 4)
    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        raise GGUFFormatError(f"tensor {name!r}: unknown tensor type {raw_type}") from None
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise GGUFFormatError(f"tensor {name!r}: tensor type {qtype.name} has no block size")
    return name, qtype, ne, int(c.unpack("<Q", 8))


def _alignment(meta: Metadata) -> int:
    key = "general.alignment"
    align = meta.get(key, 32)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFFormatError(f"metadata {key!r} is {align!r}; it must be a power of two")
    # (gguf.cpp reads it with gguf_get_val_u32, which asserts the type)
    problem = type_problem(key, meta.types[key], GENERAL[key]) if key in meta else None
    if problem:
        raise GGUFFormatError(problem)
    return align


def _check_layout(infos: list[tuple[str, int, int]], align: int) -> None:
    """Tensor data in header order, each starting where the one before ends, padded to the
    alignment (llama.cpp's rule): a type or shape changed in the header, an overlap, a gap or a
    reordering all break it."""
    expected = 0
    for name, offset, nbytes in infos:
        if offset != expected:
            raise GGUFFormatError(
                f"tensor {name!r}: data offset {offset}, expected {expected} (where the previous "
                f"tensor's data ends, padded to the alignment {align}): the header's types, "
                "shapes or offsets do not match the data"
            )
        expected = (offset + nbytes + align - 1) // align * align
