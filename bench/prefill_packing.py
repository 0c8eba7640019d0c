"""A prefill step of several prompts: padded to the longest (the old batch) beside packed (only
the real tokens computed, Batch.packed), alternated in rounds, one thread's CPU time.

Each round runs, in turn, for each scenario, the padded step and the packed step of the same
prompts into the same cache slots (the cache is laid out afresh between them: nothing of one is
read by the other). Scenarios:

    base    no prompt on an adapter
    mixed   every prompt on its own adapter (the adapters given, in turn), scale 1

Before timing, each packed row's logits are checked against the same prompt prefilled alone
(bit for bit: printed as the largest |difference|) and against the padded row's.

--engine: the same prompts also as requests through the engine (one token each, prefix cache
off), its scheduler planning their steps within --chunk tokens (padded: counted with padding,
so 16 prompts of 36 padded take two steps at 512), padded and packed in turn: the CPU time of
every step until each request has its first token.

Printed: the medians over the rounds of milliseconds a step (one thread's CPU time, which the
machine's other load does not inflate), the ratio packed / padded, and the tokens computed.

    .venv/bin/python bench/prefill_packing.py /work/models/llama-1b-q4_k_m.gguf \
        /work/models/llama-1b-lora-r16-s*.gguf --prompts 16 --rounds 7
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

import graftlm
from graftlm.lora.settings import AdapterSettings
from graftlm.models import Transformer
from graftlm.runtime.engine import Engine, lora_rows
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.step.batch import Batch

Make = Callable[..., Batch]


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def step(model: Transformer, make: Make, rows: list[list[int]], settings: list[dict[int, float]]):
    """One prefill step of these prompts from position 0 of slots 0..n-1: (logits, CPU s)."""
    model.allocate_cache(len(rows))
    lora = lora_rows(settings, model.device)
    batch = make(rows, list(range(len(rows))), [0] * len(rows), lora, model.device)
    t0 = time.thread_time()
    logits = model.forward(batch)
    return logits, time.thread_time() - t0


def served(eng: Engine, packed: bool, rows: list[list[int]], settings: list[dict[int, float]]):
    """Every request's prefill through the engine's steps: (steps, CPU s)."""
    eng.scheduler.packed = packed
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for ids, s in zip(rows, settings, strict=True):
        eng.submit(Request(ids, params, AdapterSettings(s)))
    steps, t0 = 0, time.thread_time()
    while eng.busy:
        eng.step()
        steps += 1
    return steps, time.thread_time() - t0


def check(model: Transformer, rows: list[list[int]], settings: list[dict[int, float]]) -> None:
    packed, _ = step(model, Batch.packed, rows, settings)
    padded, _ = step(model, Batch.padded, rows, settings)
    alone = []
    for ids, s in zip(rows, settings, strict=True):
        model.allocate_cache(1)
        alone.append(model.forward(Batch.single(ids, 0, 0, lora_rows([s], model.device)))[0])
    ref = torch.stack(alone)
    print(
        f"  packed vs alone: max |d logit| {float((packed - ref).abs().max()):.3g}; "
        f"padded vs alone: {float((padded - ref).abs().max()):.3g}; "
        f"greedy equal: {bool((packed.argmax(-1) == ref.argmax(-1)).all())}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("adapters", nargs="*")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=27)
    ap.add_argument("--max-len", type=int, default=36)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--engine", action="store_true", help="also through the engine's steps")
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = graftlm.load(args.model, threads=1, ctx_size=256, n_seq=args.prompts)
    model = m.engine.model
    ids = [m.add_lora(a, scale=0.0) for a in args.adapters]
    rows = prompts(args.prompts, args.min_len, args.max_len, model.cfg.n_vocab)
    real = sum(len(r) for r in rows)
    print(f"{args.prompts} prompts, {real} tokens ({args.prompts * max(map(len, rows))} padded)")
    scen = {"base": [{} for _ in rows]}
    if ids:
        scen["mixed"] = [{ids[i % len(ids)]: 1.0} for i in range(len(rows))]
    with torch.inference_mode():
        for name, settings in scen.items():
            print(name)
            check(model, rows, settings)
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for name, settings in scen.items():
                order = [("padded", Batch.padded), ("packed", Batch.packed)]
                for way, make in order if r % 2 == 0 else order[::-1]:
                    times.setdefault((name, way), []).append(step(model, make, rows, settings)[1])
        # (a fresh engine: the steps above laid the model's cache out anew)
        eng = Engine(model, n_slots=len(rows), chunk=args.chunk, prefix_cache=False)
        for r in range(args.rounds if args.engine else 0):
            for name, settings in scen.items():
                for packed in (False, True) if r % 2 == 0 else (True, False):
                    way = "engine " + ("packed" if packed else "padded")
                    n, t = served(eng, packed, rows, settings)
                    times.setdefault((name, way), []).append(t)
                    print(f"  round {r} {name} {way}: {n} steps, {t:.2f} s", flush=True)
    for name in scen:
        for kind in ("", "engine ") if args.engine else ("",):
            pad = statistics.median(times[(name, kind + "padded")])
            pack = statistics.median(times[(name, kind + "packed")])
            print(
                f"{kind}{name:6s} padded {pad * 1e3:8.1f} ms  packed {pack * 1e3:8.1f} ms  "
                f"packed/padded {pack / pad:.3f}  (rounds {args.rounds})"
            )


if __name__ == "__main__":
    main()
