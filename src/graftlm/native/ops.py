"""Thin wrappers over the attention, norm, gate and LoRA helpers of ``csrc/``: each returns
None (lora_delta: False) when it cannot serve the call (no library, not CPU float32, unsupported
shape, an index out of range), and the caller then runs its PyTorch twin."""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch

from graftlm.native.abi import GlAttn, GlKv, GlLoraSite
from graftlm.native.build import library, threads

if TYPE_CHECKING:
    from graftlm.step.batch import RowIndex
    from graftlm.step.kv_cache import KVCache

__all__ = [
    "attn_decode",
    "attn_prefill",
    "gated",
    "library",
    "lora_delta",
    "rms_norm",
]

MAX_HEAD_DIM = 1024  # the C attention keeps a rotated query of this size on its stack
# The fewest positions a prompt chunk's last query sees for its attention to take bfloat16 pairs
# (where the CPU has them, features() "attn-bf16"): below it attention is a small share of the
# prompt's time (about 3% of Llama-1B's pp512 at depth 0) and float32 costs nothing worth
# saving; at depth 4,096 it is 40% of the time, and bfloat16 pairs cut that by a third.
BF16_ATTN_MIN_KEYS = 2048
# Past it, where the CPU has AVX-512 VNNI too (features() "attn-i8"), the scores may come from
# int8 codes (GRAFTLM_I8_ATTN=1, read once; off by default): 0.87x the attention time at depth
# 4,096 and 16,384 (Llama-1B, 1 thread), but about 3x the bfloat16 scores' error of the output
# (bench/prompt_attention_error.py: 1.6e-2 against 5.9e-3 on SmolLM2's real heads), and forced on
# at every length it moved SmolLM2's golden mean |d log-prob| from 0.0243 to 0.0269.
I8_ATTN_SCORES = os.environ.get("GRAFTLM_I8_ATTN", "").startswith("1")
# Through a q8_0 cache the scores come from the cache's own codes against q8_0 queries (as
# llama.cpp's with a q8_0 K cache; csrc/attn_prompt_q8.c) unless GRAFTLM_Q8_ATTN=0 (read once):
# 0.88-0.89x the kernel time (Llama-1B at depth 4,096 and 16,384, 1 thread). On the real models
# (bench/prompt_attention_error.py --logprobs --tokens 3584: README and docs, scoring exact but for
# the prompt attention of chunks past 2,048 keys; mean |d log-prob| over float32's top-20 at the
# 1,536 positions past 2,048, top-1 agreement) the q8 route's error against the q8_0 cache's float32
# attention is 1.13x the bfloat16 route's on SmolLM2 (3.71e-2 against 3.28e-2; top-1 0.984/0.991)
# and 1.39x on gemma-3-270m (4.42e-2 against 3.17e-2; 0.982/0.986), of the order of the q8_0
# cache's own effect (exact, against an f16 cache: 2.98e-2, 3.94e-2), not far under it; against
# the f16 cache's float32 attention 3.61e-2 against 3.40e-2 (SmolLM2) and 4.94e-2 against 4.05e-2
# (gemma-3), top-1 0.988/0.989 and 0.983/0.980 (an f16 cache's bfloat16 route: 1.55e-2, 1.02e-2).
# Kept on for llama.cpp's parity (its q8_0 K cache rounds the queries to q8_0 alike).
Q8_ATTN_SCORES = not os.environ.get("GRAFTLM_Q8_ATTN", "").startswith("0")


def prompt_route(type_code: int, d: int, exact: bool, bf16_scores: bool = False) -> str:
    """Which scores a prompt step asks gl_attn_prefill for (PROMPT_MODES), through a cache of
    this type (3: q8_0) and head dim: "f32" (exact), "bf16", or int8 scores: a q8_0 cache's own
    codes ("q8": whole 32-value blocks) or the keys' codes less their mean ("i8",
    GRAFTLM_I8_ATTN=1). GRAFTLM_I8_ATTN=1 asks for int8 scores through every cache, a q8_0 cache's
    own codes there even with GRAFTLM_Q8_ATTN=0. Where the CPU lacks AVX-512 VNNI and BF16
    (features() "attn-i8") the kernel answers "bf16" or float32 for all but "f32"; the callers'
    twins check features() for that."""
    q8 = type_code == 3 and d % 32 == 0
    if exact:
        return "f32"
    if bf16_scores or not (I8_ATTN_SCORES or (Q8_ATTN_SCORES and q8)):
        return "bf16"
    return "q8" if q8 else "i8"


