"""The float weights' products (csrc/float.c, kind 4) against their twins, in float64.

F16, F32 and BF16 with few rows of x: float32 products of x and W (FMA), so the twin is x @ W.T
on the same values; the sums run in another order, so the bound is a few ulps of the sum of
|terms| of each output. BF16 from a whole tile of rows (6) where the CPU has AVX512-BF16 and the
512-bit kernels: x rounded to bfloat16 (round to nearest even) and summed by VDPBF16PS, whose
products of two bfloat16 values are exact in float32: the twin is bf16(x) @ W.T, to the same
bound. The shapes' outputs are not a multiple of a tile's 4 (nor of a task's 32) and k is not a
multiple of the 1024 values a pass reads (FB_KC); the rows are not a multiple of a tile's 6.
GRAFTLM_BF16_DOTS=0 turns that path off (read once by the library): a subprocess runs the same
checks with it off. The AVX2 and ymm variants (built in a subprocess) keep the FMA path for
every row count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from synth_tensors import gguf_tensor
from test_decode_attention import variant_outputs

from graftlm.native import bf16_dots, library
from graftlm.quant import QWeight

SHAPES = [(37, 1056), (70, 2112)]  # (n_out, n_in)
ROWS = (1, 5, 6, 7, 13, 100)
TILE_ROWS = 6  # rows of x from which a BF16 product rounds x (float.c: FB_ROWS)


def _case(qt: Q, shape: tuple[int, int], m: int) -> tuple[QWeight, torch.Tensor]:
    raw, _ = gguf_tensor(qt, shape, seed=shape[0])
    w = QWeight.from_gguf(raw, qt, shape, name="w")
    return w, torch.randn(m, shape[1], generator=torch.Generator().manual_seed(m))


def _assert_twin(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: object) -> None:
    """Within float32 summation error of x @ w.T in float64: a few ulps of the sum of |terms|."""
    want = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T
    err = (got.double() - want).abs()
    assert bool((err <= 4e-6 * bound + 1e-30).all()), (what, float((err / bound).max()))


def _check(qt: Q, shape: tuple[int, int], m: int, got: torch.Tensor, dots: bool) -> None:
    w, x = _case(qt, shape, m)
    deq = w.dequantize()
    rounded = dots and qt == Q.BF16 and m >= TILE_ROWS
    _assert_twin(got, x.bfloat16().float() if rounded else x, deq, (qt.name, shape, m))
    if rounded:  # x rounded: not the float32 product's result
        assert not torch.equal(got, w.matmul(x, exact=True)), (shape, m)


def test_products_match_their_twins() -> None:
    if library() is None:
        pytest.skip("native kernels unavailable here")
    for qt in (Q.F16, Q.BF16, Q.F32):
        for shape in SHAPES:
            for m in ROWS:
                w, x = _case(qt, shape, m)
                assert w.kernel == "native-float"
                _check(qt, shape, m, w.matmul(x), bf16_dots())


def test_x_rounds_to_nearest_even() -> None:
    """BF16's W = I: each output is x's value as the product read it. With the dot products,
    bf16(x) rounded to nearest, ties to even (torch's rounding, and ggml's GGML_FP32_TO_BF16);
    with FMA, x itself."""
    if library() is None:
        pytest.skip("native kernels unavailable here")
    k = 64
    eye = torch.eye(k).bfloat16().view(torch.uint8).numpy()
    w = QWeight.from_gguf(eye, Q.BF16, (k, k), name="eye")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TILE_ROWS + 1, k, generator=g) * torch.logspace(-20, 20, k)
    # ties: halfway between two bfloat16 values (8 bits of mantissa), down and up to the even one
    ulp = 2.0**-7
    ties = [1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), -(1 + 3 * ulp / 2), 2 + ulp, 2 + 3 * ulp]
    x[0, : len(ties)] = torch.tensor(ties)
    x[1, :4] = torch.tensor([0.0, -0.0, 3.0e38, -3.0e38])
    got = w.matmul(x)
    want = x.bfloat16().float() if bf16_dots() else x
    assert torch.equal(got, want), (got - want).abs().max()
    if bf16_dots():
        assert got[0, : len(ties)].tolist() == [
            1.0,
            1 + 2 * ulp,
            -1.0,
            -(1 + 2 * ulp),
            2.0,
            2 + 4 * ulp,
        ]
    few = w.matmul(x[: TILE_ROWS - 1])  # fewer rows: x as it is
    assert torch.equal(few, x[: TILE_ROWS - 1])


VARIANT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[2]).parent))
from gguf import GGMLQuantizationType as Q
import test_float as t
torch.set_num_threads(1)
from graftlm.native import bf16_dots, isa
out = {"isa": isa(), "dots": bf16_dots()}
for qt in (Q.F16, Q.BF16, Q.F32):
    for shape in t.SHAPES:
        for m in t.ROWS:
            w, x = t._case(qt, shape, m)
            out[f"{qt.name}:{shape}:{m}"] = w.matmul(x)
t.test_x_rounds_to_nearest_even()
torch.save(out, sys.argv[1])
"""


def test_with_the_dots_off(tmp_path: Path) -> None:
    """GRAFTLM_BF16_DOTS=0 in a subprocess: the FMA path's twin (x float32) for every row
    count, on every CPU."""
    if library() is None:
        pytest.skip("native kernels unavailable here")
    env = {**os.environ, "GRAFTLM_BF16_DOTS": "0"}
    path = tmp_path / "out.pt"
    done = subprocess.run(
        [sys.executable, "-c", VARIANT, str(path), str(Path(__file__).parent)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(path)
    assert theirs["dots"] is False
    for qt in (Q.F16, Q.BF16, Q.F32):
        for shape in SHAPES:
            for m in ROWS:
                _check(qt, shape, m, theirs[f"{qt.name}:{shape}:{m}"], theirs["dots"])


@pytest.mark.parametrize("other", ["avx2", "ymm"])
def test_other_variants_match_the_float32_twin(tmp_path: Path, other: str) -> None:
    """The AVX2 and ymm builds: the FMA path for every row count."""
    if library() is None:
        pytest.skip("native kernels unavailable here")
    theirs = variant_outputs(tmp_path, other, VARIANT)
    assert theirs["dots"] is False
    for qt in (Q.F16, Q.BF16, Q.F32):
        for shape in SHAPES:
            for m in ROWS:
                _check(qt, shape, m, theirs[f"{qt.name}:{shape}:{m}"], dots=False)
