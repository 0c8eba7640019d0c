"""A prototype's question: how much faster are the one-to-four-row products of IQ2_XXS and IQ3_XXS
weights repacked at load into tiles of 16 outputs x one super-block (bench/xiq.c: the layout, the
kernel) than the library's gl_mm_iq, which reads the file's super-blocks in place?

1. the check: the tiles (written here by `tiles`) read back by `untile` and dequantized in gguf's
   float32 order, bit for bit against gguf.quants.dequantize; xiq_mm against `product_ref` (x
   quantized as quant.c does, the units' integer sums exact, the FMAs rounded once) and against
   the library's gl_mm_iq, bit for bit;
2. the timing: xiq_mm against gl_mm_iq, one thread, alternated (A B, B A ..) in this process's
   CPU time, each call quantizing its own x; in cache (one weight) and out of cache (calls taking
   copies of the weight in turn, 96 MiB of them, 3x the L3); ns an output's super-block.

    PYTHONPATH=src .venv/bin/python bench/xiq.py [--rows 1 2 3 4] [--rounds 21]

With --library: the library's tiles (gl_pack_iq, gl_mm_iq_tiles: this kernel integrated, the
lanes past 4 rows) against gl_mm_iq in place, the same bits checked, the same table; with
--against LIB.so too: against that build's gl_mm_iq_tiles (the same tiles).
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
from gguf import quants as gq
from gguf.quants import dequantize

from graftlm.native import build

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synth_tensors
from kernels import load_alike, timed  # noqa: E402
from synth_tensors import random_blocks  # noqa: E402

SHAPES = [(768, 2048), (2048, 768), (2048, 2048)]  # n_out x n_in
CHECK_SHAPES = [(16, 256, 1), (48, 768, 4), (32, 2304, 3), (64, 512, 2)]  # n, k, M
TYPES = {"IQ2_XXS": (Q.IQ2_XXS, 0, 66), "IQ3_XXS": (Q.IQ3_XXS, 3, 98)}  # type, v, file bytes
P = ctypes.c_void_p
I64 = ctypes.c_int64
POOL = 96 << 20  # bytes of weight copies out of cache


def load_prototype(folder: Path) -> ctypes.CDLL:
    """bench/xiq.c built with the library's flags, its grid tables from the library's sources."""
    source = Path(__file__).resolve().with_name("xiq.c")
    csrc = Path(build.__file__).resolve().parent / "csrc"
    out = folder / "xiq.so"
    subprocess.run(["cc", *build.FLAGS, f"-I{csrc}", str(source), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.xiq_mm.argtypes = [P, I64, I64, P, ctypes.c_int, ctypes.c_int, I64, P, P]
    lib.xiq_mm.restype = None
    lib.xiq_tile_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.xiq_tile_bytes.restype = I64
    return lib


def ksigns() -> np.ndarray:
    """KSIGNS: a 7-bit sign index -> its 8 sign bits (bit 7 the parity)."""
    j = np.arange(128, dtype=np.uint8)
    return j | ((np.unpackbits(j[:, None], axis=1).sum(axis=1) & 1) << 7).astype(np.uint8)


def fields(raw: np.ndarray, v: int, n: int, k: int) -> tuple[np.ndarray, ...]:
    """The file's super-blocks -> d (n, nsb) uint16, idx (n, nsb, entries) uint8, aux (n, nsb, 8)
    uint32 (a unit's 4 7-bit sign indices at bits 0, 7, 14, 21 and ls at 28)."""
    b = raw.reshape(n, k // 256, 66 if v == 0 else 98)
    d = b[..., 0:2].copy().view(np.uint16)[..., 0]
    if v == 0:
        q = b[..., 2:].reshape(n, k // 256, 8, 8)
        return d, q[..., :4].reshape(n, k // 256, 32), q[..., 4:].copy().view(np.uint32)[..., 0]
    return d, b[..., 2:66].copy(), b[..., 66:].copy().view(np.uint32)


def value_signs(aux: np.ndarray) -> np.ndarray:
    """(..., 8) words -> (..., 8 units, 32) bools: value j of the unit negative."""
    idx = (aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127
    sb = ksigns()[idx]  # (..., 8, 4) sign bytes, byte l: values 8 l ..
    return np.unpackbits(sb[..., None], axis=-1, bitorder="little").reshape(*aux.shape, 32) == 1


def lane_map(v: int) -> tuple[np.ndarray, np.ndarray]:
    """For vector s (IQ3_XXS: 0, 1; IQ2_XXS: 0) byte 4 o + i and m: (entry of the unit, value of
    the unit) as tables ent[s, i] and val[s, i, m]."""
    if v == 0:
        i = np.arange(4)
        return i[None], (8 * i[:, None] + np.arange(8)[None])[None]
    ent = 4 * np.arange(2)[:, None] + np.arange(4)[None]  # (s, i)
    m = np.arange(8)
    val = 4 * (4 * (m // 4)[None, None] + np.arange(4)[None, :, None]) + (m % 4)[None, None]
    return ent, np.broadcast_to(val, (2, 4, 8))


def tiles(raw: np.ndarray, v: int, n: int, k: int, expl: int) -> np.ndarray:
    """xiq.c's tiles of the weight (n a multiple of 16): (n / 16, k / 256, tile bytes) uint8."""
    d, idx, aux = fields(raw, v, n, k)
    g, nsb = n // 16, k // 256
    per = 4 if v == 0 else 8  # entries a unit
    nv = 1 if v == 0 else 2
    ent, val = lane_map(v)
    idx_u = idx.reshape(g, 16, nsb, 8, per)  # (group, o, sb, unit, entry)
    sgn = value_signs(aux).reshape(g, 16, nsb, 8, 32)
    units = []
    for u in range(8):
        parts = []
        for s in range(nv):  # byte 4 o + i: entry ent[s, i] of the unit
            parts.append(idx_u[:, :, :, u, ent[s]].transpose(0, 2, 1, 3).reshape(g, nsb, 64))
        if expl:
            for s in range(nv):
                for m in range(4 if v == 3 else 8):
                    mm = m if v == 0 else 4 * s + m
                    bits = sgn[:, :, :, u, val[s, :, mm]].transpose(0, 2, 1, 3).reshape(g, nsb, 64)
                    parts.append(np.packbits(bits, axis=-1, bitorder="little"))
        else:
            w = aux.reshape(g, 16, nsb, 8)[:, :, :, u].transpose(0, 2, 1)
            parts.append(w.copy().view(np.uint8).reshape(g, nsb, 64))
        units.append(np.concatenate(parts, axis=-1))
    head = [d.reshape(g, 16, nsb).transpose(0, 2, 1).copy().view(np.uint8).reshape(g, nsb, 32)]
    if expl:
        ls = (
            (aux >> 28).astype(np.uint8).reshape(g, 16, nsb, 8).transpose(0, 2, 3, 1)
        )  # (g, sb, u, o)
        head.append((ls[:, :, 0::2] | ls[:, :, 1::2] << 4).reshape(g, nsb, 64))
    return np.ascontiguousarray(np.concatenate(units + head, axis=-1))


def untile(t: np.ndarray, v: int, n: int, k: int, expl: int) -> tuple[np.ndarray, ...]:
    """The tiles read back as xiq.c reads them: magnitudes (n, k) float32 (the grid's), negative
    (n, k) bools, scale d (n, k/256) float32 and ls (n, k/32)."""
    g, nsb = n // 16, k // 256
    ub = 128 if v == 0 else 192
    grid = (gq.IQ2_XXS if v == 0 else gq.IQ3_XXS).grid.reshape(256, -1)
    ent, val = lane_map(v)
    per, nv = (4, 1) if v == 0 else (8, 2)
    mag = np.zeros((g, nsb, 16, 8, 32), np.float32)
    neg = np.zeros((g, nsb, 16, 8, 32), bool)
    ls = np.zeros((g, nsb, 16, 8), np.int64)
    for u in range(8):
        pu = t[:, :, u * ub : (u + 1) * ub]
        for s in range(nv):
            ix = pu[..., 64 * s : 64 * s + 64].reshape(g, nsb, 16, 4)
            for i in range(4):
                e = ent[s, i]  # the entry's values: grid[ix] at value e * (32 / per) ..
                width = 32 // per
                mag[:, :, :, u, e * width : (e + 1) * width] = grid[ix[..., i]]
        tail = pu[..., ub - 64 :]
        if expl:
            bits = np.unpackbits(tail.reshape(g, nsb, 8, 8), axis=-1, bitorder="little")
            bits = bits.reshape(g, nsb, 8, 16, 4)  # (m, o, i)
            for m in range(8):
                s, mm = (0, m) if v == 0 else divmod(m, 4)
                for i in range(4):
                    neg[:, :, :, u, val[s, i, m if v == 0 else 4 * s + mm]] = (
                        bits[:, :, m, :, i] == 1
                    )
        else:
            w = tail.copy().view(np.uint32).reshape(g, nsb, 16)
            neg[:, :, :, u] = value_signs(w[..., None])[..., 0, :]
            ls[:, :, :, u] = w >> 28
    head = t[:, :, 8 * ub :]
    d = head[..., :32].copy().view(np.float16).reshape(g, nsb, 16).astype(np.float32)
    if expl:
        c = head[..., 32:96].reshape(g, nsb, 4, 16)
        ls[..., 0::2] = (c & 15).transpose(0, 1, 3, 2)
        ls[..., 1::2] = (c >> 4).transpose(0, 1, 3, 2)

    def rows(a: np.ndarray) -> np.ndarray:  # (g, sb, o, ...) -> (n, sb * ...)
        return a.swapaxes(1, 2).reshape(n, -1)

    return rows(mag), rows(neg), rows(d), rows(ls)


def dequantize_twin(t: np.ndarray, v: int, n: int, k: int, expl: int) -> np.ndarray:
    """gguf's (d * (0.5 + ls) * f * grid) * sign in float32 from the tiles."""
    mag, neg, d, ls = untile(t, v, n, k, expl)
    f = np.float32(0.25 if v == 0 else 0.5)
    db = np.repeat(d, 8, axis=1) * (np.float32(0.5) + ls.astype(np.float32)) * f
    return np.where(neg, np.float32(-1), np.float32(1)) * (np.repeat(db, 32, axis=1) * mag)


def quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quant.c's quantize_blocks: x (M, k) -> codes (M, k) int8, scales (M, k/32) float32."""
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    amax = np.abs(b).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(amax > 0, amax, np.float32(1)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    return np.rint(b * inv[..., None]).astype(np.int8).reshape(m, k), d


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c), rounded once: the float64 sum of the exact product rounded to odd
    (TwoSum's error), then to float32."""
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24 x 24 bits
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    odd = (s.view(np.int64) & 1) == 1
    fix = (e != 0) & ~odd
    s = np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def product_ref(t: np.ndarray, v: int, n: int, k: int, expl: int, x: np.ndarray) -> np.ndarray:
    """y (M, n) in xiq.c's Semantics from the tiles (the library's products, the same bits)."""
    mag, neg, d, ls = untile(t, v, n, k, expl)
    w = np.where(neg, -mag, mag).astype(np.int64)  # (n, k) the signed grid values
    xq, xd = quantize_ref(x)
    m = x.shape[0]
    sums = np.einsum(
        "nuv,muv->mnu", w.reshape(n, k // 32, 32), xq.reshape(m, k // 32, 32).astype(np.int64)
    )
    f = np.float32(0.25 if v == 0 else 0.5)
    s = np.repeat(d, 8, axis=1) * (
        (np.float32(0.5) + ls.astype(np.float32)) * f
    )  # (n, k/32): exact
    acc = np.zeros((m, n), np.float32)
    for u in range(k // 32):
        acc = fma32(sums[..., u].astype(np.float32), s[None, :, u] * xd[:, None, u], acc)
    return acc


class Weight:
    """A random weight of one type: the file's super-blocks and the tiles, each expl."""

    def __init__(self, name: str, n: int, k: int, rng: np.random.Generator) -> None:
        self.qtype, self.v, self.file_bytes = TYPES[name]
        self.name, self.n, self.k = name, n, k
        self.raw = np.ascontiguousarray(random_blocks(self.qtype, (n, k), rng))
        self.tiles = {e: tiles(self.raw, self.v, n, k, e) for e in (0, 1)}


def check(lib: ctypes.CDLL, proto: ctypes.CDLL, w: Weight, x: np.ndarray, full: bool) -> str:
    """The tiles' dequantization against gguf's, xiq_mm against gl_mm_iq and (full) product_ref."""
    m, k, n = x.shape[0], w.k, w.n
    want = dequantize(w.raw, w.qtype).reshape(n, k)
    ya = np.empty((m, n), np.float32)
    lib.gl_mm_iq(x.ctypes.data, m, k, w.raw.ctypes.data, w.v, n, ya.ctypes.data, 1)
    for e, t in w.tiles.items():
        if t.shape[-1] != proto.xiq_tile_bytes(w.v, e):
            raise SystemExit(
                f"{w.name} expl={e}: tiles of {t.shape[-1]} bytes, xiq.c says otherwise"
            )
        if full and not np.array_equal(
            dequantize_twin(t, w.v, n, k, e).view(np.int32), want.view(np.int32)
        ):
            raise SystemExit(
                f"{w.name} {n}x{k} expl={e}: the tiles' dequantization differs from gguf's"
            )
        yb = np.empty((m, n), np.float32)
        scratch = np.empty(2 * m * k + 4 * m * k // 32, np.int8)
        proto.xiq_mm(
            x.ctypes.data, m, k, t.ctypes.data, w.v, e, n, yb.ctypes.data, scratch.ctypes.data
        )
        if not np.array_equal(yb.view(np.int32), ya.view(np.int32)):
            raise SystemExit(f"{w.name} {n}x{k} M={m} expl={e}: xiq_mm differs from gl_mm_iq "
                             f"at {np.argwhere(yb != ya)[:3].tolist()}")  # fmt: skip
        if full:
            ref = product_ref(t, w.v, n, k, e, x)
            if not np.array_equal(yb.view(np.int32), ref.view(np.int32)):
                raise SystemExit(
                    f"{w.name} {n}x{k} M={m} expl={e}: xiq_mm differs from product_ref"
                )
    return f"{w.name} {n}x{k} M={m}: same bits" + (
        " (gguf, twin, library)" if full else " (library)"
    )


def calls(
    lib: ctypes.CDLL, proto: ctypes.CDLL, w: Weight, x: np.ndarray, copies: int
) -> list[Callable[[], object]]:
    """[gl_mm_iq, xiq_mm without expl, xiq_mm with expl] of x by w, each taking `copies` copies
    of its weight in turn (1: the same weight every call)."""
    m, k, n = x.shape[0], w.k, w.n
    y = np.empty((m, n), np.float32)
    scratch = np.empty(2 * m * k + 4 * m * k // 32, np.int8)
    pools = [np.stack([a.reshape(-1)] * copies) for a in (w.raw, w.tiles[0], w.tiles[1])]
    turn = [0, 0, 0]

    def lib_call() -> None:
        turn[0] = (turn[0] + 1) % copies
        lib.gl_mm_iq(x.ctypes.data, m, k, pools[0][turn[0]].ctypes.data, w.v, n, y.ctypes.data, 1)

    def proto_call(e: int) -> Callable[[], None]:
        def call() -> None:
            turn[1 + e] = (turn[1 + e] + 1) % copies
            t = pools[1 + e][turn[1 + e]]
            proto.xiq_mm(
                x.ctypes.data, m, k, t.ctypes.data, w.v, e, n, y.ctypes.data, scratch.ctypes.data
            )

        return call

    return [lib_call, proto_call(0), proto_call(1)]


def speeds(lib: ctypes.CDLL, proto: ctypes.CDLL, names: list[str], shapes: list[tuple[int, int]],
           rows: list[int], rounds: int, rng: np.random.Generator) -> None:  # fmt: skip
    """The table: ns an output's super-block (median; per row of x), A gl_mm_iq, B xiq_mm with the
    file's sign words, C with explicit signs; each pair alternated."""
    print(
        "| type | n_out x n_in | where | M | A ns | B ns | C ns | A/B | A/C | B spread | C spread |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        for n, k in shapes:
            w = Weight(name, n, k, rng)
            for where in ("cache", "memory"):
                copies = 1 if where == "cache" else max(2, POOL // w.raw.nbytes)
                for m in rows:
                    x = rng.standard_normal((m, k)).astype(np.float32)
                    check(lib, proto, w, x, full=False)
                    fa, fb, fc = calls(lib, proto, w, x, copies)
                    units = n * k / 256 * m
                    reps = max(1, int(4e6 / units))
                    tab = timed([fa, fb], reps, rounds)
                    tac = timed([fa, fc], reps, rounds)
                    a = statistics.median(tab[0] + tac[0]) / units * 1e9
                    b, c = (statistics.median(t[1]) / units * 1e9 for t in (tab, tac))
                    sp = [
                        f"{min(t[1]) / units * 1e9:.2f}-{max(t[1]) / units * 1e9:.2f}"
                        for t in (tab, tac)
                    ]
                    print(f"| {name} | {n}x{k} | {where} | {m} | {a:.2f} | {b:.2f} | {c:.2f} | "
                          f"{a / b:.3f} | {a / c:.3f} | {sp[0]} | {sp[1]} |", flush=True)  # fmt: skip
            del w


def pooled(
    fn: Callable[..., None], pool: np.ndarray, x: np.ndarray, v: int, n: int
) -> tuple[Callable[[], None], np.ndarray]:
    """A call of fn (gl_mm_iq's arguments) on x taking pool's copies of a weight in turn; its y."""
    m, k = x.shape
    y = np.empty((m, n), np.float32)
    turn = [0]

    def call() -> None:
        turn[0] = (turn[0] + 1) % len(pool)
        fn(x.ctypes.data, m, k, pool[turn[0]].ctypes.data, v, n, y.ctypes.data, 1)

    return call, y


def library_ab(lib: ctypes.CDLL, names: list[str], shapes: list[tuple[int, int]], rows: list[int],
               rounds: int, rng: np.random.Generator, other: ctypes.CDLL | None = None) -> None:  # fmt: skip
    """The library's own tiles (gl_pack_iq, gl_mm_iq_tiles: xiq.c's kernel integrated, the lanes
    past 4 rows) against gl_mm_iq in place (other: against other's gl_mm_iq_tiles on the same
    tiles): the same bits, then ns an output's super-block a row, one thread, alternated, in cache
    and out of cache."""
    a_name = "in place" if other is None else "other's tiles"
    print(f"| type | n_out x n_in | where | M | {a_name} ns | tiles ns | ratio | tiles spread |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        for n, k in shapes:
            w = Weight(name, n, k, rng)
            tiles = np.empty_like(w.raw)
            assert lib.gl_pack_iq(w.v, w.raw.ctypes.data, n, k, tiles.ctypes.data, 1) == 0
            for where in ("cache", "memory"):
                copies = 1 if where == "cache" else max(2, POOL // w.raw.nbytes)
                pools = [np.stack([a] * copies) for a in (w.raw if other is None else tiles, tiles)]
                fn_a = lib.gl_mm_iq if other is None else other.gl_mm_iq_tiles
                for m in rows:
                    x = rng.standard_normal((m, k)).astype(np.float32)
                    (fa, ya), (fb, yb) = (
                        pooled(f, q, x, w.v, n)
                        for f, q in zip((fn_a, lib.gl_mm_iq_tiles), pools, strict=True)
                    )
                    fa(), fb()
                    if not np.array_equal(ya.view(np.int32), yb.view(np.int32)):
                        raise SystemExit(
                            f"{name} {n}x{k} M={m}: gl_mm_iq_tiles differs from gl_mm_iq"
                        )
                    units = n * k / 256 * m
                    ta, tb = timed([fa, fb], max(1, int(4e6 / units)), rounds)
                    a, b = (statistics.median(t) / units * 1e9 for t in (ta, tb))
                    sp = f"{min(tb) / units * 1e9:.2f}-{max(tb) / units * 1e9:.2f}"
                    print(f"| {name} | {n}x{k} | {where} | {m} | {a:.2f} | {b:.2f} | {a / b:.3f} | {sp} |",
                          flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 3, 4])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--types", nargs="*", default=list(TYPES))
    ap.add_argument("--shapes", nargs="*", default=[f"{n}x{k}" for n, k in SHAPES])
    ap.add_argument("--library", action="store_true", help="the library's tiles against in place")
    ap.add_argument("--against", help="with --library: another build's gl_mm_iq_tiles (a .so path)")
    args = ap.parse_args()
    ours = build.library()
    if ours is None or "zmm-vnni" not in build.features():
        raise SystemExit(
            "xiq needs the library's 512-bit VNNI build with VBMI (gl_mm_iq's iq_group_few)"
        )
    lib = load_alike(ours._name)
    lib.gl_mm_iq.argtypes = [P, I64, I64, P, ctypes.c_int, I64, P, ctypes.c_int]
    lib.gl_mm_iq.restype = None
    rng = np.random.default_rng(0)
    shapes = [(int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes]
    if args.library:
        lib.gl_pack_iq.argtypes = [ctypes.c_int, P, I64, I64, P, ctypes.c_int]
        other = load_alike(args.against) if args.against else None
        for li in (lib,) if other is None else (lib, other):
            li.gl_mm_iq_tiles.argtypes = lib.gl_mm_iq.argtypes
            li.gl_mm_iq_tiles.restype = None
        a_is = "gl_mm_iq, in place" if other is None else f"{args.against}'s gl_mm_iq_tiles"
        print(f"## one thread, alternated: A {a_is}, B this tree's gl_mm_iq_tiles")
        library_ab(lib, args.types, shapes, args.rows, args.rounds, rng, other)
        return
    with tempfile.TemporaryDirectory() as tmp:
        proto = load_prototype(Path(tmp))
        print("## the check (tiles against gguf, xiq_mm against its twin and gl_mm_iq)")
        for name in args.types:
            for n, k, m in CHECK_SHAPES:
                x = rng.standard_normal((m, k)).astype(np.float32)
                print(check(lib, proto, Weight(name, n, k, rng), x, full=True), flush=True)
        print("\n## one thread, alternated: A gl_mm_iq (in place), B xiq_mm (tiles, the file's sign "
              "words), C xiq_mm (tiles, explicit signs); ns an output's super-block a row")  # fmt: skip
        speeds(lib, proto, args.types, shapes, args.rows, args.rounds, rng)


if __name__ == "__main__":
    main()