PROMPT_MODES = {"i8": 0, "f32": 1, "bf16": 2, "q8": 3}  # gl_attn_prefill's `exact`, route by route


def decode_head_dims(d: int, dv: int) -> bool:
    """Whether gl_attn_decode takes heads of d (keys) and dv (values) dims: whole 8-float
    vectors, a rotated key on the stack."""
    return 0 < d <= MAX_HEAD_DIM and 0 < dv <= MAX_HEAD_DIM and d % 8 == 0 and dv % 8 == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Semantics: x * rsqrt(mean(x^2, -1) + eps) * weight (sum of squares in double), or None."""
    lib = library()
    if (
        lib is None
        or x.dtype is not torch.float32
        or weight.dtype is not torch.float32
        or x.device.type != "cpu"
        or not x.is_contiguous()
        or not weight.is_contiguous()
        or weight.numel() != x.shape[-1]
    ):
        return None
    y = torch.empty_like(x)
    n = x.shape[-1]
    lib.gl_rms_norm(
        x.data_ptr(), x.numel() // max(n, 1), n, weight.data_ptr(), eps, y.data_ptr(), threads()
    )
    return y


def lora_delta(y: torch.Tensor, x: torch.Tensor, site: GlLoraSite, nth: int | None = None) -> bool:
    """y (B, T, n_out) += per row b: sum_j scale[b, j] * B_j (A_j x[b, t]), in place, over the
    adapters of `site` (a gl_lora_site: graftlm.lora.packed's table of packed adapters and the
    batch's scale table, a row of it per row of x); x (M, n_in) and y (M, n_out): each row its
    own scale row (a routed expert's tokens, models.moe). On nth threads (default: all). False
    (nothing done) when it cannot serve the call."""
    lib = library()
    if (
        lib is None
        or x.dtype is not torch.float32
        or y.dtype is not torch.float32
        or x.dim() not in (2, 3)
        or x.device.type != "cpu"
        or not (x.is_contiguous() and y.is_contiguous())
    ):
        return False
    n_in, m = x.shape[-1], x.numel() // x.shape[-1]
    t = x.shape[1] if x.dim() == 3 else 1
    lib.gl_lora(
        ctypes.byref(site), n_in, y.shape[-1], x.data_ptr(), m, t, y.data_ptr(), nth or threads()
    )
    return True


GATES = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


def gated(gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
    """(..., 2 ff) = [gate | up] -> act(gate) * up (..., ff), or None.

    Semantics: silu(g) = g / (1 + e^-g); gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
    as PyTorch's F.gelu(approximate="tanh"), with a vectorized exp (~2 ulp). "swiglu_oai" is
    gpt-oss's clamped gate, the whole product: c = min(g, 7); c sigmoid(1.702 c) (clamp(up, -7, 7)
    + 1) (models.gpt_oss.swiglu_oai)."""
    lib = library()
    if (
        lib is None
        or gate_up.dtype is not torch.float32
        or gate_up.device.type != "cpu"
        or not gate_up.is_contiguous()
        or gate_up.shape[-1] % 2
    ):
        return None
    ff = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], ff)
    rows = gate_up.numel() // (2 * ff)
    lib.gl_gated(gate_up.data_ptr(), rows, ff, GATES[act], out.data_ptr(), threads())
    return out


def _sinks_ok(sinks: torch.Tensor, n_head: int) -> bool:
    """Whether the C attention reads these sinks as they are: (n_head,) float32, contiguous, CPU."""
    return (
        sinks.dtype is torch.float32
        and sinks.device.type == "cpu"
        and sinks.is_contiguous()
        and tuple(sinks.shape) == (n_head,)
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _row_stride(t: torch.Tensor) -> int | None:
    """Row stride of a CPU float32 (B, 1, heads * dim) whose last dimension is contiguous."""
    if t.dtype is not torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
        return None
    return int(t.stride(0))


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool
) -> torch.Tensor | None:
    """x (B, T, H, D) rotated at positions (B, T) by the tables (n_ctx, rot / 2): a fresh
    contiguous (B, T, H, D), or None (also for a position outside the tables, which the C code
    checks before it reads them). Same arithmetic as the PyTorch twin: a * cos - b * sin,
    b * cos + a * sin."""
    lib = library()
    if lib is None or x.dim() != 4 or x.device.type != "cpu" or x.dtype is not torch.float32:
        return None
    b, t, h, d = x.shape
    rot = 2 * cos.shape[-1]
    rs = x.stride(1)
    if (
        x.stride(3) != 1
        or x.stride(2) != d
        or (b > 1 and x.stride(0) != t * rs)
        or rot > d
        or positions.shape != (b, t)
        or positions.dtype is not torch.long
        or not positions.is_contiguous()
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.dtype is not torch.float32
        or sin.dtype is not torch.float32
    ):
        return None
    out = torch.empty(b, t, h, d)
    done = lib.gl_rope(
        x.data_ptr(), b * t, rs, h, d, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        cos.shape[0], rot, int(neox), out.data_ptr(), threads(),
    )  # fmt: skip
    return out if done == 0 else None


def gl_kv(cache: KVCache, layer: int) -> GlKv | None:
    """The C view of one layer's paged cache (gl_kv), or None when it cannot be one (not on the
    CPU, not contiguous). Points into the cache's tensors: the caller keeps the cache alive."""
    kc, vc, tables = cache.k[layer], cache.v[layer], cache.tables
    if not (
        kc.device.type == "cpu"
        and kc.is_contiguous()
        and vc.is_contiguous()
        and tables.is_contiguous()
        and tables.dtype is torch.int32
    ):
        return None
    return GlKv(kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), cache.n_blocks, cache.n_slots,
                cache.max_blocks, cache.block, cache.n_head_kv, cache.type_code)  # fmt: skip


