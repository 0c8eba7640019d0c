"""QWeight.matmul (the seam) against its float32 twin, across kernels, M, leading dims, modes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from synth_tensors import gguf_tensor

from graftlm.native import bf16_dots, disabled, library
from graftlm.quant import QWeight, config, linear
from graftlm.quant.int4pack import int4pack_layout

# (type, shape, kernel expected with torch's kernels (int4pack usable), with native kernels)
CASES = [
    (Q.F32, (96, 256), "dense-f32", "native-float"),
    (Q.F16, (96, 256), "dense-f16", "native-float"),
    (Q.BF16, (96, 256), "dense-bf16", "native-float"),
    (Q.F16, (101, 576), "dense-f16", "native-float"),  # a last task of 5 outputs
    (Q.Q4_0, (100, 256), "int4pack", "native-u4"),
    (Q.Q4_1, (192, 576), "int4pack", "native-u4"),
    (Q.Q4_K, (64, 512), "int4pack", "native-k4"),
    (Q.Q4_K, (100, 768), "int4pack", "native-k4"),  # a padded row group
    (Q.Q5_0, (256, 640), "int4pack2", "native-u4"),
    (Q.Q5_0, (100, 896), "int4pack2", "native-u4"),  # a padded row group
    (Q.Q5_1, (64, 256), "int4pack2", "native-u4"),
    (Q.Q5_1, (100, 896), "int4pack2", "native-u4"),
    (Q.Q5_K, (80, 512), "int4pack2", "native-k4"),
    (Q.Q5_K, (100, 768), "int4pack2", "native-k4"),
    (Q.Q6_K, (64, 512), "int4pack2", "native-k16"),
    (Q.Q6_K, (100, 768), "int4pack2", "native-k16"),
    (Q.Q8_0, (256, 640), "int4pack2", "native-s8"),
    (Q.Q8_0, (8192, 64), "int8g", "native-s8"),  # vocabulary-wide (embedding / tied head)
    (Q.Q2_K, (64, 512), "blocks", "native-k16"),
    (Q.Q2_K, (100, 768), "blocks", "native-k16"),
    (Q.Q3_K, (64, 512), "blocks", "native-k16"),
    (Q.Q3_K, (100, 768), "blocks", "native-k16"),
    (Q.IQ4_NL, (64, 256), "blocks", "native-s8"),
    (Q.IQ4_NL, (100, 896), "blocks", "native-s8"),  # a padded row group
    (Q.IQ4_XS, (64, 512), "blocks", "native-s8"),
    (Q.IQ4_XS, (100, 768), "blocks", "native-s8"),
    (Q.MXFP4, (64, 256), "blocks", "native-mx4"),
    (Q.MXFP4, (100, 864), "blocks", "native-mx4"),  # a padded row group, 27 blocks a row
    (Q.IQ2_XXS, (32, 256), "blocks", "native-iq"),
    (Q.IQ2_XS, (100, 768), "blocks", "native-iq"),  # a last task of 4 outputs
    (Q.IQ2_S, (37, 512), "blocks", "native-iq"),
    (Q.IQ3_XXS, (64, 512), "blocks", "native-iq"),
    (Q.IQ3_S, (45, 256), "blocks", "native-iq"),
]
MODES = ["torch", "native"]
# fused paths: bf16 x and scales (torch, observed ~3e-3), or int8 x per 32 values (native, ~5e-3)
BF16_TOL = 1e-2
F32_TOL = 1e-5


def need(mode: str) -> None:
    if mode == "native" and library() is None:
        pytest.skip("native kernels unavailable here")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


def load(
    qtype: Q, shape: tuple[int, int], prefer: str = "fast", mode: str = "torch"
) -> tuple[QWeight, torch.Tensor]:
    """mode "torch": built with the native kernels disabled; "native": the default registry."""
    need(mode)
    raw, _ = gguf_tensor(qtype, shape, seed=7)
    if mode == "native":
        w = QWeight.from_gguf(raw, qtype, shape, name="blk.0.x", prefer=prefer)
    else:
        with disabled():
            w = QWeight.from_gguf(raw, qtype, shape, name="blk.0.x", prefer=prefer)
    return w, w.dequantize()


@pytest.fixture(
    scope="module",
    params=[(c, m) for c in CASES for m in MODES],
    ids=lambda p: f"{p[0][0].name}-{p[0][1][0]}x{p[0][1][1]}-{p[1]}",
)
def case(request: pytest.FixtureRequest) -> tuple[QWeight, torch.Tensor, str]:
    (qtype, shape, torch_kernel, native_kernel), mode = request.param
    w, dense = load(qtype, shape, mode=mode)
    return w, dense, native_kernel if mode == "native" else torch_kernel


def test_kernel_choice(case: tuple[QWeight, torch.Tensor, str]) -> None:
    w, _, kernel = case
    if kernel.startswith("int4pack") and int4pack_layout() is None:
        pytest.skip("torch's int4pack kernel is not usable on this build")
    assert w.kernel == kernel


@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3), (64,)], ids=str)
def test_matmul_matches_float32_twin(
    case: tuple[QWeight, torch.Tensor, str], lead: tuple[int, ...]
) -> None:
    w, dense, _ = case
    x = torch.randn(*lead, w.shape[1], generator=torch.Generator().manual_seed(0))
    ref = x @ dense.T
    y = linear(x, w)
    assert y.shape == (*lead, w.shape[0]) and y.dtype == torch.float32
    assert rel_err(y, ref) < BF16_TOL
    assert torch.allclose(w.reference_matmul(x), ref, rtol=1e-5, atol=1e-6)
    assert rel_err(w.matmul(x, exact=True), ref) < F32_TOL
    assert rel_err(linear(x, w, exact=True), ref) < F32_TOL


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.F32])
def test_float_weights_keep_x_float32(qtype: Q) -> None:
    """F16 / BF16 / F32 weights on the native products (csrc/float.c) read the file's values in
    place and keep x float32: the fast product is the float32 GEMM's up to the order of its sums,
    for every count of rows of x a tile takes (1-4) and a row count past one tile; BF16 from 6
    rows where the library takes VDPBF16PS (native.bf16_dots) on x rounded to bfloat16, as
    llama.cpp does."""
    w, dense = load(qtype, (101, 576), mode="native")
    assert w.kernel == "native-float"
    for m in (1, 2, 3, 4, 5, 9, 33):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        if qtype == Q.BF16 and m >= 6 and bf16_dots():
            x = x.bfloat16().float()  # (what the product reads: tests/native/test_float.py)
        assert rel_err(w.matmul(x), x @ dense.T) < F32_TOL


@pytest.mark.parametrize("mode", MODES)
def test_fused_and_float32_paths_cover_every_m(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Crossing PREFILL_M and chunking the float32 path (tiny chunks) changes nothing."""
    w, dense = load(Q.Q5_0, (256, 640), mode=mode)
    monkeypatch.setattr(config, "CHUNK_ELEMS", 64 * 640)  # 4 chunks of 64 rows
    edge = min(config.PREFILL_M[w.kernel], 256)
    for m in (1, edge - 1, edge, 300):
        x = torch.randn(m, 640)
        assert rel_err(w.matmul(x), x @ dense.T) < BF16_TOL


