"""gpt-oss's attention sinks in the native attention (gl_attn.sinks: one more logit a head in each
softmax's denominator, with no value) against primitives.attention's written-out twin, in float64
over the cache's own values: decode steps (a row's positions split over tasks and merged) and
prompt chunks, rows of 1, 15, 16, 17 and 4,095 positions, with and without windows, every cache
type; and the same cases through the other ISA variants of this CPU (the 256-bit kernels where
512-bit ones exist, and the AVX2 build). Sinks of -inf leave the attention bit for bit as it is
without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention_twins import (
    BF16_ATTN,
    PREFILL_ATOL,
    PREFILL_RTOL,
    paged_cache,
    q8_scores,
    rounded,
    row_index,
)
from test_decode_attention import TYPES, Case, _check, run_case, variant_outputs

from graftlm.native import library, ops
from graftlm.step.kv_cache import KV_TYPES

pytestmark = pytest.mark.skipif(library() is None, reason="native kernels unavailable here")


def sinks_of(h: int) -> torch.Tensor:
    """gpt-oss's sinks for h heads (h >= 2): one far above every score (it takes most of the
    softmax), one far below (it takes nothing), the rest about the scores' size."""
    s = torch.randn(h, generator=torch.Generator().manual_seed(h)) * 2
    s[0], s[-1] = 8.0, -30.0
    return s


# decode: (name, row lengths before the new token, heads, kv heads, head dim, window, cap, neox)
DECODE: list[Case] = [
    ("one position", [0], 8, 1, 64, 0, 0.0, True),
    ("15", [14], 4, 2, 64, 0, 0.0, False),
    ("16 in a window of 5", [15], 4, 2, 64, 5, 0.0, False),
    ("17, and a row of 4", [16, 3], 4, 2, 64, 0, 0.0, True),
    ("4,095 split over tasks", [4094], 8, 1, 64, 0, 0.0, True),
    ("4,095 in a window of 128, and 17", [4094, 16], 8, 1, 64, 128, 0.0, True),
]
# prompts: (queries a row, heads, kv heads, head dim, the rows' starts, window)
Prompt = tuple[int, int, int, int, list[int], int]
PREFILL: list[Prompt] = [
    (1, 8, 1, 64, [0], 0),
    (15, 4, 2, 64, [0], 0),
    (16, 4, 2, 64, [0, 3], 5),
    (17, 8, 1, 64, [0], 16),  # gpt-oss's tiny window
    (17, 8, 1, 64, [4078], 0),  # the last query sees 4,095 positions
    (17, 8, 1, 64, [4078], 128),
]


@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("case", DECODE, ids=[c[0] for c in DECODE])
def test_decode_attention_with_sinks_equals_its_twin(case: Case, kv: str) -> None:
    torch.set_num_threads(2)  # (the long rows split into tasks merged at the end)
    _check(case, kv, run_case(case, kv, sinks=sinks_of(case[2])))


def run_prompt(p: Prompt, kv: str, exact: bool, sinks: torch.Tensor | None) -> torch.Tensor:
    """The native prompt attention of case p (made the same way in every process)."""
    t, h, hkv, d, starts, window = p
    g = torch.Generator().manual_seed(t + len(starts))
    dense = torch.randn(3, hkv, max(starts) + t + 3, d, generator=g)
    q = torch.randn(len(starts), t, h, d, generator=g) * 2
    cache = paged_cache(dense, KV_TYPES[kv][0], seed=t)
    slots = [2, 0][: len(starts)]
    out = ops.attn_prefill(
        q, cache, 0, row_index(slots, starts, t), d**-0.5, window, exact=exact, sinks=sinks
    )
    assert out is not None
    return out


