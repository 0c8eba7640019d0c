"""Quantized weights in the native layouts of ``graftlm/native/csrc/quant.c`` (see its header).

* ``NativeU4Kernel``: Q4_0, Q4_1 (Q5_0, Q5_1) as 4-bit codes (and a plane of fifth bits) with a
  float16 scale and offset per 32 values.
* ``NativeK4Kernel``, ``NativeK16Kernel``: Q4_K, Q5_K, Q6_K (at the file's size), Q3_K and Q2_K
  in their super-blocks (csrc/kquant.c).
* ``NativeS8Kernel``: Q8_0 as int8 codes with a scale per 32 values; IQ4_NL and IQ4_XS the same
  way, their codes kept in 4 bits (indices into IQ4_NL's table of 16 int8 values).
* ``NativeFloatKernel``: F16, BF16 and F32 read in place from the file (csrc/float.c), x kept
  float32: the one native kind whose products do not round x to int8 (BF16's prompts, with
  AVX512-BF16: x in bfloat16, as llama.cpp's; ``graftlm.native.bf16_dots``).

The formats whose values come from a table (MXFP4, the grid quants IQ2_* and IQ3_*) are in
``native_tables.py``.

Matrix products with few rows of x (decode, batched decode) quantize x to int8 per 32 values, as
llama.cpp does for its CPU matmuls, and run integer dot products; from ``config.PREFILL_M`` rows
on, and for every exact product, the weight is dequantized exactly in chunks for a
float32 GEMM instead.  Dequantization is bit-exact with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from graftlm import hugepages
from graftlm.native import library, threads
from graftlm.native.abi import GlWeight
from graftlm.native.build import loaded_library
from graftlm.quant import config
from graftlm.quant.base import Kernel, QType, Shape, row_bytes
from graftlm.quant.torch_kernels import DenseKernel

T = GGMLQuantizationType


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _pack_scales(
    qtype: QType,
    shape: tuple[int, int],
    pack: Callable[[tuple[torch.Tensor, ...]], int],
    count: int,
) -> tuple[torch.Tensor, ...]:
    """Allocate `count` scale tensors of `shape` and fill them with `pack` (the C packer, which
    returns nonzero when a float16 scale would not be exact): float16 for the types whose scales
    are the file's float16 values, float32 when that fails or for the others."""
    dtypes = (torch.float16, torch.float32) if qtype in F16_SCALES else (torch.float32,)
    for dtype in dtypes:
        scales = tuple(torch.empty(shape, dtype=dtype) for _ in range(count))
        if not pack(scales):
            break
    return scales


def _check_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    ids = ids.contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"row ids must be in [0, {n}), got {ids.min()}..{ids.max()}")
    return ids


