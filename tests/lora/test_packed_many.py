"""An adapter's projections packed together (pack_many, the read off the engine's thread) are
byte for byte what each packed alone gives; the batched value check refuses what the per-delta
one refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from graftlm.errors import AdapterError
from graftlm.lora import packed
from graftlm.lora.adapter import Delta, ResolvedAdapter
from graftlm.native import library
from graftlm.quant.native_kernels import NativeS8Kernel

pytestmark = pytest.mark.skipif(library() is None, reason="no native library")


def _factors(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Projections as an adapter gives them: q and v stacked into one qkv (two parts, zero
    blocks between), a plain one, one with a zero column, one of another rank and n_in."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(5):  # stacked q (outputs 0..575) and v (outputs 768..959) of rank 4 each
        b = torch.zeros(960, 8)
        b[:576, :4] = torch.randn(576, 4, generator=g)
        b[768:, 4:] = torch.randn(192, 4, generator=g)
        if i == 3:
            b[:, 2] = 0  # a zero column: this one's parts differ from the others'
        out.append((torch.randn(8, 576, generator=g), b))
    out += [(torch.randn(4, 576, generator=g), torch.randn(200, 4, generator=g)) for _ in range(3)]
    out.append((torch.randn(12, 96, generator=g), torch.randn(64, 12, generator=g)))
    out.append((torch.randn(3, 40, generator=g), torch.randn(64, 3, generator=g)))  # n_in % 32
    return out


def _alone_a_s8(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A's Q8_0 form as it was made for one projection: gguf's quantizer, then the s8 packer."""
    raw = quants.quantize(a.contiguous().numpy(), GGMLQuantizationType.Q8_0)
    k = NativeS8Kernel.build(
        torch.from_numpy(np.ascontiguousarray(raw)), GGMLQuantizationType.Q8_0, tuple(a.shape)
    )
    assert isinstance(k, NativeS8Kernel)
    return k.q, k.s


def _same(x: torch.Tensor, y: torch.Tensor) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape
    assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


@pytest.mark.parametrize("compact", [True, False])
def test_pack_many_is_each_packed_alone(compact: bool) -> None:
    factors = _factors(0)
    together = packed.pack_many(factors, compact)
    for (a, b), many in zip(factors, together, strict=True):
        alone = packed.PackedSlot(a, b, compact)
        assert many is not None
        assert [(p.c0, p.r, p.lo, p.hi) for p in many.parts] == [
            (p.c0, p.r, p.lo, p.hi) for p in alone.parts
        ]
        for p, q in zip(many.parts, alone.parts, strict=True):
            _same(p.data, q.data)
            assert p.data.is_contiguous()
        assert (many.aq is None) == (alone.aq is None) and (many.a is None) == (alone.a is None)
        if alone.aq is not None:
            assert many.aq is not None
            ref = _alone_a_s8(a)
            for x, y, z in zip(many.aq, alone.aq, ref, strict=True):
                _same(x, y)
                _same(x, z)
                assert x.is_contiguous()
        if alone.a is not None:
            assert many.a is not None
            _same(many.a, alone.a)
        assert many.nbytes == alone.nbytes
        torch.testing.assert_close(many.b_dense(), alone.b_dense(), rtol=0, atol=0)
        assert (many.struct.r, many.struct.n_parts) == (alone.struct.r, alone.struct.n_parts)


def test_batched_value_check_refuses_what_each_check_refuses() -> None:
    """Many projections of one shape checked together: one past float16's range is named."""
    g = torch.Generator().manual_seed(1)
    deltas = {
        f"blk.{i}.attn_q": Delta(
            torch.randn(4, 64, generator=g), torch.randn(64, 4, generator=g), sources=(f"t{i}",)
        )
        for i in range(6)
    }
    ok = ResolvedAdapter("x.gguf", 0.0, dict(deltas), n_tensors=12)
    ok.check_values()
    deltas["blk.4.attn_q"].b *= 1e6
    bad = ResolvedAdapter("x.gguf", 0.0, deltas, n_tensors=12)
    with pytest.raises(AdapterError, match=r"t4 \(in blk\.4\.attn_q\): its delta reaches") as err:
        bad.check_values()
    assert "t3" not in str(err.value)
    deltas["blk.4.attn_q"].b[0, 0] = float("nan")
    with pytest.raises(AdapterError, match="1 value is inf or nan"):
        bad.check_values()


