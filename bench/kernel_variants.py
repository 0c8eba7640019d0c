"""The native products of each quant type at 1 row of x (decode) and 512 (a prompt), best of 5,
on 2 threads. Run it under each kernel variant to compare them in the same minutes:

    for isa in ymm native ymm native; do
        GRAFTLM_NATIVE_ISA=$isa PYTHONPATH=src python bench/kernel_variants.py
    done
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from graftlm.native import features, isa
from graftlm.quant import QWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synth_tensors
from synth_tensors import gguf_tensor  # noqa: E402

CASES = [
    (Q.Q4_1, (8192, 2048)),
    (Q.Q5_0, (8192, 2048)),
    (Q.Q4_K, (8192, 2048)),
    (Q.Q4_K, (2048, 8192)),
    (Q.Q5_K, (8192, 2048)),
    (Q.Q6_K, (2048, 8192)),
    (Q.Q8_0, (8192, 2048)),
]


def best_ms(w: QWeight, x: torch.Tensor, reps: int = 5) -> float:
    w.matmul(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        w.matmul(x)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(2)
    print(f"variant {isa()}: {', '.join(features()) or 'AVX2 + FMA'}")
    for qt, shape in CASES:
        raw, _ = gguf_tensor(qt, shape, seed=1)
        w = QWeight.from_gguf(raw, qt, shape, name="w")
        cells = []
        for m in (1, 512):
            ms = best_ms(w, torch.randn(m, shape[1]))
            cells.append(f"M={m} {ms:.2f} ms ({2 * m * shape[0] * shape[1] / ms / 1e6:.0f} GOP/s)")
        print(f"{qt.name} {shape[0]}x{shape[1]}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
