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
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from graftlm.native import unavailable_reason
from graftlm.native.ops import attn_decode
from graftlm.step import KVCache
from graftlm.step.kv_cache import KV_TYPES, row_width

# (name, heads, kv heads, head dim)
SHAPES = {
    "llama-1b": (32, 8, 64),
    "qwen2.5-1.5b": (12, 2, 128),
    "gemma-3-270m": (4, 1, 256),
}


def probe_bandwidth(exe: Path) -> float:
    out = subprocess.run([str(exe), "2", "1024", "5"], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[0])


def build_probe(folder: Path) -> Path:
    source = Path(__file__).resolve().with_name("read_bandwidth.c")
    exe = folder / "read_bandwidth"
    subprocess.run(["cc", "-O3", "-march=native", "-pthread", str(source), "-o", str(exe)],
                   check=True)  # fmt: skip
    return exe


def case(
    shape: str, kv: str, depth: int, rows: int, reps: int, working_set: int
) -> tuple[float, int]:
    """Seconds per call (the best of reps: the VM's noise only slows calls down) and the cache
    bytes one call reads."""
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

    def call(layer: int) -> None:
        out = attn_decode(q, k, v, cache, layer, slots, pos, cos, sin, False, d**-0.5, 0)
        assert out is not None

    for layer in range(n_layer):
        call(layer)
    times = []
    for i in range(max(reps, n_layer)):  # every layer once at least, each call the next layer
        t0 = time.perf_counter()
        call(i % n_layer)
        times.append(time.perf_counter() - t0)
    return min(times), nbytes


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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if unavailable_reason():
        print(f"native kernels unavailable: {unavailable_reason()}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_probe(Path(tmp))
        probes = [probe_bandwidth(exe)]
        results = []
        for shape in args.shapes:
            for kv in args.types:
                for rows in args.rows:
                    for depth in args.depths:
                        sec, nbytes = case(
                            shape, kv, depth, rows, args.reps, args.working_set << 20
                        )
                        results.append((shape, kv, rows, depth, sec, nbytes))
        probes.append(probe_bandwidth(exe))
    bw = max(probes)
    print(f"read bandwidth: {', '.join(f'{p / 1e9:.1f}' for p in probes)} GB/s "
          f"(shares against {bw / 1e9:.1f}); {args.threads} threads")  # fmt: skip
    print("| shape | cache | rows | depth | ms a layer | GB/s | share of bandwidth |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape, kv, rows, depth, sec, nbytes in results:
        rate = nbytes / sec
        print(f"| {shape} | {kv} | {rows} | {depth} | {sec * 1e3:.3f} | {rate / 1e9:.1f} | "
              f"{100 * rate / bw:.0f}% |")  # fmt: skip


if __name__ == "__main__":
    main()
