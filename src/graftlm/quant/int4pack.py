"""Quantized weights as torch's CPU int4pack tiles, served by ``_weight_int4pack_mm_for_cpu``.

The fused kernel computes, per group of 32 input columns with bfloat16 (scale s, zero z)::

    Semantics: y[m, n] = sum_k x[m, k] * ((c[n, k] - 8) * s[g(k), n] + z[g(k), n]),  c in [0, 16)

with bfloat16 x and fp32 accumulation.  A GGUF group w = S * (u + c_min) + B maps onto it exactly
(up to rounding s, z to bfloat16) by one of three plane layouts:

* one plane (u < 16, 32-groups: Q4_0, Q4_1, Q4_K): c = u, s = S, z = S*(8 + c_min) + B.
* split planes (u < 256, 32-groups: Q5_0, Q5_1, Q5_K, Q8_0): K' = 2K, c = [u & 15 | u >> 4],
  x' = [x | 16 x]; the high plane's zero is 0 or 8 S, whichever keeps the low zero a power-of-two
  multiple of S (exact in bfloat16 for the symmetric types).
* paired planes (u < 64, 16-groups, no B: Q6_K): each 16-column sub-block becomes one 32-group
  [u & 15 (x) | 4*(u >> 4) + t (4 x)] with t = (c_min + 40) / 4, which makes z = 0 exactly.

The packed tile layout is private to torch (it differs between AVX2, AVX512 and other builds), so
``int4pack_layout()`` learns it once by packing a probe and checks that it round-trips; codes are
read back from the tiles for ``dequantize``/``rows``/the float32 path, so no second copy is kept.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from graftlm.quant import config
from graftlm.quant.base import Kernel, Pair, QType, Shape
from graftlm.quant.formats import FORMATS, BlockFormat, Fields

PAD_N = 64  # n_out is padded to this (a multiple of every tile width torch uses)
GROUP = 32


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 16) -> torch's packed tiles, uint8 (N, K // 2)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


@functools.lru_cache(maxsize=64)
def _columns(k: int) -> torch.Tensor:
    """(1, k) column indices, made once per width (read-only, shared)."""
    return torch.arange(k).unsqueeze(0)


@dataclass(frozen=True)
class Int4PackLayout:
    """Where torch puts code (n, k): tiles of ``block_n`` rows, flat (N/block_n, K, block_n/2).

    Within a tile row k, nibble position p (p < block_n/2: low nibble of byte p, else high nibble
    of byte p - block_n/2) holds local row ``row_of_pos[p]``.
    """

    block_n: int
    pos_of_row: torch.Tensor  # (block_n,) int64, inverse of row_of_pos
    identity: bool

    def unpack(self, packed: torch.Tensor, k: int, b0: int, b1: int) -> torch.Tensor:
        """Codes of tiles [b0, b1): uint8 ((b1 - b0) * block_n, k)."""
        half = self.block_n // 2
        p3 = packed.view(-1, k, half)[b0:b1]  # (tiles, K, B/2)
        if not self.identity:
            nib = torch.cat([p3 & 0x0F, p3 >> 4], dim=2)[:, :, self.pos_of_row]  # (tiles, K, B)
            return nib.transpose(1, 2).reshape(-1, k)  # (tiles * B, K)
        out = p3.new_empty(p3.shape[0], self.block_n, k)  # (tiles, B, K); rows [0, B/2) = low
        torch.bitwise_and(p3, 0x0F, out=out[:, :half].transpose(1, 2))
        torch.bitwise_right_shift(p3, 4, out=out[:, half:].transpose(1, 2))
        return out.view(-1, k)

    def gather(self, packed: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Codes of rows ``ids``: uint8 (len(ids), k)."""
        half = self.block_n // 2
        p3 = packed.view(-1, k, half)
        pos = self.pos_of_row[ids % self.block_n]
        tile, byte_at = (ids // self.block_n).unsqueeze(1), (pos % half).unsqueeze(1)
        byte = p3[tile, _columns(k), byte_at]  # (L, K)
        return (byte >> ((pos // half) * 4).to(torch.uint8).unsqueeze(1)) & 0x0F


def _find_layout(n: int = PAD_N) -> Int4PackLayout | None:
    rows = torch.arange(n)
    flat = _pack(torch.stack([rows & 15, rows >> 4], dim=1)).reshape(-1)  # K = 2 probe
    for block_n in (64, 32, 16):
        p3 = flat.view(n // block_n, 2, block_n // 2)
        nib = torch.cat([p3 & 0x0F, p3 >> 4], dim=2).long()  # (tiles, 2, B)
        row = nib[:, 0] + 16 * nib[:, 1] - (torch.arange(n // block_n) * block_n).unsqueeze(1)
        if bool((row == row[0]).all()) and sorted(row[0].tolist()) == list(range(block_n)):
            pos = torch.argsort(row[0])
            ident = bool((pos == torch.arange(block_n)).all())
            return Int4PackLayout(block_n, pos, ident)
    return None


@functools.cache
def int4pack_layout() -> Int4PackLayout | None:
    """torch's int4pack tile layout on this build, or None when it is absent or not understood.

    Learned from a probe, then checked: random codes must round-trip through pack/unpack/gather,
    and the fused matmul must follow the documented (c - 8) * s + z semantics.
    """
    try:
        layout = _find_layout()
        if layout is None:
            return None
        gen = torch.Generator().manual_seed(0)
        n, k = 3 * PAD_N, 4 * GROUP
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        packed = _pack(codes)
        ids = torch.tensor([0, n - 1, 5, 77])
        if not torch.equal(layout.unpack(packed, k, 0, n // layout.block_n), codes):
            return None
        if not torch.equal(layout.gather(packed, k, ids), codes[ids]):
            return None
        sz = torch.rand(k // GROUP, n, 2, generator=gen).to(torch.bfloat16)
        x = torch.randn(2, k, generator=gen).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz).float()
        s, z = (sz[..., i].float().t().repeat_interleave(GROUP, dim=1) for i in (0, 1))
        ref = x.float() @ ((codes.float() - 8) * s + z).t()
        return layout if bool(((y - ref).norm() / ref.norm()) < 1e-2) else None
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


class Planes(ABC):
    """How GGUF codes u (rows, K) map onto 4-bit int4pack codes (rows, factor * K)."""

    factor: int
    kernel_key: str

    def __init__(self, fmt: BlockFormat) -> None:
        self.fmt = fmt

    @abstractmethod
    def encode(self, u: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, c: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def scale_zero(self, s: torch.Tensor, b: torch.Tensor | None) -> Pair:
        """Exact per-group S, B (rows, G) -> int4pack s, z (rows, G') in float32."""

    @abstractmethod
    def expand_x(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 x (M, K) -> x' (M, factor * K) matching the code layout."""


class OnePlane(Planes):
    """Semantics: w = (u - 8) * S + (S * (8 + c_min) + B)."""

    factor, kernel_key = 1, "int4pack"

    def encode(self, u: torch.Tensor) -> torch.Tensor:
        return u

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        return c

    def scale_zero(self, s: torch.Tensor, b: torch.Tensor | None) -> Pair:
        z = s * float(8 + self.fmt.c_min)
        return s, z if b is None else z + b

    def expand_x(self, x: torch.Tensor) -> torch.Tensor:
        return x


class SplitPlanes(Planes):
    """Semantics: w = [(lo - 8) S + S(8 + c_min + 16 t) + B] + 16 [(hi - 8) S + S (8 - t)]."""

    factor, kernel_key = 2, "int4pack2"

    def __init__(self, fmt: BlockFormat) -> None:
        super().__init__(fmt)
        self.t = 8 if fmt.c_min <= -64 else 0  # keeps both zeros power-of-two multiples of S

    def encode(self, u: torch.Tensor) -> torch.Tensor:
        return torch.cat([u & 0x0F, u >> 4], dim=1)  # (rows, 2K): [low plane | high plane]

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        k = c.shape[1] // 2
        return c[:, :k] | (c[:, k:] << 4)

    def scale_zero(self, s: torch.Tensor, b: torch.Tensor | None) -> Pair:
        z_lo = s * float(8 + self.fmt.c_min + 16 * self.t)
        z_lo = z_lo if b is None else z_lo + b
        return torch.cat([s, s], dim=1), torch.cat([z_lo, s * float(8 - self.t)], dim=1)

    def expand_x(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x * 16], dim=-1)  # (M, 2K), exact: 16 x is a power-of-two scaling


class PairedPlanes(Planes):
    """Semantics: per 16-sub-block, w = (lo - 8) S + 4 (4 hi + t - 8) S with t = (c_min + 40)/4."""

    factor, kernel_key = 2, "int4pack2"

    def __init__(self, fmt: BlockFormat) -> None:
        super().__init__(fmt)
        self.t = (fmt.c_min + 40) // 4

    def encode(self, u: torch.Tensor) -> torch.Tensor:
        rows, k = u.shape
        u3 = u.view(rows, k // 16, 16)
        return torch.cat([u3 & 0x0F, (u3 >> 4) * 4 + self.t], dim=2).reshape(rows, 2 * k)

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        rows, k2 = c.shape
        c3 = c.reshape(rows, k2 // 32, 32)
        hi = (c3[:, :, 16:] - self.t) >> 2
        return (c3[:, :, :16] | (hi << 4)).reshape(rows, k2 // 2)

    def scale_zero(self, s: torch.Tensor, b: torch.Tensor | None) -> Pair:
        return s, torch.zeros_like(s)

    def expand_x(self, x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        x3 = x.view(m, k // 16, 16)
        return torch.cat([x3, x3 * 4], dim=2).reshape(m, 2 * k)  # (M, 2K) per sub-block [x | 4x]


def planes_for(fmt: BlockFormat) -> Planes | None:
    """The plane layout that fits a GGUF format exactly, if any."""
    if not fmt.affine:
        return None
    if fmt.group_size == GROUP:
        return OnePlane(fmt) if fmt.bits <= 4 else SplitPlanes(fmt)
    paired_ok = not fmt.offset and 5 <= fmt.bits <= 6 and (fmt.c_min + 40) % 4 == 0
    if fmt.group_size == 16 and paired_ok and 0 <= (fmt.c_min + 40) // 4 <= 3:
        return PairedPlanes(fmt)
    return None


class Int4PackKernel(Kernel):
    """int4pack tiles (+ bf16 scale/zero) for decode, exact GGUF scale fields for everything else.

    Semantics (M < PREFILL_M, bf16 compute): y = float32(int4pack_mm(expand_x(bf16(x)), tiles))
    Semantics (otherwise): y = x @ dequantize_rows(chunk).T per chunk, float32.
    Memory per weight: one plane 0.5 B + 0.125 B (s, z) + the file's scale bytes; two planes
    1 B + 0.25 B + scale bytes.
    """

    row_multiple = PAD_N

    def __init__(
        self,
        shape: tuple[int, int],
        planes: Planes,
        layout: Int4PackLayout,
        packed: torch.Tensor,
        sz: torch.Tensor,
        fields: Fields,
    ) -> None:
        super().__init__(shape)
        self.name = planes.kernel_key
        self.planes, self.fmt, self.layout = planes, planes.fmt, layout
        self.packed = packed  # (n_pad, K' / 2) uint8, torch tile layout
        self.sz = sz  # (K' / 32, n_pad, 2) bfloat16: (s, z) per group and output row
        self.fields = fields  # compact exact scales, each (n_out, x)
        self.k_packed = shape[1] * planes.factor

    @classmethod
    def accepts(cls, qtype: QType, shape: Shape) -> bool:
        fmt = FORMATS.get(qtype)
        return fmt is not None and planes_for(fmt) is not None and int4pack_layout() is not None

    @classmethod
    def build(cls, raw: torch.Tensor, qtype: QType, shape: Shape) -> Kernel:
        fmt = FORMATS[qtype]
        planes, layout = planes_for(fmt), int4pack_layout()
        assert planes is not None and layout is not None
        n, k = shape
        n_pad = -(-n // PAD_N) * PAD_N
        kp = k * planes.factor
        packed = torch.zeros(n_pad, kp // 2, dtype=torch.uint8)
        sz = torch.zeros(kp // GROUP, n_pad, 2, dtype=torch.bfloat16)
        parts: list[Fields] = []
        step = config.chunk_rows(kp, PAD_N, config.LOAD_CHUNK_ELEMS)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            u, f = fmt.split_rows(raw[r0:r1], k)
            s, z = planes.scale_zero(*fmt.group_params(f))
            codes = planes.encode(u)  # (rows, K') in [0, 16)
            pad = (-codes.shape[0]) % PAD_N
            if pad:
                codes = torch.cat([codes, codes.new_zeros(pad, kp)])
            packed[r0 : r0 + codes.shape[0]] = _pack(codes)
            sz[:, r0:r1, 0] = s.t().to(torch.bfloat16)
            sz[:, r0:r1, 1] = z.t().to(torch.bfloat16)
            parts.append(f)
        fields = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
        return cls(shape, planes, layout, packed, sz, fields)

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if not config.use_fused(self.name, x.shape[0], exact):
            return self.chunked_matmul(x)
        xp = self.planes.expand_x(x.to(torch.bfloat16))  # (M, K')
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xp, self.packed, GROUP, self.sz)
        if self.packed.shape[0] != self.shape[0]:
            y = y[:, : self.shape[0]]  # (M, n_pad) -> (M, n_out)
        return y.float()

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        bn = self.layout.block_n
        b0, b1 = start // bn, -(-stop // bn)
        codes = self.layout.unpack(self.packed, self.k_packed, b0, b1)
        codes = codes[start - b0 * bn : stop - b0 * bn]
        fields = {name: v[start:stop] for name, v in self.fields.items()}
        return self.fmt.dequantize(self.planes.decode(codes), fields)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.layout.gather(self.packed, self.k_packed, ids)
        fields = {name: v[ids] for name, v in self.fields.items()}
        return self.fmt.dequantize(self.planes.decode(codes), fields)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.sz, *self.fields.values())
