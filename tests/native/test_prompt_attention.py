"""The prompt attention kernel (gl_attn_prefill) against its PyTorch twin, the written-out softmax
in float64 over the cache's own values: every cache type, chunks of 1, 15, 16, 17 and 4,095
queries, a chunk reaching 16,384 positions, chunks after earlier ones (whole blocks below the
diagonal), rows at their own starts, scattered blocks, GQA groups of 1 to 6 heads, head sizes of
16 to 256 (80: a 16-value tail), sliding windows (one inside a block), gemma-2's soft-cap,
gpt-oss's sinks, keys whose scores keep growing (past the lazy max's margin: csrc/
attn_prompt_lazy.c). (QK-norm and RoPE come before: the kernel takes q and the cache as they
are.)

Fast steps where the CPU has AVX-512 BF16 take bfloat16 tiles (VDPBF16PS): q, k and v rounded to
bfloat16, and each softmax weight before it meets the values. Their twin rounds q, k and v alike
and holds the output within the weights' rounding: within 2^-8 times the weighted sum of the
values' magnitudes (each weight's relative rounding is at most 2^-9, and the output is the rounded
weights' convex combination). Where the CPU has AVX-512 VNNI too, their scores come from int8
codes (csrc/attn_prompt_i8.c): the twin makes the same codes (the keys less their bfloat16 mean,
per-key and per-query scales, rounded half to even in float32) and sums them exactly, so the same
bound holds (the kernel's float32 mean may round to another bfloat16 than the twin's float64 one:
that moves every score of a row alike, and a code where a product sits on a rounding's edge).
Through a q8_0 cache on such a CPU the scores come from the cache's own codes unless bfloat16
scores are asked for (csrc/attn_prompt_q8.c, llama.cpp's q8_0 x q8_0): the twin rounds each query row to q8_0 as the
cache rounds its keys, takes the keys as cached, and sums in float64; the values and weights as
the bfloat16 route's, so the same bound holds.
Exact steps, CPUs without AVX512-BF16 and a -DGL_NO_BF16_ATTN build keep float32 products: within
float32's rounding of the twin."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from variants import variant_library

from graftlm.native import features, library, ops
from graftlm.step import Batch, KVCache, RowIndex
from graftlm.step.kv_cache import KV_TYPES, q8_0_pack, q8_0_unpack

pytestmark = pytest.mark.skipif(library() is None, reason="native kernels unavailable here")

BF16_ATTN = "attn-bf16" in features()
I8_ATTN = "attn-i8" in features()
# a fast step's route here (int8 scores only where asked for: GRAFTLM_I8_ATTN=1)
FAST = "i8" if I8_ATTN and ops.I8_ATTN_SCORES else "bf16" if BF16_ATTN else "f32"


def fast(kv: str, route: str = FAST) -> str:
    """A fast step's route through a cache of type kv: a q8_0 cache's own codes where the CPU
    has AVX-512 VNNI and BF16 and int8 scores are asked for (ops.prompt_route: by default, unless
    GRAFTLM_Q8_ATTN=0 without GRAFTLM_I8_ATTN=1; bf16_scores asks for "bf16")."""
    q8 = ops.prompt_route(3, 64, False) == "q8"
    return "q8" if I8_ATTN and q8 and kv == "q8_0" and route != "f32" else route


class Prompt(NamedTuple):
    name: str
    t: int  # queries a row
    starts: list[int]  # the rows' positions before the chunk
    h: int
    hkv: int
    d: int
    window: int = 0
    cap: float = 0.0
    sinks: bool = False
    rise: float = 0.0  # > 0: key j scaled by 1 + rise * j / n_ctx (scores that keep growing)


CASES = [
    Prompt("one query", 1, [0], 4, 2, 64),
    Prompt("15 queries", 15, [0], 4, 2, 64),
    Prompt("16 after a block", 16, [16], 4, 2, 64),
    Prompt("17 after 5", 17, [5], 8, 2, 64),
    Prompt("4,095 queries", 4095, [0], 4, 1, 32),
    Prompt("to 16,384, small heads", 100, [16284], 2, 1, 16),
    Prompt("rows at their own starts", 40, [0, 70, 3], 8, 2, 64),
    Prompt("qwen's group of 6", 100, [300], 12, 2, 128),
    Prompt("no group, a tail of 16", 33, [10], 3, 3, 80),
    Prompt("three q8_0 blocks", 40, [50], 4, 2, 96),
    Prompt("gemma-3's window", 300, [400], 4, 1, 256, window=256),
    Prompt("a window inside a block", 40, [20], 4, 2, 64, window=5),
    Prompt("gemma-2's soft-cap", 70, [129], 8, 4, 256, cap=50.0),
    Prompt("a tight soft-cap", 50, [0], 4, 2, 32, cap=2.0),
    Prompt("gpt-oss's sinks and window", 50, [100], 8, 2, 64, window=32, sinks=True),
    Prompt("keys growing past a lazy max", 40, [2000], 4, 2, 64, rise=6.0),
    Prompt("gpt-oss's sinks, no window", 40, [2000], 8, 2, 64, sinks=True),
    Prompt("one query, chunks of 32 keys", 1, [2015], 12, 2, 64),
]
TYPES = list(KV_TYPES)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q8_0_unpack(q8_0_pack(x)) if dtype is torch.uint8 else x.to(dtype).float()


def _sinks(h: int) -> torch.Tensor:
    """One sink far above the scores, one far below, the rest about their size."""
    s = torch.randn(h, generator=torch.Generator().manual_seed(h)) * 2
    s[0], s[-1] = 8.0, -30.0
    return s


def _inputs(
    p: Prompt, kv: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KVCache, list[int]]:
    """q (B, T, H, D), the keys and values (slots, Hkv, n_ctx, D) as the cache holds them, the
    cache (every slot's blocks scattered over the pool, out of order) and the rows' slots."""
    dtype = KV_TYPES[kv][0]
    d = 64 if dtype is torch.uint8 and p.d % 32 else p.d  # q8_0 rows are whole 32-value blocks
    n_slots, n_ctx = len(p.starts) + 1, max(p.starts) + p.t
    g = torch.Generator().manual_seed(p.t + n_ctx)
    cache = KVCache(1, n_slots, p.hkv, n_ctx, d, d, dtype,
                    n_blocks=2 * n_slots * -(-n_ctx // 16) + 1)  # fmt: skip
    order = (torch.randperm(cache.n_blocks - 1, generator=g) + 1).tolist()
    keys = torch.randn(n_slots, p.hkv, n_ctx, d, generator=g)
    if p.rise:  # a row's max grows chunk after chunk: weights past the lazy softmax's margin
        keys *= 1 + p.rise * torch.arange(n_ctx).view(1, 1, -1, 1) / n_ctx
    values = torch.randn(n_slots, p.hkv, n_ctx, d, generator=g)
    for s in range(n_slots):
        blocks = order[s * cache.max_blocks : (s + 1) * cache.max_blocks]
        cache.set_table(s, blocks)
        for i, b in enumerate(blocks):
            n = min(16, n_ctx - i * 16)
            cache.key_rows(0)[b, :, :n] = cache._pack(keys[s, :, i * 16 : i * 16 + n])
            cache.v[0][b, :, :n] = cache._pack(values[s, :, i * 16 : i * 16 + n])
    q = torch.randn(len(p.starts), p.t, p.h, d, generator=g) * 2
    slots = list(range(n_slots - 1, 0, -1))  # slot 0 unused: rows out of the slots' order
    return q, _rounded(keys, dtype), _rounded(values, dtype), cache, slots


def _rows(slots: list[int], starts: list[int], t: int) -> RowIndex:
    rows = Batch(
        torch.zeros(len(slots), t, dtype=torch.long), slots, starts, [t] * len(slots)
    ).index()
    assert rows is not None
    return rows


def run(p: Prompt, kv: str, exact: bool, bf16_scores: bool = False) -> torch.Tensor:
    q, _, _, cache, slots = _inputs(p, kv)
    d = q.shape[-1]
    sinks = _sinks(p.h) if p.sinks else None
    out = ops.attn_prefill(q, cache, 0, _rows(slots, p.starts, p.t), d**-0.5, p.window, p.cap,
                           exact=exact, sinks=sinks, bf16_scores=bf16_scores)  # fmt: skip
    assert out is not None
    return out


def int8_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d) float32 -> its int8 codes and scale a row, as the kernel makes them: scale
    max|x| / 127, codes round(x * (127 / max|x|)) half to even (0 where the row is 0)."""
    mx = x.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, 127.0 / mx, torch.zeros_like(mx))
    return torch.round(x * inv), mx / 127.0


