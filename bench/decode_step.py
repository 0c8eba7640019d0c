"""Milliseconds per decode step for B one-token rows (each its own sequence), SmolLM2 by default.

Shows how the batched decode step scales with the batch: the number that bounds serving
throughput (see README, "Speed").

    .venv/bin/python bench/decode_step.py [B ...] [--model PATH] [--steps 10] [--profile]

With `--depth D` every row's sequence already holds D positions (random keys and values written
into the cache, as a long prefix would leave them; the step reads them all), so many long
sequences decode together (issue 37: 16 sequences of 4,096); `--cache-type` picks the cache
(llama.cpp's -ctk names) and `--bandwidth` prints each step's share of the machine's read
bandwidth, counting the weights once and every row's keys and values.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from vs_llama_cpp import Bandwidth, kv_bytes, token_bytes

import graftlm
from graftlm.step.batch import Batch
from graftlm.step.kv_cache import KV_TYPES, KVCache, q8_0_pack


def fill_cache(cache: KVCache, depth: int) -> None:
    """Random keys and values (unit normal, as a model's are in scale) at every slot's first
    `depth` positions: the default tables map slot s's positions to blocks of its own."""
    n = -(-depth // cache.block)
    gen = torch.Generator().manual_seed(0)
    for pool in (*cache.k, *cache.v):
        for s in range(cache.n_slots):
            blocks = cache.tables[s, :n].long()
            shape = pool[blocks].shape
            if cache.dtype is torch.uint8:  # q8_0 rows: their bytes
                rows = torch.randn(*shape[:-1], shape[-1] // 34 * 32, generator=gen)
                pool[blocks] = q8_0_pack(rows)
            else:
                pool[blocks] = torch.randn(*shape, generator=gen).to(cache.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=0, help="positions every sequence holds")
    ap.add_argument("--cache-type", "-ctk", choices=list(KV_TYPES), default=None)
    ap.add_argument("--bandwidth", action="store_true", help="the steps' share of it")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, depth = max(args.rows), args.depth
    loaded = graftlm.load(
        args.model,
        ctx_size=max(256, depth + args.steps + 16),
        n_seq=n,
        cache_type=args.cache_type,
    )
    model = loaded.model
    probe = Bandwidth(Path(tempfile.mkdtemp())) if args.bandwidth else None
    if args.bandwidth:
        path = str(loaded.path)
        weights = token_bytes(path)
        cache_name = next(k for k, (t, _) in KV_TYPES.items() if t == model.cache.dtype)
    with torch.inference_mode():
        if depth:
            fill_cache(model.cache, depth)
        else:
            for s in range(n):
                model.forward(Batch.single(list(range(100, 110 + s)), s, 0))
        for b in args.rows:
            start = [depth or 10 + s for s in range(b)]

            def step(i: int, b: int = b, start: list[int] = start) -> None:
                tokens = torch.tensor([[5 + i]] * b)
                model.forward(Batch(tokens, list(range(b)), [p + i for p in start], [1] * b))

            step(0)
            bw = probe.measure() if probe else 0.0
            t0 = time.perf_counter()
            for i in range(1, args.steps + 1):
                step(i)
            s = (time.perf_counter() - t0) / args.steps
            line = f"{b:3d} rows: {s * 1000:7.1f} ms/step, {b / s:7.1f} tok/s"
            if probe:
                bw = max(bw, probe.measure())
                read = weights + b * kv_bytes(path, depth, args.steps, cache_name)
                line += (f", {read / 2**20:,.0f} MiB a step, {read / s / 1e9:.1f} GB/s: "
                         f"{read / s / bw:.0%} of {bw / 1e9:.1f}")  # fmt: skip
            print(line)
            if args.profile:
                from torch.profiler import profile

                with profile() as prof:
                    for i in range(args.steps + 1, args.steps + 4):
                        step(i)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
