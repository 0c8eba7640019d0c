"""An adapter's factors on one projection in the native delta's layout, packed once when the adapter
is read (``AdapterSet.load``; the server reads in a worker thread), never in a step, and the table
of a projection's packed adapters that the kernels read (``gl_lora_site``; the layouts are
described in ``native/csrc/lora.c``).

Semantics are the PyTorch twin's (``LoraSite.add_delta``): per row b of the batch
    y[b] += sum_s scales[b, s] * B_s (A_s x[b]).
What this adds is the form each factor takes:

- A (r, n_in): on a projection whose base product is approximate (``compact``: int8 activations)
  as Q8_0 codes and scales packed as an s8 weight, so A . x takes the base product's integer dots
  (|error| <= max|block| / 254), or in bfloat16 where n_in is not whole blocks of 32; float32
  otherwise.
- B (n_out, r) in parts: consecutive columns whose nonzero outputs fall in the same 32-output
  blocks (an adapter on q, k and v of a stacked projection has three), each stored block by block
  with the block's columns in turn, so a task of 32 outputs reads one contiguous range of each
  part; bfloat16 on a compact projection (each 16 outputs as the pairs (o + u, o + 8 + u)),
  float32 otherwise. A column that is zero in B is in no part and costs nothing.

A projection's adapters are one table of such slots, each naming its column in the batch's scale
table: the kernels skip an adapter at scale 0 on a row, and one at 0 on every row, so a step with
any mix of adapters reads each active adapter's factors once and builds nothing.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from graftlm.native import library
from graftlm.native.abi import GlLoraPart, GlLoraSite, GlLoraSlot
from graftlm.quant.native_kernels import NativeS8Kernel

BLOCK = 32  # outputs a product task covers: one block of every part it reaches


def part_ranges(bt: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(c0, r, lo, hi) of each part of B (bt: (R, n_out), B transposed): the runs of consecutive
    columns that reach the same blocks [lo, hi) of 32 outputs; zero columns are in none."""
    r, n_out = bt.shape
    blocks = -(-n_out // BLOCK)
    padded = torch.zeros(r, blocks * BLOCK, dtype=torch.bool)
    padded[:, :n_out] = bt != 0
    nz = padded.view(r, blocks, BLOCK).any(dim=2)  # (R, blocks): where each column reaches
    first = nz.int().argmax(dim=1)
    last = blocks - nz.flip(1).int().argmax(dim=1)
    out: list[tuple[int, int, int, int]] = []
    for c, (any_nz, blo, bhi) in enumerate(
        zip(nz.any(dim=1).tolist(), first.tolist(), last.tolist(), strict=True)
    ):
        if not any_nz:
            continue
        if out and out[-1][0] + out[-1][1] == c and out[-1][2:] == (blo, bhi):
            c0, n, _, _ = out[-1]
            out[-1] = (c0, n + 1, blo, bhi)
        else:
            out.append((c, 1, blo, bhi))
    return out


def pack_part(bt: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns bt (r, n_out) over blocks [lo, hi) as the kernels read them: (hi - lo, r, 32),
    block by block, zero past n_out; in bfloat16 each 16 outputs as the pairs (o + u, o + 8 + u)."""
    r, n_out = bt.shape
    cut = bt[:, lo * BLOCK : min(hi * BLOCK, n_out)]
    padded = torch.zeros(r, (hi - lo) * BLOCK, dtype=dtype)
    padded[:, : cut.shape[1]] = cut
    blocks = padded.view(r, hi - lo, BLOCK).transpose(0, 1)  # (blocks, r, 32)
    if dtype == torch.bfloat16:
        blocks = blocks.reshape(hi - lo, r, 2, 2, 8).transpose(3, 4)
    return blocks.reshape(hi - lo, r, BLOCK).contiguous()


def unpack_part(data: torch.Tensor, n_out: int, lo: int) -> torch.Tensor:
    """The inverse of pack_part: (r, n_out) float32, zero outside the part's blocks."""
    blocks, r, _ = data.shape
    if data.dtype == torch.bfloat16:
        data = data.view(blocks, r, 2, 8, 2).transpose(3, 4).reshape(blocks, r, BLOCK)
    out = torch.zeros(r, max(n_out, (lo + blocks) * BLOCK))
    out[:, lo * BLOCK : (lo + blocks) * BLOCK] = data.transpose(0, 1).reshape(r, -1).float()
    return out[:, :n_out]


def a_s8(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A (r, n_in) float32 as an s8 weight for the products' integer dots: Q8_0 codes and scales
    (per 32 values, |error| <= max|block| / 254), packed as a Q8_0 weight is. None when n_in is
    not a whole number of blocks, or without the library."""
    r, n_in = a.shape
    if n_in % 32 or library() is None:
        return None
    raw = quants.quantize(a.contiguous().numpy(), GGMLQuantizationType.Q8_0)
    k = NativeS8Kernel.build(
        torch.from_numpy(np.ascontiguousarray(raw)), GGMLQuantizationType.Q8_0, (r, n_in)
    )
    assert isinstance(k, NativeS8Kernel)
    return k.q, k.s


@dataclass(frozen=True)
class Part:
    c0: int
    r: int
    lo: int
    hi: int
    data: torch.Tensor  # pack_part's (hi - lo, r, 32)


class PackedSlot:
    """One adapter's factors on one projection, packed (see the module's docstring)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, compact: bool) -> None:
        dtype = torch.bfloat16 if compact else torch.float32
        self.r, self.n_out = int(a.shape[0]), int(b.shape[0])
        self.half = compact
        self.aq = a_s8(a) if compact else None
        # A itself only where the integer dots cannot serve
        self.a = None if self.aq is not None else a.to(dtype).contiguous()
        bt = b.T
        self.parts = [
            Part(c0, r, lo, hi, pack_part(bt[c0 : c0 + r], lo, hi, dtype))
            for c0, r, lo, hi in part_ranges(bt)
        ]
        self._parts = (GlLoraPart * max(len(self.parts), 1))()
        for i, p in enumerate(self.parts):
            self._parts[i] = GlLoraPart(p.data.data_ptr(), p.c0, p.r, p.lo, p.hi)
        self.struct = GlLoraSlot(
            a=None if self.a is None else self.a.data_ptr(),
            parts=ctypes.addressof(self._parts),
            r=self.r,
            n_parts=len(self.parts),
        )
        if self.aq is not None:
            self.struct.aq, self.struct.a_scales = self.aq[0].data_ptr(), self.aq[1].data_ptr()
            self.struct.a_half = int(self.aq[1].dtype is torch.float16)

    @property
    def nbytes(self) -> int:
        """The bytes the packed factors take."""
        held = [p.data for p in self.parts] + ([self.a] if self.a is not None else [])
        held += list(self.aq or ())
        return sum(t.numel() * t.element_size() for t in held)

    def b_dense(self) -> torch.Tensor:
        """B (n_out, r) float32 back from the parts (what the kernels multiply by)."""
        out = torch.zeros(self.r, self.n_out)
        for p in self.parts:
            out[p.c0 : p.c0 + p.r] = unpack_part(p.data, self.n_out, p.lo)
        return out.T.contiguous()


def pack(a: torch.Tensor, b: torch.Tensor, compact: bool) -> PackedSlot | None:
    """The factors packed, or None where the native delta does not serve them (no library,
    factors off the CPU)."""
    if library() is None or a.device.type != "cpu" or b.device.type != "cpu":
        return None
    return PackedSlot(a.float(), b.float(), compact)


class SlotTable:
    """A projection's packed adapters as one C array (gl_lora_slot), in slot order, each
    naming its slot id: its column in the batch's scale table. Every slot of a projection is
    packed for the same kind of base product (compact or not)."""

    def __init__(self, slots: list[tuple[int, PackedSlot]]) -> None:
        self.slots = [p for _, p in slots]  # the structs point into them
        self.ids = [s for s, _ in slots]
        self.bf = int(self.slots[0].half)
        self.array = (GlLoraSlot * max(len(slots), 1))(*[p.struct for p in self.slots])
        for i, (slot, _) in enumerate(slots):
            self.array[i].id = slot

    def point(self, site: GlLoraSite, scales: int, ld: int) -> None:
        """Point a gl_lora_site at this table and at a scale table (rows ld floats apart)."""
        site.slot, site.n, site.bf = ctypes.addressof(self.array), len(self.slots), self.bf
        site.scales, site.ld = scales, ld

    def site(self, scales: torch.Tensor) -> GlLoraSite:
        """A gl_lora_site over this table for scales (B, n_cols) float32, contiguous."""
        site = GlLoraSite()
        self.point(site, scales.data_ptr(), scales.shape[1])
        return site
