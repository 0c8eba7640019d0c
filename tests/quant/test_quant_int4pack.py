"""The int4pack plumbing: the learned tile layout, and the plane algebra behind each GGUF type."""

from __future__ import annotations

import pytest
import torch

from graftlm.quant.formats import FORMATS
from graftlm.quant.int4pack import (
    GROUP,
    OnePlane,
    PairedPlanes,
    SplitPlanes,
    _pack,
    int4pack_layout,
    planes_for,
)

layout = int4pack_layout()
needs_int4pack = pytest.mark.skipif(layout is None, reason="torch int4pack is not usable here")


@needs_int4pack
@pytest.mark.parametrize("n,k", [(64, 32), (192, 96), (320, 1280)])
def test_layout_unpacks_and_gathers_what_torch_packed(n: int, k: int) -> None:
    assert layout is not None
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = _pack(codes)
    bn = layout.block_n  # 64 on AVX-512 builds of torch, 32 on AVX2 ones
    assert torch.equal(layout.unpack(packed, k, 0, n // bn), codes)
    if n >= 2 * bn:  # a second tile exists
        assert torch.equal(layout.unpack(packed, k, 1, 2), codes[bn : 2 * bn])
    ids = torch.tensor([n - 1, 0, min(bn, n - 1), bn // 2 + 1, 3])
    assert torch.equal(layout.gather(packed, k, ids), codes[ids])


def test_plane_choice_per_format() -> None:
    kinds = {q.name: type(planes_for(f)).__name__ for q, f in FORMATS.items()}
    assert kinds == {
        "Q4_0": "OnePlane",
        "Q4_1": "OnePlane",
        "Q4_K": "OnePlane",
        "Q5_0": "SplitPlanes",
        "Q5_1": "SplitPlanes",
        "Q5_K": "SplitPlanes",
        "Q8_0": "SplitPlanes",
        "Q6_K": "PairedPlanes",
        "Q2_K": "NoneType",
        "Q3_K": "NoneType",  # 16-groups of <= 4 bits: would need padding
        "MXFP4": "NoneType",  # a table of values, not affine in the code
    }


@pytest.mark.parametrize(
    "qtype", [q for q, f in FORMATS.items() if planes_for(f)], ids=lambda q: q.name
)
def test_plane_algebra_reproduces_gguf_weights(qtype: object) -> None:
    """Reference twin of the fused kernel's arithmetic, in float64 with unrounded s, z:

    sum over planes of x' * ((c - 8) * s + z) must equal x * (S * (u + c_min) + B) exactly.
    """
    fmt = FORMATS[qtype]  # type: ignore[index]
    planes = planes_for(fmt)
    assert planes is not None
    rows, k = 3, 256
    u = torch.randint(0, 2**fmt.bits, (rows, k), dtype=torch.uint8)
    u[0, : 2**fmt.bits] = torch.arange(2**fmt.bits, dtype=torch.uint8)[:k]  # every code value
    g = k // fmt.group_size
    s = torch.rand(rows, g, dtype=torch.float64) + 0.5
    b = torch.randn(rows, g, dtype=torch.float64) if fmt.offset else None
    c = planes.encode(u)
    assert c.shape == (rows, planes.factor * k) and int(c.max()) < 16
    assert torch.equal(planes.decode(c), u)
    sp, zp = planes.scale_zero(s, b)
    w_eff = (c.double() - 8).view(rows, -1, GROUP) * sp.unsqueeze(-1) + zp.unsqueeze(-1)
    x = torch.eye(k, dtype=torch.float64)  # probe every column: x' @ w_eff.T = W.T
    got = planes.expand_x(x) @ w_eff.view(rows, -1).T  # (k, rows)
    want = (u.double() + fmt.c_min).view(rows, g, -1) * s.unsqueeze(-1)
    if b is not None:
        want = want + b.unsqueeze(-1)
    assert torch.allclose(got.T, want.view(rows, k), rtol=0, atol=1e-12)


def test_symmetric_types_have_bf16_exact_zeros() -> None:
    """Zeros that are power-of-two multiples of the scale stay exact after rounding to bf16."""
    s = torch.rand(2, 8) + 0.1
    for qtype in ("Q4_0", "Q5_0", "Q8_0", "Q6_K"):
        fmt = next(f for q, f in FORMATS.items() if q.name == qtype)
        planes = planes_for(fmt)
        assert isinstance(planes, (OnePlane, SplitPlanes, PairedPlanes))
        sp, zp = planes.scale_zero(s.repeat(1, 2) if fmt.group_size == 16 else s, None)
        ratio = zp / sp
        assert torch.all((ratio == 0) | (ratio.abs().log2() == ratio.abs().log2().round()))