def prompt_twin(p: Prompt, kv: str, bf16: bool, q8: bool = False) -> torch.Tensor:
    """The written-out softmax with sinks in float64 over the cache's values (and q, k, v as
    bfloat16 where the kernel's products take bfloat16 pairs; q8: the scores of q rounded to
    q8_0 against the keys as cached, a q8_0 cache's own codes' route, csrc/attn_prompt_q8.c)."""
    t, h, hkv, d, starts, window = p
    g = torch.Generator().manual_seed(t + len(starts))
    dense = torch.randn(3, hkv, max(starts) + t + 3, d, generator=g)
    q = torch.randn(len(starts), t, h, d, generator=g) * 2
    slots = [2, 0][: len(starts)]

    def seen(x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.bfloat16).float() if bf16 else x).double()

    cached = rounded(dense, KV_TYPES[kv][0]).double()
    keys = seen(rounded(dense, KV_TYPES[kv][0]))
    values = seen(rounded(dense.flip(-1), KV_TYPES[kv][0]))  # (paged_cache's V: K reversed)
    sink = sinks_of(h).double().view(h, 1, 1).expand(h, t, 1)
    outs = []
    for r, (s, p0) in enumerate(zip(slots, starts, strict=True)):
        pos = torch.arange(p0, p0 + t).view(t, 1)
        key = torch.arange(p0 + t).view(1, -1)
        mask = (key <= pos) & ((pos - key < window) if window else True)
        k = keys[s, :, : p0 + t].repeat_interleave(h // hkv, 0)  # (h, L, d)
        v = values[s, :, : p0 + t].repeat_interleave(h // hkv, 0)
        if q8:  # (h, t, d) against the keys as cached
            k8 = cached[s, :, : p0 + t].repeat_interleave(h // hkv, 0)
            q8r = rounded(q[r], torch.uint8).double().transpose(0, 1)
            scores = (q8r @ k8.transpose(1, 2)) * d**-0.5
        else:
            scores = (seen(q[r]).transpose(0, 1) @ k.transpose(1, 2)) * d**-0.5  # (h, t, L)
        scores = scores.masked_fill(~mask, float("-inf"))
        prob = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        outs.append((prob @ v).transpose(0, 1).flatten(1))  # (t, h * d)
    return torch.stack(outs)


@pytest.mark.parametrize("exact", [True, False], ids=["float32", "fast"])
@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("p", PREFILL, ids=[f"{c[0]}@{c[4]}w{c[5]}" for c in PREFILL])
def test_prefill_attention_with_sinks_equals_its_twin(p: Prompt, kv: str, exact: bool) -> None:
    out = run_prompt(p, kv, exact, sinks_of(p[1]))
    bf16 = BF16_ATTN and not exact
    rtol, atol = (PREFILL_RTOL, PREFILL_ATOL) if bf16 else (1e-5, 2e-5)
    ref = prompt_twin(p, kv, bf16, q8_scores(kv, exact))
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("kv", TYPES)
def test_sinks_of_minus_infinity_change_no_bit(kv: str) -> None:
    """A sink at -inf adds exp(-inf) = 0 to each sum: the attention without sinks, bit for bit
    (which the NULL pointer every other family passes computes)."""
    torch.set_num_threads(2)
    none = torch.full((8,), float("-inf"))
    for case in (DECODE[4], DECODE[5]):
        assert torch.equal(run_case(case, kv)["out"], run_case(case, kv, sinks=none)["out"])
    for p in (PREFILL[3], PREFILL[5]):
        assert torch.equal(run_prompt(p, kv, False, None), run_prompt(p, kv, False, none))


VARIANT = """
import sys, torch
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/.."]
from graftlm.native import isa
import test_sinks as t
torch.set_num_threads(2)
out = {"isa": isa()}
for kv in t.TYPES:
    for i, case in enumerate(t.DECODE):
        out[f"d{i}:{kv}"] = t.run_case(case, kv, sinks=t.sinks_of(case[2]))["out"]
    for i, p in enumerate(t.PREFILL):
        out[f"p{i}:{kv}"] = t.run_prompt(p, kv, False, t.sinks_of(p[1]))
torch.save(out, sys.argv[1])
"""


@pytest.mark.parametrize("other", ["avx2", "ymm"])
def test_other_variants_with_sinks_equal_the_twin(tmp_path: Path, other: str) -> None:
    """The other variants' kernels (built in a subprocess: float32 products, q8_0 keys in
    float32) against the twins, case by case."""
    theirs = variant_outputs(tmp_path, other, VARIANT)
    for kv in TYPES:
        for i, case in enumerate(DECODE):
            got = run_case(case, kv, sinks=sinks_of(case[2]))
            got["out"] = theirs[f"d{i}:{kv}"]
            _check(case, kv, got, q8_dots=False, bf16_pairs=False)
        for i, p in enumerate(PREFILL):
            want = prompt_twin(p, kv, bf16=False)
            torch.testing.assert_close(theirs[f"p{i}:{kv}"].double(), want, rtol=1e-5, atol=2e-5)
