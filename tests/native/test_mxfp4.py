"""MXFP4's native kernel (csrc/mxfp4.c, native-mx4) against its twins: gguf's dequantization and
the PyTorch format (quant/formats.py's MXFP4), bit for bit, at every E8M0 exponent the format has;
its products against the int8-activation arithmetic written out in float64, for every row count
of a tile and odd shapes; and its 512-bit pairs, 256-bit groups and AVX2 variant against each
other, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from graftlm.native import disabled, features, library, unavailable_reason
from graftlm.quant import QWeight

pytestmark = pytest.mark.skipif(library() is None, reason=f"native: {unavailable_reason()}")

MXFP4 = Q.MXFP4
VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)
EDGES = (0, 1, 2, 3, 126, 127, 128, 253, 254, 255)  # subnormal scales, 1/2, the largest
# (n_out, n_in): one row, a lone group's remainder, pairs and a remainder, 27 blocks a row
SHAPES = [(1, 32), (7, 96), (9, 64), (37, 864), (80, 160)]


def blocks(shape: tuple[int, int], rng: np.random.Generator, exps: np.ndarray) -> np.ndarray:
    """Random codes (every nibble) with the given exponent per block: (n_out, row bytes) uint8."""
    n, k = shape
    raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = exps
    return raw.reshape(n, -1)


def weights64(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The weights in float64 from the codes and exponents (finite where float32's overflow)."""
    n, k = shape
    b = raw.reshape(n, k // 32, 17)
    codes = np.concatenate([b[:, :, 1:] & 0xF, b[:, :, 1:] >> 4], axis=-1)  # (n, kb, 32)
    scale = np.exp2(b[:, :, :1].astype(np.float64) - 128)
    return (VALUES[codes] * scale).reshape(n, k)


def int8_rounded(x: np.ndarray) -> np.ndarray:
    """x as the integer products take it: per 32 values round(x * 127 / max|x|) * max|x| / 127."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(xb * inv) * (amax / np.float32(127))).reshape(m, k).astype(np.float64)


def bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("prefer", ["fast", "torch", "reference"])
def test_every_exponent_dequantizes_bit_exact_with_gguf(prefer: str) -> None:
    """All 256 E8M0 exponents (0 and 1: subnormal scales; 255: 2^126, whose larger values
    overflow to inf in gguf's float32 as in ours) with every code, in native-mx4, in the PyTorch
    twin (the fallback with native disabled) and in the reference."""
    shape = (24, 384)  # 24 * 12 = 288 blocks: every exponent at least once
    rng = np.random.default_rng(0)
    exps = np.resize(np.arange(256, dtype=np.uint8), (24, 12))
    raw = blocks(shape, rng, exps)
    with np.errstate(over="ignore"):
        want = gguf.quants.dequantize(raw, MXFP4).reshape(shape)
    assert np.isinf(want).any() and (np.abs(want[want != 0]) < np.finfo(np.float32).tiny).any()
    with np.errstate(over="ignore"):  # (the reference dequantizes with gguf)
        if prefer == "torch":
            with disabled():
                w = QWeight.from_gguf(raw, MXFP4, shape, name="x")
            assert w.kernel == "blocks"
        else:
            w = QWeight.from_gguf(raw, MXFP4, shape, name="x", prefer=prefer)
    if prefer == "fast":
        assert w.kernel == "native-mx4" and w.nbytes == raw.nbytes  # the file's 4.25 bits
    np.testing.assert_array_equal(bits(w.dequantize()), bits(want))
    ids = torch.tensor([23, 0, 7, 7, 16])
    np.testing.assert_array_equal(bits(w.rows(ids)), bits(want[ids.numpy()]))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_products_are_the_int8_arithmetic(shape: tuple[int, int]) -> None:
    """Every row count of a tile (1..6), past it and a remainder, rows of weights whose scales
    differ by up to 2^40: each output within float32 summation of the float64 twin."""
    n, k = shape
    rng = np.random.default_rng(n * k)
    raw = blocks(shape, rng, rng.integers(108, 148, (n, k // 32)).astype(np.uint8))
    w = QWeight.from_gguf(raw, MXFP4, shape, name="x")
    assert w.kernel == "native-mx4"
    w64 = weights64(raw, shape)
    for m in (*range(1, 15), 50):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :32] = 0  # an all-zero block: xd = 0
        want = int8_rounded(x) @ w64.T
        got = w.matmul(torch.from_numpy(x)).numpy()
        # each output against its weight row's size (|x| ~ 1)
        tol = 2e-5 * np.abs(w64).max(axis=1) * np.sqrt(k) + 1e-30
        assert (np.abs(got - want) <= tol).all(), (m, float(np.abs(got - want).max()))


@pytest.mark.parametrize("e,x_scale", [(0, 2.0**100), (1, 2.0**100), (254, 2.0**-100),
                                       (255, 2.0**-100)])  # fmt: skip
def test_edge_exponents_in_the_products(e: int, x_scale: float) -> None:
    """Weights at the smallest and largest scales, against x that keeps the products finite:
    the E8M0 scale is folded in after the integer dots, so e = 255's products are finite
    where its dequantized float32 values (12 * 2^126) are not."""
    shape = (16, 128)
    rng = np.random.default_rng(e)
    raw = blocks(shape, rng, np.full((16, 4), e, dtype=np.uint8))
    w = QWeight.from_gguf(raw, MXFP4, shape, name="x")
    x = (rng.standard_normal((3, 128)) * x_scale).astype(np.float32)
    want = int8_rounded(x) @ weights64(raw, shape).T
    got = w.matmul(torch.from_numpy(x)).numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_pairs_and_groups_are_the_same_bits() -> None:
    """In this process: the 512-bit pairs (from one row on) against the 256-bit groups (pairs
    never), every row count and odd shapes, bit for bit."""
    lib = library()
    if lib is None or "zmm-vnni" not in features():
        pytest.skip("no 512-bit VNNI kernels on this CPU")
    before = lib.gl_set_pair_rows(1)
    try:
        for shape in SHAPES:
            rng = np.random.default_rng(1)
            raw = blocks(shape, rng, rng.integers(110, 140, (shape[0], shape[1] // 32)))
            w = QWeight.from_gguf(raw, MXFP4, shape, name="x")
            for m in (1, 2, 5, 6, 7, 13):
                x = torch.from_numpy(rng.standard_normal((m, shape[1])).astype(np.float32))
                lib.gl_set_pair_rows(1)
                paired = w.matmul(x)
                lib.gl_set_pair_rows(1 << 30)
                alone = w.matmul(x)
                assert torch.equal(paired, alone), (shape, m)
    finally:
        lib.gl_set_pair_rows(before)


PRODUCTS = """
import sys, numpy as np, torch
from gguf import GGMLQuantizationType as Q
from graftlm.native import isa
from graftlm.quant import QWeight
torch.set_num_threads(1)
out = {"isa": isa()}
for n, k in ((7, 96), (37, 864), (80, 160)):
    rng = np.random.default_rng(n)
    raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = rng.integers(110, 140, (n, k // 32))
    w = QWeight.from_gguf(raw.reshape(n, -1), Q.MXFP4, (n, k), name="x")
    out[f"{n}x{k}:kernel"] = w.kernel
    out[f"{n}x{k}:deq"] = w.dequantize()
    for m in (1, 3, 6, 7, 40):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        out[f"{n}x{k}:{m}"] = w.matmul(x)
# the smallest and largest scales (subnormal 2^-128 and 2^-127, up to 2^127), x keeping them finite
for name, exps, scale in (("low", (0, 1, 2, 3), 1.0), ("high", (250, 252, 254, 255), 2.0**-100)):
    rng = np.random.default_rng(len(name))
    raw = rng.integers(0, 256, (16, 8, 17), dtype=np.uint8)
    raw[:, :, 0] = np.resize(np.array(exps, dtype=np.uint8), (16, 8))
    w = QWeight.from_gguf(raw.reshape(16, -1), Q.MXFP4, (16, 256), name="x")
    for m in (1, 7):
        x = torch.from_numpy((rng.standard_normal((m, 256)) * scale).astype(np.float32))
        out[f"{name}:{m}"] = w.matmul(x)
torch.save(out, sys.argv[1])
"""


@pytest.mark.parametrize("other", ["avx2", "ymm"])
def test_other_variants_are_the_same_bits(tmp_path: Path, other: str) -> None:
    """The AVX2 variant (maddubs sums, no VNNI; its scales from the exponents' bits, its lookups
    by VPSHUFB) and the ymm one (256-bit VNNI groups only), built in subprocesses, against this
    CPU's on odd shapes and at the edge exponents: the same bits."""
    if not features():
        pytest.skip("this CPU's variant is the AVX2 one: nothing to compare it with")
    if other == "ymm" and "zmm-vnni" not in features():
        pytest.skip("no 512-bit VNNI kernels on this CPU: the ymm variant is this one")
    got = {}
    for isa in ("native", other):
        env = {**os.environ, "GRAFTLM_NATIVE_ISA": isa, "GRAFTLM_AMX_ROWS": "0"}
        path = tmp_path / f"{isa}.pt"
        done = subprocess.run([sys.executable, "-c", PRODUCTS, str(path)], env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        got[isa] = torch.load(path)
    mine, them = got["native"], got[other]
    assert them["isa"] == other
    for key, value in mine.items():
        if key.endswith(":kernel"):
            assert value == them[key] == "native-mx4"
        elif key != "isa":
            assert torch.equal(value, them[key]), (key, float((value - them[key]).abs().max()))
