"""QWeight: the one matmul seam of the model, and the registry that picks its kernel."""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from graftlm.quant import config
from graftlm.quant.base import ArrayLike, Kernel, as_bytes, byte_rows, release_pages
from graftlm.quant.int4pack import Int4PackKernel
from graftlm.quant.native_kernels import (
    NativeFloatKernel,
    NativeK4Kernel,
    NativeK16Kernel,
    NativeS8Kernel,
    NativeU4Kernel,
)
from graftlm.quant.native_tables import NativeIQKernel, NativeMX4Kernel
from graftlm.quant.torch_kernels import (
    BlockKernel,
    DenseKernel,
    DeviceDenseKernel,
    Int8GroupKernel,
    ReferenceKernel,
)

# Tried in order; the first kernel that accepts (type, shape) holds the weight.  The model never
# looks at quantization types: it only ever calls QWeight.matmul / rows.
FAST_KERNELS: list[type[Kernel]] = [
    NativeFloatKernel,  # accept only where the native library built (AVX2 + a C compiler)
    DenseKernel,
    NativeU4Kernel,
    NativeK4Kernel,
    NativeK16Kernel,
    NativeS8Kernel,
    NativeMX4Kernel,
    NativeIQKernel,
    Int8GroupKernel,
    Int4PackKernel,
    BlockKernel,
]
REFERENCE_KERNELS: list[type[Kernel]] = [ReferenceKernel]


def register_kernel(kernel: type[Kernel], *, first: bool = True) -> None:
    """Add a kernel to the fast registry (ahead of the built-ins unless first=False)."""
    FAST_KERNELS.insert(0 if first else len(FAST_KERNELS) - 1, kernel)


