"""The decode attention kernel (gl_attn_decode) against its PyTorch twin, SDPA in float64 on the
cache's own values: every cache type, lengths around a block's edges and long ones (a row's
positions split over tasks and merged), scattered blocks, rows of different lengths in one call,
GQA groups of 1 to 8 heads, head sizes with a half-vector tail, sliding windows, soft-capping,
RoPE in both layouts; and the same cases through the other ISA variants of this CPU (the 256-bit
kernels where 512-bit ones exist, and the AVX2 build), each against the twin.

Where the CPU has AVX-512 BF16 a bfloat16 cache's 512-bit kernel takes bfloat16 pairs (VDPBF16PS):
the query rounded to bfloat16, and each softmax weight before it meets the values. Its twin rounds
the query alike and holds the output within the weights' rounding: an output value within 2^-8
times the weighted sum of the values' magnitudes (each weight's relative rounding is at most 2^-9,
and the output is the rounded weights' convex combination).

With AVX-512 VNNI a q8_0 cache's values meet their weights in 16-bit integers (VPDPWSSD): each
weight times its key's value scale, rounded to a fixed point of 2^-15 of the largest such product
of its head in a step of 32 positions (an error of at most 2^-16 of it, 32 of them a step), so an
output value is within 2^-11 of the head's largest value of the exact one: below the cache's own
rounding of each value (2^-8 of its block's largest); measured, within 2^-16 or a little more."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graftlm.native import features, library, ops
from graftlm.step import KVCache
from graftlm.step.kv_cache import KV_TYPES, q8_0_pack, q8_0_unpack

pytestmark = pytest.mark.skipif(library() is None, reason="native kernels unavailable here")

# (name, row lengths before the new token, heads, kv heads, head dim, window, soft-cap, neox)
Case = tuple[str, list[int], int, int, int, int, float, bool]
CASES: list[Case] = [
    ("one position", [0], 4, 2, 64, 0, 0.0, False),
    ("a block less one", [14], 4, 2, 64, 0, 0.0, False),
    ("a block", [15], 4, 2, 64, 0, 0.0, False),
    ("a block and one", [16], 4, 2, 64, 0, 0.0, False),
    ("rows of their own lengths", [16, 3, 40, 0], 8, 2, 64, 0, 0.0, True),
    ("4,095 split over tasks", [4094], 4, 1, 128, 0, 0.0, False),
    ("16,384, llama-1b's group", [16383], 32, 8, 64, 0, 0.0, False),
    ("qwen's group of 6", [700], 12, 2, 128, 0, 0.0, True),
    ("no group", [300, 33], 3, 3, 64, 0, 0.0, False),
    ("a group of 8 and a tail of 8 values", [99], 8, 1, 72, 0, 0.0, False),
    ("gemma-3's window", [600, 20], 4, 1, 256, 512, 0.0, True),
    ("gemma-2's soft-cap", [129], 8, 4, 256, 0, 50.0, True),
    ("a window inside a block", [40], 4, 2, 64, 5, 0.0, False),
]
TYPES = list(KV_TYPES)
# with AVX-512 VNNI the 512-bit kernel takes q8_0 keys through integer dots against the query
# quantized per 32 values (llama.cpp's q8_0 x q8_0); its twin quantizes the query alike
Q8_DOTS = "vnni" in features() and "avx512f" in features()
# with AVX-512 BF16 the 512-bit kernel takes a bfloat16 cache in bfloat16 pairs
BF16_PAIRS = "attn-bf16" in features()


def _rope(x: torch.Tensor, pos: int, base: float, neox: bool) -> torch.Tensor:
    """x (..., D) rotated at pos in float64, as rope_head does (pairs, or halves when neox)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos * inv
    cos, sin = ang.cos(), ang.sin()
    x = x.double()
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


def _tables(n_ctx: int, d: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n_ctx, dtype=torch.float64).view(-1, 1) * inv
    return ang.cos().float().contiguous(), ang.sin().float().contiguous()


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q8_0_unpack(q8_0_pack(x)) if dtype is torch.uint8 else x.to(dtype).float()


