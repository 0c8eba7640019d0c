"""Quantized weights whose values are looked up in a table, on their native kernels.

* ``NativeMX4Kernel``: MXFP4 (gpt-oss's experts) at the file's size, its codes looked up as
  integers (csrc/mxfp4.c).
* ``NativeIQKernel``: the grid quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S read in place
  (IQ2_XXS and IQ3_XXS regrouped into tiles of 16 outputs where the build has VBMI), their grid
  entries and sign bits expanded in the products (csrc/iquant.c).

Their PyTorch twins are ``formats.MXFP4`` and ``formats.GridFormat``; the products and the
dequantization follow ``native_kernels.py``'s kernels (int8 x per 32 values for few rows, exact
dequantization bit-exact with ``gguf.quants.dequantize``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from gguf import GGMLQuantizationType

from graftlm import hugepages
from graftlm.native import library, threads
from graftlm.native.abi import GlWeight
from graftlm.native.build import loaded_library
from graftlm.quant.base import Kernel, QType, Shape, row_bytes
from graftlm.quant.native_kernels import NativeKernel, _ptr

T = GGMLQuantizationType


# ---- MXFP4 (csrc/mxfp4.c) ---------------------------------------------------------------------
class NativeMX4Kernel(NativeKernel):
    """Semantics: w[n, i] = V[c[n, i]] * 2^(e[n, i // 32] - 128), V MXFP4's e2m1 values doubled
    (ggml's kvalues_mxfp4: integers in [-12, 12]) at the file's 4-bit code c, e its E8M0 exponent
    per 32 values (e 0 and 1: 2^-128 and 2^-127, as ggml_e8m0_to_fp32_half). Kept at the file's
    4.25 bits a weight, regrouped by 8 rows (see csrc/mxfp4.c); the products are integer dots
    of V + 12 with x quantized to int8 per 32, the 12s taken off in float with the E8M0 scale."""

    name = "native-mx4"
    TYPES = (T.MXFP4,)
    BLOCK_BYTES = 136  # a block of 32 values of 8 rows: 128 bytes of codes, 8 exponents

    def __init__(self, shape: Shape, q: torch.Tensor) -> None:
        super().__init__(shape)
        self.q = q
        n, k = shape
        self._view = GlWeight(5, 0, 32, 0, n, k, q.data_ptr(), None, None)
        lib = loaded_library()
        assert lib is not None
        self._fn = lib.gl_mm_mx4
        self._args = (k, q.data_ptr(), n)

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        lib = library()
        assert lib is not None
        n, k = shape
        raw = raw.contiguous()
        q = hugepages.empty(-(-n // 8) * (k // 32) * cls.BLOCK_BYTES, dtype=torch.uint8)
        bad = lib.gl_pack_mx4(raw.data_ptr(), row_bytes(qtype, k), n, k, q.data_ptr(), threads())
        assert bad == 0, (qtype, shape)
        return cls(shape, q)

    def _deq(self, ids: torch.Tensor | None, row0: int, count: int) -> torch.Tensor:
        lib = loaded_library()
        assert lib is not None
        k = self.shape[1]
        out = torch.empty(count, k, dtype=torch.float32)
        lib.gl_deq_mx4(self.q.data_ptr(), k, _ptr(ids), row0, count, out.data_ptr(), threads())
        return out

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q,)


# ---- IQ2_XXS .. IQ3_S (csrc/iquant.c) -------------------------------------------------------
_IN_PLACE: ContextVar[bool] = ContextVar("graftlm_iq_in_place", default=False)


@contextmanager
def iq_in_place() -> Iterator[None]:
    """IQ2_XXS and IQ3_XXS weights built inside stay the file's bytes in place, no tiles: a model
    bound for another device (api.load's --device cuda), whose weights are dequantized from them
    once and moved, packs nothing into host memory first."""
    token = _IN_PLACE.set(True)
    try:
        yield
    finally:
        _IN_PLACE.reset(token)


def iq_tiles_wanted() -> bool:
    """Whether IQ2_XXS and IQ3_XXS weights are regrouped into tiles at load where the native
    build takes them (GRAFTLM_IQ_TILES=0 keeps them in place: the A/B of bench/decode_parts.py;
    so does iq_in_place)."""
    return os.environ.get("GRAFTLM_IQ_TILES", "1") != "0" and not _IN_PLACE.get()


class NativeIQKernel(NativeKernel):
    """Semantics: w[n, i] = s[n, i // 32] * grid[n, i] * sign[n, i] (IQ2_XS, IQ2_S: s per 16),
    grid a magnitude from the type's table of 8 (IQ2) or 4 (IQ3) values an entry, s from the
    super-block's float16 d and a 4-bit ls: d (0.5 + ls) / 4 (IQ2_*), d (0.5 + ls) / 2 (IQ3_XXS),
    d (1 + 2 ls) (IQ3_S).

    IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S read in place from the file (csrc/iquant.c): its
    super-blocks of 256 values as they are, 2.06 to 3.44 bits a weight, no copy. Its grid
    entries and sign bits are expanded in the products into signed bytes, 16 outputs (8 without
    512-bit VNNI) to a vector for all the rows of x, for the integer dots with x quantized to
    int8 per 32 values (llama.cpp's arithmetic). IQ2_XXS and IQ3_XXS where the build has AVX-512
    VBMI: the same bytes regrouped at load into tiles of 16 outputs' super-blocks (tiles=True;
    csrc/iquant.c's layout), their grid indices and sign words of a unit in lanes of outputs, which
    one to a few rows of x read with no transposition (1.2-1.5x at one row); the same products.
    """

    name = "native-iq"
    TYPES = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)
    VARIANT = {t: i for i, t in enumerate(TYPES)}  # csrc/iquant.c's IQ2_XXS .. IQ3_S
    TILED = (T.IQ2_XXS, T.IQ3_XXS)
    keeps_source = True

    def __init__(self, q: torch.Tensor, shape: Shape, variant: int, tiles: bool = False) -> None:
        super().__init__(shape)
        # (n_out, row bytes), the file's bytes; tiles: (n_out rounded up to 16, row bytes), regrouped
        self.q, self.variant, self.tiles = q, variant, tiles
        self.keeps_source = not tiles  # tiles: a copy, the file's bytes released
        n, k = shape
        self._view = GlWeight(6, int(tiles), 256, variant, n, k, q.data_ptr(), None, None)
        lib = loaded_library()
        assert lib is not None
        self._fn = lib.gl_mm_iq_tiles if tiles else lib.gl_mm_iq
        self._args = (k, q.data_ptr(), variant, n)

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        return qtype in cls.TYPES and shape[1] % 256 == 0 and library() is not None

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        variant, raw = cls.VARIANT[T(qtype)], raw.contiguous()
        lib = library()
        assert lib is not None
        if T(qtype) in cls.TILED and iq_tiles_wanted() and lib.gl_iq_tiles():
            n, k = shape
            q = hugepages.empty(-(-n // 16) * 16 * row_bytes(qtype, k), dtype=torch.uint8)
            bad = lib.gl_pack_iq(variant, raw.data_ptr(), n, k, q.data_ptr(), threads())
            assert bad == 0, (qtype, shape)
            return cls(q.view(-1, row_bytes(qtype, k)), shape, variant, True)
        return cls(raw, shape, variant)

    def _deq(self, ids: torch.Tensor | None, row0: int, count: int) -> torch.Tensor:
        lib = loaded_library()
        assert lib is not None
        k = self.shape[1]
        out = torch.empty(count, k, dtype=torch.float32)
        deq = lib.gl_deq_iq_tiles if self.tiles else lib.gl_deq_iq
        deq(self.q.data_ptr(), self.variant, k, _ptr(ids), row0, count, out.data_ptr(), threads())
        return out

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q,)
