"""The grid quants' native kernel (csrc/iquant.c: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) against
its PyTorch twin (quant/formats.py's GridFormat: the dequantization, bit for bit, and llama.cpp's
int8-activation arithmetic over it), on odd shapes and every tile of rows; its tables against
gguf-py's; and a routed-expert model of these types served by the one-call native layers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from synth_tensors import random_blocks

import graftlm
from graftlm.native import features, library, unavailable_reason
from graftlm.native.build import CSRC
from graftlm.quant import QWeight
from graftlm.quant.formats import GRID_FORMATS

pytestmark = pytest.mark.skipif(library() is None, reason=f"native: {unavailable_reason()}")

TYPES = [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S]
ROOT = Path(__file__).resolve().parents[2]


def _module(path: Path) -> object:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def int8_twin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T with x rounded to int8 per 32 values as the kernels round it, in float64."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)
    xq = torch.round(xb * inv)  # half to even, as the kernel's rounding
    return ((xq * (amax / 127)).reshape(m, k).double()) @ w.double().T


def test_the_grids_header_is_gguf_pys_tables() -> None:
    gen = _module(ROOT / "scripts" / "gen_iq_grids.py")
    assert (CSRC / "iq_grids.h").read_text() == gen.header(), "rerun scripts/gen_iq_grids.py"  # type: ignore[attr-defined]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(37, 768), (8, 256), (1, 512), (1, 256)], ids=str)
def test_native_dequantization_is_the_twins_bit_for_bit(qtype: Q, shape: tuple[int, int]) -> None:
    raw = random_blocks(qtype, shape, np.random.default_rng(shape[0]))
    w = QWeight.from_gguf(raw, qtype, shape, name="w")
    assert w.kernel == "native-iq"
    twin = GRID_FORMATS[qtype].dequantize_rows(torch.from_numpy(raw))
    got = w.dequantize()
    assert torch.equal(got.view(torch.int32), twin.view(torch.int32))
    ids = torch.tensor([shape[0] - 1, 0, shape[0] // 2, shape[0] - 1])
    assert torch.equal(w.rows(ids).view(torch.int32), twin[ids].view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_native_products_are_the_int8_twin_for_every_row_count(qtype: Q) -> None:
    """Rows 1..13 (every tile of MT = 6 rows and its remainders), an output count that leaves a
    last task of 5, a zero and an all-zero block of x."""
    n, k = 37, 768
    g = torch.Generator().manual_seed(int(qtype))
    raw = random_blocks(qtype, (n, k), np.random.default_rng(int(qtype)))
    w = QWeight.from_gguf(raw, qtype, (n, k), name="w")
    dense = GRID_FORMATS[qtype].dequantize_rows(torch.from_numpy(raw))
    for m in range(1, 14):
        x = torch.randn(m, k, generator=g)
        x[:, 5] = 0
        x[0, 64:96] = 0
        want = int8_twin(x, dense)
        got = w.matmul(x)
        scale = float(want.abs().max())
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * scale)
        exact = x.double() @ dense.double().T  # the rounding of x is what separates them
        assert float((got - exact).abs().max()) < 0.02 * scale
        torch.testing.assert_close(w.matmul(x, exact=True), x @ dense.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_rows_product_is_the_same_bits_alone_or_among_others(qtype: Q) -> None:
    """Ten super-blocks a row: each row of 2, 3, 4, 5 and 13 rows of x gives the bits it gives
    alone (with VBMI, up to three rows of IQ2_XXS and IQ2_S and four of the others take their own
    kernel, iq_group_few, which sums each output's values in place in an order of its own, one row
    of IQ2_XS, IQ2_S and IQ3_S iq_group_one; more rows the lanes of 16 outputs, in tiles of 8)."""
    n, k = 19, 2560
    raw = random_blocks(qtype, (n, k), np.random.default_rng(7))
    w = QWeight.from_gguf(raw, qtype, (n, k), name="w")
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([w.matmul(x[i : i + 1]) for i in range(13)])
    for m in (2, 3, 4, 5, 13):
        assert torch.equal(w.matmul(x[:m]), alone[:m])


@pytest.mark.parametrize("qtype", [Q.IQ2_XS, Q.IQ2_S, Q.IQ3_S], ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(37, 768), (1, 256), (17, 2560), (32, 512)], ids=str)
def test_one_rows_kernel_is_the_few_rows_bits(qtype: Q, shape: tuple[int, int]) -> None:
    """One row of IQ2_XS, IQ2_S and IQ3_S (with VBMI, iq_group_one: x's signs in the values) gives
    the bits of the same row among two (iq_group_few), and the int8 twin: odd output counts, x's
    codes at +-127 (a block of one large value each sign), zeros, negative and positive runs."""
    n, k = shape
    raw = random_blocks(qtype, (n, k), np.random.default_rng(11))
    w = QWeight.from_gguf(raw, qtype, (n, k), name="w")
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5))
    x[:, 0], x[:, 32], x[:, 64:96] = 40.0, -40.0, 0.0
    x[0, 96:128] = -x[0, 96:128].abs()
    x[0, 128:160] = x[0, 128:160].abs()
    one, among = w.matmul(x[:1]), w.matmul(x)[:1]
    assert torch.equal(one.view(torch.int32), among.view(torch.int32))
    want = int8_twin(x[:1], GRID_FORMATS[qtype].dequantize_rows(torch.from_numpy(raw)))
    torch.testing.assert_close(one.double(), want, rtol=0, atol=2e-5 * float(want.abs().max()))


TILES = "iq-tiles" in features()


@pytest.mark.skipif(not TILES, reason="the build takes no tiles (AVX-512 VBMI)")
@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ3_XXS], ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(37, 768), (48, 2560), (1, 512), (17, 256)], ids=str)
def test_tiles_are_the_file_in_place_bit_for_bit(
    qtype: Q, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """IQ2_XXS and IQ3_XXS regrouped into tiles of 16 outputs (a last group padded): the same
    dequantization (the twin's bits), rows and products of every row count (the tiles' few-row
    kernel up to 4, their lanes past it) as the file's super-blocks read in place."""
    n, k = shape
    raw = random_blocks(qtype, shape, np.random.default_rng(n + k))
    tiled = QWeight.from_gguf(raw, qtype, shape, name="w")
    monkeypatch.setenv("GRAFTLM_IQ_TILES", "0")
    in_place = QWeight.from_gguf(raw, qtype, shape, name="w")
    assert tiled._k.tiles and not in_place._k.tiles  # type: ignore[attr-defined]
    assert tiled.nbytes == -(-n // 16) * 16 * raw.shape[1]  # the file's bytes, and the padding
    twin = GRID_FORMATS[qtype].dequantize_rows(torch.from_numpy(raw))
    assert torch.equal(tiled.dequantize().view(torch.int32), twin.view(torch.int32))
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(tiled.rows(ids).view(torch.int32), twin[ids].view(torch.int32))
    g = torch.Generator().manual_seed(n)
    for m in (*range(1, 10), 13, 33, 130):
        x = torch.randn(m, k, generator=g)
        x[0, 32:64] = 0
        assert torch.equal(
            tiled.matmul(x).view(torch.int32), in_place.matmul(x).view(torch.int32)
        ), m


@pytest.mark.skipif(not TILES, reason="the build takes no tiles (AVX-512 VBMI)")
def test_a_large_weights_tiles_packed_on_threads_are_one_threads() -> None:
    """gl_pack_iq shares a weight of 64M values or more among its threads: the same tiles."""
    n, k = 4104, 16384  # 2^26 values and a padded group
    raw = np.random.default_rng(5).integers(0, 256, (n, k // 256 * 66), dtype=np.uint8)
    lib = library()
    assert lib is not None
    one, two = np.empty((n + 8, raw.shape[1]), np.uint8), np.empty((n + 8, raw.shape[1]), np.uint8)
    assert lib.gl_pack_iq(0, raw.ctypes.data, n, k, one.ctypes.data, 1) == 0
    assert lib.gl_pack_iq(0, raw.ctypes.data, n, k, two.ctypes.data, 2) == 0
    assert np.array_equal(one, two)
    # the last group's 8 pad outputs: zero super-blocks (d 0, indices and sign words 0) in each
    # tile (8 units of 64 index bytes, then 64 of sign words, byte 4 o + i output o's; then the
    # 16 float16 d)
    tiles = one[n // 16 * 16 :].reshape(k // 256, 16 * 66)
    assert not np.any(tiles[:, 8 * 128 + 16 : 8 * 128 + 32])  # d of outputs 8 .. 15
    assert np.any(tiles[:, 8 * 128 : 8 * 128 + 16])  # (those of the 8 real ones: random bytes)
    units = tiles[:, : 8 * 128].reshape(k // 256, 8, 2, 64)
    assert not np.any(units[..., 32:])
    assert lib.gl_pack_iq(1, raw.ctypes.data, n, k, one.ctypes.data, 1) == 1  # IQ2_XS: in place


def _tiny_moe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mix: str) -> Path:
    """bench/real_shapes.py's Qwen3-MoE shrunk (its grid mixes: the five types between them)."""
    from dataclasses import replace

    rs = _module(ROOT / "bench" / "real_shapes.py")
    small = replace(rs.SHAPES["qwen3-30b-a3b-6l"], d=256, n_head=4, n_head_kv=2, head_dim=64,  # type: ignore[attr-defined]
                    ff=256, n_layer=2, vocab=512, n_expert=8, n_expert_used=2)  # fmt: skip
    monkeypatch.setitem(rs.SHAPES, "tiny-moe", small)  # type: ignore[attr-defined]
    return Path(rs.write_model(tmp_path, "tiny-moe", mix))  # type: ignore[attr-defined]


def test_a_model_bound_for_another_device_packs_no_tiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--device other than the CPU: the IQ2_XXS / IQ3_XXS weights stay the file's bytes in place
    while the model is built (its weights are dequantized from them and moved), no tiles packed
    into host memory first; on the CPU the same file's weights are tiles where the build has them."""
    from graftlm.quant.native_tables import NativeIQKernel

    path = _tiny_moe(tmp_path, monkeypatch, "iq2_xxs")
    built: list[NativeIQKernel] = []
    build = NativeIQKernel.build.__func__  # type: ignore[attr-defined]

    def spy(cls: type[NativeIQKernel], *args: object) -> object:
        built.append(build(cls, *args))
        return built[-1]

    monkeypatch.setattr(NativeIQKernel, "build", classmethod(spy))
    graftlm.load(path, ctx_size=64, n_seq=2, device="meta")
    assert built and not any(k.tiles for k in built)
    assert all(k.keeps_source for k in built)
    built.clear()
    graftlm.load(path, ctx_size=64, n_seq=2, cache_type="f32")
    assert built and any(k.tiles for k in built) == TILES
    assert all(k.keeps_source != k.tiles for k in built)


@pytest.mark.parametrize("mix", ["iq2_xxs", "iq2_xs", "iq3_xxs"])
def test_routed_experts_of_grid_types_run_in_the_native_layers(
    mix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small Qwen3-MoE of one of bench/real_shapes.py's grid mixes (the five types between
    them; Q5_K output): every decode step in one native call, bit-identical to one call a layer
    and within 1e-4 of the composed blocks."""
    from spies import stack_calls

    from graftlm.models.base import Transformer
    from graftlm.step.batch import Batch

    path = _tiny_moe(tmp_path, monkeypatch, mix)
    model = graftlm.load(path, ctx_size=64, n_seq=2, cache_type="f32").model
    assert model.fused_stack() is not None
    for blk in model.blocks:
        experts = [*blk.ffn_gate_up_exps.stacked, *blk.ffn_down_exps.weights]
        assert {w.kernel for w in experts} == {"native-iq"}

    def run() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for s, n in enumerate((9, 4)):
                model.forward(Batch.single([(7 * s + j) % 50 + 3 for j in range(n)], s, 0))
            for step in range(3):
                tokens = torch.tensor([[20 + step], [31 + step]])
                out.append(model.forward(Batch(tokens, [0, 1], [9 + step, 4 + step], [1, 1])))
        return out

    served = stack_calls(monkeypatch)
    fused = run()
    assert served[-3:] == [True] * 3
    if TILES and mix != "iq2_xs":  # its IQ2_XXS or IQ3_XXS experts in tiles: the same bits in place
        experts = [
            w for b in model.blocks for w in (*b.ffn_gate_up_exps.stacked, *b.ffn_down_exps.weights)
        ]
        assert any(w._k.tiles for w in experts)  # type: ignore[attr-defined]
        monkeypatch.setenv("GRAFTLM_IQ_TILES", "0")
        model = graftlm.load(path, ctx_size=64, n_seq=2, cache_type="f32").model
        for a, b in zip(fused, run(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    monkeypatch.setattr(Transformer, "native_layers", lambda self, x, batch: None)
    one_by_one = run()
    monkeypatch.setattr(Transformer, "native_block", lambda self, i, x, batch: None)
    monkeypatch.setattr(Transformer, "native_routed_ffn", lambda self, i, h, batch: None)
    composed = run()
    for a, b, c in zip(fused, one_by_one, composed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
