"""Twins shared by the native attention tests (test_native_attention.py, test_sinks.py): masked
SDPA over paged caches, the rows of a batch, and the tolerances of the bfloat16 and int8 routes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graftlm.native import (
    features,
    ops,
)
from graftlm.step.batch import Batch, RowIndex
from graftlm.step.kv_cache import KVCache, q8_0_pack, q8_0_unpack

# Prompt attention in bfloat16 pairs (the library's "attn-bf16": AVX-512 BF16): q, k, the weights
# and v rounded to bfloat16, so its twin takes q, k, v rounded alike, and the weights' rounding
# (2^-9 of each) is what the tolerance leaves (at most 2^-9 of the largest |v|, about 0.008 here)
BF16_ATTN = "attn-bf16" in features()
PREFILL_RTOL, PREFILL_ATOL = (1e-2, 8e-3) if BF16_ATTN else (1e-5, 2e-5)


def q8_scores(kv: str, exact: bool) -> bool:
    """Whether a prompt step's scores through this cache come from a q8_0 cache's own codes
    against q8_0 queries (csrc/attn_prompt_q8.c): fast steps where the CPU has AVX-512 VNNI and
    BF16 and ops.prompt_route asks for them."""
    route = ops.prompt_route(3, 64, exact)
    return "attn-i8" in features() and route == "q8" and kv == "q8_0"


def as_attn(x: torch.Tensor) -> torch.Tensor:
    """x as the prompt attention's products see it."""
    return x.to(torch.bfloat16).float() if BF16_ATTN else x


def row_index(slots: list[int], starts: list[int], t: int) -> RowIndex | None:
    """The index a batch of t-token rows at these slots and starts hands the kernels."""
    tokens = torch.zeros(len(slots), t, dtype=torch.long)
    return Batch(tokens, slots, starts, [t] * len(slots)).index()


def masked_sdpa(q, kc, vc, slots, starts, scale, window):  # type: ignore[no-untyped-def]
    """The twin of attn_prefill: SDPA with an explicit mask, row by row."""
    b, t, h, d = q.shape
    outs = []
    for r in range(b):
        length = starts[r] + t
        pos = torch.arange(starts[r], length).view(t, 1)
        key = torch.arange(length).view(1, length)
        mask = key <= pos
        if window:
            mask &= pos - key < window
        o = F.scaled_dot_product_attention(
            q[r : r + 1].transpose(1, 2), kc[slots[r] : slots[r] + 1, :, :length],
            vc[slots[r] : slots[r] + 1, :, :length], attn_mask=mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        outs.append(o.transpose(1, 2).flatten(2))
    return torch.cat(outs)


def paged_cache(dense: torch.Tensor, dtype: torch.dtype, seed: int = 0) -> KVCache:
    """A paged cache holding dense (slots, Hkv, n_ctx, D) as both K and V... of layer 0, its
    blocks scattered over the pool in a random order (and a spare block between them), so that
    every kernel must follow the block table."""
    n_slots, hkv, n_ctx, d = dense.shape
    cache = KVCache(1, n_slots, hkv, n_ctx, d, d, dtype, n_blocks=2 * n_slots * -(-n_ctx // 16) + 1)
    g = torch.Generator().manual_seed(seed)
    order = (torch.randperm(cache.n_blocks - 1, generator=g) + 1).tolist()
    for s in range(n_slots):
        blocks = order[s * cache.max_blocks : (s + 1) * cache.max_blocks]
        cache.set_table(s, blocks)
        for i, b in enumerate(blocks):
            piece = dense[s, :, i * 16 : (i + 1) * 16]
            cache.key_rows(0)[b, :, : piece.shape[1]] = cache._pack(piece)
            cache.v[0][b, :, : piece.shape[1]] = cache._pack(piece.flip(-1))  # V: K reversed
    return cache


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of this type holds it, as float32."""
    return q8_0_unpack(q8_0_pack(x)) if dtype is torch.uint8 else x.to(dtype).float()
