"""Where a one-row decode step's time goes, part by part, against a plain read of the same bytes.

For each part of a model's decode step (the output head, each kind of a layer's projections summed
over the layers, the routed experts a token uses), the one-row products' time and the time a
plain streaming read (`stream_read.c`, the read probe's loop) takes over the very buffers those
products read, in this process, on as many threads, alternated in rounds; then the layers in their one native
call (where the model has it), and the whole step (the model's forward: the layers, the head, the
Python around them) against a read of all the parts. The ratio of the two is the part's share of the memory's speed on this machine *now*,
which a separate read probe (bench/read_bandwidth.c, run before and after) cannot give on a VM
whose bandwidth moves by a third from minute to minute.

    .venv/bin/python bench/decode_parts.py --model DIR/gpt-oss-20b-mxfp4.gguf [--threads 1] [--rounds 15]
    .venv/bin/python bench/decode_parts.py --model DIR/llama-1b-q4_k_m-ctx40960.gguf --depth 16384 \
        --cache-type q8_0 --threads 2

With --depth D the sequence holds D positions of random keys and values first, and the layers'
and the step's reads take in the cache blocks its attention reads (the issue's "weight + cache
bytes a token"), so their share is that of a decode step at depth.

With --lora FILE (repeatable) the adapters apply at scale 1 to the step's row, in the layers' one
call and the step, whose reads take in the factors the delta reads (every adapted projection's,
the chosen experts' on routed experts): the issue's "with an adapter" rows. The parts' rows stay
the base products.

With one thread the times are this thread's CPU time (a shared machine's descheduling is not
counted), with more, wall time: run those on a quiet machine. Each part's products are called one
by one from Python (about 10 us a call), where the step runs a layer in one native call: the
layers' own efficiency is the step's row. A routed part counts the `n_used` experts a token runs,
spread over the experts (the router's choice does not change the bytes).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from decode_step import fill_cache, room_for

import graftlm
from graftlm.lora.site import LoraSite
from graftlm.models import Transformer
from graftlm.models.moe import Experts, GatedExperts
from graftlm.models.seam import Projection, ProjectionGroup
from graftlm.quant import QWeight
from graftlm.runtime.engine import lora_rows
from graftlm.step.batch import Batch
from graftlm.step.kv_cache import KV_TYPES, KVCache


def reader(folder: Path) -> Callable[[torch.Tensor, int], None]:
    """stream_read.c built with the system's C compiler and OpenMP: read(t, threads) sums t's
    bytes as 64-bit words, each thread its contiguous share."""
    source = Path(__file__).resolve().with_name("stream_read.c")
    lib_path = folder / "stream_read.so"
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), "-o"]
    subprocess.run([*cmd, str(lib_path)], check=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.stream_read.restype = ctypes.c_uint64
    lib.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def read(t: torch.Tensor, threads: int) -> None:
        lib.stream_read(t.data_ptr(), t.numel() * t.element_size() // 64 * 64, threads)

    return read


def buffers(w: QWeight) -> list[torch.Tensor]:
    """The tensors a weight's product reads (its kernel's), small ones left out."""
    return [t for t in w._k.tensors() if t.numel() * t.element_size() >= 4096]


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def kv_buffers(cache: KVCache, positions: int) -> list[torch.Tensor]:
    """The cache's key and value blocks that slot 0's first `positions` lie in, as views of
    each pool (a run of consecutive blocks one view)."""
    n = -(-positions // cache.block)
    blocks = cache.tables[0, :n].long().tolist()
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return [pool[a:e] for pool in (*cache.k, *cache.v) for a, e in runs]


def parts(model: Transformer, n_used: int, n_expert: int) -> dict[str, list[QWeight]]:
    """The step's weights by part: the head, then each projection or expert kind of the blocks
    (its attribute's name), summed over the layers; n_used experts of each routed kind a layer."""
    out: dict[str, list[QWeight]] = {"output": [model.output.weight]}  # (tied: token_embd)
    chosen = [e * n_expert // max(n_used, 1) for e in range(n_used)]
    for blk in model.blocks:
        for name, v in vars(blk).items():
            if isinstance(v, ProjectionGroup):
                got = [p.weight for p in v.projections()]
            elif isinstance(v, Projection):
                got = [v.weight]
            elif isinstance(v, GatedExperts) and v.stacked is not None:
                got = [v.stacked[e] for e in chosen]
            elif isinstance(v, GatedExperts):
                got = [p[e] for p in v.parts for e in chosen]
            elif isinstance(v, Experts):
                got = [v[e] for e in chosen]
            else:
                continue
            out.setdefault(name, []).extend(got)
    return out


def site_buffers(site: LoraSite | None) -> list[torch.Tensor]:
    """The tensors a site's adapters' delta reads: each slot's packed factors (lora.packed) or,
    where a slot has none, its float32 factors."""
    if site is None:
        return []
    out: list[torch.Tensor] = []
    for slot in site.slot_ids:
        packed = site._packed.get(slot)
        if packed is None:
            out.extend(site._factors[slot])
            continue
        out += [p.data for p in packed.parts] + ([packed.a] if packed.a is not None else [])
        out += list(packed.aq or ())
    return out


def adapter_buffers(model: Transformer, n_used: int, n_expert: int) -> list[torch.Tensor]:
    """The adapters' factors a one-row step reads in the layers: every adapted projection's,
    and on routed experts the n_used chosen experts' (as `parts` chooses them)."""
    chosen = [e * n_expert // max(n_used, 1) for e in range(n_used)]
    out: list[torch.Tensor] = []
    for blk in model.blocks:
        for v in vars(blk).values():
            if isinstance(v, ProjectionGroup):
                for p in v.projections():
                    out += site_buffers(p.lora)
            elif isinstance(v, Projection):
                out += site_buffers(v.lora)
            elif isinstance(v, GatedExperts) and v.stacked is None:
                out += [
                    t for part in v.parts for e in chosen for t in site_buffers(part.seams[e].lora)
                ]
            elif isinstance(v, Experts | GatedExperts):
                out += [t for e in chosen for t in site_buffers(v.seams[e].lora)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--depth", type=int, default=0, help="positions the sequence holds")
    ap.add_argument("--cache-type", default="f16", choices=sorted(KV_TYPES))
    ap.add_argument("--lora", action="append", default=[], metavar="FILE",
                    help="an adapter at scale 1 on the step's row (repeatable); its factors' bytes "
                    "count in the layers' and the step's reads")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    read = reader(Path(tempfile.mkdtemp()))
    ctx = args.depth + args.rounds * 4 + 64
    loaded = graftlm.load(args.model, ctx_size=max(256, ctx), n_seq=1, cache_type=args.cache_type)
    model, cfg = loaded.model, loaded.model.cfg
    room_for(model, ctx, f"{args.model}: --depth {args.depth}")
    for path in args.lora:
        loaded.add_lora(path, 1.0)
    rows = lora_rows([loaded.adapters.settings(None)], torch.device("cpu"))
    if args.depth:
        fill_cache(model.cache, args.depth)
    # (the steps' positions run from the depth to about 2 a round past it: the middle, read)
    kv = kv_buffers(model.cache, max(16, args.depth) + args.rounds)
    by_part = parts(model, cfg.n_expert_used, cfg.n_expert)
    flush = torch.ones(64 << 20, dtype=torch.uint8)  # read between runs: no part starts in cache
    # each width's row of x made before any timing (not inside it: a randn a call, 8-15 us)
    widths = {w.shape[1] for ws in by_part.values() for w in ws}
    xs = {k: torch.randn(1, k) for k in widths}

    def products(ws: list[QWeight]) -> None:
        for w in ws:
            w.matmul(xs[w.shape[1]])

    def reads(ts: list[torch.Tensor]) -> None:
        for t in ts:
            read(t, args.threads)

    pos = [max(16, args.depth)]

    def step() -> None:
        i = pos[0]
        pos[0] += 1
        model.forward(Batch(torch.tensor([[5 + i]]), [0], [i], [1], lora=rows))

    x = torch.randn(1, 1, cfg.n_embd)

    def layers() -> None:
        i = pos[0]
        pos[0] += 1
        model.native_layers(x, Batch(torch.tensor([[5]]), [0], [i], [1], lora=rows))

    def bufs(ws: list[QWeight]) -> list[torch.Tensor]:
        return [t for w in ws for t in buffers(w)]

    # the step and the layers read the cache's keys and values too (at depth: what they are for)
    # (and the adapters' factors: the layers' sites, the chosen experts')
    lora = adapter_buffers(model, cfg.n_expert_used, cfg.n_expert) if rows is not None else []
    every = bufs([w for ws in by_part.values() for w in ws]) + kv + lora
    in_layers = (
        bufs([w for name, ws in by_part.items() if name != "output" for w in ws]) + kv + lora
    )
    part_bufs = {name: bufs(ws) for name, ws in by_part.items()}
    runs: dict[str, tuple[Callable[[], None], Callable[[], None], list[torch.Tensor]]] = {
        name: (lambda ws=ws: products(ws), lambda ts=part_bufs[name]: reads(ts), part_bufs[name])
        for name, ws in by_part.items()
    }
    if model.fused_stack() is not None:
        runs["the layers (one native call)"] = (layers, lambda: reads(in_layers), in_layers)
    runs["the step (forward)"] = (step, lambda: reads(every), every)
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        model.forward(Batch.single(list(range(100, 116)), 0, 0))
        for rnd in range(args.rounds):
            for name, (prod, rd, _) in runs.items():
                pair = [("products", prod), ("read", rd)]
                for kind, f in pair[:: -1 if rnd % 2 else 1]:
                    read(flush, args.threads)
                    t0 = clock()
                    f()
                    times.setdefault((name, kind), []).append(clock() - t0)
    what = "CPU time, one thread" if args.threads == 1 else f"wall time, {args.threads} threads"
    depth = f", depth {args.depth} ({args.cache_type} cache: {nbytes(kv) / 1e6:,.1f} MB)"
    depth = depth if args.depth else ""
    if lora:
        depth += f", {len(args.lora)} adapter(s): {nbytes(lora) / 1e6:,.1f} MB of factors a step"
    print(f"{Path(args.model).name}: medians of {args.rounds} alternated rounds, {what}"
          f"{depth}\n")  # fmt: skip
    print("| part | MB | products ms | GB/s | read ms | GB/s | share |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (_, _, ts) in runs.items():
        nb = nbytes(ts)
        p, r = (statistics.median(times[(name, k)]) for k in ("products", "read"))
        print(f"| {name} | {nb / 1e6:,.1f} | {p * 1e3:.2f} | {nb / p / 1e9:.1f} | "
              f"{r * 1e3:.2f} | {nb / r / 1e9:.1f} | {r / p:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
