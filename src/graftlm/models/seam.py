"""The projection seam: every matrix product of the model, and the one place that decides how it
runs.

Semantics, per row b of the batch and token t:
    y[b, t] = W x[b, t] + sum_s scale[b, s] * B_s (A_s x[b, t])
with W the (quantized) base weight, (A_s, B_s) the adapter slots on this projection (LoraSite)
and the scales the batch's (Batch.lora). The ways it runs, fastest first; each is the twin of the
next and is tested against it:

1. one native pass (``gl_proj``): the base product, then each task's outputs get B's delta while
   still in cache; for a fast step (not Batch.exact) on a weight the native products hold;
2. the base product (``quant.linear``, exact or fast as the batch says), then the delta from the
   site's native form (``native.ops.lora_delta``);
3. the base product, then the delta in PyTorch (``LoraSite.add_delta``).

A projection with no adapter, or a step with no active adapter, runs the base product alone.
The native forms of a site's stack (B blocked as the kernels stream it, spans, A as Q8_0) are
made here, from the site's factors, and cached on the site (LoraSite.derived).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from graftlm.lora.site import LoraSite
from graftlm.lora.targets import Target
from graftlm.models.layers import activation, gated
from graftlm.native import layer as native_layer
from graftlm.native import library
from graftlm.native import ops as native_ops
from graftlm.native.abi import GlLoraSite
from graftlm.quant import QWeight, config, linear
from graftlm.quant.native_kernels import NativeS8Kernel
from graftlm.step.batch import Batch, LoraRows


@dataclass(frozen=True)
class NativeLora:
    """A site's active stack in the native delta's layout."""

    a: torch.Tensor  # (R, n_in) float32, or bfloat16 in the compact form
    blocked: torch.Tensor  # native_ops.lora_block(B_cat.T), same dtype as a
    spans: torch.Tensor  # (R, 2) int64: nonzero output range of each column
    col_slot: torch.Tensor  # (R,) int64
    layout: tuple[tuple[int, int], ...]
    a_s8: tuple[torch.Tensor, torch.Tensor] | None  # A as Q8_0 for the integer dots (compact)

    def point(self, site: GlLoraSite, scales: int) -> None:
        """Point a gl_lora_site at this form and at a scale table's address."""
        site.a, site.bb = self.a.data_ptr(), self.blocked.data_ptr()
        site.span, site.r = self.spans.data_ptr(), self.a.shape[0]
        site.bf = int(self.a.dtype is torch.bfloat16)
        site.aq = None
        if self.a_s8 is not None:
            site.aq, site.a_scales = self.a_s8[0].data_ptr(), self.a_s8[1].data_ptr()
            site.a_half = int(self.a_s8[1].dtype is torch.float16)
        site.scales = scales


def native_lora(site: LoraSite, active: tuple[int, ...], exact: bool) -> NativeLora | None:
    """The native form of the site's active stack (made once per active set and precision), or
    None where the native delta does not serve the site (no library, a gathering site, factors
    off the CPU or not float32)."""
    slots = site.present(active)
    if not slots or site.gather or site.device.type != "cpu" or library() is None:
        return None
    half = site.compact and not exact
    return site.derived(("native", slots, half), lambda: _native_form(site, slots, half))


def _native_form(site: LoraSite, slots: tuple[int, ...], half: bool) -> NativeLora | None:
    st = site.concat(slots)
    if not st.a.dtype == st.bt.dtype == torch.float32:
        return None
    dtype = torch.bfloat16 if half else torch.float32
    blocked, spans = native_ops.lora_block(st.bt, dtype), native_ops.lora_spans(st.bt)
    a_s8 = lora_a_s8(st.a) if half else None
    return NativeLora(st.a.to(dtype).contiguous(), blocked, spans, st.col_slot, st.layout, a_s8)


def lora_a_s8(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A (R, n_in) float32 as an s8 weight for the decode products' integer dots: Q8_0 codes and
    scales (per 32 values, |error| <= max|block| / 254), packed as a Q8_0 weight is. None when
    n_in is not a whole number of blocks."""
    r, n_in = a.shape
    if n_in % 32 or library() is None:
        return None
    raw = quants.quantize(a.contiguous().numpy(), GGMLQuantizationType.Q8_0)
    k = NativeS8Kernel.build(
        torch.from_numpy(np.ascontiguousarray(raw)), GGMLQuantizationType.Q8_0, (r, n_in)
    )
    assert isinstance(k, NativeS8Kernel)
    return k.q, k.s


def add_delta(
    site: LoraSite, y: torch.Tensor, x: torch.Tensor, rows: LoraRows, exact: bool
) -> torch.Tensor:
    """y plus the delta of x on `site` for rows: natively where the site's form allows (ways 2
    and 3 of the module's docstring); in place when y is contiguous."""
    form = native_lora(site, rows.active, exact)
    if form is not None:
        s = rows.columns(form.layout, form.col_slot)  # (B, 1, R)
        if native_ops.lora_delta(y, x, form.a, s, form.blocked, form.spans, form.a_s8):
            return y
    return site.add_delta(y, x, rows)


def _one_pass(
    weight: QWeight, x: torch.Tensor, site: LoraSite, batch: Batch
) -> torch.Tensor | None:
    """Way 1 of the module's docstring, or None where it does not run."""
    lora = batch.lora
    if (
        lora is None
        or batch.exact
        or x.dim() != 3
        or x.dtype is not torch.float32
        or x.device.type != "cpu"
        or not x.is_contiguous()
    ):
        return None
    b, t, _ = x.shape
    w = weight.native()  # (None first for a kernel the native product does not know)
    if w is None or b * t == 0 or not config.use_fused(weight.kernel, b * t):
        return None
    form = native_lora(site, lora.active, exact=False)
    if form is None:
        return None
    scales = lora.columns(form.layout, form.col_slot)  # (B, 1, R)
    view = GlLoraSite()
    form.point(view, scales.data_ptr())
    y = torch.empty(b, t, weight.shape[0])
    native_layer.proj(w, view, x, y)
    return y


class Projection:
    """One matrix product of the model: y = W x + sum_s scale[row, s] * B_s (A_s x).

    The single place where a base weight meets the adapters attached to it. The base weight knows
    its own quantization; `lora` (set by the adapter machinery, None while no adapter touches this
    projection) knows its stacked slots; the batch knows each row's scales and the precision.
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

    @property
    def approximate(self) -> bool:
        """Whether the fast base product rounds x to int8 (the native kernels)."""
        return self.weight.kernel.startswith("native")

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        site, rows = self.lora, batch.lora
        if site is None or rows is None:
            return linear(x, self.weight, batch.exact)
        y = _one_pass(self.weight, x, site, batch)
        if y is not None:
            return y
        return add_delta(site, linear(x, self.weight, batch.exact), x, rows, batch.exact)


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
            return gated(self.fused(x, batch), act)
        gate, up = self(x, batch)
        return activation(gate, act) * up

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
