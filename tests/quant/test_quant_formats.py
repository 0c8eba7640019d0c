"""dequantize() of every kernel is bit-exact with gguf.quants.dequantize; rows() agrees with it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import QuantError
from synth_tensors import gguf_tensor, random_blocks

from graftlm.native import disabled
from graftlm.quant import QWeight, dequantize_any
from graftlm.quant.formats import FORMATS

# Types the brief requires; K-quants need n_in % 256 == 0.
CORE = [
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q8_0,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
]
EXOTIC = [Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.TQ1_0, Q.TQ2_0,
          Q.MXFP4]  # fmt: skip
SHAPE = (100, 512)  # n_out not a multiple of 16/64: exercises int4pack padding


def bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def gguf_can_quantize(qtype: Q) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), dtype=np.float32), qtype)
    except (NotImplementedError, QuantError):
        return False
    return True


def check_exact(raw: np.ndarray, qtype: Q, prefer: str) -> QWeight:
    """prefer: "fast" (native kernels where built), "torch" (native disabled), "reference"."""
    ref = gguf.quants.dequantize(raw, qtype).reshape(SHAPE)
    if prefer == "torch":
        with disabled():
            w = QWeight.from_gguf(raw, qtype, SHAPE, name="t")
    else:
        w = QWeight.from_gguf(raw, qtype, SHAPE, name="t", prefer=prefer)
    got = w.dequantize()
    assert got.dtype == torch.float32 and got.shape == SHAPE
    np.testing.assert_array_equal(bits(got), bits(ref), err_msg=f"{qtype.name} {w.kernel}")
    ids = torch.tensor([[3, 0], [SHAPE[0] - 1, 3]], dtype=torch.int32)  # any int dtype/shape
    np.testing.assert_array_equal(bits(w.rows(ids)), bits(ref[[3, 0, SHAPE[0] - 1, 3]]))
    return w


@pytest.mark.parametrize("prefer", ["fast", "torch", "reference"])
@pytest.mark.parametrize("qtype", CORE + EXOTIC, ids=lambda q: q.name)
def test_quantized_by_gguf_is_bit_exact(qtype: Q, prefer: str) -> None:
    """Weights made by gguf.quants.quantize from normal floats (the realistic distribution)."""
    if not gguf_can_quantize(qtype):
        pytest.skip(
            f"gguf.quants.quantize does not implement {qtype.name}; "
            "covered by test_random_blocks_are_bit_exact"
        )
    raw, how = gguf_tensor(qtype, SHAPE, seed=1)
    assert how == "gguf.quantize"
    check_exact(raw, qtype, prefer)


@pytest.mark.parametrize("prefer", ["fast", "torch", "reference"])
@pytest.mark.parametrize(
    "qtype", [q for q in CORE + EXOTIC if q not in (Q.F32, Q.F16, Q.BF16)], ids=lambda q: q.name
)
def test_random_blocks_are_bit_exact(qtype: Q, prefer: str) -> None:
    """Random codes in every bit of every block (the only way to make K-quant / IQ test data)."""
    raw = random_blocks(qtype, SHAPE, np.random.default_rng(2))
    check_exact(raw, qtype, prefer)


def test_gguf_cannot_quantize_these_so_random_blocks_cover_them() -> None:
    """Pin which types rely on random blocks only, so a gguf upgrade that adds one is noticed."""
    missing = {q for q in CORE + EXOTIC if not gguf_can_quantize(q)}
    assert {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K} <= missing
    assert not missing & {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_format_split_is_exact_and_codes_in_range(qtype: Q) -> None:
    fmt = FORMATS[qtype]
    raw = random_blocks(qtype, (8, 512), np.random.default_rng(3))
    u, fields = fmt.split_rows(torch.from_numpy(raw), 512)
    assert u.dtype == torch.uint8 and int(u.max()) < 2**fmt.bits
    assert int(u.max()) == 2**fmt.bits - 1  # random blocks reach the top code
    s, b = fmt.group_params(fields)
    assert s.shape == (8, 512 // fmt.group_size) and (b is not None) == fmt.offset
    np.testing.assert_array_equal(
        bits(fmt.dequantize(u, fields)), bits(gguf.quants.dequantize(raw, qtype))
    )


def test_reader_style_typed_arrays_and_torch_inputs() -> None:
    """GGUFReader gives float32/float16 arrays for F32/F16 (uint8 for BF16); torch works too."""
    w = np.random.default_rng(4).normal(size=SHAPE).astype(np.float32)
    for arr, qtype in [
        (w, Q.F32),
        (w.astype(np.float16), Q.F16),
        (torch.from_numpy(w), Q.F32),
        (torch.from_numpy(w).bfloat16(), Q.BF16),
    ]:
        qw = QWeight.from_gguf(arr, qtype, SHAPE)
        ref = torch.from_numpy(w) if qtype == Q.F32 else torch.as_tensor(arr).float()
        assert torch.equal(qw.dequantize(), ref)


def test_f32_is_a_zero_copy_view_and_dequantize_is_fresh() -> None:
    w = np.random.default_rng(5).normal(size=SHAPE).astype(np.float32)
    w.setflags(write=False)  # like a read-only memory map
    qw = QWeight.from_gguf(w, Q.F32, SHAPE)
    # the native products read it in place where they built, torch's F.linear elsewhere
    assert qw.kernel in ("native-float", "dense-f32") and qw.nbytes == w.nbytes
    assert np.shares_memory(qw._k.tensors()[0].numpy(), w)
    d = qw.dequantize()
    d += 1  # writable and not the weight itself
    assert torch.equal(qw.dequantize(), torch.from_numpy(w))


@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.IQ4_NL], ids=lambda q: q.name
)
def test_dequantize_any_matches_gguf(qtype: Q) -> None:
    raw, _ = gguf_tensor(qtype, (4, 256), seed=6, prefer_quantize=False)
    ref = gguf.quants.dequantize(raw, qtype)
    for shape in [(4, 256), (2, 2, 256), (1024,)]:
        if len(shape) == 1 and qtype not in (Q.F32, Q.F16, Q.BF16):
            shape = (4 * 256,)
        got = dequantize_any(raw, qtype, shape)
        assert got.shape == shape and got.dtype == torch.float32
        np.testing.assert_array_equal(bits(got).reshape(-1), bits(ref).reshape(-1))
    typed = raw.view(np.float32) if qtype == Q.F32 else raw
    out = dequantize_any(typed, int(qtype), (4, 256))
    out += 1  # always writable, never the caller's memory
    assert not np.shares_memory(out.numpy(), raw)


def test_dequantize_any_rejects_what_gguf_cannot_dequantize() -> None:
    with pytest.raises(NotImplementedError):
        dequantize_any(np.zeros(40, np.uint8), Q.Q8_1, (32,))
    with pytest.raises(ValueError):
        dequantize_any(np.zeros(34, np.uint8), Q.Q8_0, (31,))
    with pytest.raises(ValueError):
        dequantize_any(np.zeros(33, np.uint8), Q.Q8_0, (32,))
