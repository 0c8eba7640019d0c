"""A prompt's native routed FFN at the default scratch budget (fused.MOE_SCRATCH_BYTES, 64 MiB:
a chunk split into calls of as many tokens as fit) against one call of up to MOE_ROWS tokens (the
budget unbounded), alternated prompt by prompt in one process, one thread's CPU time.

    python bench/moe_budget_ab.py --model /work/models/qwen3-30b-a3b-6l-q4_k_m.gguf \\
        --prompt 512 --rounds 9

The routers see random normed inputs (fixed per layer and shape), so each token picks its own
experts as in a trained model (bench/moe_prompt_ab.py's --spread). The model's scratch is kept
between prompts (grown once, as in a served model).
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
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n = args.prompt
    m = graftlm.load(args.model, threads=1, ctx_size=n + 16)
    model, engine = m.model, m.engine
    native_ffn = Transformer.native_routed_ffn
    noise: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def routed(self: Any, i: int, h: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        key = (i, tuple(h.shape))
        if key not in noise:
            noise[key] = torch.randn(h.shape, generator=torch.Generator().manual_seed(i))
        return native_ffn(self, i, noise[key], batch)

    Transformer.native_routed_ffn = routed  # type: ignore[method-assign]
    settings = m.adapters.settings(None)
    budget, unbounded = fused.MOE_SCRATCH_BYTES, 1 << 62
    layer = model.fused_layer(0)
    print(f"{args.model}: {layer.moe_rows()} tokens a call at {budget >> 20} MiB")

    def prompt() -> float:
        ids = torch.randint(100, m.config.n_vocab - 100, (n,), generator=torch.Generator())
        slot = engine.slots.borrow(n)
        t = time.thread_time()
        try:
            with torch.inference_mode():
                rows = engine.lora_rows([settings])
                model.forward(Batch.single(ids.tolist(), slot, 0, rows, model.device))
        finally:
            engine.slots.give_back(slot)
        return time.thread_time() - t

    got: dict[int, list[float]] = {budget: [], unbounded: []}
    for r in range(args.rounds + 1):
        for b in (budget, unbounded) if r % 2 else (unbounded, budget):
            fused.MOE_SCRATCH_BYTES = b
            x = prompt()
            if r:  # (round 0 warms both)
                got[b].append(x * 1e3)
    old, new = got[unbounded], got[budget]
    ratios = [o / v for o, v in zip(old, new, strict=True)]
    print(
        f"pp{n} thread CPU ms: one call {statistics.median(old):.1f} "
        f"[{min(old):.1f}-{max(old):.1f}], budget {statistics.median(new):.1f} "
        f"[{min(new):.1f}-{max(new):.1f}]; one call/budget "
        f"{statistics.median(old) / statistics.median(new):.3f} (rounds' ratios median "
        f"{statistics.median(ratios):.3f}, {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