def kv_write(cache: KVCache, layer: int, rows: RowIndex, k: torch.Tensor, v: torch.Tensor) -> bool:
    """KVCache.write natively (gl_kv_write): a step's k, v (B, T, Hkv, D) at each row's slot and
    positions from its start, with the same bits. False, having written nothing, where it cannot
    (then KVCache.write runs)."""
    lib = library()
    kv = gl_kv(cache, layer)
    if lib is None or kv is None or rows.max_slot >= cache.n_slots or k.dim() != 4:
        return False
    b, t = k.shape[:2]
    for x, d in ((k, cache.head_dim), (v, cache.v_head_dim)):
        if (
            x.dtype is not torch.float32
            or x.device.type != "cpu"
            or tuple(x.shape) != (rows.slots.numel(), t, cache.n_head_kv, d)
            or x.stride(3) != 1
            or x.stride(2) != d
            or x.stride(0) != t * x.stride(1)
        ):
            return False
    for which, x in enumerate((k, v)):
        lib.gl_kv_write(
            ctypes.byref(kv), which, x.data_ptr(), x.stride(1), rows.slots.data_ptr(),
            rows.starts.data_ptr(), b, t, x.shape[3], threads(),
        )  # fmt: skip
    return True


def attn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    layer: int,
    slots: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    neox: bool,
    scale: float,
    window: int,
    softcap: float = 0.0,
    bounds: tuple[int, int] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Attention for B rows of one new token each (see gl_attn_decode), or None.

    q (B, 1, H*D), k (B, 1, Hkv*D), v (B, 1, Hkv*Dv), unrotated; cache: the paged cache, of which
    layer's blocks are read and written; slots/positions (B,) int64; cos/sin (n_ctx, rot/2)
    float32. Writes the rotated k and v into the cache; returns (B, 1, H*Dv). bounds: (max slot,
    max position) when the caller knows them to be non-negative (Batch.index), else they are
    read from the tensors. sinks (H,) float32: one more logit a head in each softmax's
    denominator, with no value (gpt-oss; primitives.attention's written-out twin).
    """
    lib = library()
    kv = gl_kv(cache, layer)
    if lib is None or kv is None or q.dtype is not torch.float32:
        return None
    if sinks is not None and not _sinks_ok(sinks, q.shape[-1] // cache.head_dim):
        return None
    d, dv = cache.head_dim, cache.v_head_dim
    hkv = int(kv.n_head_kv)
    b = q.shape[0]
    h = q.shape[-1] // d
    rot = cos.shape[-1] * 2
    if not decode_head_dims(d, dv) or q.shape[1] != 1 or h % hkv or rot > d:
        return None
    qs, ks, vs = _row_stride(q), _row_stride(k), _row_stride(v)
    if qs is None or ks is None or vs is None or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    if bounds is None:
        if positions.numel() and min(int(positions.min()), int(slots.min())) < 0:
            return None
        bounds = (int(slots.max()), int(positions.max())) if positions.numel() else (0, 0)
    if bounds[0] >= cache.n_slots or bounds[1] >= min(cache.n_ctx, cos.shape[0]):
        return (
            None  # the C code writes the cache at (slot, position): out of range stays in PyTorch
        )
    out = q.new_empty(b, 1, h * dv)
    n_pos = cache.max_blocks * cache.block
    attn = GlAttn(kv, cos.data_ptr(), sin.data_ptr(), h, hkv, d, dv, n_pos, rot, int(neox), window,
                  scale, softcap, _ptr(sinks))  # fmt: skip
    lib.gl_attn_decode(
        ctypes.byref(attn), q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs,
        slots.data_ptr(), positions.data_ptr(), b, out.data_ptr(), threads(),
    )  # fmt: skip
    return out


def attn_prefill(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    rows: RowIndex,
    scale: float,
    window: int,
    softcap: float = 0.0,
    exact: bool = False,
    sinks: torch.Tensor | None = None,
    bf16_scores: bool = False,
) -> torch.Tensor | None:
    """Causal attention of B rows of T new tokens through the cache (see gl_attn_prefill), or None.

    q (B, T, H, D) rotated; cache: the paged cache, whose layer holds every row's keys and values
    up to start + T - 1 (this chunk's included); rows: the batch's slots and starts
    (Batch.index). Returns (B, T, H * D): query t of row b at position starts[b] + t sees the keys
    at positions <= its own, within `window` when > 0; softcap > 0: the scores (scale q.k) are
    softcap * tanh(score / softcap) before the softmax (gemma-2). Padding queries past a row's
    real tokens get values that nothing reads. exact: float32 products even where the CPU's
    prompt attention takes bfloat16 pairs (features() "attn-bf16"), for Batch.exact steps.
    sinks (H,) float32: one more logit a head in each softmax's denominator, with no value
    (gpt-oss). Where the CPU has AVX-512 VNNI too (features() "attn-i8") a fast step's scores
    through a q8_0 cache come from the cache's own codes against q8_0 queries, as llama.cpp's
    (csrc/attn_prompt_q8.c; Q8_ATTN_SCORES), through other caches from int8 codes where
    GRAFTLM_I8_ATTN=1 (csrc/attn_prompt_i8.c); bf16_scores: bfloat16 pairs instead, either way.
    """
    lib = library()
    kv = gl_kv(cache, layer)
    if lib is None or kv is None or q.dim() != 4:
        return None
    b, t, h, d = q.shape
    hkv, dk = cache.n_head_kv, cache.head_dim
    if (
        q.dtype is not torch.float32
        or q.device.type != "cpu"
        or not q.is_contiguous()
        or cache.v_head_dim != dk
        or dk != d
        or d % 16
        or h % hkv
        or rows.slots.numel() != b
        or rows.max_slot >= cache.n_slots
        or rows.max_start + t > cache.n_ctx
        or (sinks is not None and not _sinks_ok(sinks, h))
    ):
        return None
    mode = PROMPT_MODES[prompt_route(cache.type_code, d, exact, bf16_scores)]
    out = q.new_empty(b, t, h * d)
    n_pos = cache.max_blocks * cache.block
    attn = GlAttn(kv, None, None, h, hkv, d, d, n_pos, 0, 0, window, scale, softcap, _ptr(sinks))
    lib.gl_attn_prefill(
        ctypes.byref(attn), q.data_ptr(), rows.slots.data_ptr(), rows.starts.data_ptr(), b, t,
        out.data_ptr(), mode, threads(),
    )  # fmt: skip
    return out
