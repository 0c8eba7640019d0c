"""Decode attention at depth: one new token a row attending to D cached positions through the
paged KV cache (gl_attn_decode), for real models' head shapes and every cache type. Prints
milliseconds per call of one layer, the cache bytes a call reads over that time (GB/s) and that
rate's share of the machine's read bandwidth (`bench/read_bandwidth.c`, probed before and after
the cases; the higher probe counts), so the kernel's distance from the memory is read directly.

The keys and values are random; the blocks of every row are scattered over the pool (a row's
table names blocks in a shuffled order) as a served cache's are. Successive calls go to successive
layers of a cache of several, together at least --working-set MiB (default 256: several times a
server CPU's last-level cache), as a model's step reads each layer's cache once between the other
layers' weights: one layer called again and again would be read from the cache (Llama-1B's layer at
4,096 positions in f16 is 8 MiB).

    .venv/bin/python bench/decode_attention.py [--threads 2] [--depths 4096 16384] [--rows 1 16]

--against PATH (another checkout's `src`, e.g. a worktree of main): its kernels built too and the
two libraries' calls alternated rep by rep on the same cache, so the ratio of their times holds
in a noisy minute. Each line also gives ns a key and kv head (the call's time over the positions
times the rows' kv heads: every query head of a group rides on its kv head's pass).

--cpu times each call by the calling thread's CPU time (with --threads 1 the kernel runs on it):
on a machine shared with other work, time spent descheduled is not counted. With --against the
last column is then the median of the ratios of adjacent calls (this / against) with the
quartiles of those ratios: their spread is the noise.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from vs_llama_cpp import Bandwidth

from graftlm.native import abi, ops, unavailable_reason
from graftlm.native.ops import attn_decode
from graftlm.step import KVCache
from graftlm.step.kv_cache import KV_TYPES, row_width

# (name, heads, kv heads, head dim)
SHAPES = {
    "llama-1b": (32, 8, 64),
    "qwen2.5-1.5b": (12, 2, 128),
    "gemma-3-270m": (4, 1, 256),
}


def other_library(src: str) -> ctypes.CDLL:
    """The native library of the checkout whose package is under src, built (or found in the
    cache) by its own build module, bound to this one's ABI."""
    env = {**os.environ, "PYTHONPATH": src}
    code = "from graftlm.native import build; print(build._build(build._compiler()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    lib = ctypes.CDLL(out.stdout.strip().splitlines()[-1])
    abi.bind(lib)
    return lib