def int8_scores(q: torch.Tensor, k: torch.Tensor, lo: int) -> torch.Tensor:
    """q (h, t, d), k (h, L, d) float32 -> q.k (h, t, L) in float64 from int8 codes: the keys less
    their mean over positions lo.. (rounded to bfloat16), each key and query row coded alone."""
    mu = k[:, lo:].double().mean(1, keepdim=True).to(torch.bfloat16).float()
    kc, sk = int8_codes(k - mu)
    qc, sq = int8_codes(q)
    return (qc.double() @ kc.double().transpose(1, 2)) * sq.double() * sk.double().transpose(1, 2)


def twin(p: Prompt, kv: str, route: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The written-out attention in float64 (route "bf16": q, k and v rounded to bfloat16; "i8": v
    rounded, the scores from int8 codes; "q8": v rounded, q rounded to q8_0, k as cached; "f32":
    as they are), and the weighted sum of the values' magnitudes (the scale of a weight's
    rounding)."""
    q, keys, values, _, slots = _inputs(p, kv)
    d = q.shape[-1]

    def seen(x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.bfloat16).float() if route != "f32" else x).double()

    outs, spreads = [], []
    for r, (s, p0) in enumerate(zip(slots, p.starts, strict=True)):
        k = seen(keys[s, :, : p0 + p.t]).repeat_interleave(p.h // p.hkv, 0)  # (h, L, d)
        v = seen(values[s, :, : p0 + p.t]).repeat_interleave(p.h // p.hkv, 0)
        k32 = keys[s, :, : p0 + p.t].repeat_interleave(p.h // p.hkv, 0)
        o, sp = [], []
        for t0 in range(0, p.t, 512):  # (h, 512, L) at a time
            t1 = min(p.t, t0 + 512)
            pos = torch.arange(p0 + t0, p0 + t1).view(-1, 1)
            key = torch.arange(p0 + p.t).view(1, -1)
            mask = (key <= pos) & ((pos - key < p.window) if p.window else True)
            if route == "i8":
                lo = max(0, p0 - p.window + 1) if p.window else 0
                scores = int8_scores(q[r, t0:t1].transpose(0, 1), k32, lo) * d**-0.5
            elif route == "q8":
                q8 = _rounded(q[r, t0:t1], torch.uint8).double().transpose(0, 1)
                scores = (q8 @ k32.double().transpose(1, 2)) * d**-0.5
            else:
                scores = (seen(q[r, t0:t1]).transpose(0, 1) @ k.transpose(1, 2)) * d**-0.5
            if p.cap:
                scores = torch.tanh(scores / p.cap) * p.cap
            scores = scores.masked_fill(~mask, float("-inf"))
            if p.sinks:
                sink = _sinks(p.h).double().view(p.h, 1, 1).expand(p.h, t1 - t0, 1)
                prob = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
            else:
                prob = torch.softmax(scores, -1)
            o.append((prob @ v).transpose(0, 1).flatten(1))  # (t, h * d)
            sp.append((prob @ v.abs()).transpose(0, 1).flatten(1))
        outs.append(torch.cat(o))
        spreads.append(torch.cat(sp))
    return torch.stack(outs), torch.stack(spreads)


def _check(p: Prompt, kv: str, out: torch.Tensor, route: str) -> None:
    want, spread = twin(p, kv, route)
    if route != "f32":  # within the weights' rounding
        err = (out.double() - want).abs() - (2.0**-8 * spread + 3e-5)
        assert float(err.max()) <= 0, f"{p.name}, {kv}: {float(err.max())} past the bound"
    else:
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("p", CASES, ids=[c.name for c in CASES])
def test_prompt_attention_equals_its_twin(p: Prompt, kv: str) -> None:
    torch.set_num_threads(2)
    _check(p, kv, run(p, kv, exact=False), fast(kv))


@pytest.mark.parametrize("kv", TYPES)
def test_a_lazy_max_far_behind_falls_back(kv: str) -> None:
    """Keys whose scores grow far past a row's lazy max (a fast route's weights against a max
    that lags): a lazy max that never fell back overflows (NaN on every route). A fast route's
    case only: float32 scores near 1,000 round by ~1e-4, past the exact route's bound."""
    torch.set_num_threads(2)
    p = Prompt("keys growing far past a lazy max", 40, [2000], 4, 2, 64, rise=200.0)
    _check(p, kv, run(p, kv, exact=False), fast(kv))