class NativeKernel(Kernel):
    """Shared plumbing: the fused/float32 choice and dequantized-row helpers."""

    TYPES: ClassVar[tuple[GGMLQuantizationType, ...]] = ()
    rounds_x = True

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        return qtype in cls.TYPES and shape[1] % 32 == 0 and library() is not None

    # the product's C function and its arguments between (x, M) and (y, threads): fixed per
    # weight, bound once so a decode step pays one ctypes call per matmul and little else
    _fn: Any = None
    _args: tuple[Any, ...] = ()

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        m = x.shape[0]
        if not config.use_fused(self.name, m, exact):
            return self.chunked_matmul(x)
        y = torch.empty((m, self.shape[0]), dtype=torch.float32)
        self._mm(x, y)
        return y

    _view: GlWeight | None = None

    def native(self) -> GlWeight | None:
        """The weight as the native projection and layer calls read it (gl_weight)."""
        return self._view

    def _mm(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y = x @ W.T through the native product (x (M, n_in), y (M, n_out), contiguous)."""
        self._fn(x.data_ptr(), x.shape[0], *self._args, y.data_ptr(), threads())

    def _deq(self, ids: torch.Tensor | None, row0: int, count: int) -> torch.Tensor:
        raise NotImplementedError

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        return self._deq(None, start, stop - start)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = _check_ids(ids.to(torch.int64), self.shape[0])
        return self._deq(ids, 0, ids.numel())


# types whose scales (and Q4_1's offsets) are the file's float16 values: stored as float16
F16_SCALES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL)


class NativeU4Kernel(NativeKernel):
    """Semantics: w[n, 32b + j] = q[n, 32b + j] * d[n, b] + m[n, b], q in [0, 16) (Q4_0, Q4_1)
    or [0, 32) (Q5_0, Q5_1: the fifth bits in a plane beside the 4-bit codes).

    Q4_0 / Q5_0: d = file d, m = -8 d / -16 d.  Q4_1 / Q5_1: d, m as in the file.  d and m are
    kept as float16 (the file's size, with m: 0.5 B more per 32 values for Q4_0 and Q5_0).
    """

    name = "native-u4"
    TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
    OFFSET = {T.Q4_0: 8, T.Q5_0: 16}  # dequantized as (q - offset) * d, gguf's exact expression

    def __init__(
        self,
        shape: Shape,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        offset: int,
        five: bool,
    ) -> None:
        super().__init__(shape)
        self.qs, self.d, self.m = qs, d, m  # interleaved by 8 rows (see csrc/quant.c)
        self.half, self.five = int(d.dtype == torch.float16), int(five)
        n, k = shape
        self._view = GlWeight(
            0, self.half, 32, self.five, n, k, qs.data_ptr(), d.data_ptr(), m.data_ptr()
        )
        self.offset = offset
        lib = loaded_library()
        assert lib is not None
        self._fn = lib.gl_mm_u4
        self._args = (k, qs.data_ptr(), d.data_ptr(), m.data_ptr(), self.half, self.five, n)

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        lib = library()
        assert lib is not None
        n, k = shape
        raw = raw.contiguous()
        n8 = -(-n // 8) * 8  # rows in groups of 8, the last padded with zero rows
        five = qtype in (T.Q5_0, T.Q5_1)
        qs = hugepages.empty(n8, k // 2 + (k // 8 if five else 0), dtype=torch.uint8)
        d, m = _pack_scales(
            qtype, (n8, k // 32),
            lambda dm: lib.gl_pack_u4(
                int(qtype), raw.data_ptr(), row_bytes(qtype, k), n, k, qs.data_ptr(),
                dm[0].data_ptr(), dm[1].data_ptr(), int(dm[0].dtype == torch.float16), threads(),
            ),
            2,
        )  # fmt: skip
        return cls(shape, qs, d, m, cls.OFFSET.get(qtype, 0), five)

    def _deq(self, ids: torch.Tensor | None, row0: int, count: int) -> torch.Tensor:
        lib = loaded_library()
        assert lib is not None
        k = self.shape[1]
        out = torch.empty(count, k, dtype=torch.float32)
        lib.gl_deq_u4(
            self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr(), self.half, self.five,
            self.offset, k,
            _ptr(ids), row0, count, out.data_ptr(), threads(),
        )  # fmt: skip
        return out

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.qs, self.d, self.m)


class NativeK4Kernel(NativeKernel):
    """Semantics: w[n, 32b + j] = q[n, 32b + j] * (d[n, b // 8] * sc[n, b]) - dmin[n, b // 8] *
    mn[n, b], q in [0, 16) (Q4_K) or [0, 32) (Q5_K); d, dmin the file's float16 per 256 values,
    sc, mn its 6-bit scale and min per 32.

    Kept in the super-block form, regrouped by 8 rows: 4.625 bits a weight for Q4_K (file 4.5),
    5.625 for Q5_K (5.5); Q5_K's fifth bits are a bit plane beside the 4-bit codes.
    """

    name = "native-k4"
    TYPES = (T.Q4_K, T.Q5_K)

    def __init__(self, shape: Shape, q: torch.Tensor, d: torch.Tensor, five: bool) -> None:
        super().__init__(shape)
        self.q, self.d, self.five = q, d, int(five)  # see csrc/kquant.c for the layout
        n, k = shape
        self._view = GlWeight(2, 1, 32, self.five, n, k, q.data_ptr(), d.data_ptr(), None)
        lib = loaded_library()
        assert lib is not None
        self._fn = lib.gl_mm_k4
        self._args = (k, q.data_ptr(), d.data_ptr(), self.five, n)

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        return qtype in cls.TYPES and shape[1] % 256 == 0 and library() is not None

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        lib = library()
        assert lib is not None
        n, k = shape
        five = qtype == T.Q5_K
        groups = -(-n // 8)  # rows in groups of 8, the last padded with zero rows
        q = hugepages.empty(groups * (k // 32) * (144 + 32 * five), dtype=torch.uint8)
        d = torch.empty(groups * (k // 256) * 16, dtype=torch.float16)
        raw = raw.contiguous()
        bad = lib.gl_pack_k4(
            int(qtype), raw.data_ptr(), row_bytes(qtype, k), n, k, q.data_ptr(), d.data_ptr(),
            threads(),
        )  # fmt: skip
        assert bad == 0, qtype
        return cls(shape, q, d, five)

    def _deq(self, ids: torch.Tensor | None, row0: int, count: int) -> torch.Tensor:
        lib = loaded_library()
        assert lib is not None
        k = self.shape[1]
        out = torch.empty(count, k, dtype=torch.float32)
        lib.gl_deq_k4(
            self.q.data_ptr(), self.d.data_ptr(), self.five, k, _ptr(ids), row0, count,
            out.data_ptr(), threads(),
        )  # fmt: skip
        return out

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.d)


class NativeK16Kernel(NativeKernel):
    """Semantics: w[n, 16u + j] = (q[n, 16u + j] - O) * (d[n, u // 16] * sc[n, u])
    [- dmin[n, u // 16] * mn[n, u]]; d (dmin) the file's float16 per 256 values, sc (mn) its scale
    (min) per 16. Q6_K: q in [0, 64), O 32; Q3_K: q in [0, 8), O 4, sc signed; Q2_K: q in [0, 4),
    O 0, with the mins.

    Kept in the super-block form, regrouped by 8 rows, the codes in 4 bits (Q6_K: and two bit
    planes): 6.5625 bits a weight for Q6_K (the file's size), 4.625 for Q3_K (file 3.44), 5.125
    for Q2_K (file 2.63).
    """

    name = "native-k16"
    TYPES = (T.Q6_K, T.Q3_K, T.Q2_K)
    VARIANT = {T.Q6_K: 0, T.Q3_K: 1, T.Q2_K: 2}  # csrc/kquant.c's V_Q6, V_Q3, V_Q2

    def __init__(self, shape: Shape, q: torch.Tensor, d: torch.Tensor, variant: int) -> None:
        super().__init__(shape)
        self.q, self.d, self.variant = q, d, variant  # see csrc/kquant.c for the layout
        n, k = shape
        self._view = GlWeight(3, 1, 16, variant, n, k, q.data_ptr(), d.data_ptr(), None)
        lib = loaded_library()
        assert lib is not None
        self._fn = lib.gl_mm_k6
        self._args = (k, q.data_ptr(), d.data_ptr(), variant, n)

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        return qtype in cls.TYPES and shape[1] % 256 == 0 and library() is not None

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        lib = library()
        assert lib is not None
        n, k = shape
        v = cls.VARIANT[T(qtype)]
        groups = -(-n // 8)  # rows in groups of 8, the last padded with zero rows
        block = 128 + (64 if v == 0 else 0) + 16 + (16 if v == 2 else 0)
        q = hugepages.empty(groups * (k // 32) * block, dtype=torch.uint8)
        d = torch.empty(groups * (k // 256) * (16 if v == 2 else 8), dtype=torch.float16)
        raw = raw.contiguous()
        bad = lib.gl_pack_k6(
            int(qtype), raw.data_ptr(), row_bytes(qtype, k), n, k, q.data_ptr(), d.data_ptr(),
            threads(),
        )  # fmt: skip
        assert bad == 0, qtype
        return cls(shape, q, d, v)

    def _deq(self, ids: torch.Tensor | None, row0: int, count: int) -> torch.Tensor:
        lib = loaded_library()
        assert lib is not None
        k = self.shape[1]
        out = torch.empty(count, k, dtype=torch.float32)
        lib.gl_deq_k6(
            self.q.data_ptr(), self.d.data_ptr(), self.variant, k, _ptr(ids), row0, count,
            out.data_ptr(), threads(),
        )  # fmt: skip
        return out

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.d)


class NativeS8Kernel(NativeKernel):
    """Semantics: w[n, i] = v[n, i] * s[n, i // 32], v int8.

    Q8_0: v, s = d as in the file: 1 B + 2 B (the file's float16 d) per 32 values.
    IQ4_NL, IQ4_XS: v = IQ4_NL's table at the file's 4-bit code, kept as the code (u4's layout).
    IQ4_NL: s = d, float16 (the file's 4.5 bits a weight). IQ4_XS: s = d * (ls - 32) from its
    float16 d per 256 and its 6-bit ls per 32, both kept (ls - 32 as int8): 4.375 bits a weight
    against the file's 4.25.
    """

    name = "native-s8"
    TYPES = (T.Q8_0, T.IQ4_NL, T.IQ4_XS)
    VARIANT = {T.Q8_0: 0, T.IQ4_NL: 1, T.IQ4_XS: 2}  # csrc/quant.c's S8_Q8, S8_N4, S8_N4X
    BLOCK_BYTES = (256, 128, 136)  # a block of 32 values of 8 rows

    def __init__(self, shape: Shape, q: torch.Tensor, s: torch.Tensor, variant: int) -> None:
        super().__init__(shape)
        self.q, self.s, self.sblk = q, s, 32  # interleaved by 8 rows (see csrc/quant.c)
        self.half, self.variant = int(s.dtype == torch.float16), variant
        n, k = shape
        self._view = GlWeight(
            1, self.half, self.sblk, variant, n, k, q.data_ptr(), s.data_ptr(), None
        )
        lib = loaded_library()
        assert lib is not None
        self._fn = lib.gl_mm_s8
        self._args = (k, q.data_ptr(), s.data_ptr(), self.half, variant, self.sblk, n)

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        return (
            qtype in cls.TYPES
            and shape[1] % GGML_QUANT_SIZES[qtype][0] == 0  # IQ4_XS: super-blocks of 256
            and library() is not None
        )

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        lib = library()
        assert lib is not None
        n, k = shape
        v = cls.VARIANT[T(qtype)]
        raw = raw.contiguous()
        groups = -(-n // 8)  # rows in groups of 8, the last padded with zero rows
        q = hugepages.empty(groups * (k // 32) * cls.BLOCK_BYTES[v], dtype=torch.uint8)

        def pack(sc: tuple[torch.Tensor, ...]) -> int:
            return int(lib.gl_pack_s8(
                int(qtype), raw.data_ptr(), row_bytes(qtype, k), n, k, q.data_ptr(),
                sc[0].data_ptr(), int(sc[0].dtype == torch.float16), threads(),
            ))  # fmt: skip

        if v == 2:  # its own float16 d per 256 values
            s = torch.empty(groups * (k // 256) * 8, dtype=torch.float16)
            assert pack((s,)) == 0, qtype
        else:
            (s,) = _pack_scales(qtype, (groups * 8, k // 32), pack, 1)
        return cls(shape, q, s, v)

    def _deq(self, ids: torch.Tensor | None, row0: int, count: int) -> torch.Tensor:
        lib = loaded_library()
        assert lib is not None
        k = self.shape[1]
        out = torch.empty(count, k, dtype=torch.float32)
        lib.gl_deq_s8(
            self.q.data_ptr(), self.s.data_ptr(), self.half, self.variant, self.sblk, k,
            _ptr(ids), row0, count, out.data_ptr(), threads(),
        )  # fmt: skip
        return out

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.s)


class NativeFloatKernel(NativeKernel):
    """Semantics: y = x @ float32(W).T, W the file's F16 / BF16 / F32 values read in place (no
    copy, no repacking); x stays float32 and each value is converted as it is read (csrc/float.c),
    so the fast product differs from the float32 GEMM only in the order of its sums. Decode
    reads each weight once at its stored size, where upcasting chunks for a float32 GEMM wrote
    and read them again as float32 on every call.

    BF16 with 6 rows of x or more, where the library has AVX512-BF16 and its 512-bit kernels
    (``graftlm.native.bf16_dots``; GRAFTLM_BF16_DOTS=0 turns it off, read once), as llama.cpp's:
    y = bf16(x) @ W.T, x rounded to nearest even, the products exact in float32 (VDPBF16PS at
    twice the FMA's multiply rate). rounds_x stays False: it speaks of int8 rounding, which an
    adapter's compact form may then match, and bfloat16's is 16x finer."""

    name = "native-float"
    TYPES = tuple(DenseKernel.DTYPES)
    HALF: ClassVar[dict[QType, int]] = {T.F16: 0, T.BF16: 1, T.F32: 2}
    keeps_source = True
    rounds_x = False

    def __init__(self, w: torch.Tensor, half: int) -> None:
        super().__init__((w.shape[0], w.shape[1]))
        self.w = w  # (n_out, n_in) in the file's dtype
        n, k = self.shape
        self._view = GlWeight(4, half, 32, 0, n, k, w.data_ptr(), None, None)
        lib = loaded_library()
        assert lib is not None
        self._fn = lib.gl_mm_f
        self._args = (k, w.data_ptr(), half, n)

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        # (n_out, row bytes) of the mapped file -> (n_out, n_in) values, still the file's bytes
        return cls(raw.contiguous().view(DenseKernel.DTYPES[qtype]), cls.HALF[qtype])

    def _deq(self, ids: torch.Tensor | None, row0: int, count: int) -> torch.Tensor:
        w = self.w[row0 : row0 + count] if ids is None else self.w[ids]
        return w.to(torch.float32, copy=True)  # (never the file's bytes themselves)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w,)
