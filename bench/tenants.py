"""Many tenants in one decode step: the engine's step on B rows, base beside adapters, alternated.

One model with N adapters attached (at scale 0: a request names its own), and decode steps of B
one-token rows (each its own sequence), in these scenarios, taken in turn each round:

    base      no row on an adapter
    same      every row on adapter 0
    distinct  row i on adapter i mod N (rows ordered by adapter, as the engine orders them)
    churn     as distinct, but the set of adapters in the step changes every step (rows leave
              and join adapters), as in a server where requests start and end

Printed: milliseconds a step and tokens per second of each (the median over the rounds), each
one's ratio to base, and what attaching one adapter cost (its native form is packed then).

    .venv/bin/python bench/real_shapes.py DIR --shape llama-1b --mix q4_k_m --adapter --adapters 16
    .venv/bin/python bench/tenants.py DIR/llama-1b-q4_k_m.gguf DIR/llama-1b-lora-r16*.gguf --rows 16

Run it on a quiet machine, from a worktree when src/ is being edited (the library is rebuilt from
the sources it imports).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import graftlm
from graftlm.runtime.engine import lora_rows
from graftlm.step.batch import Batch

Settings = list[dict[int, float]]


def scenarios(ids: list[int], rows: int) -> dict[str, Callable[[int], Settings]]:
    n = len(ids)

    def distinct(step: int) -> Settings:
        return [{ids[r * n // rows if rows >= n else r % n]: 1.0} for r in range(rows)]

    def churn(step: int) -> Settings:  # a third of the rows on no adapter, moving each step
        out = [
            {ids[(r + step) % n]: 1.0} if (r + step) % 3 else {} for r in range(rows)
        ]  # fmt: skip
        return sorted(out, key=lambda s: tuple(s))  # the engine's order: by adapter id

    return {
        "base": lambda step: [{} for _ in range(rows)],
        "same": lambda step: [{ids[0]: 1.0} for _ in range(rows)],
        "distinct": distinct,
        "churn": churn,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("adapters", nargs="+")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b = args.rows
    m = graftlm.load(args.model, ctx_size=64 + 4 * args.rounds * 4, n_seq=b)
    attach = []
    ids = []
    for path in args.adapters:
        t0 = time.perf_counter()
        ids.append(m.add_lora(path, 0.0))
        attach.append(time.perf_counter() - t0)
    print(f"{args.model}: {len(ids)} adapters, {b} rows, {args.threads} threads")
    print(
        f"attach (read, check, pack): median {statistics.median(attach) * 1000:.0f} ms an adapter"
    )
    model, cases = m.model, scenarios(ids, b)
    times: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for s in range(b):
            model.forward(Batch.single(list(range(100, 116)), s, 0))
        pos = [16] * b

        def step(settings: Settings) -> float:
            batch = Batch(torch.tensor([[5]] * b), list(range(b)), list(pos), [1] * b,
                          lora_rows(settings, torch.device("cpu")))  # fmt: skip
            t0 = time.perf_counter()
            model.forward(batch)
            for i in range(b):
                pos[i] += 1
            return time.perf_counter() - t0

        for f in cases.values():  # warm: each scenario's first step
            step(f(0))
        for rnd in range(1, args.rounds + 1):
            for k, f in cases.items():
                times[k].append(step(f(rnd)))
    base = statistics.median(times["base"])
    print(f"{'scenario':9s} {'ms/step':>8s} {'tok/s':>7s} {'/ base':>7s}")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:9s} {med * 1000:8.1f} {b / med:7.1f} {base / med:7.2f}")


if __name__ == "__main__":
    main()