@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("p", CASES, ids=[c.name for c in CASES])
def test_exact_prompt_attention_is_float32(p: Prompt, kv: str) -> None:
    """An exact step's (scoring's) products are float32 on every CPU."""
    torch.set_num_threads(2)
    _check(p, kv, run(p, kv, exact=True), "f32")


@pytest.mark.parametrize(
    ("flag", "route"),
    [("-DGL_NO_BF16_ATTN", "f32"), ("-DGL_NO_I8_ATTN", "bf16")],
    ids=["no-bf16", "no-vnni"],
)
def test_fast_steps_where_the_cpu_lacks_a_feature(
    monkeypatch: pytest.MonkeyPatch, flag: str, route: str
) -> None:
    """A fast step on an AVX-512 CPU without BF16 (built here with -DGL_NO_BF16_ATTN: float32,
    every case against the unrounded twin) or without VNNI (-DGL_NO_I8_ATTN: the scores in
    bfloat16 pairs even with int8 scores asked for, against the bfloat16 twin)."""
    if not (BF16_ATTN if route == "f32" else I8_ATTN):
        pytest.skip("this CPU's kernel is that one: the tests above")
    variant_library(monkeypatch, flag)
    monkeypatch.setattr(ops, "I8_ATTN_SCORES", True)  # (what the variant must refuse)
    torch.set_num_threads(2)
    for p in CASES:
        for kv in ("f16", "q8_0"):
            _check(p, kv, run(p, kv, exact=False), route)


