"""Milliseconds per decode step for B one-token rows (each its own sequence), SmolLM2 by default.

Shows how the batched decode step scales with the batch: the number that bounds serving
throughput (see README, "Speed").

    .venv/bin/python bench/decode_step.py [B ...] [--model PATH] [--steps 10] [--profile]
"""

from __future__ import annotations

import argparse
import time

import torch

import graftlm
from graftlm.step.batch import Batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = max(args.rows)
    model = graftlm.load(args.model, ctx_size=256, n_seq=n).model
    with torch.inference_mode():
        for s in range(n):
            model.forward(Batch.single(list(range(100, 110 + s)), s, 0))
        for b in args.rows:

            def step(i: int, b: int = b) -> None:
                tokens = torch.tensor([[5 + i]] * b)
                model.forward(
                    Batch(tokens, list(range(b)), [10 + s + i for s in range(b)], [1] * b)
                )

            step(0)
            t0 = time.perf_counter()
            for i in range(1, args.steps + 1):
                step(i)
            ms = (time.perf_counter() - t0) / args.steps * 1000
            print(f"{b:3d} rows: {ms:7.1f} ms/step, {b * 1000 / ms:7.1f} tok/s")
            if args.profile:
                from torch.profiler import profile

                with profile() as prof:
                    for i in range(args.steps + 1, args.steps + 4):
                        step(i)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
