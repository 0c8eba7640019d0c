"""A prompt's routed FFN native (gl_moe_ffn, one call a layer) against composed from Python
(moe_ffn / routed_ffn, two or three native calls an expert), alternated prompt by prompt in one
process under one loaded model.

    python bench/moe_prompt_ab.py --model /work/models/qwen3-30b-a3b-6l-q4_k_m.gguf \\
        --prompt 128 512 --rounds 7 --threads 1 --spread [--lora ADAPTER.gguf]

One thread: the thread's CPU time of each prompt; more: wall time (and the process's CPU time).
`--spread`: the routed FFNs of both ways see random normed inputs (rms 1, fixed per layer and
shape) in place of the model's, so each token picks its own experts as in a trained model (the
random weights of bench/real_shapes.py route every token of a prompt to the same few experts);
without it, the model's own routing. Prints each way's median, the ratio of medians and the
median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import graftlm
from graftlm.models import fused
from graftlm.models.base import Transformer
from graftlm.step.batch import Batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, nargs="+", default=[128])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spread", action="store_true")
    ap.add_argument("--lora", help="an adapter at scale 1 on every prompt")
    args = ap.parse_args()
    m = graftlm.load(args.model, threads=args.threads, ctx_size=max(args.prompt) + 16)
    model, engine = m.model, m.engine
    if args.lora:
        m.add_lora(args.lora, 1.0)
    native_ffn = Transformer.native_routed_ffn
    noise: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    way = {"native": True}

    def routed(self: Any, i: int, h: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        if args.spread:
            key = (i, tuple(h.shape))
            if key not in noise:
                g = torch.Generator().manual_seed(i)
                noise[key] = torch.randn(h.shape, generator=g)
            h = noise[key]
        if way["native"]:
            return native_ffn(self, i, h, batch)
        return self.composed_routed_ffn(i, h, batch)

    Transformer.native_routed_ffn = routed  # type: ignore[method-assign]
    assert fused.NATIVE_ROUTED_FFN
    settings = m.adapters.settings(None)

    def prompt(n: int) -> tuple[float, float, float]:
        ids = torch.randint(100, m.config.n_vocab - 100, (n,), generator=torch.Generator())
        slot = engine.slots.borrow(n)
        t, w, c = time.thread_time(), time.perf_counter(), time.process_time()
        try:
            with torch.inference_mode():
                for i in range(0, n, engine.chunk):
                    rows = engine.lora_rows([settings])
                    piece = ids[i : i + engine.chunk].tolist()
                    model.forward(Batch.single(piece, slot, i, rows, model.device))
        finally:
            engine.slots.give_back(slot)
        return time.thread_time() - t, time.perf_counter() - w, time.process_time() - c

    print(f"{args.model} threads={args.threads} spread={args.spread} lora={args.lora}")
    for n in args.prompt:
        got: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        for r in range(args.rounds + 1):
            for native in (True, False) if r % 2 else (False, True):
                way["native"] = native
                x = prompt(n)
                if r:  # (round 0 warms both)
                    got[native].append(x)
        k = 0 if args.threads == 1 else 1
        what = "thread CPU" if k == 0 else "wall"
        old = [x[k] * 1e3 for x in got[False]]
        new = [x[k] * 1e3 for x in got[True]]
        ratios = [o / v for o, v in zip(old, new, strict=True)]
        print(
            f"pp{n} {what} ms: composed {statistics.median(old):.1f} "
            f"[{min(old):.1f}-{max(old):.1f}], native {statistics.median(new):.1f} "
            f"[{min(new):.1f}-{max(new):.1f}]; composed/native {statistics.median(old) / statistics.median(new):.3f} "
            f"(rounds' ratios median {statistics.median(ratios):.3f}, {min(ratios):.3f}-{max(ratios):.3f})"
        )
        if k:
            cpu = [statistics.median(x[2] * 1e3 for x in got[w]) for w in (False, True)]
            print(f"   process CPU ms: composed {cpu[0]:.1f}, native {cpu[1]:.1f}")


if __name__ == "__main__":
    main()
