"""Quantized matmul throughput per kernel and rows of x, side by side in one run.

For each weight type and shape: GMAC/s of the native int8-activation kernel, of the exact float32
path (dequantize chunks + float32 GEMM) and of torch's own fused kernel (native disabled; the
blocks fallback for the types torch has none for: MXFP4 and the grid quants), for M = 1 .. 512
rows.  This is where ``graftlm.quant.config.PREFILL_M`` comes from.  The grid quants (IQ2_*,
IQ3_*) run on Qwen3-30B-A3B's expert and attention shapes, and the float types (F16, BF16) on
Llama-1B's, when --types names them (BF16's from 6 rows: VDPBF16PS where the CPU has it,
GRAFTLM_BF16_DOTS=0 in the environment for the FMA path; the FMA peak of a Zen 4 core, 16 MACs a cycle, is ~58 GMAC/s at 3.65 GHz).

    .venv/bin/python bench/kernels.py [--rows 1 4 16 64 128 512] [--threads 2] [--types MXFP4 IQ3_XXS]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from graftlm.native import disabled, unavailable_reason
from graftlm.quant import QWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synth_tensors
from synth_tensors import gguf_tensor, random_blocks  # noqa: E402

SHAPES = [(Q.Q4_1, 3072, 576), (Q.Q4_1, 576, 1536), (Q.Q4_K, 640, 2048), (Q.Q5_0, 2048, 640),
          (Q.Q6_K, 640, 2048), (Q.Q8_0, 4096, 640)]  # fmt: skip
SHAPES += [(Q.MXFP4, 5760, 2880), (Q.MXFP4, 2880, 2880)]  # gpt-oss-20b's experts: [gate; up], down
# an expert's stacked gate and up, its down, and the attention's Q (Qwen3-30B-A3B)
GRID_SHAPES = [(t, n, k) for t in (Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S)
               for n, k in ((1536, 2048), (2048, 768), (4096, 2048))]  # fmt: skip
# Llama-1B's attention Q, its FFN's gate (and up) and down
FLOAT_SHAPES = [
    (t, n, k) for t in (Q.F16, Q.BF16) for n, k in ((2048, 2048), (8192, 2048), (2048, 8192))
]


def gmacs(fn: Callable[[], object], macs: int) -> float:
    fn()
    reps = max(2, int(5e7 / macs))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return macs * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 64, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", nargs="*", help="only these GGUF types (e.g. MXFP4)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if unavailable_reason():
        print(f"native kernels unavailable: {unavailable_reason()}")
    rng = np.random.default_rng(0)
    print("| type | n_out x n_in | M | native | float32 chunks | torch fused | (GMAC/s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    shapes = SHAPES + GRID_SHAPES + FLOAT_SHAPES if args.types else SHAPES
    for qtype, n, k in shapes:
        if args.types and qtype.name not in args.types:
            continue
        floats = qtype in (Q.F16, Q.BF16)
        raw = gguf_tensor(qtype, (n, k))[0] if floats else random_blocks(qtype, (n, k), rng)
        w = QWeight.from_gguf(raw, qtype, (n, k))
        with disabled():
            wt = QWeight.from_gguf(raw, qtype, (n, k))
        for m in args.rows:
            x, y = torch.randn(m, k), torch.empty(m, n)
            macs = m * n * k
            kern = w._k
            nat = gmacs(lambda: kern._mm(x, y), macs) if hasattr(kern, "_mm") else 0.0  # noqa: B023
            f32 = gmacs(lambda: kern.chunked_matmul(x), macs)  # noqa: B023
            fused = gmacs(lambda: wt.matmul(x), macs)  # noqa: B023
            print(f"| {qtype.name} | {n}x{k} | {m} | {nat:.1f} ({w.kernel}) | {f32:.1f} "
                  f"| {fused:.1f} ({wt.kernel}) | |")  # fmt: skip


if __name__ == "__main__":
    main()
