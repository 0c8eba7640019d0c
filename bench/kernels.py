"""Quantized matmul throughput per kernel and rows of x, side by side in one run.

For each weight type and shape: GMAC/s of the native int8-activation kernel, of the exact float32
path (dequantize chunks + float32 GEMM) and of torch's own fused kernel (native disabled; the
blocks fallback for the types torch has none for: MXFP4 and the grid quants), for M = 1 .. 512
rows.  This is where ``graftlm.quant.config.PREFILL_M`` comes from.  The grid quants (IQ2_*,
IQ3_*) run on Qwen3-30B-A3B's expert and attention shapes, and the float types (F16, BF16) on
Llama-1B's, when --types names them (BF16's from 6 rows: VDPBF16PS where the CPU has it,
GRAFTLM_BF16_DOTS=0 in the environment for the FMA path; the FMA peak of a Zen 4 core, 16 MACs a cycle, is ~58 GMAC/s at 3.65 GHz).

    .venv/bin/python bench/kernels.py [--rows 1 4 16 64 128 512] [--threads 2] [--types MXFP4 IQ3_XXS]

With `--against LIB` (another tree's built library, e.g. main's: `python -c "from graftlm.native
import build; print(build.library()._name)"` there) the grid quants named by --types run through
gl_mm_iq of LIB and of this tree's library in turn (A B B A ..., `--rounds`), one thread, timed in
this thread's CPU time (a shared machine's descheduling is not counted): the median GMAC/s of
each, the ratio, the weight bytes a second that the new one reads (GB/s, one row: the share of
the machine's read bandwidth a core takes) and whether the two gave the same bits.

    .venv/bin/python bench/kernels.py --against /tmp/main.so --types IQ3_XXS IQ2_XXS --rows 1 2 4 8 16 64

With --types naming only SHAPES' types (one of them not a k-quant, or --cached),
--against runs SHAPES' products the same way (each through its kernel's C function, gl_mm_u4,
gl_mm_k4 ..), their weights in cache: the kernels' arithmetic rather than memory.

    .venv/bin/python bench/kernels.py --against /tmp/main.so --types Q4_K Q4_1 Q8_0 Q6_K --rows 16 512

With --types Q4_K and/or Q6_K only, --against runs the k-quants' products (gl_mm_k4, gl_mm_k6) the
same way, on K_SHAPES: Qwen3-30B-A3B's expert matrices, the same k on big matrices, Llama-1B's FFN
gate and output head, each in enough copies that every call reads its weight from memory (the GB/s
of one row against a one-thread read of memory: the per-call costs of small matrices show there).

    .venv/bin/python bench/kernels.py --against /tmp/main.so --types Q4_K Q6_K --rows 1 16 32
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from graftlm.native import disabled, unavailable_reason
from graftlm.quant import QWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synth_tensors
from synth_tensors import gguf_tensor, random_blocks  # noqa: E402

SHAPES = [(Q.Q4_1, 3072, 576), (Q.Q4_1, 576, 1536), (Q.Q4_K, 640, 2048), (Q.Q5_K, 640, 2048), (Q.Q5_0, 2048, 640),
          (Q.Q6_K, 640, 2048), (Q.Q8_0, 4096, 640)]  # fmt: skip
SHAPES += [(Q.MXFP4, 5760, 2880), (Q.MXFP4, 2880, 2880)]  # gpt-oss-20b's experts: [gate; up], down
# an expert's stacked gate and up, its down, and the attention's Q (Qwen3-30B-A3B)
GRID_SHAPES = [(t, n, k) for t in (Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S)
               for n, k in ((1536, 2048), (2048, 768), (4096, 2048))]  # fmt: skip
# Llama-1B's attention Q, its FFN's gate (and up) and down
FLOAT_SHAPES = [
    (t, n, k) for t in (Q.F16, Q.BF16) for n, k in ((2048, 2048), (8192, 2048), (2048, 8192))
]


def gmacs(fn: Callable[[], object], macs: int) -> float:
    fn()
    reps = max(2, int(5e7 / macs))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return macs * reps / (time.perf_counter() - t0) / 1e9


GRID_TYPES = {Q.IQ2_XXS: 0, Q.IQ2_XS: 1, Q.IQ2_S: 2, Q.IQ3_XXS: 3, Q.IQ3_S: 4}  # gl_mm_iq's v


def iq_call(
    lib: ctypes.CDLL, x: np.ndarray, raw: np.ndarray, v: int, y: np.ndarray
) -> Callable[[], object]:
    """y = x @ W.T by lib's gl_mm_iq on one thread (raw: W's super-blocks, type v)."""
    m, k = x.shape
    n = y.shape[1]
    return lambda: lib.gl_mm_iq(x.ctypes.data, m, k, raw.ctypes.data, v, n, y.ctypes.data, 1)


def grid_against(other: str, types: list[str], rows: list[int], rounds: int) -> None:
    """The grid quants' products of the library `other` (A) and this tree's (B), alternated."""
    libs = both_libraries(other)
    for lib in libs:
        lib.gl_mm_iq.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    rng = np.random.default_rng(0)
    print("| type | n_out x n_in | M | A GMAC/s | B GMAC/s | B / A | B GB/s of weights | bits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for qtype, n, k in GRID_SHAPES:
        if qtype.name not in types:
            continue
        raw = np.ascontiguousarray(random_blocks(qtype, (n, k), rng))
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            ys = [np.empty((m, n), np.float32) for _ in libs]
            calls = [
                iq_call(lib, x, raw, GRID_TYPES[qtype], y) for lib, y in zip(libs, ys, strict=True)
            ]
            for call in calls:
                call()
            same = np.array_equal(ys[0].view(np.int32), ys[1].view(np.int32))
            reps = max(1, int(2e7 / (m * n * k)))
            times = timed(calls, reps, rounds)
            a, b = (m * n * k / statistics.median(t) / 1e9 for t in times)
            gbs = raw.nbytes / statistics.median(times[1]) / 1e9
            print(f"| {qtype.name} | {n}x{k} | {m} | {a:.1f} | {b:.1f} | {b / a:.2f} | {gbs:.1f} "
                  f"| {'same' if same else 'DIFFER'} |")  # fmt: skip


# k-quant A/B (--against with --types Q4_K Q6_K): Qwen3-30B-A3B's expert [gate; up] and down, the
# same k on a big matrix, Llama-1B's FFN gate and its 128,256-wide Q6_K output head; each (type, n,
# k, copies): copies of the weight at their own addresses, the calls taking them in turn, so that
# every call reads its weight from memory as a decode step does (the copies' bytes past L3)
K_SHAPES = [(Q.Q4_K, 1536, 2048, 96), (Q.Q6_K, 2048, 768, 96), (Q.Q4_K, 2048, 768, 96),
            (Q.Q4_K, 16384, 2048, 8), (Q.Q6_K, 16384, 768, 12), (Q.Q4_K, 8192, 2048, 12),
            (Q.Q6_K, 128256, 2048, 1)]  # fmt: skip


def timed(calls: list[Callable[[], object]], reps: int, rounds: int) -> list[list[float]]:
    """Seconds of this thread's CPU time a call, per round, the calls alternated A B, B A, .."""
    times: list[list[float]] = [[] for _ in calls]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            t0 = time.thread_time()
            for _ in range(reps):
                calls[i]()
            times[i].append((time.thread_time() - t0) / reps)
    return times


