"""The AMX tiles' products (csrc/amx.c) against their twin: the same product in PyTorch, float64,
on the bfloat16 roundings of x and of gguf's dequantized weight. The tiles sum exact products of
those roundings in float32, so only the order of the sums may differ. Skipped where the library
has no AMX or Linux refused the tiles' state; test_isa keeps the VNNI kernels' own twins."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from layer_twins import q8_x
from synth_tensors import gguf_tensor

from graftlm.native import amx, build, library
from graftlm.quant import QWeight

pytestmark = pytest.mark.skipif(not amx(), reason="no AMX tiles here (CPU, compiler or kernel)")

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q2_K, Q.IQ4_NL,
         Q.IQ4_XS]  # fmt: skip


@pytest.fixture(autouse=True)
def tiles_from_32_rows() -> Iterator[None]:
    """The tiles take products of 32 rows or more here, whatever GRAFTLM_AMX_ROWS says."""
    lib = library()
    assert lib is not None
    before = lib.gl_set_amx_rows(32)
    yield
    lib.gl_set_amx_rows(before)


def bf16_twin(x: torch.Tensor, raw: np.ndarray, qt: Q, shape: tuple[int, int]) -> torch.Tensor:
    w = torch.from_numpy(quants.dequantize(raw, qt).reshape(shape))
    return x.bfloat16().double() @ w.bfloat16().double().T


def assert_twin(y: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within float32 summation error of the twin: a few ulps of the sum of |terms| per output."""
    bound = x.bfloat16().double().abs() @ w.bfloat16().double().abs().T
    err = (y.double() - want).abs()
    assert bool((err <= 4e-6 * bound + 1e-30).all()), float((err / bound).max())


@pytest.mark.parametrize("qt", TYPES)
def test_tiles_match_the_bfloat16_twin(qt: Q) -> None:
    """Every weight format on the tiles: 72 outputs (two whole tasks of 32, and 8 the VNNI
    kernels take), 32 rows, 45 (a last tile of 13 rows), 300."""
    shape = (72, 512)
    raw, _ = gguf_tensor(qt, shape, seed=7)
    w = QWeight.from_gguf(raw, qt, shape, name="w")
    deq = torch.from_numpy(quants.dequantize(raw, qt).reshape(shape))
    lib = library()
    assert lib is not None
    for m in (32, 45, 300):
        x = torch.randn(m, shape[1], generator=torch.Generator().manual_seed(m))
        y = w.matmul(x)
        assert_twin(y[:, :64], bf16_twin(x, raw, qt, shape)[:, :64], x, deq[:64])
        before = lib.gl_set_amx_rows(0)  # the same product on the VNNI kernels
        vnni = w.matmul(x)
        lib.gl_set_amx_rows(before)
        torch.testing.assert_close(y[:, 64:], vnni[:, 64:], rtol=0, atol=0)  # the last 8 outputs
        assert not torch.equal(y[:, :64], vnni[:, :64])  # int8 x there, bfloat16 here


def test_long_rows_in_chunks_of_k() -> None:
    """600 rows of k = 8192: x in bfloat16 is 9.4 MiB, so the sums are made over chunks of k
    (amx_tasks) that add to what the previous chunks left in y."""
    qt, shape = Q.Q4_K, (64, 8192)
    raw, _ = gguf_tensor(qt, shape, seed=2)
    w = QWeight.from_gguf(raw, qt, shape, name="w")
    deq = torch.from_numpy(quants.dequantize(raw, qt).reshape(shape))
    x = torch.randn(600, shape[1], generator=torch.Generator().manual_seed(1))
    assert_twin(w.matmul(x), bf16_twin(x, raw, qt, shape), x, deq)


def test_rows_below_the_threshold_stay_on_vnni() -> None:
    """31 rows take the VNNI kernels (int8 x), bit for bit what they give with the tiles off."""
    qt, shape = Q.Q4_K, (64, 512)
    raw, _ = gguf_tensor(qt, shape, seed=4)
    w = QWeight.from_gguf(raw, qt, shape, name="w")
    lib = library()
    assert lib is not None
    x = torch.randn(31, shape[1], generator=torch.Generator().manual_seed(3))
    y, tiles = w.matmul(x), w.matmul(torch.cat([x, x[:1]]))[:31]
    lib.gl_set_amx_rows(0)
    off = w.matmul(x)
    assert torch.equal(y, off)
    assert not torch.equal(tiles, off)  # one row more, and the tiles take them


def test_rows_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAFTLM_AMX_ROWS", "0")
    assert build.amx_rows() == 0
    monkeypatch.setenv("GRAFTLM_AMX_ROWS", "64")
    assert build.amx_rows() == 64
    for bad in ("-1", "many"):
        monkeypatch.setenv("GRAFTLM_AMX_ROWS", bad)
        with pytest.raises(ValueError, match=f"GRAFTLM_AMX_ROWS='{bad}'"):
            build.amx_rows()


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q8_0])
def test_lora_delta_on_the_tiles(qt: Q) -> None:
    """A projection with adapters at 48 rows: the delta's s * A . x (int8 dots, as at any row
    count) in bfloat16 against B in bfloat16, summed on the tiles with the base product. 72
    outputs: the last 8 on the VNNI kernels and the float delta. Two adapters of ranks 4 and 36
    (two blocks of 32 columns), one on part of the outputs, rows on different adapters, a row on
    none."""
    from graftlm.lora.site import LoraSite
    from graftlm.models.seam import Projection
    from graftlm.step.batch import Batch, LoraRows

    n_out, n_in = 72, 512
    raw, _ = gguf_tensor(qt, (n_out, n_in), seed=9)
    w = QWeight.from_gguf(raw, qt, (n_out, n_in), name="w")
    p = Projection("blk.0.ffn_gate_up", w)
    p.lora = LoraSite(n_in, n_out, compact=True)
    g = torch.Generator().manual_seed(5)
    a1, b1 = torch.randn(4, n_in, generator=g), torch.randn(n_out, 4, generator=g)
    a2, b2 = torch.randn(36, n_in, generator=g) / 8, torch.randn(n_out, 36, generator=g)
    b2[:40] = 0
    p.lora.put(1, a1, b1)
    p.lora.put(2, a2, b2)
    table = [[0.0, 1.0, 0.5], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]]
    rows = LoraRows(torch.tensor(table), (1, 2))
    x = torch.randn(3, 16, n_in, generator=g)
    batch = Batch(torch.zeros(3, 16, dtype=torch.long), [0, 1, 2], [0] * 3, [16] * 3, rows)
    got = p(x, batch)
    base = w.matmul(x)
    torch.testing.assert_close(got[2], base[2], rtol=0, atol=0)  # the row on no adapter
    want = base.clone()
    for slot, (a, b) in ((1, (a1, b1)), (2, (a2, b2))):
        aq = torch.from_numpy(quants.dequantize(quants.quantize(a.numpy(), Q.Q8_0), Q.Q8_0))
        scale = torch.tensor(table)[:, slot].view(3, 1, 1)
        av = scale * (q8_x(x) @ aq.T)
        tiles = av.bfloat16().float() @ b.bfloat16().float().T
        vnni = av @ b.bfloat16().float().T
        want[..., :64] += tiles[..., :64]
        want[..., 64:] += vnni[..., 64:]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * float(want.abs().max()))
