"""The kernels that are not int4pack: dense, int8 groups, raw GGUF blocks, float32 reference."""

from __future__ import annotations

from typing import ClassVar

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from graftlm.quant import config
from graftlm.quant.base import Kernel, QType, Shape
from graftlm.quant.formats import FORMATS, GRID_FORMATS

T = GGMLQuantizationType


def gguf_can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` implements ``qtype``."""
    return qtype in (T.F32, T.F16) or qtype in gguf.quants._type_traits


class DenseKernel(Kernel):
    """F32 / F16 / BF16 kept as they are in the file (a zero-copy view when the data allows).

    Semantics: y = x @ float32(W).T — F32 directly; F16/BF16 upcast CHUNK_ELEMS at a time (exact
    float32 compute: a bf16 GEMM is slower than this on CPUs without native bf16 dot products).
    """

    DTYPES: ClassVar[dict[GGMLQuantizationType, torch.dtype]] = {
        T.F32: torch.float32,
        T.F16: torch.float16,
        T.BF16: torch.bfloat16,
    }
    NAMES: ClassVar[dict[torch.dtype, str]] = {
        torch.float32: "dense-f32",
        torch.float16: "dense-f16",
        torch.bfloat16: "dense-bf16",
    }
    keeps_source = True

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__((w.shape[0], w.shape[1]))
        self.w = w  # (n_out, n_in) in the file's dtype
        self.name = self.NAMES[w.dtype]

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        return qtype in cls.DTYPES

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        return cls(raw.view(cls.DTYPES[qtype]))  # (n_out, row_bytes) u8 -> (n_out, n_in)

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self.w.dtype is torch.float32:
            return F.linear(x, self.w)
        return self.chunked_matmul(x)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.w[start:stop].to(torch.float32, copy=True)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w[ids].float()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w,)


class Int8GroupKernel(Kernel):
    """Q8_0 as int8 codes sliced by 32-column group, one ``_weight_int8pack_mm`` per group.

    Semantics: y = sum_g (x[:, g] @ q[g].T) * d[g]   (bf16 x and d, fp32 accumulation)

    ``_weight_int8pack_mm`` only has per-output-row scales, so each of the K/32 column groups is
    its own call; that costs ~10 us a call, which only pays off on very wide weights (the
    vocabulary head / embedding), hence MIN_N_OUT.  Memory: 1 B + 4 B per 32 (fp16 d, bf16 d).
    """

    name = "int8g"
    MIN_N_OUT = 8192

    def __init__(self, shape: tuple[int, int], q: torch.Tensor, d16: torch.Tensor) -> None:
        super().__init__(shape)
        self.q = q  # (G, n_out, 32) int8
        self.d16 = d16  # (n_out, G) float16, the file's scales (exact path)
        self.dk = d16.t().to(torch.bfloat16).contiguous()  # (G, n_out) bf16 (kernel)

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        has_op = hasattr(torch, "_weight_int8pack_mm")
        return qtype == T.Q8_0 and shape[0] >= cls.MIN_N_OUT and has_op

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        n, k = shape
        blocks = raw.view(n, k // 32, 34)  # per block: fp16 d | int8 q[32]
        q = blocks[:, :, 2:].permute(1, 0, 2).contiguous().view(torch.int8)  # (G, n, 32)
        d16 = blocks[:, :, :2].contiguous().view(torch.float16).view(n, k // 32)
        return cls(shape, q, d16)

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        m = x.shape[0]
        if not config.use_fused(self.name, m, exact):
            return self.chunked_matmul(x)
        g_count = self.q.shape[0]
        xs = x.to(torch.bfloat16).view(m, g_count, 32).transpose(0, 1).contiguous()  # (G, M, 32)
        y = torch._weight_int8pack_mm(xs[0], self.q[0], self.dk[0]).float()
        for g in range(1, g_count):
            y.add_(torch._weight_int8pack_mm(xs[g], self.q[g], self.dk[g]))
        return y

    def _deq(self, q: torch.Tensor, d16: torch.Tensor) -> torch.Tensor:
        # q (G, rows, 32) int8, d16 (rows, G).  Semantics (gguf order): w = float(q) * float(d)
        w = q.permute(1, 0, 2).float() * d16.float().unsqueeze(-1)
        return w.reshape(q.shape[1], -1)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        return self._deq(self.q[:, start:stop], self.d16[start:stop])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._deq(self.q[:, ids], self.d16[ids])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.d16, self.dk)


class BlockKernel(Kernel):
    """Fallback: the GGUF blocks as they are, dequantized chunk by chunk for every matmul.

    Semantics: y[:, r0:r1] = x @ decode(blocks[r0:r1]).T in float32, where decode is the torch
    port in ``formats`` when the type has one (Q2_K, Q3_K, ..., the IQ2 / IQ3 grid types) and
    gguf's numpy code otherwise (IQ1_*, TQ*, MXFP4, ...).  Compact (exactly the file's bytes) and
    exact, but slow for decode.
    """

    name = "blocks"
    keeps_source = True

    def __init__(self, shape: Shape, qtype: QType, raw: torch.Tensor) -> None:
        super().__init__(shape)
        self.qtype = qtype
        self.raw = raw  # (n_out, row_bytes) uint8
        self.fmt = FORMATS.get(qtype)
        self.grid = GRID_FORMATS.get(qtype)

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        return qtype in FORMATS or qtype in GRID_FORMATS or gguf_can_dequantize(qtype)

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        return cls(shape, qtype, raw)

    def _decode(self, raw: torch.Tensor) -> torch.Tensor:
        if self.fmt is not None:
            return self.fmt.dequantize(*self.fmt.split_rows(raw, self.shape[1]))
        if self.grid is not None:
            return self.grid.dequantize_rows(raw)
        return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), self.qtype).copy())

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return self.chunked_matmul(x)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        return self._decode(self.raw[start:stop])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._decode(self.raw[ids])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.raw,)


class ReferenceKernel(Kernel):
    """The oracle: a dense float32 copy made by ``gguf.quants.dequantize``.

    Semantics: y = x @ W.T with W = gguf.quants.dequantize(raw) (float32 GEMM).
    """

    name = "reference-f32"

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__((w.shape[0], w.shape[1]))
        self.w = w  # (n_out, n_in) float32, owned

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        return gguf_can_dequantize(qtype)

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        w = np.array(gguf.quants.dequantize(raw.numpy(), qtype), dtype=np.float32, copy=True)
        return cls(torch.from_numpy(w).view(shape))

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return F.linear(x, self.w)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.w[start:stop].clone()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w[ids]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w,)


class DeviceDenseKernel(Kernel):
    """A bf16 dense copy on an accelerator (``QWeight.to("cuda")``): no GGUF-exact promise.

    Semantics: y = float32(bf16(x) @ W_bf16.T); dequantize returns the bf16 values as float32.
    """

    name = "device-bf16"

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__((w.shape[0], w.shape[1]))
        self.w = w

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        raise NotImplementedError("made by QWeight.to(device), not from GGUF bytes")

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return F.linear(x.to(self.w.device, torch.bfloat16), self.w).float()

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.w[start:stop].float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w[ids.to(self.w.device)].float()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w,)