def load_alike(path: str) -> ctypes.CDLL:
    """A build of the native library loaded by ctypes and set as graftlm sets its own (pair rows,
    task claims, AMX rows), so that two builds compared are compared alike."""
    from graftlm.native import build

    lib = ctypes.CDLL(path)
    for setter in ("gl_set_pair_rows", "gl_set_dynamic", "gl_set_amx_rows"):
        fn = getattr(lib, setter)
        fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_int64
    lib.gl_set_pair_rows(build.pair_rows())
    lib.gl_set_dynamic(int(build.dynamic()))
    lib.gl_set_amx_rows(build.amx_rows())  # (an AMX CPU's tiles on both sides, or neither)
    return lib


def both_libraries(other: str) -> list[ctypes.CDLL]:
    """The library `other` (A) and this tree's (B), both by load_alike: with this tree's as
    graftlm loaded it on one side, an unchanged kernel read 1.13-1.19x at 512 rows three runs in
    a row (Q4_1 3072x576)."""
    from graftlm.native import library

    ours = library()
    if ours is None:
        raise SystemExit(f"native kernels unavailable: {unavailable_reason()}")
    return [load_alike(other), load_alike(ours._name)]


def kquant_against(other: str, types: list[str], rows: list[int], rounds: int) -> None:
    """The k-quants' products (gl_mm_k4, gl_mm_k6) of the library `other` (A) and this tree's (B),
    alternated, one thread, on the same packed weights (the layout is the same in both)."""
    libs = both_libraries(other)
    for lib in libs:
        for fn in (lib.gl_mm_k4, lib.gl_mm_k6):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int]  # fmt: skip
    rng = np.random.default_rng(0)
    print("| type | n_out x n_in | copies | M | A GMAC/s | B GMAC/s | B / A | A GB/s | B GB/s "
          "| bits |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for qtype, n, k, copies in K_SHAPES:
        if qtype.name not in types:
            continue
        kern = QWeight.from_gguf(random_blocks(qtype, (n, k), rng), qtype, (n, k))._k
        packed = [(kern.q, kern.d)] + [(kern.q.clone(), kern.d.clone()) for _ in range(copies - 1)]
        small = kern.five if qtype == Q.Q4_K else kern.variant
        nbytes = kern.q.nbytes + kern.d.nbytes
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            ys = [np.empty((m, n), np.float32) for _ in libs]
            fns = [lib.gl_mm_k4 if qtype == Q.Q4_K else lib.gl_mm_k6 for lib in libs]
            # per library, per copy: the call's arguments
            args = [[(x.ctypes.data, m, k, q.data_ptr(), d.data_ptr(), small, n, y.ctypes.data, 1)
                     for q, d in packed] for y in ys]  # fmt: skip
            fns[0](*args[0][0])
            fns[1](*args[1][0])
            same = np.array_equal(ys[0].view(np.int32), ys[1].view(np.int32))
            reps = max(copies, int(4e8 / (m * n * k)) // copies * copies)
            times: list[list[float]] = [[], []]
            for r in range(rounds):
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    t0 = time.thread_time()
                    fn, ai = fns[i], args[i]
                    for j in range(reps):
                        fn(*ai[j % copies])
                    times[i].append((time.thread_time() - t0) / reps)
            a, b = (m * n * k / statistics.median(t) / 1e9 for t in times)
            ga, gb = (nbytes / statistics.median(t) / 1e9 for t in times)
            print(f"| {qtype.name} | {n}x{k} | {copies} | {m} | {a:.1f} | {b:.1f} | {b / a:.3f} "
                  f"| {ga:.2f} | {gb:.2f} | {'same' if same else 'DIFFER'} |", flush=True)  # fmt: skip


def shapes_against(other: str, types: list[str], rows: list[int], rounds: int) -> None:
    """The products of SHAPES' types named by `types` (weights in cache: the kernels' arithmetic)
    through the same C function of the library `other` (A) and of this tree's (B), alternated,
    one thread, on the same packed weights (the kernel's bound arguments, _args)."""
    libs = both_libraries(other)
    rng = np.random.default_rng(0)
    print("| type | n_out x n_in | M | A GMAC/s | B GMAC/s | B / A | bits |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for qtype, n, k in SHAPES:
        if qtype.name not in types:
            continue
        kern = QWeight.from_gguf(random_blocks(qtype, (n, k), rng), qtype, (n, k))._k
        if getattr(kern, "_fn", None) is None:
            continue
        fns = [getattr(lib, kern._fn.__name__) for lib in libs]
        for fn in fns:
            fn.argtypes, fn.restype = kern._fn.argtypes, kern._fn.restype
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            ys = [np.empty((m, n), np.float32) for _ in fns]
            args = [(x.ctypes.data, m, *kern._args, y.ctypes.data, 1) for y in ys]
            for fn, a in zip(fns, args, strict=True):
                fn(*a)
            same = np.array_equal(ys[0].view(np.int32), ys[1].view(np.int32))
            reps = max(2, int(4e7 / (m * n * k)))
            times: list[list[float]] = [[], []]
            for r in range(rounds):
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    fn, a = fns[i], args[i]
                    t0 = time.thread_time()
                    for _ in range(reps):
                        fn(*a)
                    times[i].append((time.thread_time() - t0) / reps)
            ga, gb = (m * n * k / statistics.median(t) / 1e9 for t in times)
            print(f"| {qtype.name} | {n}x{k} | {m} | {ga:.1f} | {gb:.1f} | {gb / ga:.3f} "
                  f"| {'same' if same else 'DIFFER'} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 64, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", nargs="*", help="only these GGUF types (e.g. MXFP4)")
    ap.add_argument("--against", help="a library file: the A/B against it (above)")
    ap.add_argument("--rounds", type=int, default=7, help="with --against: alternated rounds")
    ap.add_argument("--cached", action="store_true", help="with --against: SHAPES' Q4_K, Q6_K too")
    args = ap.parse_args()
    shape_types = {t.name for t, _, _ in SHAPES}
    if args.against and args.types and set(args.types) <= {"Q4_K", "Q6_K"} and not args.cached:
        kquant_against(args.against, args.types, args.rows, args.rounds)
        return
    if args.against and args.types and set(args.types) <= shape_types:
        shapes_against(args.against, args.types, args.rows, args.rounds)
        return
    if args.against:
        grid = {t.name for t in GRID_TYPES}
        if args.types and not set(args.types) <= grid:  # (each A/B takes its own set of types)
            raise SystemExit(
                f"--against with --types {' '.join(args.types)}: name types of one of "
                f"Q4_K Q6_K (the k-quants from memory); {' '.join(sorted(shape_types))} "
                f"(SHAPES, in cache); {' '.join(sorted(grid))} (the grid quants)"
            )
        grid_against(args.against, args.types or sorted(grid), args.rows, args.rounds)
        return
    torch.set_num_threads(args.threads)
    if unavailable_reason():
        print(f"native kernels unavailable: {unavailable_reason()}")
    rng = np.random.default_rng(0)
    print("| type | n_out x n_in | M | native | float32 chunks | torch fused | (GMAC/s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    shapes = SHAPES + GRID_SHAPES + FLOAT_SHAPES if args.types else SHAPES
    for qtype, n, k in shapes:
        if args.types and qtype.name not in args.types:
            continue
        floats = qtype in (Q.F16, Q.BF16)
        raw = gguf_tensor(qtype, (n, k))[0] if floats else random_blocks(qtype, (n, k), rng)
        w = QWeight.from_gguf(raw, qtype, (n, k))
        with disabled():
            wt = QWeight.from_gguf(raw, qtype, (n, k))
        for m in args.rows:
            x, y = torch.randn(m, k), torch.empty(m, n)
            macs = m * n * k
            kern = w._k
            nat = gmacs(lambda: kern._mm(x, y), macs) if hasattr(kern, "_mm") else 0.0  # noqa: B023
            f32 = gmacs(lambda: kern.chunked_matmul(x), macs)  # noqa: B023
            fused = gmacs(lambda: wt.matmul(x), macs)  # noqa: B023
            print(f"| {qtype.name} | {n}x{k} | {m} | {nat:.1f} ({w.kernel}) | {f32:.1f} "
                  f"| {fused:.1f} ({wt.kernel}) | |")  # fmt: skip


if __name__ == "__main__":
    main()
