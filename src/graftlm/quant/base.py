"""The kernel interface every weight storage implements, and helpers they share."""

from __future__ import annotations

import mmap
import warnings
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from graftlm.hugepages import libc_madvise
from graftlm.quant import config

ArrayLike = np.ndarray | torch.Tensor
QType = GGMLQuantizationType
Shape = tuple[int, int]  # (n_out, n_in), torch order
Pair = tuple[torch.Tensor, torch.Tensor]


def row_bytes(qtype: GGMLQuantizationType, n_in: int) -> int:
    """Bytes of one row of ``n_in`` values of ``qtype`` in a GGUF file."""
    block, size = GGML_QUANT_SIZES[qtype]
    if n_in % block:
        raise ValueError(f"{qtype.name} rows need a multiple of {block} values, got {n_in}")
    return n_in // block * size


def as_bytes(data: ArrayLike) -> torch.Tensor:
    """Any numpy array / CPU tensor -> flat uint8 tensor over the same memory (no copy if it can).

    GGUF memory maps are read-only; torch warns about wrapping them, but nothing here ever writes
    through the returned view.
    """
    if isinstance(data, torch.Tensor):
        return data.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    arr = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def byte_rows(data: ArrayLike, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> torch.Tensor:
    """A 2-D GGUF tensor's bytes as (n_out, row_bytes) uint8, zero-copy over ``data``."""
    n_out, n_in = shape
    flat = as_bytes(data)
    rb = row_bytes(qtype, n_in)
    if flat.numel() != n_out * rb:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {n_out * rb} bytes, got {flat.numel()}"
        )
    return flat.view(n_out, rb)


_MADVISE = libc_madvise()


def release_pages(data: ArrayLike) -> int:
    """Drop this process's resident pages under ``data`` if it is a read-only file mapping.

    Only an ``np.memmap`` opened with mode "r" qualifies (GGUFReader's): its pages are clean and
    file-backed, so MADV_DONTNEED just unmaps them and any later read faults them back in from
    the page cache.  Anything else (heap arrays, copy-on-write maps, tensors) is left alone.
    Returns the number of bytes released (0 when nothing was done).
    """
    if _MADVISE is None or not isinstance(data, np.memmap) or getattr(data, "mode", None) != "r":
        return 0
    if getattr(data, "_mmap", None) is None or not data.flags.c_contiguous:
        return 0
    page = mmap.PAGESIZE
    start = -(-data.ctypes.data // page) * page  # whole pages inside the tensor only
    stop = (data.ctypes.data + data.nbytes) // page * page
    if stop <= start or _MADVISE(start, stop - start, mmap.MADV_DONTNEED) != 0:
        return 0
    return stop - start


class Kernel(ABC):
    """Storage of one 2-D weight (n_out, n_in) plus the matmul that reads it.

    Subclasses keep the weight compact and implement ``dequantize_rows`` exactly (bit-equal to
    ``gguf.quants.dequantize``); ``reference_matmul`` built on it is every fast path's twin.
    """

    name: str
    row_multiple: ClassVar[int] = 1  # float32 chunks start at multiples of this row count
    keeps_source: bool = False  # whether it holds views of the GGUF bytes (an instance may say)
    # whether the fast product rounds x (int8 per 32 values: the native integer products), so an
    # adapter's fast form on the same projection may round too (lora.packed's compact form)
    rounds_x: ClassVar[bool] = False

    def __init__(self, shape: tuple[int, int]) -> None:
        self.shape = shape

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        """Whether this kernel can hold a ``qtype`` weight of this shape."""
        return True

    @classmethod
    @abstractmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        """raw: (n_out, row_bytes) uint8 GGUF bytes (may be a read-only memory map view)."""

    @abstractmethod
    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """x (M, n_in) float32, contiguous -> (M, n_out) float32 = x @ W.T. exact: through float32
        dequantization and a float32 GEMM (no fused kernel, no rounding of x)."""

    def native(self) -> Any:
        """The weight as graftlm's native projection and layer calls read it (a gl_weight
        struct), or None for a kernel they do not know."""
        return None

    @abstractmethod
    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of W as float32 (stop - start, n_in), bit-exact with gguf."""

    @abstractmethod
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] as float32 (len(ids), n_in), dequantizing only those rows."""

    @abstractmethod
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor this kernel keeps alive (for nbytes)."""

    def reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The slow twin of ``matmul``. Semantics: y = x @ dequantize_rows(0, n_out).T (float32)."""
        return F.linear(x, self.dequantize_rows(0, self.shape[0]))

    def chunked_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 path: dequantize CHUNK_ELEMS-sized row chunks, float32 GEMM each.

        Semantics: y[:, r0:r1] = x @ dequantize_rows(r0, r1).T for consecutive chunks.
        """
        n_out, n_in = self.shape
        step = config.chunk_rows(n_in, self.row_multiple)
        if step >= n_out:
            return F.linear(x, self.dequantize_rows(0, n_out))
        y = x.new_empty(x.shape[0], n_out)
        for r0 in range(0, n_out, step):
            r1 = min(n_out, r0 + step)
            y[:, r0:r1] = F.linear(x, self.dequantize_rows(r0, r1))
        return y
