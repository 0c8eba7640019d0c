"""Pieces every architecture shares besides the projection seam (seam.py): norms, RoPE, attention
over the cache."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from graftlm.native import ops as native_ops
from graftlm.step.batch import Batch, Packing
from graftlm.step.kv_cache import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: x * rsqrt(mean(x^2, -1) + eps) * weight."""
    y = native_ops.rms_norm(x, weight, eps)
    if y is None and not x.is_contiguous() and x.device.type == "cpu":
        y = native_ops.rms_norm(x.contiguous(), weight, eps)  # QK-norm of a stacked q, k
    return y if y is not None else F.rms_norm(x, (x.shape[-1],), weight, eps)


class Rope:
    """Rotary embedding tables for one base; applied to (B, T, H, D) by position (B, T).

    factors (dim/2,): per-frequency divisors, as ggml's `freq_factors` (llama3's `rope_freqs`,
    LongRoPE's `rope_factors_long/short`); mscale multiplies cos and sin (LongRoPE's
    attn_factor)."""

    def __init__(
        self,
        dim: int,
        base: float,
        n_ctx: int,
        neox: bool,
        factors: torch.Tensor | None = None,
        mscale: float = 1.0,
    ) -> None:
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if factors is not None:
            inv = inv / factors.to(torch.float64).reshape(-1)
        ang = torch.arange(n_ctx, dtype=torch.float64).unsqueeze(1) * inv  # (n_ctx, dim/2)
        self.cos = (ang.cos() * mscale).float()
        self.sin = (ang.sin() * mscale).float()
        self.dim = dim
        self.neox = neox
        # every layer of a step rotates q and k at the same positions: gather the rows once
        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def to(self, device: torch.device) -> Rope:
        """The tables moved to `device` (in place; returns self)."""
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        self._memo = None
        return self

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memo = self._memo
        if memo is not None and memo[0] is positions:
            return memo[1], memo[2]
        if self.neox:
            cos = self.cos[positions].unsqueeze(2)  # (B, T, 1, dim/2)
            sin = self.sin[positions].unsqueeze(2)
        else:  # adjacent pairs rotate as complex numbers: one multiply by e^(i angle)
            cos = torch.complex(self.cos[positions], self.sin[positions]).unsqueeze(2)
            sin = cos
        self._memo = (positions, cos, sin)
        return cos, sin

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, H, D) rotated at positions (B, T): natively where it can, else in PyTorch."""
        out = native_ops.rope(x, positions, self.cos, self.sin, self.neox)
        return out if out is not None else self.rotate(x, positions)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The PyTorch twin of the native rotation."""
        cos, sin = self.tables(positions)
        d = self.dim
        rot, rest = x[..., :d], x[..., d:]
        if self.neox:
            x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:  # adjacent pairs, the order llama GGUF files permute Q/K into
            pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], d // 2, 2).contiguous())
            out = torch.view_as_real(pairs * cos).flatten(-2)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def yarn(
    dim: int,
    base: float,
    factor: float,
    n_ctx_orig: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    ext_factor: float = 1.0,
    attn_factor: float = 0.0,
) -> tuple[torch.Tensor, float]:
    """YaRN as ggml's rope computes it, as Rope's (factors (dim/2,), mscale).

    Semantics (ggml_rope_yarn_corr_dims, rope_yarn): with corr(n) = dim ln(n_ctx_orig / (2 pi n))
    / (2 ln base), the ramp runs from lo = max(0, floor(corr(beta_fast))) to hi = min(dim - 1,
    ceil(corr(beta_slow))); pair j keeps mix_j = (1 - clamp((j - lo) / max(0.001, hi - lo), 0, 1))
    * ext_factor of its own frequency and 1 - mix_j of it divided by `factor`; cos and sin are
    multiplied by attn_factor, by default 1 + 0.1 ln(factor). (transformers' `truncate: false`,
    gpt-oss's own config, skips the floor and ceil; llama.cpp has no such switch.)"""

    def corr(n_rot: float) -> float:
        return dim * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(0.0, math.floor(corr(beta_fast)))
    hi = min(dim - 1.0, math.ceil(corr(beta_slow)))
    j = torch.arange(dim // 2, dtype=torch.float64)
    mix = (1 - ((j - lo) / max(0.001, hi - lo)).clamp(0, 1)) * ext_factor
    kept = (1 - mix) / factor + mix  # the share of each pair's frequency kept
    mscale = attn_factor or 1.0 + 0.1 * math.log(factor)
    return 1 / kept, mscale


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    batch: Batch,
    cache: KVCache,
    scale: float,
    window: int = 0,
    cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk: bool = False,
) -> torch.Tensor:
    """q (B, T, H, D), k/v (B, T, Hkv, D) -> (B, T, H * Dv), through the cache; cap > 0: the
    scores soft-capped (softcap) before the mask and the softmax (gemma-2); sinks (H,): one more
    logit a head in the softmax's denominator, with no value (gpt-oss's attention sinks). A
    packed batch (Batch.packed: q (N, 1, H, D)) attends sequence by sequence, each as it would
    alone: its keys and values written, its queries against its own cache. chunk: a prompt
    chunk even where it is one token (a packed row): the native prompt kernel reads the cache in
    place, where a lone token would gather its whole context in float32."""
    if batch.packing is not None:
        return _by_sequence(
            q, k, v, batch.packing,
            lambda qr, kr, vr, row: attention(
                qr, kr, vr, layer, row, cache, scale, window, cap, sinks, chunk=True
            ),
        )  # fmt: skip
    rows = batch.index()
    if rows is None or not native_ops.kv_write(cache, layer, rows, k, v):
        cache.write(layer, batch, k, v)
    if (batch.n_tokens > 1 or chunk) and rows is not None:
        # prompt chunks: causal blocks, rows at own starts
        # float32 products for exact steps and short contexts, bfloat16 pairs past them
        exact = batch.exact or rows.max_start + q.shape[1] < native_ops.BF16_ATTN_MIN_KEYS
        out = native_ops.attn_prefill(
            q.contiguous(), cache, layer, rows, scale, window, cap, exact, sinks
        )
        if out is not None:  # read straight from the cache: no gathered copy of the rows
            return out.view(*q.shape[:2], -1)
    keys, values = cache.read(layer, batch)  # (B, Hkv, L, D)
    if cap > 0 or sinks is not None:
        return _scores_written_out(q, keys, values, batch, scale, cap, window, sinks)
    # one sequence's first chunk inside its window: plain causal attention, which SDPA computes
    # without the masked half (an explicit mask makes it compute every score)
    causal = batch.n_rows == 1 and batch.starts[0] == 0 and batch.n_tokens > 1
    causal = (
        causal and batch.lengths[0] == batch.n_tokens and (window == 0 or batch.n_tokens <= window)
    )
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys,
        values,
        attn_mask=None if causal else batch.mask(window),
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[2] != keys.shape[1],
    )  # (B, H, T, Dv)
    return out.transpose(1, 2).flatten(2)


