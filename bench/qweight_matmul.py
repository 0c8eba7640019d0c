"""Microbenchmark of QWeight.matmul on the real models' shapes: ``python bench/qweight_matmul.py``.

For each weight shape of SmolLM2-135M (Q4_1 + Q8_0 head) and gemma-3-270m (Q5_0, Q8_0, Q4_K,
Q6_K, Q8_0 head) it builds a random GGUF tensor, loads it as a QWeight, and times ``matmul`` for
M rows of x against a dense bf16 and a dense f32 ``F.linear`` of the same shape.  Times are the
minimum over repeated calls (robust to a busy machine), with enough copies of each weight cycled
to exceed the last-level cache (decode streams weights from DRAM; hot-cache numbers flatter
dense f32).  Memory is QWeight.nbytes against the GGUF bytes.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from graftlm.quant.qweight import QWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synth_tensors
from synth_tensors import gguf_tensor  # noqa: E402

Q = GGMLQuantizationType
V = TypeVar("V")

SHAPES: dict[str, list[tuple[str, GGMLQuantizationType, int, int]]] = {
    "smollm2": [  # (tensor, type, n_out, n_in)
        ("attn_q/o", Q.Q4_1, 576, 576),
        ("attn_k/v", Q.Q4_1, 192, 576),
        ("ffn_gate/up", Q.Q4_1, 1536, 576),
        ("ffn_down", Q.Q4_1, 576, 1536),
        ("head(tied)", Q.Q8_0, 49152, 576),
    ],
    "gemma3": [
        ("attn_q", Q.Q5_0, 1024, 640),
        ("attn_k", Q.Q5_0, 256, 640),
        ("ffn_gate/up", Q.Q5_0, 2048, 640),
        ("attn_v", Q.Q8_0, 256, 640),
        ("attn_output", Q.Q4_K, 640, 1024),
        ("ffn_down", Q.Q6_K, 640, 2048),
        ("head(tied)", Q.Q8_0, 262144, 640),
    ],
}


def time_call(fn: Callable[[], object], budget: float) -> float:
    """Minimum wall time of fn() in microseconds over >= 5 calls / ``budget`` seconds."""
    fn()
    best, t_end, n = float("inf"), time.perf_counter() + budget, 0
    while n < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best * 1e6


def cycle_of(make: Callable[[], V], nbytes: int, cold_bytes: int) -> Iterator[V]:
    """Enough copies of a weight, cycled, that their bytes exceed ``cold_bytes``."""
    copies = max(1, min(256, -(-cold_bytes // max(nbytes, 1))))
    return itertools.cycle([make() for _ in range(copies)])


def bench_shape(
    qtype: GGMLQuantizationType, n: int, k: int, ms: list[int], budget: float, cold_bytes: int
) -> tuple[str, list[dict[str, float]]]:
    """(kernel name, one row per M: us per call of ours / dense bf16 / dense f32, bytes)."""
    raw, _ = gguf_tensor(qtype, (n, k), prefer_quantize=False)
    qw = QWeight.from_gguf(raw, qtype, (n, k))
    ws = cycle_of(lambda: QWeight.from_gguf(raw.copy(), qtype, (n, k)), qw.nbytes, cold_bytes)
    w32 = qw.dequantize()
    d16 = cycle_of(lambda: w32.to(torch.bfloat16), n * k * 2, cold_bytes)
    d32 = cycle_of(lambda: w32.clone(), n * k * 4, cold_bytes)

    def ours(x: torch.Tensor) -> torch.Tensor:
        return next(ws).matmul(x)

    def dense_bf16(x: torch.Tensor) -> torch.Tensor:  # same seam contract: f32 in, f32 out
        return F.linear(x.bfloat16(), next(d16)).float()

    def dense_f32(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, next(d32))

    rows = []
    for m in ms:
        x = torch.randn(m, k)
        us = {
            f.__name__: time_call(functools.partial(f, x), budget)
            for f in (ours, dense_bf16, dense_f32)
        }
        rows.append(
            {
                "M": m,
                "ours": us["ours"],
                "bf16": us["dense_bf16"],
                "f32": us["dense_f32"],
                "nbytes": qw.nbytes,
                "file": raw.nbytes,
            }
        )
    return qw.kernel, rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--m", default="1,64,512", help="rows of x for layer weights")
    ap.add_argument("--head-m", default="1", help="rows of x for the vocabulary heads")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--cold-mb", type=int, default=96, help="cycle weights up to this many MB")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure each cell this many times, keep the minimum (busy machines)",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ms = [int(v) for v in a.m.split(",")]
    head_ms = [int(v) for v in a.head_m.split(",")]
    print(
        f"threads={a.threads} torch={torch.__version__} "
        f"cpu={torch.backends.cpu.get_cpu_capability()}  (us per call, min of repeats)"
    )
    print(
        f"{'model':8} {'tensor':12} {'type':5} {'n_out x n_in':>13} {'kernel':10} "
        f"{'MB ours':>8} {'/file':>5} {'M':>4} {'us ours':>9} {'us bf16':>9} {'us f32':>9}"
    )
    for model in a.models.split(","):
        for tensor, qtype, n, k in SHAPES[model]:
            head = tensor.startswith("head")
            runs = [
                bench_shape(qtype, n, k, head_ms if head else ms, a.budget, a.cold_mb << 20)
                for _ in range(a.repeat)
            ]
            kernel = runs[0][0]
            for i, r in enumerate(runs[0][1]):
                for key in ("ours", "bf16", "f32"):
                    r[key] = min(run[1][i][key] for run in runs)
                mb, ratio = r["nbytes"] / 2**20, r["nbytes"] / r["file"]
                print(
                    f"{model:8} {tensor:12} {qtype.name:5} {f'{n}x{k}':>13} {kernel:10} "
                    f"{mb:8.2f} {ratio:5.2f} {r['M']:4.0f} {r['ours']:9.0f} {r['bf16']:9.0f} "
                    f"{r['f32']:9.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
