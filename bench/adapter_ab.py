"""The cost of one adapter on single-stream decode, measured finely interleaved.

Whole-run benchmarks on this 2-core machine drift by tens of percent within minutes; the ratio of
two runs minutes apart says little about a 5% cost. This bench alternates short blocks of decode
steps with the adapter on (scale 1) and off (scale 0: not in the step's active set, the plain base
step) on one model and one cache, and prints the median of the per-pair ratios.

    .venv/bin/python bench/adapter_ab.py [--model PATH] [--lora PATH] [--pairs 60] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import graftlm
from graftlm.step.batch import Batch, LoraRows

SHARED = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--lora", default=str(SHARED / "smollm2" / "pirate-f32.gguf"))
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=64, help="positions the steps attend over")
    ap.add_argument("--null", action="store_true", help="both blocks without the adapter: the bias")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = graftlm.load(args.model, ctx_size=args.ctx + args.steps + 8)
    slot = m.add_lora(args.lora, 1.0)
    model, engine = m.model, m.engine
    on = None if args.null else engine.lora_rows([{slot: 1.0}])
    prompt = list(range(100, 100 + args.ctx))

    def block(lora: LoraRows | None, i: int) -> float:
        t0 = time.perf_counter()
        for s in range(args.steps):
            # every block decodes the same positions: equal attention work either way
            tok = torch.tensor([[7 + (i + s) % 50]])
            model.forward(Batch(tok, [0], [args.ctx + s], [1], lora=lora))
        return (time.perf_counter() - t0) / args.steps

    with torch.inference_mode():
        model.forward(Batch.single(prompt, 0, 0))
        for i in range(4):
            block(None, i), block(on, i)
        base, with_a, ratios = [], [], []
        for i in range(args.pairs):
            if i % 2:  # alternate which goes first
                b, a = block(None, i), block(on, i)
            else:
                a, b = block(on, i), block(None, i)
            base.append(b)
            with_a.append(a)
            ratios.append(b / a)
    mb, ma = statistics.median(base), statistics.median(with_a)
    q = statistics.quantiles(ratios, n=4)
    print(
        f"base {1 / mb:6.1f} tok/s ({mb * 1e3:.3f} ms)  adapter {1 / ma:6.1f} tok/s ({ma * 1e3:.3f} ms)"
    )
    print(
        f"adapter / base speed: median pair {statistics.median(ratios):.3f} "
        f"(quartiles {q[0]:.3f}-{q[2]:.3f}, {args.pairs} pairs of {args.steps} steps); "
        f"cost {(ma - mb) * 1e3:.3f} ms/token"
    )
    # the least disturbed blocks: a neighbour's memory traffic only ever adds time
    fb, fa = sorted(base)[: len(base) // 10 + 1], sorted(with_a)[: len(with_a) // 10 + 1]
    lb, la = statistics.mean(fb), statistics.mean(fa)
    print(f"fastest tenth of the blocks: {lb / la:.3f} (cost {(la - lb) * 1e3:.3f} ms/token)")


if __name__ == "__main__":
    main()
