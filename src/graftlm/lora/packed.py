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

import torch

from graftlm.native import library
from graftlm.native.abi import GlLoraPart, GlLoraSite, GlLoraSlot

BLOCK = 32  # outputs a product task covers: one block of every part it reaches


def part_ranges(bt: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(c0, r, lo, hi) of each part of B (bt: (R, n_out), B transposed): the runs of consecutive
    columns that reach the same blocks [lo, hi) of 32 outputs; zero columns are in none."""
    return part_ranges_many(bt.unsqueeze(0))[0]


def part_ranges_many(bts: torch.Tensor) -> list[list[tuple[int, int, int, int]]]:
    """part_ranges of each of G factors of one shape at once (bts: (G, R, n_out)): a few tensor
    operations for all of them, then plain Python on the (G, R) summary."""
    g, r, n_out = bts.shape
    blocks = -(-n_out // BLOCK)
    padded = torch.zeros(g, r, blocks * BLOCK, dtype=torch.bool)
    padded[:, :, :n_out] = bts != 0
    nz = padded.view(g, r, blocks, BLOCK).any(dim=3)  # (G, R, blocks): where each column reaches
    first = nz.int().argmax(dim=2)
    last = blocks - nz.flip(2).int().argmax(dim=2)
    summary = torch.stack([nz.any(dim=2).int(), first, last], dim=2)  # (G, R, 3)
    if g and bool((summary == summary[:1]).all()):  # (the usual stack: all columns alike)
        ranges = _runs(summary[0].tolist())
        return [list(ranges) for _ in range(g)]
    return [_runs(cols) for cols in summary.tolist()]


def _runs(cols: list[list[int]]) -> list[tuple[int, int, int, int]]:
    """(c0, r, lo, hi) of each run of consecutive columns of one factor that reach the same
    blocks, from its columns' (any nonzero, first block, end block)."""
    ranges: list[tuple[int, int, int, int]] = []
    for c, (any_nz, blo, bhi) in enumerate(cols):
        if not any_nz:
            continue
        if ranges and ranges[-1][0] + ranges[-1][1] == c and ranges[-1][2:] == (blo, bhi):
            c0, n, _, _ = ranges[-1]
            ranges[-1] = (c0, n + 1, blo, bhi)
        else:
            ranges.append((c, 1, blo, bhi))
    return ranges


def pack_part(bt: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns bt (r, n_out) over blocks [lo, hi) as the kernels read them: (hi - lo, r, 32),
    block by block, zero past n_out; in bfloat16 each 16 outputs as the pairs (o + u, o + 8 + u)."""
    return pack_parts(bt.unsqueeze(0), lo, hi, dtype)[0]


def pack_parts(bts: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """pack_part of G factors of one shape at once: bts (G, r, n_out) -> (G, hi - lo, r, 32)."""
    g, r, n_out = bts.shape
    cut = bts[:, :, lo * BLOCK : min(hi * BLOCK, n_out)]
    padded = torch.zeros(g, r, (hi - lo) * BLOCK, dtype=dtype)
    padded[:, :, : cut.shape[2]] = cut
    blocks = padded.view(g, r, hi - lo, BLOCK).transpose(1, 2)  # (G, blocks, r, 32)
    if dtype == torch.bfloat16:
        blocks = blocks.reshape(g, hi - lo, r, 2, 2, 8).transpose(4, 5)
    return blocks.reshape(g, hi - lo, r, BLOCK).contiguous()


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
    return a_s8_many([a])[0]


def a_s8_many(factors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """a_s8 of several A of one n_in in one native call (csrc/quant.c's gl_pack_q8_0_f32: gguf's
    Q8_0 quantizer, then the s8 packer, on one thread): each A's rows then zero rows to whole
    groups of 8 (as the packer pads a lone one; a zero row's Q8_0 bytes are all zero), so each
    one's codes and scales are a contiguous view of the shared result, byte for byte what a_s8
    gives it alone."""
    n_in = int(factors[0].shape[1])
    lib = library()
    if n_in % 32 or lib is None:
        return [None] * len(factors)
    rows = [int(a.shape[0]) for a in factors]
    padded = [-(-r // 8) * 8 for r in rows]
    total = sum(padded)
    if len(set(rows)) == 1:  # (the usual adapter: one rank everywhere)
        x = torch.zeros(len(factors), padded[0], n_in)
        x[:, : rows[0]] = torch.stack(factors)
    else:
        x = torch.zeros(total, n_in)
        at = 0
        for a, r, p in zip(factors, rows, padded, strict=True):
            x[at : at + r] = a
            at += p
    q = torch.empty(total // 8, n_in // 32 * 256, dtype=torch.uint8)  # (groups of 8 rows, codes)
    s = torch.empty(total, n_in // 32, dtype=torch.float16)
    lib.gl_pack_q8_0_f32(x.data_ptr(), total, n_in, q.data_ptr(), s.data_ptr())
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    at = 0
    for p in padded:
        out.append((q[at // 8 : (at + p) // 8].view(-1), s[at : at + p]))
        at += p
    return out


def unpack_a_s8(aq: tuple[torch.Tensor, torch.Tensor], r: int, n_in: int) -> torch.Tensor:
    """The inverse of a_s8, as ggml dequantizes Q8_0 (code times its block's float16 scale):
    A (r, n_in) float32. The layout is gl_pack_s8's (csrc/quant.c): rows in groups of 8, per
    group and block of 32 values the codes of value 4 c + j of row i at byte 32 c + 4 i + j, the
    scales of a group's block its 8 rows' in turn."""
    kb, groups = n_in // 32, -(-r // 8)
    q = aq[0].view(torch.int8).view(groups, kb, 8, 8, 4)  # (group, block, c, row i, j)
    codes = q.permute(0, 3, 1, 2, 4).reshape(groups * 8, n_in)[:r]
    d = aq[1].reshape(groups, kb, 8).permute(0, 2, 1).reshape(groups * 8, kb)[:r]
    return (codes.float().view(r, kb, 32) * d.float().unsqueeze(2)).view(r, n_in)


@dataclass(frozen=True)
class Part:
    c0: int
    r: int
    lo: int
    hi: int
    data: torch.Tensor  # pack_part's (hi - lo, r, 32)


class PackedSlot:
    """One adapter's factors on one projection, packed (see the module's docstring): the only
    form of them a site keeps (lora.site). `factors()` reads A and B back in float32 for the
    PyTorch twin: the very values the kernels multiply by (on a compact site B rounded to
    bfloat16 and A through Q8_0; on any other site the factors as given)."""

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        compact: bool,
        ahead: tuple[tuple[torch.Tensor, torch.Tensor] | None, list[Part]] | None = None,
    ) -> None:
        """ahead: A's s8 form (None: none) and B's parts, made already (pack_many)."""
        dtype = torch.bfloat16 if compact else torch.float32
        self.r, self.n_in, self.n_out = int(a.shape[0]), int(a.shape[1]), int(b.shape[0])
        self.half = compact
        if ahead is None:
            bt = b.T
            ahead = (
                a_s8(a) if compact else None,
                [
                    Part(c0, r, lo, hi, pack_part(bt[c0 : c0 + r], lo, hi, dtype))
                    for c0, r, lo, hi in part_ranges(bt)
                ],
            )
        self.aq, self.parts = ahead
        # A itself only where the integer dots cannot serve
        self.a = None if self.aq is not None else a.to(dtype).contiguous()
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

    def a_dense(self) -> torch.Tensor:
        """A (r, n_in) float32 back from its form (what the kernels multiply by): the Q8_0
        codes times their scales, or the bfloat16 or float32 A widened (float32: A itself)."""
        if self.aq is not None:
            return unpack_a_s8(self.aq, self.r, self.n_in)
        assert self.a is not None
        return self.a.float()

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (r, n_in), B (n_out, r)) in float32, made anew on each call (nothing is kept)."""
        return self.a_dense(), self.b_dense()


def pack(a: torch.Tensor, b: torch.Tensor, compact: bool) -> PackedSlot | None:
    """The factors packed, or None where the native delta does not serve them (no library,
    factors off the CPU)."""
    if library() is None or a.device.type != "cpu" or b.device.type != "cpu":
        return None
    return PackedSlot(a.float(), b.float(), compact)


def pack_many(
    factors: list[tuple[torch.Tensor, torch.Tensor]], compact: bool
) -> list[PackedSlot | None]:
    """pack of each (A, B) in turn, the same bytes, made together: the factors of one shape (an
    adapter's q of every layer, its v of every layer) go through each step of the packing as
    one stack (A's Q8_0 form in one quantization and one packing call, B's part ranges and their
    blocks in a few tensor operations), so an adapter costs a few dozen tensor operations, not
    a few dozen a projection (a reader thread under traffic waits for the interpreter's lock at
    each of them)."""
    out: list[PackedSlot | None] = [None] * len(factors)
    if library() is None or any(
        a.device.type != "cpu" or b.device.type != "cpu" for a, b in factors
    ):
        return out
    dtype = torch.bfloat16 if compact else torch.float32
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (a, b) in enumerate(factors):
        groups.setdefault((*a.shape, *b.shape), []).append(i)
    for idx in groups.values():
        a_list = [factors[i][0].float() for i in idx]
        aqs: list[tuple[torch.Tensor, torch.Tensor] | None] = (
            a_s8_many(a_list) if compact else [None] * len(idx)
        )
        bts = torch.stack([factors[i][1] for i in idx]).float().transpose(1, 2)  # (G, r, n_out)
        ranges = part_ranges_many(bts)
        if all(rs == ranges[0] for rs in ranges):
            # (the usual adapter: each projection's columns reach the same blocks) each part
            # packed for all of them at once
            stacks = [(c0, w, lo, hi, pack_parts(bts[:, c0 : c0 + w], lo, hi, dtype))
                      for c0, w, lo, hi in ranges[0]]  # fmt: skip
            parts = [[Part(c0, w, lo, hi, data[g]) for c0, w, lo, hi, data in stacks]
                     for g in range(len(idx))]  # fmt: skip
        else:
            parts = [
                [Part(c0, w, lo, hi, pack_part(bts[g, c0 : c0 + w], lo, hi, dtype))
                 for c0, w, lo, hi in rs]
                for g, rs in enumerate(ranges)
            ]  # fmt: skip
        for g, i in enumerate(idx):
            out[i] = PackedSlot(a_list[g], factors[i][1], compact, (aqs[g], parts[g]))
    return out


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
