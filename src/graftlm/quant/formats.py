"""GGUF block formats, decomposed into integer codes and exact per-group scales.

Every legacy and K-quant GGUF block type dequantizes to the same shape of formula::

    Semantics: w[k] = S[g] * (u[k] + c_min) (+ B[g])      with g = k // group_size

where ``u`` is an unsigned code of ``bits`` bits, ``S``/``B`` are float32 per-group values
derived *exactly* (same float32 operations, same order) as ``gguf.quants`` derives them, and
``B`` is absent for the symmetric types.  One small class per GGUF type splits raw blocks into
``u`` plus a handful of compact fields (the fp16/int8 numbers of the file itself), and turns
those fields back into ``S``/``B``.  Kernels store ``u`` in whatever layout suits them and keep
the compact fields, so ``dequantize()`` stays bit-exact with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

Fields = dict[str, torch.Tensor]

_SHIFT_NIBBLES = torch.tensor([0, 4], dtype=torch.uint8)
_SHIFT_CRUMBS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
_SHIFT_BITS = torch.arange(8, dtype=torch.uint8)


def _f16(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """fp16 values stored at byte columns [start, stop) of every block: (nb, (stop-start)//2)."""
    return blocks[:, start:stop].contiguous().view(torch.float16)


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """(nb, groups*half) bytes -> (nb, groups*2*half): per group, low nibbles then high nibbles."""
    nb = qs.shape[0]
    q = qs.reshape(nb, groups, 1, -1) >> _SHIFT_NIBBLES.view(1, 1, 2, 1)
    return (q & 0x0F).reshape(nb, -1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """(nb, nbytes) bytes -> (nb, 8 * nbytes) bits.

    Semantics: out[:, j] = (qh[:, j // 8] >> (j % 8)) & 1, i.e. bit j of the little-endian
    integer the bytes spell (Q5_0/Q5_1's uint32 qh).
    """
    nb = qh.shape[0]
    return ((qh.reshape(nb, -1, 1) >> _SHIFT_BITS.view(1, 1, 8)) & 1).reshape(nb, -1)


def _rep(t: torch.Tensor, n: int) -> torch.Tensor:
    """Repeat each column ``n`` times as float32: (rows, a) -> (rows, a*n)."""
    return t.float().repeat_interleave(n, dim=1)


class BlockFormat(ABC):
    """One GGUF block type: how raw blocks split into codes + compact fields, and back."""

    qtype: ClassVar[GGMLQuantizationType]
    bits: ClassVar[int]  # codes u are in [0, 2**bits)
    c_min: ClassVar[int]  # signed code = u + c_min
    group_size: ClassVar[int]  # values sharing one S (and B)
    offset: ClassVar[bool] = False  # whether B exists
    # whether w is affine in the code (the formula above); MXFP4's is a table of values instead
    # (its own dequantize), which int4pack's planes cannot hold
    affine: ClassVar[bool] = True
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        if hasattr(cls, "qtype"):
            cls.block_size, cls.type_size = GGML_QUANT_SIZES[cls.qtype]
            FORMATS[cls.qtype] = cls()

    @abstractmethod
    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        """(nb, type_size) uint8 -> u (nb, block_size) uint8 and fields {name: (nb, x)}."""

    @abstractmethod
    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row-major fields (rows, x*blocks_per_row) -> S, B float32 of shape (rows, n_groups)."""

    # ---- generic helpers built on split/group_params -------------------------------------
    def split_rows(self, raw: torch.Tensor, n_in: int) -> tuple[torch.Tensor, Fields]:
        """raw (rows, row_bytes) uint8 -> u (rows, n_in) uint8, fields (rows, x*blocks_per_row)."""
        rows = raw.shape[0]
        u, f = self.split(raw.reshape(-1, self.type_size))
        return u.reshape(rows, n_in), {k: v.reshape(rows, -1) for k, v in f.items()}

    def dequantize(self, u: torch.Tensor, f: Fields) -> torch.Tensor:
        """Semantics: w = S[g] * float(u + c_min) (+ B[g]) in float32, gguf's order of ops."""
        rows, n_in = u.shape
        s, b = self.group_params(f)
        w = u.reshape(rows, -1, self.group_size).float()  # (rows, G, gs); in-place from here on
        if self.c_min:
            w.add_(float(self.c_min))
        w.mul_(s.unsqueeze(-1))
        if b is not None:
            w.add_(b.unsqueeze(-1))
        return w.reshape(rows, n_in)


FORMATS: dict[GGMLQuantizationType, BlockFormat] = {}
T = GGMLQuantizationType


class Q4_0(BlockFormat):
    qtype, bits, c_min, group_size = T.Q4_0, 4, -8, 32

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        return _nibbles(blocks[:, 2:], 1), {"d": _f16(blocks, 0, 2)}

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        return f["d"].float(), None


class Q4_1(BlockFormat):
    qtype, bits, c_min, group_size = T.Q4_1, 4, 0, 32
    offset = True

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        return _nibbles(blocks[:, 4:], 1), {"d": _f16(blocks, 0, 2), "m": _f16(blocks, 2, 4)}

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        return f["d"].float(), f["m"].float()


class Q5_0(BlockFormat):
    qtype, bits, c_min, group_size = T.Q5_0, 5, -16, 32

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        u = _nibbles(blocks[:, 6:], 1) | (_bits(blocks[:, 2:6]) << 4)
        return u, {"d": _f16(blocks, 0, 2)}

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        return f["d"].float(), None


class Q5_1(BlockFormat):
    qtype, bits, c_min, group_size = T.Q5_1, 5, 0, 32
    offset = True

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        u = _nibbles(blocks[:, 8:], 1) | (_bits(blocks[:, 4:8]) << 4)
        return u, {"d": _f16(blocks, 0, 2), "m": _f16(blocks, 2, 4)}

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        return f["d"].float(), f["m"].float()


class Q8_0(BlockFormat):
    qtype, bits, c_min, group_size = T.Q8_0, 8, -128, 32

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        return blocks[:, 2:] ^ 0x80, {"d": _f16(blocks, 0, 2)}  # int8 q -> u = q + 128

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        return f["d"].float(), None


class Q2_K(BlockFormat):
    # block: scales[16] (lo nibble = scale, hi nibble = min) | qs[64] | d | dmin
    qtype, bits, c_min, group_size = T.Q2_K, 2, 0, 16
    offset = True

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        nb = blocks.shape[0]
        q = blocks[:, 16:80].reshape(nb, 2, 1, 32) >> _SHIFT_CRUMBS.view(1, 1, 4, 1)
        f = {"sc": blocks[:, :16].contiguous(), "d": _f16(blocks, 80, 82)}
        f["dmin"] = _f16(blocks, 82, 84)
        return (q & 3).reshape(nb, 256), f

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        sc = f["sc"]
        s = _rep(f["d"], 16) * (sc & 0x0F).float()
        return s, -(_rep(f["dmin"], 16) * (sc >> 4).float())


class Q3_K(BlockFormat):
    # block: hmask[32] | qs[64] | scales[12] (16 x 6-bit) | d ;  q = u - 4 in [-4, 3]
    qtype, bits, c_min, group_size = T.Q3_K, 3, -4, 16

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        nb = blocks.shape[0]
        ql = (blocks[:, 32:96].reshape(nb, 2, 1, 32) >> _SHIFT_CRUMBS.view(1, 1, 4, 1)) & 3
        qh = (blocks[:, :32].reshape(nb, 1, 1, 32) >> _SHIFT_BITS.view(1, 1, 8, 1)) & 1
        u = ql.reshape(nb, 256) | (qh.reshape(nb, 256) << 2)
        sc = blocks[:, 96:108]
        lo = (sc[:, :8].reshape(nb, 1, 8) >> _SHIFT_NIBBLES.view(1, 2, 1)).reshape(nb, 16)
        hi = (sc[:, 8:].reshape(nb, 1, 4) >> _SHIFT_CRUMBS.view(1, 4, 1)).reshape(nb, 16)
        scales = ((lo & 0x0F) | ((hi & 3) << 4)).view(torch.int8) - 32
        return u, {"sc": scales, "d": _f16(blocks, 108, 110)}

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _rep(f["d"], 16) * f["sc"].float(), None


def _k_scale_min(sc12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte packed 6-bit (scale, min) pairs of Q4_K/Q5_K -> two (nb, 8) uint8."""
    nb = sc12.shape[0]
    s = sc12.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


class Q4_K(BlockFormat):
    # block: d | dmin | scales[12] | qs[128];  w = (d*sc) * u - (dmin*m) per 32
    qtype, bits, c_min, group_size = T.Q4_K, 4, 0, 32
    offset = True
    _qs_at = 16

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        sc, mn = _k_scale_min(blocks[:, 4:16])
        f = {"d": _f16(blocks, 0, 2), "dmin": _f16(blocks, 2, 4), "sc": sc, "m": mn}
        return _nibbles(blocks[:, self._qs_at : self._qs_at + 128], 4), f

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = _rep(f["d"], 8) * f["sc"].float()
        return s, -(_rep(f["dmin"], 8) * f["m"].float())


class Q5_K(Q4_K):
    # block: d | dmin | scales[12] | qh[32] | qs[128]
    qtype, bits, c_min, group_size = T.Q5_K, 5, 0, 32
    _qs_at = 48

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        nb = blocks.shape[0]
        ul, f = super().split(blocks)
        qh = (blocks[:, 16:48].reshape(nb, 1, 1, 32) >> _SHIFT_BITS.view(1, 1, 8, 1)) & 1
        return ul | (qh.reshape(nb, 256) << 4), f


class Q6_K(BlockFormat):
    # block: ql[128] | qh[64] | scales[16] (int8) | d ;  w = (d*sc) * (u - 32) per 16
    qtype, bits, c_min, group_size = T.Q6_K, 6, -32, 16

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        nb = blocks.shape[0]
        ql = (blocks[:, :128].reshape(nb, 2, 1, 64) >> _SHIFT_NIBBLES.view(1, 1, 2, 1)) & 0x0F
        qh = (blocks[:, 128:192].reshape(nb, 2, 1, 32) >> _SHIFT_CRUMBS.view(1, 1, 4, 1)) & 3
        u = ql.reshape(nb, 256) | (qh.reshape(nb, 256) << 4)
        sc = blocks[:, 192:208].contiguous().view(torch.int8)
        return u, {"sc": sc, "d": _f16(blocks, 208, 210)}

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _rep(f["d"], 16) * f["sc"].float(), None


# ---- MXFP4: a table of values, not affine in the code ----------------------------------------
_MXFP4_VALUES = torch.tensor(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32
)


class MXFP4(BlockFormat):
    """block: e (E8M0) | qs[16];  w = VALUES[u] * e8m0_half(e), gguf's one float32 product.

    VALUES are the e2m1 values doubled (ggml's kvalues_mxfp4, integers) and e8m0_half(e) =
    2^(e - 128) the scale halved to match (ggml_e8m0_to_fp32_half: e 0 and 1 give the float32
    subnormals 2^-128 and 2^-127, e 255 gives 2^126).  The PyTorch twin of csrc/mxfp4.c's
    dequantization, and the fallback's decoder.
    """

    qtype, bits, c_min, group_size = T.MXFP4, 4, 0, 32
    affine = False

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        return _nibbles(blocks[:, 1:], 1), {"e": blocks[:, :1].contiguous()}

    def group_params(self, f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
        e = f["e"].to(torch.int32)
        bits = torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1) << 23)
        return bits.view(torch.float32), None

    def dequantize(self, u: torch.Tensor, f: Fields) -> torch.Tensor:
        rows, n_in = u.shape
        s, _ = self.group_params(f)
        w = _MXFP4_VALUES.take(u.long()).view(rows, -1, self.group_size)  # (rows, G, 32)
        return w.mul_(s.unsqueeze(-1)).reshape(rows, n_in)


# ---- the grid quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) -------------------------------
# Not of the u + c_min shape: every 8 (IQ2) or 4 (IQ3) values are one entry of a table of small
# magnitudes, each value with a sign bit.  Semantics (gguf's float32 order):
#     w = (db[g] * grid[idx[e]][j]) * sign[i]
# with db per 32 values (IQ2_XS, IQ2_S: per 16) from the super-block's float16 d and 4-bit ls.
# The PyTorch twin of csrc/iquant.c, over gguf-py's own tables.


class GridFormat(ABC):
    """One grid-quant type: raw super-blocks -> float32 values, as gguf.quants decodes them."""

    qtype: ClassVar[GGMLQuantizationType]
    group_size: ClassVar[int] = 32  # values sharing one db
    type_size: ClassVar[int]
    _grid: torch.Tensor | None = None

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls.type_size = GGML_QUANT_SIZES[cls.qtype][1]
        GRID_FORMATS[cls.qtype] = cls()

    def grid(self) -> torch.Tensor:
        """(entries, 8 or 4) float32: gguf-py's table of this type."""
        if self._grid is None:
            cls = gguf_quants._type_traits[self.qtype]
            cls.init_grid()
            grid = np.array(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
            type(self)._grid = torch.from_numpy(grid)
        assert self._grid is not None
        return self._grid

    @abstractmethod
    def parts(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(nb, type_size) uint8 -> db (nb, 256 / group_size) float32, grid indices (nb,
        entries) int64, sign bytes (nb, 32) uint8 (bit j of byte i: value 8 i + j negative)."""

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        """(nb, type_size) uint8 -> (nb, 256) float32, bit-exact with gguf.quants.dequantize."""
        nb = blocks.shape[0]
        db, idx, sb = self.parts(blocks)
        g = self.grid()[idx].reshape(nb, -1, self.group_size)  # (nb, groups, group_size)
        w = (db.unsqueeze(-1) * g).reshape(nb, 256)
        neg = ((sb.unsqueeze(-1) >> _SHIFT_BITS) & 1).reshape(nb, 256).bool()
        return w * torch.where(neg, -1.0, 1.0)

    def dequantize_rows(self, raw: torch.Tensor) -> torch.Tensor:
        """raw (rows, row_bytes) uint8 -> (rows, n_in) float32."""
        rows = raw.shape[0]
        return self.dequantize(raw.reshape(-1, self.type_size)).reshape(rows, -1)


GRID_FORMATS: dict[GGMLQuantizationType, GridFormat] = {}


def _u32(b: torch.Tensor) -> torch.Tensor:
    """(nb, 4 x) bytes -> (nb, x) int64: the little-endian uint32 they spell. One block's
    slice past its float16 d counts as contiguous with the block's offset and stride: copied,
    as a view as int32 needs both aligned."""
    b = b.contiguous()
    if b.storage_offset() % 4 or b.stride(0) % 4:
        b = b.clone(memory_format=torch.contiguous_format)
    return b.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _ksigns(i: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices -> their sign bytes (bit 7 the parity of the other seven)."""
    return _KSIGNS[i]


def _ls(b: torch.Tensor) -> torch.Tensor:
    """(nb, x) bytes of two 4-bit scales each -> (nb, 2 x) float32, low nibble first."""
    return _nibbles(b, b.shape[1]).float()


_SHIFT_SIGNS = torch.tensor([0, 7, 14, 21], dtype=torch.int64)
_KSIGNS = torch.frombuffer(bytearray(gguf_quants.IQ2_XXS.ksigns), dtype=torch.uint8)


class IQ2_XXS(GridFormat):
    # block: d | 8 x (4 grid bytes, u32: four 7-bit sign indices and ls in bits 28-31)
    qtype = T.IQ2_XXS

    def parts(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nb = b.shape[0]
        aux = _u32(b[:, 2:66]).reshape(nb, 8, 2)[..., 1]
        db = _f16(b, 0, 2).float() * (0.5 + (aux >> 28).float()) * 0.25
        idx = b[:, 2:66].reshape(nb, 8, 8)[..., :4].reshape(nb, 32).long()
        sb = _ksigns((aux.unsqueeze(-1) >> _SHIFT_SIGNS) & 127).reshape(nb, 32)
        return db, idx, sb


class IQ2_XS(GridFormat):
    # block: d | 32 x u16 (9-bit grid index, 7-bit sign index) | 16 x 4-bit ls (per 16 values)
    qtype, group_size = T.IQ2_XS, 16

    def parts(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = b[:, 2:66].contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
        db = _f16(b, 0, 2).float() * (0.5 + _ls(b[:, 66:74])) * 0.25
        return db, q & 511, _ksigns(q >> 9)


class IQ2_S(GridFormat):
    # block: d | 32 grid bytes | 32 sign bytes | 8 bytes of 2 high index bits | 16 x 4-bit ls
    qtype, group_size = T.IQ2_S, 16

    def parts(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nb = b.shape[0]
        qh = ((b[:, 66:74].reshape(nb, 8, 1) >> _SHIFT_CRUMBS) & 3).reshape(nb, 32)
        idx = b[:, 2:34].long() | (qh.long() << 8)
        db = _f16(b, 0, 2).float() * (0.5 + _ls(b[:, 74:82])) * 0.25
        return db, idx, b[:, 34:66]


class IQ3_XXS(GridFormat):
    # block: d | 64 grid bytes | 8 x u32 (four 7-bit sign indices, ls in bits 28-31)
    qtype = T.IQ3_XXS

    def parts(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nb = b.shape[0]
        aux = _u32(b[:, 66:98])
        db = _f16(b, 0, 2).float() * (0.5 + (aux >> 28).float()) * 0.5
        sb = _ksigns((aux.unsqueeze(-1) >> _SHIFT_SIGNS) & 127).reshape(nb, 32)
        return db, b[:, 2:66].long(), sb


class IQ3_S(GridFormat):
    # block: d | 64 grid bytes | 8 bytes of high index bits | 32 sign bytes | 8 x 4-bit ls
    qtype = T.IQ3_S

    def parts(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = b[:, 2:66].long() | (_bits(b[:, 66:74]).long() << 8)
        db = _f16(b, 0, 2).float() * (1 + 2 * _nibbles(b[:, 106:110], 4)).float()
        return db, idx, b[:, 74:106]
