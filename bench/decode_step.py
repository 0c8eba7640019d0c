"""Milliseconds per decode step for B one-token rows (each its own sequence), SmolLM2 by default.

Shows how the batched decode step scales with the batch: the number that bounds serving
throughput (see README, "Speed").

    .venv/bin/python bench/decode_step.py [B ...] [--model PATH] [--steps 10] [--profile]

With `--depth D` every row's sequence already holds D positions (random keys and values written
into the cache, as a long prefix would leave them; the step reads them all), so many long
sequences decode together (issue 37: 16 sequences of 4,096); `--cache-type` picks the cache
(llama.cpp's -ctk names) and `--bandwidth` prints each step's share of the machine's read
bandwidth, counting the weights once and every row's keys and values.

`--cpu` also prints each step's CPU time on the calling thread (with `--threads 1` the whole
step runs on it: on a shared machine the time it spends descheduled is not counted), the median
of the steps' and their quartiles.

With `--engine` the rows are greedy requests stepped by the engine (the scheduler's plan, the
batch built, sampling, the prefix cache's bookkeeping), as a server steps them, and each step's
time is split: the model's forward against the rest, in wall time and in this thread's CPU time
(run it with `--threads 1` on a shared machine: the CPU time is what holds). `--adapters FILE...`
attaches adapters, and with `--engine` the rows are also run mixed, row r on adapter r mod N,
alternated with the base (`--each`: all rows on one adapter, each adapter in turn, as
`adapter K`: an attention adapter against an expert adapter on an MoE model):

    .venv/bin/python bench/decode_step.py 16 32 --model DIR/llama-1b-q4_k_m.gguf --engine \
        --threads 1 --adapters DIR/llama-1b-lora-r16-s{2..17}.gguf

`--distinct 1 4 16` runs the mixed rows on the first K adapters for each K (16 rows on 4
adapters: each on 4 rows), `--rounds N` alternates the configurations N times and prints each
one's median step CPU time beside the base's, and every run prints the CPU time of the steps
that ran its prompts (`--prompt` tokens each, plus r % 5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from vs_llama_cpp import Bandwidth, kv_bytes, token_bytes

import graftlm
from graftlm.lora.settings import AdapterSettings
from graftlm.models import Transformer
from graftlm.runtime.engine import Engine
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.step.batch import Batch
from graftlm.step.kv_cache import KV_TYPES, KVCache, q8_0_pack


def room_for(model: Transformer, need: int, what: str) -> None:
    """Exit with a message when `what` needs more positions than the model is built for (the
    file's training context caps it: models.context_size), where a step past it would fail in
    the RoPE tables."""
    if model.n_ctx < need:
        sys.exit(f"{what} needs {need} positions; the model is built for {model.n_ctx} "
                 "(its context_length)")  # fmt: skip


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


def engine_steps(
    engine: Engine, rows: int, steps: int, lora: list[AdapterSettings], prompt: int = 8
) -> tuple[float, float, float, float, float]:
    """`rows` greedy requests (row r on lora[r % len(lora)], prompt + r % 5 tokens) stepped by
    the engine until each decoded `steps` tokens past its first; per decode step: (wall s, this
    thread's CPU s, the forward's wall s, the forward's CPU s), medians over the steps, and the
    CPU s of the steps that ran the prompts (to every row's first token)."""
    model = engine.model
    fwd: list[tuple[float, float]] = []
    forward = model.forward

    def timed(*a: object, **k: object) -> torch.Tensor:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = forward(*a, **k)  # type: ignore[arg-type]
        fwd.append((time.perf_counter() - t0, time.thread_time() - c0))
        return out

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 2)
    reqs = [
        engine.submit(Request([100 + (r * 37 + j) % 5000 for j in range(prompt + r % 5)],
                              params, lora[r % len(lora)]))
        for r in range(rows)
    ]  # fmt: skip
    c0 = time.thread_time()
    while any(not r.generated for r in reqs):  # the prompts, and the first tokens
        engine.step()
    prefill = time.thread_time() - c0
    engine.step()  # (the first full step warms the native layers' buffers)
    model.forward = timed  # type: ignore[method-assign]
    walls: list[tuple[float, float, float, float]] = []
    try:
        while not any(r.done for r in reqs):
            fwd.clear()
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            walls.append((wall, cpu, sum(w for w, _ in fwd), sum(c for _, c in fwd)))
    finally:
        del model.forward
    while engine.busy:
        engine.step()
    med = [statistics.median(w[i] for w in walls) for i in range(4)]
    return med[0], med[1], med[2], med[3], prefill


def timed_steps(
    args: argparse.Namespace,
    step: Callable[[int], None],
    b: int,
    probe: Bandwidth | None,
    weights: int,
    kv: int,
    first: int,
) -> tuple[str, float]:
    """One timed run of `args.steps` steps (after the probe, and a probe after: the larger
    of the two is the limit the steps' read rate is shared against), its line and share."""
    bw = probe.measure() if probe else 0.0
    cpus = []
    t0 = time.perf_counter()
    for i in range(first + 1, first + args.steps + 1):
        c0 = time.thread_time()
        step(i)
        cpus.append(time.thread_time() - c0)
    s = (time.perf_counter() - t0) / args.steps
    line = f"{b:3d} rows: {s * 1000:7.1f} ms/step, {b / s:7.1f} tok/s"
    if args.cpu:
        q = statistics.quantiles(cpus, n=4)
        line += (f", CPU {statistics.median(cpus) * 1000:.1f} ms/step "
                 f"[{q[0] * 1000:.1f}, {q[2] * 1000:.1f}]")  # fmt: skip
    if not probe:
        return line, 0.0
    bw = max(bw, probe.measure())
    read = weights + b * kv
    line += (f", {read / 2**20:,.0f} MiB a step, {read / s / 1e9:.1f} GB/s: "
             f"{read / s / bw:.0%} of {bw / 1e9:.1f}")  # fmt: skip
    return line, read / s / bw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=0, help="positions every sequence holds")
    ap.add_argument("--cache-type", "-ctk", choices=list(KV_TYPES), default=None)
    ap.add_argument("--bandwidth", action="store_true", help="the steps' share of it")
    ap.add_argument("--cpu", action="store_true", help="the steps' CPU time on this thread")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops")
    ap.add_argument("--engine", action="store_true", help="the engine's steps, split")
    ap.add_argument("--adapters", nargs="*", default=[], help="with --engine: mixed rows too")
    ap.add_argument(
        "--distinct",
        type=int,
        nargs="*",
        default=[],
        help="with --adapters: mixed rows on the first K of them, for each K",
    )
    ap.add_argument(
        "--each", action="store_true", help="with --adapters: every row on adapter k, for each k"
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="alternated rounds (with --engine), else timed runs"
    )
    ap.add_argument("--prompt", type=int, default=8, help="with --engine: prompt tokens")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, depth = max(args.rows), args.depth
    need = depth + args.steps * (args.rounds + 1) + 16
    loaded = graftlm.load(args.model, ctx_size=max(256, need), n_seq=n, cache_type=args.cache_type)
    model = loaded.model
    room_for(
        model, need, f"{args.model}: --depth {depth} with {args.steps} steps x {args.rounds + 1}"
    )
    if args.engine:
        ids = [loaded.add_lora(path, 0.0) for path in args.adapters]
        kinds = {"base": [AdapterSettings()]}
        for k in args.distinct or ([len(ids)] if ids and not args.each else []):
            kinds[f"mixed {k}"] = [AdapterSettings({i: 1.0}) for i in ids[:k]]
        for k, i in enumerate(ids if args.each else []):
            kinds[f"adapter {k}"] = [AdapterSettings({i: 1.0})]
        cpus: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for rnd in range(args.rounds):
            for b in args.rows:
                for name, lora in list(kinds.items())[:: -1 if rnd % 2 else 1]:
                    wall, cpu, fw, fc, pre = engine_steps(
                        loaded.engine, b, args.steps, lora, args.prompt
                    )
                    cpus.setdefault((b, name), []).append((cpu, pre))
                    print(f"{b:3d} rows {name:9s}: {wall * 1000:7.1f} ms/step, {b / wall:6.1f} "
                          f"tok/s; forward {fw * 1000:6.1f} ms; outside it "
                          f"{(wall - fw) * 1000:5.2f} ms wall, {(cpu - fc) * 1000:5.2f} ms CPU "
                          f"({(cpu - fc) / cpu:.1%} of the step's CPU); step CPU "
                          f"{cpu * 1000:6.1f} ms, prompts' CPU {pre * 1000:6.1f} ms",
                          flush=True)  # fmt: skip
        if args.rounds > 1:
            print("medians over the rounds, CPU ms (decode step, the prompts' steps):")
            for (b, name), got in cpus.items():
                step = statistics.median(c for c, _ in got)
                pre = statistics.median(p for _, p in got)
                base = statistics.median(c for c, _ in cpus[(b, "base")])
                print(
                    f"{b:3d} rows {name:9s}: step {step * 1000:6.1f} ({step / base:.2f}x "
                    f"base), prompts {pre * 1000:6.1f}"
                )
        return
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
            shares: list[float] = []
            for rnd in range(args.rounds):
                line, share = timed_steps(args, step, b, probe, weights if probe else 0,
                                          kv_bytes(path, depth + args.steps * rnd, args.steps, cache_name) if probe
                                          else 0, args.steps * rnd)  # fmt: skip
                shares.append(share)
                print(line + (f" (round {rnd + 1})" if args.rounds > 1 else ""), flush=True)
            if probe and args.rounds > 1:
                print(f"{b:3d} rows: median share over {args.rounds} rounds "
                      f"{statistics.median(shares):.0%} (each {', '.join(f'{x:.0%}' for x in shares)})")  # fmt: skip
            if args.profile:
                from torch.profiler import profile

                with profile() as prof:
                    for i in range(args.steps * args.rounds + 1, args.steps * args.rounds + 4):
                        step(i)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
