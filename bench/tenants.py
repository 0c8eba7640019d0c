"""Many tenants in one decode step: the engine's step on B rows, base beside adapters, alternated.

One model with N adapters attached (at scale 0: a request names its own), and decode steps of B
one-token rows (each its own sequence), in these scenarios, taken in turn each round:

    base      no row on an adapter
    same      every row on adapter 0
    distinct  the rows spread over the N adapters (rows ordered by adapter, as the engine orders
              them); with more adapters than rows, each step takes the next rows' worth of them
    churn     as distinct, but the set of adapters in the step changes every step (rows leave
              and join adapters), as in a server where requests start and end

With --pp P, a prompt of P tokens runs in turn with them, and the base step's tokens per second
are printed as a share of the prompt's (a B-row decode step reads every weight once for B
tokens, as a prompt does for P: what it loses to the prompt is what its batch does not reach).

Printed: milliseconds a step and tokens per second of each (the median over the rounds), each
one's ratio to base, and what attaching one adapter cost (read, checked and packed).

    .venv/bin/python bench/real_shapes.py DIR --shape llama-1b --mix q4_k_m --adapter --adapters 16
    .venv/bin/python bench/tenants.py DIR/llama-1b-q4_k_m.gguf DIR/llama-1b-lora-r16*.gguf \
        --rows 16 --pp 512

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

    def distinct(step: int) -> Settings:  # rows grouped by adapter; more adapters than rows:
        if rows >= n:  # the step's set moves on through all of them
            return [{ids[r * n // rows]: 1.0} for r in range(rows)]
        return [{ids[(step * rows + r) % n]: 1.0} for r in range(rows)]

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
    ap.add_argument("--pp", type=int, default=0, help="also a prompt of this many tokens")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b = args.rows
    m = graftlm.load(args.model, ctx_size=max(64 + 4 * args.rounds, args.pp + 1), n_seq=b + 1)
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
    prompts: list[float] = []
    with torch.inference_mode():
        for s in range(b):
            model.forward(Batch.single(list(range(100, 116)), s, 0))

        def prompt(rnd: int) -> None:  # in the last slot, from position 0
            ids = [(i * 7919 + rnd) % 20000 + 100 for i in range(args.pp)]
            t0 = time.perf_counter()
            model.forward(Batch.single(ids, b, 0))
            prompts.append(time.perf_counter() - t0)

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
        if args.pp:
            prompt(0)
            prompts.clear()
        for rnd in range(1, args.rounds + 1):
            for k, f in cases.items():
                times[k].append(step(f(rnd)))
            if args.pp:
                prompt(rnd)
    base = statistics.median(times["base"])
    print(f"{'scenario':9s} {'ms/step':>8s} {'tok/s':>7s} {'/ base':>7s}")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:9s} {med * 1000:8.1f} {b / med:7.1f} {base / med:7.2f}")
    if prompts:
        pp = args.pp / statistics.median(prompts)
        print(f"pp{args.pp}: {pp:.1f} tok/s; the {b}-row base step makes {b / base / pp:.2f}x that")


if __name__ == "__main__":
    main()
