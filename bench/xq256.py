"""A prototype's question: how much faster is the Q4_K product of many rows of x with x quantized
per 256 values (one float scale a super-block, the sums of its codes per 32 for the mins: llama.cpp's
Q8_K) than the library's, which quantizes x per 32 (bench/xq256.c: the kernel, its slot count)?

1. the check: bench/xq256.c's quantizer and product against a numpy reference from the same
   quantized x (the integer sums exact, the float steps in the C's order: the same bits), on
   random Q4_K weights (tests/synth_tensors.py's), at small shapes with odd counts of groups,
   super-blocks and rows, then at the timed shapes (a sample of their outputs);
2. the timing: xq256_mm against the library's gl_mm_k4 on the same packed weights and x, one
   thread, alternated (A B B A ..) in this process's CPU time, each call quantizing its own x;
3. the numerics: both products against the float64 product of the dequantized weights with x
   unquantized, on random x and on x with a few channels 20 times the rest.

    PYTHONPATH=src .venv/bin/python bench/xq256.py [--rows 16 64 512] [--rounds 31]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from graftlm.native import build
from graftlm.quant import QWeight

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synth_tensors
from kernels import load_alike, timed  # noqa: E402
from synth_tensors import random_blocks  # noqa: E402

SHAPES = [(2048, 8192), (8192, 2048), (2048, 2048)]  # n_out x n_in
CHECK_SHAPES = [(48, 256, 5), (40, 768, 13), (72, 2304, 17), (16, 512, 1), (24, 1280, 8)]  # n, k, M
P = ctypes.c_void_p
I64 = ctypes.c_int64


def load_prototype(folder: Path) -> ctypes.CDLL:
    """bench/xq256.c built with the library's flags (graftlm.native.build.FLAGS)."""
    source = Path(__file__).resolve().with_name("xq256.c")
    out = folder / "xq256.so"
    subprocess.run(["cc", *build.FLAGS, str(source), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.xq256_quantize.argtypes = [P, I64, I64, P, P, P]
    lib.xq256_mm.argtypes = [P, I64, I64, P, P, I64, P]
    lib.xq256_mm_quantized.argtypes = [P, P, P, I64, I64, P, P, I64, P]
    for fn in (lib.xq256_quantize, lib.xq256_mm, lib.xq256_mm_quantized):
        fn.restype = None
    return lib


def q4k_fields(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
    """From the GGUF blocks (gguf's / ggml's Q4_K layout): codes (n, k) 0..15, sc and mn (n, k/32)
    6-bit, d and dmin (n, k/256) float32 (the float16 fields, exactly)."""
    b = raw.reshape(n, k // 256, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = b[..., 4:16].astype(np.int32)
    sc = np.empty((n, k // 256, 8), np.int32)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63  # ggml's get_scale_min_k4
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 64 values a chunk: low nibbles, then high
    codes = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, k)
    return codes, sc.reshape(n, -1), mn.reshape(n, -1), d, dmin


def quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (M, k) per 256, as xq256.c says: codes (M, k) int8, bsums (M, k/32) int16, d (M, k/256)."""
    m, k = x.shape
    v = x.reshape(m, k // 256, 256)
    amax = np.abs(v).max(axis=2)
    d = amax / np.float32(127)
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    q = np.rint(v * inv[..., None]).astype(np.int8)
    bsum = q.reshape(m, k // 32, 32).astype(np.int32).sum(axis=2).astype(np.int16)
    return q.reshape(m, k), bsum, d.astype(np.float32)


def untile(
    xq: np.ndarray, bs: np.ndarray, xd: np.ndarray, m: int, k: int, kt: int
) -> tuple[np.ndarray, ...]:
    """xq256_quantize's tiled buffers (tiles of kt rows) -> row-major codes (M, k), bsums
    (M, k/32), d (M, k/256)."""
    ks = k // 256
    q, b, d = (
        np.empty((m, k), np.int8),
        np.empty((m, ks * 8), np.int16),
        np.empty((m, ks), np.float32),
    )
    for r0 in range(0, m, kt):
        rows = min(kt, m - r0)  # (super-block, row in the tile, ...)
        q[r0 : r0 + rows] = (
            xq[r0 * k : (r0 + rows) * k].reshape(ks, rows, 256).transpose(1, 0, 2).reshape(rows, k)
        )
        b[r0 : r0 + rows] = (
            bs[r0 * ks * 8 : (r0 + rows) * ks * 8]
            .reshape(ks, rows, 8)
            .transpose(1, 0, 2)
            .reshape(rows, -1)
        )
        d[r0 : r0 + rows] = xd[r0 * ks : (r0 + rows) * ks].reshape(ks, rows).T
    return q, b, d


def product_ref(
    fields: tuple[np.ndarray, ...], xq: np.ndarray, bsum: np.ndarray, xd: np.ndarray
) -> np.ndarray:
    """y (M, n) in xq256.c's Semantics: the integer sums exact, then its float32 steps in order."""
    codes, sc, mn, d, dmin = fields
    n, k = codes.shape
    m = xq.shape[0]
    c = codes.reshape(n, k // 32, 32).astype(np.int64)
    x = xq.reshape(m, k // 32, 32).astype(np.int64)
    s32 = np.einsum("nbv,mbv->mnb", c, x)  # (M, n, blocks)
    si = (s32 * sc[None]).reshape(m, n, k // 256, 8).sum(axis=3)
    mi = (bsum.astype(np.int64)[:, None, :] * mn[None]).reshape(m, n, k // 256, 8).sum(axis=3)
    assert np.abs(si).max(initial=0) < 2**31 and np.abs(mi).max(initial=0) < 2**31
    acc = np.zeros((m, n), np.float32)
    for s in range(k // 256):
        t = (
            si[..., s].astype(np.float32) * d[None, :, s]
            - mi[..., s].astype(np.float32) * dmin[None, :, s]
        )
        acc = acc + t * xd[:, None, s]
    return acc


class Q4K:
    """A random Q4_K weight: its GGUF blocks, fields, and the library's packed form (q, d)."""

    def __init__(self, n: int, k: int, rng: np.random.Generator) -> None:
        self.n, self.k = n, k
        self.raw = random_blocks(Q.Q4_K, (n, k), rng)
        kern = QWeight.from_gguf(self.raw, Q.Q4_K, (n, k))._k
        self.q, self.d = kern.q, kern.d  # (torch tensors: kept alive with self)
        self.fields = q4k_fields(self.raw, n, k)

    def dequantized(self) -> np.ndarray:
        return dequantize(self.raw, Q.Q4_K).reshape(self.n, self.k)


def quantize_c(proto: ctypes.CDLL, x: np.ndarray) -> tuple[np.ndarray, ...]:
    m, k = x.shape
    xq, bs = np.empty(m * k, np.int8), np.empty(m * k // 32, np.int16)
    xd = np.empty(m * k // 256, np.float32)
    proto.xq256_quantize(x.ctypes.data, m, k, xq.ctypes.data, bs.ctypes.data, xd.ctypes.data)
    return xq, bs, xd


def check(proto: ctypes.CDLL, w: Q4K, x: np.ndarray, cols: np.ndarray | None = None) -> str:
    """xq256.c's quantizer and product against the numpy twins, bit for bit (cols: only those
    outputs of the product checked)."""
    m, k = x.shape
    tiled = quantize_c(proto, x)
    got = untile(*tiled, m, k, proto.xq256_rows_a_tile())
    want = quantize_ref(x)
    for name, a, b in zip(("codes", "bsums", "scales"), got, want, strict=True):
        if not np.array_equal(a, b):
            raise SystemExit(f"xq256_quantize {m}x{k}: {name} differ from quantize_ref")
    y = np.empty((m, w.n), np.float32)
    proto.xq256_mm_quantized(
        *(t.ctypes.data for t in tiled), m, k, w.q.data_ptr(), w.d.data_ptr(), w.n, y.ctypes.data
    )
    y2 = np.empty_like(y)
    proto.xq256_mm(x.ctypes.data, m, k, w.q.data_ptr(), w.d.data_ptr(), w.n, y2.ctypes.data)
    fields = w.fields if cols is None else tuple(f[cols] for f in w.fields)
    ref = product_ref(fields, *want)
    mine = y if cols is None else y[:, cols]
    if not (np.array_equal(mine.view(np.int32), ref.view(np.int32)) and np.array_equal(y, y2)):
        bad = np.argwhere(mine != ref)
        raise SystemExit(
            f"xq256 {w.n}x{k} M={m}: {len(bad)} outputs differ from product_ref, first {bad[:3]}"
        )
    return f"{w.n}x{k} M={m}: same bits ({mine.size} outputs)"


def errors(y: np.ndarray, ref: np.ndarray) -> str:
    """Relative RMS error and largest error against ref's RMS."""
    rms = float(np.sqrt(np.mean(ref**2)))
    rel, top = float(np.sqrt(np.mean((y - ref) ** 2))) / rms, float(np.abs(y - ref).max()) / rms
    return f"{rel:.2e} / {top:.2e}"


def both(
    lib: ctypes.CDLL, proto: ctypes.CDLL, w: Q4K, x: np.ndarray
) -> tuple[list[Callable[[], object]], list[np.ndarray]]:
    """[the library's product (x per 32), the prototype's (x per 256)] of x by w, and the ys
    they write."""
    m, k = x.shape
    ya, yb = np.empty((m, w.n), np.float32), np.empty((m, w.n), np.float32)
    xp, qp, dp = x.ctypes.data, w.q.data_ptr(), w.d.data_ptr()
    return [
        lambda: lib.gl_mm_k4(xp, m, k, qp, dp, 0, w.n, ya.ctypes.data, 1),
        lambda: proto.xq256_mm(xp, m, k, qp, dp, w.n, yb.ctypes.data),
    ], [ya, yb]


def speeds(
    lib: ctypes.CDLL,
    proto: ctypes.CDLL,
    shapes: list[tuple[int, int]],
    rows: list[int],
    rounds: int,
    rng: np.random.Generator,
) -> list[Q4K]:
    """The A/B table (each shape's weight checked at a sample of outputs first); its weights."""
    print("| n_out x n_in | M | A GMAC/s | B GMAC/s | B / A | A spread | B spread |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    weights = []
    for n, k in shapes:
        w = Q4K(n, k, rng)
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            check(proto, w, x, rng.choice(n, 24, replace=False))
            reps = max(1, int(2e9 / (m * n * k)))  # (calls of at least ~15 ms)
            times = timed(both(lib, proto, w, x)[0], reps, rounds)
            ga, gb = (m * n * k / statistics.median(t) / 1e9 for t in times)
            spread = [
                f"{m * n * k / max(t) / 1e9:.0f}-{m * n * k / min(t) / 1e9:.0f}" for t in times
            ]
            print(f"| {n}x{k} | {m} | {ga:.1f} | {gb:.1f} | {gb / ga:.3f} | {spread[0]} "
                  f"| {spread[1]} |", flush=True)  # fmt: skip
        weights.append(w)
    return weights


def precision(
    lib: ctypes.CDLL, proto: ctypes.CDLL, weights: list[Q4K], rng: np.random.Generator
) -> None:
    """Both products' error against float64 (the dequantized weight, x unquantized), 64 rows of
    x: normal, and with 6 channels (the same in every row) 20 times the rest."""
    print("| n_out x n_in | x | x per 32 (library) | x per 256 (xq256) |")
    print("| --- | --- | --- | --- |")
    for w in weights:
        wd = w.dequantized().astype(np.float64)
        for kind in ("normal", "outliers"):
            x = rng.standard_normal((64, w.k)).astype(np.float32)
            if kind == "outliers":
                x[:, rng.choice(w.k, 6, replace=False)] *= 20
            ref = x.astype(np.float64) @ wd.T
            calls, ys = both(lib, proto, w, x)
            for call in calls:
                call()
            print(
                f"| {w.n}x{w.k} | {kind} | {errors(ys[0], ref)} | {errors(ys[1], ref)} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 64, 512])
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--shapes", nargs="*", default=[f"{n}x{k}" for n, k in SHAPES])
    args = ap.parse_args()
    ours = build.library()
    if ours is None or "zmm-vnni" not in build.features():
        raise SystemExit("xq256 needs the library's 512-bit VNNI build (AVX-512 VNNI, GL_VNNI512)")
    lib = load_alike(ours._name)
    lib.gl_mm_k4.argtypes = [P, I64, I64, P, P, ctypes.c_int, I64, P, ctypes.c_int]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        proto = load_prototype(Path(tmp))
        print("## the check (xq256.c against its numpy twin)")
        for n, k, m in CHECK_SHAPES:
            print(check(proto, Q4K(n, k, rng), rng.standard_normal((m, k)).astype(np.float32)))
        shapes = [(int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes]
        for n, k in shapes:
            if n % 8 or k % 256:
                raise SystemExit(
                    f"--shapes {n}x{k}: xq256 takes n_out a multiple of 8, n_in of 256"
                )
        print("\n## one thread, alternated: A gl_mm_k4 (x per 32), B xq256_mm (x per 256)")
        weights = speeds(lib, proto, shapes, args.rows, args.rounds, rng)
        print("\n## the error against float64: relative RMS / largest over RMS")
        precision(lib, proto, weights, rng)


if __name__ == "__main__":
    main()
