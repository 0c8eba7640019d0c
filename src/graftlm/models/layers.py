"""Pieces every architecture shares: the projection seam, norms, RoPE, attention over the cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from graftlm.lora.targets import Target
from graftlm.native import layer as native_layer
from graftlm.native import ops as native_ops
from graftlm.quant import QWeight, linear
from graftlm.step.batch import Batch
from graftlm.step.kv_cache import KVCache

if TYPE_CHECKING:
    from graftlm.lora.site import LoraSite


class Projection:
    """One matrix product of the model: y = W x + sum_s scale[row, s] * B_s (A_s x).

    The single place where a base weight meets the adapters attached to it. The base weight knows
    its own quantization; `lora` (set by the adapter machinery, None while no adapter touches this
    projection) knows its stacked slots; the batch knows each row's scales.
    """

    __slots__ = ("name", "weight", "lora")

    def __init__(self, name: str, weight: QWeight) -> None:
        self.name = name  # GGUF base name, e.g. "blk.3.attn_q"
        self.weight = weight
        self.lora: LoraSite | None = None

    @property
    def n_in(self) -> int:
        return self.weight.shape[1]

    @property
    def n_out(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.lora is not None and batch.lora is not None:
            y = native_layer.project(self.weight, x, self.lora, batch.lora)  # one native pass
            if y is not None:
                return y
        y = linear(x, self.weight)
        if self.lora is not None and batch.lora is not None:
            y = self.lora.add_delta(y, x, batch.lora)
        return y


class ProjectionGroup:
    """Projections that read the same input (Q/K/V; gate/up), returned as one output each.

    When their weights share a quantization type the loader stacks their rows into one weight and
    the group runs one matmul (one kernel call, one activation cast, one LoRA product for all of
    them); the parts' adapters then sit on the stacked projection at their row offsets (see
    `targets`). Otherwise the parts run one after another. Either way the model sees the same
    outputs.
    """

    __slots__ = ("names", "sizes", "parts", "fused")

    def __init__(
        self,
        names: list[str],
        sizes: list[int],
        parts: list[Projection] | None = None,
        fused: Projection | None = None,
    ) -> None:
        assert (parts is None) != (fused is None)
        self.names = names  # GGUF base names of the parts, e.g. ["blk.0.attn_q", ...]
        self.sizes = sizes  # their output rows
        self.parts = parts
        self.fused = fused

    def __call__(self, x: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
        if self.fused is not None:
            return list(self.fused(x, batch).split(self.sizes, dim=-1))
        assert self.parts is not None
        return [p(x, batch) for p in self.parts]

    def gated(self, x: torch.Tensor, batch: Batch, act: str) -> torch.Tensor:
        """act(gate) * up for a [gate, up] group: one native pass over the stacked output when
        there is one, else PyTorch's ("silu" or "gelu_tanh")."""
        if self.fused is not None:
            gu = self.fused(x, batch)
            out = native_ops.gated(gu, act)
            if out is not None:
                return out
            gate, up = gu.split(self.sizes, dim=-1)
        else:
            gate, up = self(x, batch)
        a = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
        return a * up

    def projections(self) -> list[Projection]:
        return [self.fused] if self.fused is not None else list(self.parts or [])

    def targets(self) -> dict[str, Target]:
        """Where each part's rows sit in the stacked projection ({} when not stacked)."""
        if self.fused is None:
            return {}
        out, at = {}, 0
        n_in = self.fused.n_in
        for name, n in zip(self.names, self.sizes, strict=True):
            out[name] = Target(self.fused.name, n_in, n, slice(0, n), slice(at, at + n))
            at += n
        return out


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


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    batch: Batch,
    cache: KVCache,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q (B, T, H, D), k/v (B, T, Hkv, D) -> (B, T, H * Dv), through the cache."""
    cache.write(layer, batch, k, v)
    rows = batch.index()
    if batch.n_tokens > 1 and rows is not None:  # prompt chunks: causal blocks, rows at own starts
        out = native_ops.attn_prefill(
            q.contiguous(), cache.k[layer], cache.v[layer], rows, scale, window
        )
        if out is not None:  # read straight from the cache: no gathered copy of the rows
            return out.view(*q.shape[:2], -1)
    keys, values = cache.read(layer, batch)  # (B, Hkv, L, D)
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