def run_case(
    case: Case, kv: str, seed: int = 0, sinks: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The kernel's output for one case, and what the twin needs: the cache's rounded values,
    the inputs. Made the same way in every process (seeded). sinks: gpt-oss's (heads,)."""
    _, lengths, h, hkv, d, window, cap, neox = case
    dtype = KV_TYPES[kv][0]
    if dtype is torch.uint8 and d % 32:
        d = 64  # q8_0 rows are whole 32-value blocks
    rows = len(lengths)
    n_ctx = max(lengths) + 1
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, rows, hkv, n_ctx, d, d, dtype, n_blocks=2 * rows * -(-n_ctx // 16) + 1)
    order = (torch.randperm(cache.n_blocks - 1, generator=g) + 1).tolist()
    keys = torch.randn(rows, hkv, n_ctx, d, generator=g)
    values = torch.randn(rows, hkv, n_ctx, d, generator=g)
    for s in range(rows):  # every row's blocks scattered over the pool, out of order
        blocks = order[s * cache.max_blocks : (s + 1) * cache.max_blocks]
        cache.set_table(s, blocks)
        for i, b in enumerate(blocks):
            n = min(16, n_ctx - i * 16)
            cache.key_rows(0)[b, :, :n] = cache._pack(keys[s, :, i * 16 : i * 16 + n])
            cache.v[0][b, :, :n] = cache._pack(values[s, :, i * 16 : i * 16 + n])
    q = torch.randn(rows, 1, h * d, generator=g)
    k = torch.randn(rows, 1, hkv * d, generator=g)
    v = torch.randn(rows, 1, hkv * d, generator=g)
    cos, sin = _tables(n_ctx, d, 10000.0)
    slots = torch.arange(rows - 1, -1, -1)  # slots out of the rows' order
    pos = torch.tensor([lengths[int(s)] for s in slots])
    out = ops.attn_decode(
        q, k, v, cache, 0, slots, pos, cos, sin, neox, d**-0.5, window, cap, sinks=sinks
    )
    assert out is not None
    got = {"out": out, "keys": _rounded(keys, dtype), "values": _rounded(values, dtype),
           "q": q, "k": k, "v": v, "slots": slots, "pos": pos, "d": torch.tensor(d)}  # fmt: skip
    if sinks is not None:
        got["sinks"] = sinks
    return got


def twin(
    case: Case, kv: str, got: dict[str, torch.Tensor], q8_dots: bool = Q8_DOTS,
    bf16_pairs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """SDPA in float64 over the cache's values and the new token's (rotated and rounded as the
    cache holds them); with got["sinks"], primitives.attention's written-out softmax with them.
    Also the weighted sum of the values' magnitudes (the scale of a weight's rounding), and each
    head's largest value (the scale of a fixed-point weight's).
    bf16_pairs: the query rounded to bfloat16 as the kernel rounds its rotated one."""
    _, _, h, hkv, _, window, cap, neox = case
    dtype = KV_TYPES[kv][0]
    d = int(got["d"])
    outs, spreads, flats = [], [], []
    for r in range(len(got["slots"])):
        s, p = int(got["slots"][r]), int(got["pos"][r])
        kn = _rounded(_rope(got["k"][r, 0].view(hkv, d), p, 10000.0, neox).float(), dtype)
        vn = _rounded(got["v"][r, 0].view(hkv, d), dtype)
        keys = torch.cat([got["keys"][s, :, :p], kn.view(hkv, 1, d)], 1).double()
        values = torch.cat([got["values"][s, :, :p], vn.view(hkv, 1, d)], 1).double()
        lo = max(0, p - window + 1) if window else 0
        keys, values = keys[:, lo:], values[:, lo:]
        q = _rope(got["q"][r, 0].view(h, d), p, 10000.0, neox)
        if kv == "q8_0" and q8_dots:  # q8_0 keys meet the query quantized as ggml's q8_0
            q = q8_0_unpack(q8_0_pack(q.float())).double()
        if kv == "bf16" and bf16_pairs:
            q = q.float().to(torch.bfloat16).double()
        keys = keys.repeat_interleave(h // hkv, 0)
        values = values.repeat_interleave(h // hkv, 0)
        scores = (q.unsqueeze(1) @ keys.transpose(1, 2)) * d**-0.5  # (h, 1, L)
        if cap:
            scores = torch.tanh(scores / cap) * cap
        if "sinks" in got:  # one more logit a head, its share dropped
            sink = got["sinks"].double().view(h, 1, 1)
            p = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            p = torch.softmax(scores, -1)
        outs.append((p @ values).flatten())
        spreads.append((p @ values.abs()).flatten())
        flat = values.abs().amax(-1).amax(-1, keepdim=True)  # (h, 1)
        flats.append(flat.expand(h, values.shape[-1]).flatten())
    shape = (len(outs), 1, -1)
    return tuple(torch.stack(x).view(shape) for x in (outs, spreads, flats))  # type: ignore[return-value]


def _check(
    case: Case, kv: str, got: dict[str, torch.Tensor], q8_dots: bool = Q8_DOTS,
    bf16_pairs: bool = BF16_PAIRS,
) -> None:  # fmt: skip
    """The kernel's output against the twin's. bf16_pairs: the kernel that took got takes a
    bfloat16 cache in bfloat16 pairs (this CPU's 512-bit one where BF16_PAIRS)."""
    pairs = bf16_pairs and kv == "bf16"
    want, spread, flat = twin(case, kv, got, q8_dots, pairs)
    out = got["out"].double()
    if pairs:  # within the weights' rounding
        err = (out - want).abs() - (2.0**-8 * spread + 3e-5)
        assert float(err.max()) <= 0, f"{case[0]}: {float(err.max())} past the bound"
    elif kv == "q8_0" and q8_dots:  # within the fixed-point weights' rounding
        err = (out - want).abs() - (1.01 * 2.0**-11 * flat + 1e-5 * want.abs() + 3e-5)
        assert float(err.max()) <= 0, f"{case[0]}: {float(err.max())} past the bound"
    else:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decode_attention_equals_its_twin(case: Case, kv: str) -> None:
    torch.set_num_threads(2)  # (the long rows split into tasks merged at the end)
    _check(case, kv, run_case(case, kv))


def test_q8_0_keys_in_float32_where_the_cpu_has_no_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 512-bit kernel's q8_0 keys without integer dots (an AVX-512 CPU without VNNI): built
    here with -DGL_NO_Q8_DOTS, every case against the twin with the query unquantized."""
    if not Q8_DOTS:
        pytest.skip("this CPU's kernel is that one: the tests above")
    from variants import variant_library  # (tests/: not on a subprocess's path)

    variant_library(monkeypatch, "-DGL_NO_Q8_DOTS")
    torch.set_num_threads(2)
    for case in CASES:
        _check(case, "q8_0", run_case(case, "q8_0"), q8_dots=False)


def test_bfloat16_cache_in_float32_where_the_cpu_has_no_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 512-bit kernel's bfloat16 cache in float32 arithmetic (an AVX-512 CPU without BF16):
    built here with -DGL_NO_BF16_ATTN, every case against the twin with the query unrounded."""
    if not BF16_PAIRS:
        pytest.skip("this CPU's kernel is that one: the tests above")
    from variants import variant_library  # (tests/: not on a subprocess's path)

    variant_library(monkeypatch, "-DGL_NO_BF16_ATTN")
    torch.set_num_threads(2)
    for case in CASES:
        _check(case, "bf16", run_case(case, "bf16"), bf16_pairs=False)


VARIANT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from graftlm.native import isa
import test_decode_attention as t
torch.set_num_threads(2)
out = {"isa": isa()}
for i, case in enumerate(t.CASES):
    for kv in t.TYPES:
        out[f"{i}:{kv}"] = t.run_case(case, kv)["out"]
torch.save(out, sys.argv[1])
"""


def variant_outputs(tmp_path: Path, other: str, script: str) -> dict:
    """What script (run with the output's path and this folder) saved, run in a subprocess whose
    kernels are the variant other (skipped where this CPU's own variant is that one)."""
    if not features():
        pytest.skip("this CPU's variant is the AVX2 one: the tests above are its tests")
    if other == "ymm" and "avx512f" not in features():
        pytest.skip("no 512-bit kernels on this CPU: the ymm variant is this one")
    env = {**os.environ, "GRAFTLM_NATIVE_ISA": other, "GRAFTLM_AMX_ROWS": "0"}
    path = tmp_path / "out.pt"
    done = subprocess.run(
        [sys.executable, "-c", script, str(path), str(Path(__file__).parent)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(path)
    assert theirs["isa"] == other
    return theirs


@pytest.mark.parametrize("other", ["avx2", "ymm"])
def test_other_variants_equal_the_twin(tmp_path: Path, other: str) -> None:
    """The other variants' kernels (built in a subprocess) against the twin, case by case."""
    theirs = variant_outputs(tmp_path, other, VARIANT)
    for i, case in enumerate(CASES):
        for kv in TYPES:
            got = run_case(case, kv)
            got["out"] = theirs[f"{i}:{kv}"]
            # the 256-bit kernel: q8_0 keys and bfloat16 caches in float32
            _check(case, kv, got, q8_dots=False, bf16_pairs=False)


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_a_row_is_the_same_bits_whatever_else_the_step_holds(kv: str) -> None:
    """How a row's positions are split over tasks depends on its own length alone: the same row
    alone, beside a longer sequence, and followed by more rows of its own slot (a speculative
    draft's) gives the same bits, so greedy output never depends on the batch."""
    h, hkv, d, n = 8, 2, 64, 5000
    g = torch.Generator().manual_seed(3)
    cache = KVCache(1, 2, hkv, n + 8, d, d, KV_TYPES[kv][0], n_blocks=2 * (-(-(n + 8) // 16)) + 1)
    for s in range(2):
        blocks = list(range(1 + s * cache.max_blocks, 1 + (s + 1) * cache.max_blocks))
        cache.set_table(s, blocks)
        for b in blocks:
            cache.key_rows(0)[b] = cache._pack(torch.randn(hkv, 16, d, generator=g))
            cache.v[0][b] = cache._pack(torch.randn(hkv, 16, d, generator=g))
    cos, sin = _tables(n + 8, d, 10000.0)
    q, k, v = (torch.randn(4, 1, m * d, generator=g) for m in (h, hkv, hkv))

    def run(slots: list[int], pos: list[int]) -> torch.Tensor:
        b = len(slots)
        out = ops.attn_decode(q[:b], k[:b], v[:b], cache, 0, torch.tensor(slots),
                              torch.tensor(pos), cos, sin, False, d**-0.5, 0, 0.0)  # fmt: skip
        assert out is not None
        return out

    alone = run([0], [3000])[0]
    assert torch.equal(run([0, 1], [3000, n])[0], alone)
    assert torch.equal(run([0, 0, 0, 1], [3000, 3001, 3002, 4000])[0], alone)
