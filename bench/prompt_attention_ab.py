"""The prompt attention at depth (gl_attn_prefill, a fast step's path): this tree's kernel against
another revision's, alternated in one process (A B B A ...), Llama-1B's heads (32 query heads, 8
kv heads of 64) over a cache of random values, one 512-query chunk after `--depth` positions.

Prints each round's nanoseconds per query-key-head (thread CPU time over the causal
query-key-heads: with one thread, what a busy shared machine leaves intact) and the median ratio
new / old with its spread over the rounds.

    PYTHONPATH=src python bench/prompt_attention_ab.py --base HEAD~1 [--depth 16384] [--threads 1]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from graftlm.native import abi, build, library, ops
from graftlm.step import Batch, KVCache
from graftlm.step.kv_cache import KV_TYPES


def base_library(rev: str, tmp: Path) -> ctypes.CDLL:
    """The native library of revision `rev`'s csrc/, built with this tree's flags."""
    root = Path(
        subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    rel = build.CSRC.resolve().relative_to(root)
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{rel}"],
        capture_output=True, text=True, check=True, cwd=root,
    ).stdout.split()  # fmt: skip
    for name in names:
        blob = subprocess.run(
            ["git", "show", f"{rev}:{rel}/{name}"], capture_output=True, check=True, cwd=root
        ).stdout
        (tmp / name).write_bytes(blob)
    cc = build._compiler()
    assert cc is not None
    flags = [*build.FLAGS, *build.ISA_FLAGS[build.isa()]]
    out = tmp / "base.so"
    subprocess.run([cc, *flags, "-o", str(out), str(tmp / "graftlm.c")], check=True)
    lib = ctypes.CDLL(str(out))
    abi.bind(lib)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="the revision to compare with (A)")
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kv", default="f16", choices=list(KV_TYPES))
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 64], help="H Hkv D")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    new = library()
    assert new is not None, "native kernels unavailable"
    h, hkv, d = args.heads
    t, start = args.tokens, args.depth
    n = start + t
    g = torch.Generator().manual_seed(0)
    cache = KVCache(1, 1, hkv, n, d, d, KV_TYPES[args.kv][0])
    for p0 in range(0, n, 4096):  # (B, T, Hkv, D) as the cache takes them
        p1 = min(n, p0 + 4096)
        rows = Batch(torch.zeros(1, p1 - p0, dtype=torch.long), [0], [p0], [p1 - p0])
        kv = torch.randn(2, 1, p1 - p0, hkv, d, generator=g)
        cache.write(0, rows, kv[0], kv[1])
    q = torch.randn(1, t, h, d, generator=g) * 2
    index = Batch(torch.zeros(1, t, dtype=torch.long), [0], [start], [t]).index()
    assert index is not None
    qkh = h * sum(start + i + 1 for i in range(t))
    with tempfile.TemporaryDirectory() as tmp:
        old = base_library(args.base, Path(tmp))
        libs = {"old": old, "new": new}
        outs = {}
        ns: dict[str, list[float]] = {"old": [], "new": []}
        real = ops.library
        try:
            for r in range(args.rounds + 1):
                for which in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    ops.library = lambda w=which: libs[w]  # type: ignore[misc]
                    c0 = time.thread_time() if args.threads == 1 else time.perf_counter()
                    out = ops.attn_prefill(q, cache, 0, index, d**-0.5, 0)
                    c1 = time.thread_time() if args.threads == 1 else time.perf_counter()
                    assert out is not None
                    outs[which] = out
                    if r:  # the first round warms both
                        ns[which].append((c1 - c0) * 1e9 / qkh)
        finally:
            ops.library = real  # type: ignore[misc]
    ratios = [b / a for a, b in zip(ns["old"], ns["new"], strict=True)]
    clock = "thread CPU" if args.threads == 1 else "wall"
    print(
        f"{h}/{hkv} heads of {d}, {t} queries after {start}, {args.kv}, {args.threads} thread(s), ns a query-key-head ({clock}):"
    )
    for r, (a, b) in enumerate(zip(ns["old"], ns["new"], strict=True)):
        print(f"  round {r + 1}: old {a:.3f}  new {b:.3f}  new/old {b / a:.3f}")
    print(
        f"median old {statistics.median(ns['old']):.3f} new {statistics.median(ns['new']):.3f}; "
        f"new/old median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})"
    )
    diff = (outs["new"] - outs["old"]).abs().max().item()
    print(f"largest difference new - old: {diff:.2e}")


if __name__ == "__main__":
    main()
