"""Prompt attention through the paged KV cache: the native kernel (gl_attn_prefill) against
PyTorch's SDPA on the same values, side by side in one run, for real models' head shapes.

Prints milliseconds per call, useful GMAC/s (causal and window blocks only) and the largest
difference from SDPA with the same mask. Random queries and keys do not reach the denormals that
a model's own can (see ftz_begin in csrc/graftlm.h): time those through `graftlm bench`.

    .venv/bin/python bench/attention.py [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from graftlm.native import unavailable_reason
from graftlm.native.ops import attn_prefill
from graftlm.step import Batch, KVCache

# (name, new tokens, heads, kv heads, head dim, tokens already in the cache, window)
CASES = [
    ("gemma-3, first 512", 512, 4, 1, 256, 0, 0),
    ("gemma-3, window 256", 512, 4, 1, 256, 100, 256),
    ("gemma-3, chunk after 300", 128, 4, 1, 256, 300, 0),
    ("SmolLM2, first 512", 512, 9, 3, 64, 0, 0),
    ("Llama-1B, first 512", 512, 32, 8, 64, 0, 0),
    ("Llama-1B, 512 after 4,096", 512, 32, 8, 64, 4096, 0),
    ("Qwen2.5-1.5B, 512 after 4,096", 512, 12, 2, 128, 4096, 0),
]


def timed(fn: object, reps: int) -> float:
    assert callable(fn)
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if unavailable_reason():
        print(f"native kernels unavailable: {unavailable_reason()}")
        return
    print("| case | native ms | GMAC/s | SDPA ms | SDPA / native | max diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    g = torch.Generator().manual_seed(0)
    for name, t, h, hkv, d, start, window in CASES:
        length = start + t
        kc = torch.randn(1, length, hkv, d, generator=g)  # (B, T, Hkv, D) as the cache takes them
        vc = torch.randn(1, length, hkv, d, generator=g)
        q = torch.randn(1, t, h, d, generator=g)
        cache = KVCache(1, 1, hkv, length, d, d, torch.float32)
        cache.write(0, Batch(torch.zeros(1, length, dtype=torch.long), [0], [0], [length]), kc, vc)
        rows = Batch(torch.zeros(1, t, dtype=torch.long), [0], [start], [t]).index()
        assert rows is not None
        scale = d**-0.5
        pos = torch.arange(start, length).view(t, 1)
        key = torch.arange(length).view(1, length)
        mask = key <= pos
        if window:
            mask &= pos - key < window

        def native() -> torch.Tensor | None:
            return attn_prefill(q, cache, 0, rows, scale, window)  # noqa: B023

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),  # noqa: B023
                attn_mask=mask, scale=scale, enable_gqa=True,  # noqa: B023
            ).transpose(1, 2).flatten(2)  # fmt: skip

        out = native()
        assert out is not None, name
        diff = (out - sdpa()).abs().max().item()
        tn, ts = timed(native, args.reps), timed(sdpa, args.reps)
        macs = 2 * h * d * sum(min(start + i + 1, window or length) for i in range(t))
        print(f"| {name} | {tn * 1e3:.2f} | {macs / tn / 1e9:.0f} | {ts * 1e3:.2f} | "
              f"{ts / tn:.2f} | {diff:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