def huge_pages(t: torch.Tensor) -> None:
    """The 2 MiB pages inside t's memory made huge pages now (MADV_HUGEPAGE, then MADV_COLLAPSE:
    Linux 6.1+), where the kernel allows it; silently left as they are where it does not."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    lo, hi = -(-start // (2 << 20)) * (2 << 20), end // (2 << 20) * (2 << 20)
    if hi > lo:
        libc.madvise(lo, hi - lo, 14)  # MADV_HUGEPAGE
        libc.madvise(lo, hi - lo, 25)  # MADV_COLLAPSE


def case(
    shape: str, kv: str, depth: int, rows: int, reps: int, working_set: int,
    libs: list[ctypes.CDLL | None], cpu: bool = False, huge: bool = False,
) -> tuple[list[float], int, list[float]]:  # fmt: skip
    """Seconds per call of each library (None: this checkout's; the best of reps, the libraries
    alternated call by call: the VM's noise only slows calls down), the cache bytes one call
    reads, and the ratios of adjacent calls' times (the first library's over the second's)."""
    h, hkv, d = SHAPES[shape]
    dtype = KV_TYPES[kv][0]
    n_ctx = depth + 16
    width = row_width(d, dtype) * torch.empty(0, dtype=dtype).element_size()
    nbytes = rows * (depth + 1) * hkv * 2 * width
    n_layer = max(1, min(64, -(-working_set // nbytes)))
    cache = KVCache(n_layer, rows, hkv, n_ctx, d, d, dtype)
    g = torch.Generator().manual_seed(0)
    # scatter: every slot's table names a shuffled run of pool blocks
    perm = torch.randperm(cache.n_blocks - 1, generator=g).to(torch.int32) + 1
    cache.tables.copy_(perm[: rows * cache.max_blocks].view(rows, cache.max_blocks))
    if huge:
        for pool in (*cache.k, *cache.v):
            huge_pages(pool)
    for pool in (*cache.k, *cache.v):  # every page written: calloc's zero pages are one page
        if dtype is torch.uint8:
            from graftlm.step.kv_cache import q8_0_pack

            pool.copy_(q8_0_pack(torch.randn(*pool.shape[:-1], d, generator=g)))
        else:
            pool.copy_(torch.randn(pool.shape, generator=g).to(dtype))
    q = torch.randn(rows, 1, h * d, generator=g)
    k = torch.randn(rows, 1, hkv * d, generator=g)
    v = torch.randn(rows, 1, hkv * d, generator=g)
    cos = torch.ones(n_ctx, d // 2)
    sin = torch.zeros(n_ctx, d // 2)
    slots = torch.arange(rows)
    pos = torch.full((rows,), depth)

    own = ops.library

    def call(layer: int, lib: ctypes.CDLL | None) -> None:
        ops.library = own if lib is None else lambda: lib  # type: ignore[assignment]
        try:
            out = attn_decode(q, k, v, cache, layer, slots, pos, cos, sin, False, d**-0.5, 0)
        finally:
            ops.library = own  # type: ignore[assignment]
        assert out is not None

    for lib in libs:
        for layer in range(n_layer):
            call(layer, lib)
    times: list[list[float]] = [[] for _ in libs]
    # every layer once at least a library, each call the next layer (the libraries in turn: a
    # layer one library just read would be in the cache for the other)
    clock = time.thread_time if cpu else time.perf_counter
    for i in range(len(libs) * max(reps, n_layer)):
        x = i % len(libs)
        t0 = clock()
        call(i % n_layer, libs[x])
        times[x].append(clock() - t0)
    ratios = [a / b for a, b in zip(*times, strict=True)] if len(libs) == 2 else []
    return [min(t) for t in times], nbytes, ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--depths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=["f16", "q8_0"])
    ap.add_argument(
        "--working-set", type=int, default=256, help="MiB of cache the calls cycle over"
    )
    ap.add_argument("--against", help="another checkout's src: its kernels alternated with these")
    ap.add_argument("--cpu", action="store_true", help="time calls by this thread's CPU time")
    ap.add_argument(
        "--huge", action="store_true", help="the cache's pools in 2 MiB pages (MADV_COLLAPSE)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if unavailable_reason():
        print(f"native kernels unavailable: {unavailable_reason()}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        probe = Bandwidth(Path(tmp))
        probes = [probe.measure()]
        libs: list[ctypes.CDLL | None] = [None]
        if args.against:
            libs.append(other_library(args.against))
        results = []
        for shape in args.shapes:
            for kv in args.types:
                for rows in args.rows:
                    for depth in args.depths:
                        secs, nbytes, ratios = case(
                            shape, kv, depth, rows, args.reps, args.working_set << 20, libs,
                            args.cpu, args.huge,
                        )  # fmt: skip
                        results.append((shape, kv, rows, depth, secs, nbytes, ratios))
        probes.append(probe.measure())
    bw = max(probes)
    print(f"read bandwidth: {', '.join(f'{p / 1e9:.1f}' for p in probes)} GB/s "
          f"(shares against {bw / 1e9:.1f}); {args.threads} threads")  # fmt: skip
    which = ["this checkout", f"against {args.against}"]
    head = " | ".join(
        f"ms a layer, GB/s, share, ns a key and kv head ({w})" for w in which[: len(libs)]
    )
    ratio = " | this / against" if args.against else ""
    if args.against and args.cpu:
        ratio = " | this / against (CPU time: median of adjacent calls [quartiles])"
    print(f"| shape | cache | rows | depth | {head}{ratio} |")
    print("| --- " * (4 + len(libs) + (1 if args.against else 0)) + "|")
    for shape, kv, rows, depth, secs, nbytes, ratios in results:
        hkv = SHAPES[shape][1]
        cells = []
        for sec in secs:
            rate = nbytes / sec
            ns = sec * 1e9 / (rows * (depth + 1) * hkv)
            cells.append(f"{sec * 1e3:.3f}, {rate / 1e9:.1f}, {100 * rate / bw:.0f}%, {ns:.1f}")
        extra = f" | {secs[0] / secs[1]:.2f}" if len(secs) > 1 else ""
        if ratios and args.cpu:
            q = statistics.quantiles(ratios, n=4)
            extra = f" | {statistics.median(ratios):.3f} [{q[0]:.3f}, {q[2]:.3f}]"
        print(f"| {shape} | {kv} | {rows} | {depth} | {' | '.join(cells)}{extra} |")


if __name__ == "__main__":
    main()