def test_output_rows_beyond_n_out_never_leak() -> None:
    w, dense = load(Q.Q4_0, (20, 256))  # padded to 64 rows inside
    y = w.matmul(torch.randn(3, 256))
    assert y.shape == (3, 20) and y.is_contiguous()


@pytest.mark.parametrize("mode,kernel", [("torch", "int8g"), ("native", "native-s8")])
def test_tied_embedding_one_copy_serves_rows_and_head(mode: str, kernel: str) -> None:
    w, dense = load(Q.Q8_0, (8192, 64), mode=mode)
    assert w.kernel == kernel
    tokens = torch.tensor([[1, 8191], [7, 1]])
    emb = w.rows(tokens).view(2, 2, 64)
    assert torch.equal(emb, dense[tokens])
    logits = w.matmul(emb)
    assert logits.shape == (2, 2, 8192) and rel_err(logits, emb @ dense.T) < BF16_TOL
    assert w.nbytes < 1.1 * 8192 * 64 * 34 / 32


# bytes kept / file bytes: torch's planes, and the native layouts (u4: 0.5 B + 4 B per 32 values
# with the file's float16 d and m, u5 a plane of 4 B more; the K-quants' super-blocks: 2 or 4 B
# of float16 per 256 values a row beyond the file's; Q3_K and Q2_K with their codes in 4 bits;
# s8: 1 B + 2 B per 32)
@pytest.mark.parametrize("qtype,torch_ratio,native_ratio", [
    (Q.Q4_1, 1.21, 1.0), (Q.Q4_K, 1.26, 1.03), (Q.Q5_K, 1.94, 1.03), (Q.Q6_K, 1.62, 1.0),
    (Q.Q5_0, 1.92, 1.10), (Q.Q5_1, 1.92, 1.0), (Q.Q3_K, 1.0, 1.33), (Q.Q2_K, 1.0, 1.96),
    (Q.Q8_0, 1.24, 1.0), (Q.F16, 1.0, 1.0)], ids=str)  # fmt: skip
@pytest.mark.parametrize("mode", MODES)
def test_weights_stay_compact(qtype: Q, torch_ratio: float, native_ratio: float, mode: str) -> None:
    need(mode)
    raw, _ = gguf_tensor(qtype, (256, 512), prefer_quantize=False)
    if mode == "native":
        w = QWeight.from_gguf(raw, qtype, (256, 512))
    else:
        with disabled():
            w = QWeight.from_gguf(raw, qtype, (256, 512))
    assert w.nbytes <= (native_ratio if mode == "native" else torch_ratio) * raw.nbytes


def test_reference_prefer_is_dense_float32() -> None:
    w, dense = load(Q.Q4_K, (64, 512), prefer="reference")
    assert w.kernel == "reference-f32" and w.nbytes == 64 * 512 * 4
    x = torch.randn(2, 512)
    assert torch.allclose(w.matmul(x), x @ dense.T, rtol=1e-5, atol=1e-6)