def test_combine_all_is_each_combined_alone() -> None:
    """Projections whose pieces are laid out alike (Q and V stacked into each layer's QKV) are
    combined as one stack: the same A, B, ranks and sources as each combined alone."""
    from types import SimpleNamespace

    from graftlm.lora.gguf_adapter import combine, combine_all

    g = torch.Generator().manual_seed(2)

    def piece(rows: slice, at: slice, r: int, n_rows: int, name: str) -> tuple:
        d = Delta(torch.randn(r, 32, generator=g), torch.randn(n_rows, r, generator=g))
        d.sources = (name,)
        return rows, at, d

    pieces = {
        f"blk.{i}.attn_qkv": [
            piece(slice(0, 64), slice(0, 64), 4, 64, f"blk.{i}.attn_q.weight"),
            piece(slice(0, 16), slice(80, 96), 4 if i < 3 else 2, 16, f"blk.{i}.attn_v.weight"),
        ]
        for i in range(4)  # the last one's v has another rank: combined on its own
    }
    pieces["blk.0.ffn_down"] = [piece(slice(0, 96), slice(0, 96), 4, 96, "blk.0.ffn_down.weight")]
    model = SimpleNamespace(
        cfg=SimpleNamespace(n_embd=32),
        projections=lambda: {n: SimpleNamespace(n_out=96) for n in pieces},
    )
    together = combine_all(pieces, model)  # type: ignore[arg-type]
    assert list(together) == list(pieces)
    for name, parts in pieces.items():
        alone = combine(parts, 96)
        got = together[name]
        assert torch.equal(got.a, alone.a) and torch.equal(got.b, alone.b)
        assert got.parts == alone.parts and got.sources == alone.sources
        assert got.a.is_contiguous() and got.b.is_contiguous()


def test_a_s8_many_of_several_ranks_is_each_alone() -> None:
    g = torch.Generator().manual_seed(3)
    factors = [torch.randn(r, 64, generator=g) for r in (4, 12, 8, 1, 4)]
    factors[1][3] = 0  # a zero row among the real ones
    for a, got in zip(factors, packed.a_s8_many(factors), strict=True):
        assert got is not None
        for x, y in zip(got, _alone_a_s8(a), strict=True):
            _same(x, y)


def test_a_s8_is_gguf_q8_0_bit_for_bit_at_the_edges() -> None:
    """The native quantizer rounds as gguf's: ties away from zero, zero blocks, scales from
    float16's subnormals to its largest, every magnitude between."""
    g = torch.Generator().manual_seed(4)
    blocks = [torch.randn(32, generator=g) * 10.0**e for e in range(-30, 7, 3)]
    tie = torch.arange(32, dtype=torch.float32) - 15.5  # d = 127 / 127 = 1 after the max below
    tie[0] = -127.0
    blocks += [tie, tie * 0.5, -tie, torch.zeros(32), torch.full((32,), 1e-8)]
    blocks += [torch.full((32,), -3.0e-3), torch.tensor([6e4] + [1.0] * 31)]
    n = len(blocks) // 2 * 2  # rows of 64 values: two blocks each
    a = torch.stack(blocks[:n]).view(n // 2, 64)
    for rows in (a, a[:5], a[:1]):
        got = packed.a_s8(rows.contiguous())
        assert got is not None
        for x, y in zip(got, _alone_a_s8(rows.contiguous()), strict=True):
            _same(x, y)