class QWeight:
    """A 2-D weight in torch order (n_out, n_in) = GGUF ne reversed, kept compact.

    The kernel behind it is chosen once, from the GGUF type and shape; see ``kernel``.
    """

    __slots__ = ("_k", "ggml_type", "name")

    def __init__(self, kernel: Kernel, ggml_type: GGMLQuantizationType, name: str = "") -> None:
        self._k = kernel
        self.ggml_type = ggml_type
        self.name = name

    @classmethod
    def from_gguf(
        cls,
        data: ArrayLike,
        ggml_type: GGMLQuantizationType | int,
        shape: tuple[int, int],
        *,
        name: str = "",
        prefer: str = "fast",
    ) -> QWeight:
        """Wrap a GGUF tensor's bytes.

        data: raw bytes as uint8 (or a typed array for F32/F16/BF16, as GGUFReader gives them),
        numpy or CPU torch, usually a zero-copy memory-map view; it may be kept (dense and
        fallback kernels) and is never written.  When the kernel repacks the bytes and the data is
        a read-only np.memmap (GGUFReader's), the pages of this tensor are released from the
        process (madvise DONTNEED: clean file pages, re-read on demand), so resident memory is
        the repacked weights, not those plus the file.  prefer="reference" keeps a float32 copy
        made by ``gguf.quants.dequantize`` instead: the slow oracle.
        """
        qtype = GGMLQuantizationType(ggml_type)
        n_out, n_in = (int(s) for s in shape)
        if prefer not in ("fast", "reference"):
            raise ValueError(f"prefer must be 'fast' or 'reference', not {prefer!r}")
        raw = byte_rows(data, qtype, (n_out, n_in))
        for kind in FAST_KERNELS if prefer == "fast" else REFERENCE_KERNELS:
            if kind.accepts(qtype, (n_out, n_in)):
                kernel = kind.build(raw, qtype, (n_out, n_in))
                if not kernel.keeps_source:
                    release_pages(data)  # the repacked copy replaces the mapped file bytes
                return cls(kernel, qtype, name)
        raise NotImplementedError(f"{name or 'tensor'}: no kernel for GGUF type {qtype.name}")

    @property
    def shape(self) -> tuple[int, int]:
        return self._k.shape

    @property
    def kernel(self) -> str:
        """Which storage/kernel holds this weight, e.g. "int4pack", "int8g", "dense-f32"."""
        return self._k.name

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this weight holds (memory-map views count in full)."""
        return sum(t.nbytes for t in self._k.tensors())

    @property
    def device(self) -> torch.device:
        return self._k.tensors()[0].device

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """x (..., n_in) -> (..., n_out) float32.  Semantics: y = x @ W.T.

        Fast (exact=False): for few rows of x the fused kernels round x (to int8 per 32 values
        in the native ones, ~5e-3 relative error of the output; to bfloat16 in torch's, ~3e-3).
        exact=True: float32 dequantization + float32 GEMM, equal to ``x @ w.dequantize().T`` up
        to float32 summation order. See ``graftlm.quant.config``.
        """
        n_out, n_in = self._k.shape
        if x.dim() == 3 and x.dtype is torch.float32 and x.shape[-1] == n_in and x.is_contiguous():
            b, t, _ = x.shape  # the model's (B, T, n_in): straight to the kernel
            if b * t:
                return self._k.matmul(x.view(b * t, n_in), exact).view(b, t, n_out)
        if x.shape[-1] != n_in:
            raise ValueError(f"{self.name or 'weight'} {self.shape}: x has {x.shape[-1]} features")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, n_in)  # (M, n_in)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if x2.shape[0] == 0:
            return x2.new_zeros(*lead, n_out)
        y = self._k.matmul(x2.contiguous(), exact)
        return y if x.dim() == 2 else y.reshape(*lead, n_out)

    def native(self) -> Any:
        """This weight as the native projection and layer calls read it, or None (see
        Kernel.native)."""
        return self._k.native()

    @property
    def rounds_x(self) -> bool:
        """Whether the fast product rounds x (see Kernel.rounds_x)."""
        return self._k.rounds_x

    def reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The slow twin of ``matmul``: x @ dequantize().T in float32."""
        n_out, n_in = self.shape
        y = self._k.reference_matmul(x.reshape(-1, n_in).to(torch.float32))
        return y.reshape(*x.shape[:-1], n_out)

    def dequantize(self) -> torch.Tensor:
        """float32 (n_out, n_in), bit-exact with gguf.quants.dequantize; a fresh tensor."""
        return self._k.dequantize_rows(0, self.shape[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 (len(ids), n_in) = dequantize()[ids], touching only those rows (embeddings)."""
        ids = ids.reshape(-1).to(torch.long)
        return self._k.rows(ids)

    def to(self, device: torch.device | str) -> QWeight:
        """This weight on ``device``: itself on CPU, a dense bfloat16 copy elsewhere."""
        dev = torch.device(device)
        if dev == self.device:
            return self
        n_out, n_in = self.shape
        w = torch.empty(n_out, n_in, dtype=torch.bfloat16, device=dev)
        step = config.chunk_rows(n_in, self._k.row_multiple)
        for r0 in range(0, n_out, step):  # bounded host memory, whatever the weight's size
            r1 = min(n_out, r0 + step)
            w[r0:r1] = self._k.dequantize_rows(r0, r1).to(dev, torch.bfloat16)
        return QWeight(DeviceDenseKernel(w), self.ggml_type, self.name)

    def __repr__(self) -> str:
        return (
            f"QWeight({self.name!r}, {self.ggml_type.name}, shape={self.shape}, "
            f"kernel={self.kernel!r}, nbytes={self.nbytes})"
        )


def linear(x: torch.Tensor, w: QWeight, exact: bool = False) -> torch.Tensor:
    """The base product of the model's projection seam.  Semantics: y = x @ W.T, float32
    (..., n_out); exact as in QWeight.matmul."""
    return w.matmul(x, exact)


def dequantize_any(
    data: ArrayLike, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...]
) -> torch.Tensor:
    """Any tensor gguf can dequantize (1-D norms, biases, LoRA factors, IQ types, ...) as float32.

    shape is in torch order (GGUF ne reversed).  Always a fresh, writable tensor.
    """
    qtype = GGMLQuantizationType(ggml_type)
    shape = tuple(int(s) for s in shape)
    block, size = GGML_QUANT_SIZES[qtype]
    n_in = shape[-1] if shape else 1
    if n_in % block:
        raise ValueError(f"{qtype.name} rows need a multiple of {block} values, got {n_in}")
    flat = as_bytes(data).numpy()
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    if flat.size != rows * (n_in // block) * size:
        raise ValueError(f"{qtype.name} tensor of shape {shape} does not match {flat.size} bytes")
    out = gguf.quants.dequantize(flat.reshape(rows, -1), qtype)
    if np.may_share_memory(out, flat):
        out = out.copy()
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)