def test_without_int4pack_every_type_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from graftlm.quant import int4pack

    monkeypatch.setattr(int4pack, "int4pack_layout", lambda: None)
    w, dense = load(Q.Q4_K, (64, 512), mode="torch")
    assert w.kernel == "blocks"
    x = torch.randn(3, 512)
    assert rel_err(w.matmul(x), x @ dense.T) < F32_TOL


def test_empty_batch_and_bad_inputs() -> None:
    w, _ = load(Q.Q4_0, (64, 256))
    assert w.matmul(torch.empty(0, 256)).shape == (0, 64)
    assert w.matmul(torch.empty(2, 0, 256)).shape == (2, 0, 64)
    with pytest.raises(ValueError, match="features"):
        w.matmul(torch.randn(2, 255))
    raw, _ = gguf_tensor(Q.Q4_0, (64, 256))
    with pytest.raises(ValueError, match="prefer"):
        QWeight.from_gguf(raw, Q.Q4_0, (64, 256), prefer="fastest")
    with pytest.raises(ValueError, match="bytes"):
        QWeight.from_gguf(raw, Q.Q4_0, (65, 256))
    with pytest.raises(ValueError, match="multiple of 32"):
        QWeight.from_gguf(np.zeros(64 * 18, np.uint8), Q.Q4_0, (64, 31))


def test_matmul_accepts_other_float_dtypes_and_noncontiguous_x() -> None:
    w, dense = load(Q.Q4_1, (192, 576))
    x = torch.randn(576, 4).T  # non-contiguous (4, 576)
    assert rel_err(w.matmul(x.bfloat16()), x @ dense.T) < BF16_TOL
    assert rel_err(w.matmul(x), x @ dense.T) < BF16_TOL


def test_to_same_device_is_identity_and_repr() -> None:
    w, _ = load(Q.Q4_1, (192, 576))
    assert w.to("cpu") is w
    assert "int4pack" in repr(w) and "blk.0.x" in repr(w)
    if library() is not None:
        assert "native-u4" in repr(load(Q.Q4_1, (192, 576), mode="native")[0])


def test_device_dense_kernel_semantics() -> None:
    """QWeight.to('cuda') builds this kernel; its arithmetic is checked here on CPU."""
    from graftlm.quant.torch_kernels import DeviceDenseKernel

    w, dense = load(Q.Q4_1, (192, 576))
    k = DeviceDenseKernel(dense.to(torch.bfloat16))
    x = torch.randn(3, 576)
    assert rel_err(k.matmul(x), x @ dense.T) < BF16_TOL
    assert torch.equal(k.rows(torch.tensor([2])), dense[[2]].bfloat16().float())


def test_repacked_weights_release_their_memory_mapped_pages(tmp_path: Path) -> None:
    """A read-only np.memmap (what GGUFReader gives) stays valid after its pages are released."""
    from graftlm.quant.base import release_pages

    raw, _ = gguf_tensor(Q.Q4_K, (256, 1024), seed=8, prefer_quantize=False)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, mode="r", dtype=np.uint8, shape=raw.shape)
    w = QWeight.from_gguf(mapped, Q.Q4_K, (256, 1024))
    assert np.array_equal(np.asarray(mapped), raw)  # pages fault back in from the file
    assert release_pages(mapped) > 0
    assert release_pages(raw) == 0  # heap memory: never touched
    assert release_pages(np.memmap(path, mode="c", dtype=np.uint8, shape=raw.shape)) == 0
    dense = QWeight.from_gguf(raw, Q.Q4_K, (256, 1024)).dequantize()
    assert torch.equal(w.dequantize(), dense)


@pytest.mark.parametrize("mode", MODES)
def test_matmul_is_pure_under_concurrent_calls(mode: str) -> None:
    """No shared per-call buffers: threads hammering one weight get the sequential answers."""
    from concurrent.futures import ThreadPoolExecutor

    w, _ = load(Q.Q5_0, (256, 640), mode=mode)
    xs = [torch.randn(m, 640, generator=torch.Generator().manual_seed(m)) for m in (1, 3, 70, 1)]
    want = [w.matmul(x) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(w.matmul, xs * 4))
    for i, y in enumerate(got):
        assert torch.equal(y, want[i % len(xs)])


def test_register_kernel_takes_precedence() -> None:
    from graftlm.quant import FAST_KERNELS, register_kernel
    from graftlm.quant.torch_kernels import ReferenceKernel

    class Only4x(ReferenceKernel):
        name = "custom"

        @classmethod
        def accepts(cls, qtype: Q, shape: tuple[int, int]) -> bool:
            return qtype == Q.Q4_0 and shape == (4, 64)

    register_kernel(Only4x)
    try:
        raw, _ = gguf_tensor(Q.Q4_0, (4, 64))
        assert QWeight.from_gguf(raw, Q.Q4_0, (4, 64)).kernel == "custom"
        assert QWeight.from_gguf(np.tile(raw, (2, 1)), Q.Q4_0, (8, 64)).kernel != "custom"
    finally:
        FAST_KERNELS.remove(Only4x)