def _by_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packing: Packing,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Batch], torch.Tensor],
) -> torch.Tensor:
    """attention of a packed batch: q (N, 1, H, D), k/v (N, 1, Hkv, D) -> (N, 1, H * Dv), each
    sequence's rows (one real token each, in order) attended as a (1, n) row of its own; no
    padding is computed or written to the cache."""
    outs, at = [], 0
    for row in packing.rows:
        n = row.n_tokens
        qr, kr, vr = (x[at : at + n].reshape(1, n, *x.shape[2:]) for x in (q, k, v))  # (1, n, h, d)
        outs.append(attend(qr, kr, vr, row))
        at += n
    assert at == q.shape[0], f"a packed batch of {q.shape[0]} rows holds {at} sequences' tokens"
    return torch.cat(outs, dim=1).view(at, 1, -1)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return x if cap <= 0 else torch.tanh(x / cap) * cap


def _scores_written_out(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    batch: Batch,
    scale: float,
    cap: float,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """attention's soft-capped scores or its sinks, written out: scaled_dot_product_attention has
    no hook between the scores and the mask, nor a logit without a value. q (B, T, H, D),
    keys/values (B, Hkv, L, D), sinks (H,)."""
    B, T, H, D = q.shape
    Hkv = keys.shape[1]
    q = q.transpose(1, 2).reshape(B, Hkv, H // Hkv * T, D)  # heads sharing a kv head, stacked
    scores = softcap((q @ keys.transpose(-1, -2)) * scale, cap)  # (B, Hkv, H/Hkv * T, L)
    scores = scores.view(B, H, T, -1)
    mask = batch.mask(window)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(scores, dim=-1).view(B, Hkv, H // Hkv * T, -1)
    else:  # Semantics: p = softmax([scores | sink_h])[..., :L], the sink's share dropped
        sink = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
        p = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        p = p.reshape(B, Hkv, H // Hkv * T, -1)
    out = (p @ values).view(B, H, T, -1)  # (B, H, T, Dv)
    return out.transpose(1, 2).flatten(2)


def gated(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of a stacked (..., 2 ff) = [gate | up] -> (..., ff), act "silu" or
    "gelu_tanh": natively where it can (native.ops.gated), else in PyTorch."""
    out = native_ops.gated(gate_up, act)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate, act) * up


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(x) if act == "silu" else F.gelu(x, approximate="tanh")