@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("p", CASES, ids=[c.name for c in CASES])
def test_i8_scores_switched_on(monkeypatch: pytest.MonkeyPatch, p: Prompt, kv: str) -> None:
    """GRAFTLM_I8_ATTN=1 (ops.I8_ATTN_SCORES): fast steps' scores from int8 codes, as the twin
    makes them (off by default: about 3x the bfloat16 scores' error)."""
    if not I8_ATTN:
        pytest.skip("no int8 scores on this CPU (AVX-512 VNNI and BF16)")
    monkeypatch.setattr(ops, "I8_ATTN_SCORES", True)
    torch.set_num_threads(2)
    _check(p, kv, run(p, kv, exact=False), fast(kv, "i8"))
    if p in CASES[:4]:  # bf16_scores: bfloat16 pairs where int8 codes would serve
        _check(p, kv, run(p, kv, exact=False, bf16_scores=True), "bf16")


@pytest.mark.parametrize("p", CASES, ids=[c.name for c in CASES])
def test_q8_0_cache_bfloat16_scores(monkeypatch: pytest.MonkeyPatch, p: Prompt) -> None:
    """Through a q8_0 cache, bf16_scores (and GRAFTLM_Q8_ATTN=0: ops.Q8_ATTN_SCORES) take
    bfloat16 pairs, not the cache's codes."""
    if not BF16_ATTN:
        pytest.skip("no bfloat16 pairs on this CPU (AVX-512 BF16)")
    torch.set_num_threads(2)
    _check(p, "q8_0", run(p, "q8_0", exact=False, bf16_scores=True), "bf16")
    monkeypatch.setattr(ops, "Q8_ATTN_SCORES", False)
    monkeypatch.setattr(ops, "I8_ATTN_SCORES", False)  # (which asks for int8 scores everywhere)
    _check(p, "q8_0", run(p, "q8_0", exact=False), "bf16")
