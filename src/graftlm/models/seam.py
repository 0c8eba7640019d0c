"""The projection seam: every matrix product of the model, and the one place that decides how it
runs.

Semantics, per row b of the batch and token t:
    y[b, t] = W x[b, t] + sum_s scale[b, s] * B_s (A_s x[b, t])
with W the (quantized) base weight, (A_s, B_s) the adapter slots on this projection (LoraSite)
and the scales the batch's (Batch.lora). The ways it runs, fastest first; each is the twin of the
next and is tested against it:

1. one native pass (``gl_proj``): the base product, then each task's outputs get B's delta while
   still in cache; for a fast step (not Batch.exact) on a weight the native products hold;
2. the base product (``quant.linear``), then the delta from the site's packed adapters
   (``native.ops.lora_delta``), for a fast step;
3. the base product, then the delta in PyTorch (``LoraSite.add_delta``): exact steps (float32
   arithmetic on the factors as held, read back from their packed form: scoring's
   log-probabilities), and sites the native delta does not serve.

A projection with no adapter, or a step with no active adapter, runs the base product alone.
Every adapter's native form was packed when it was attached (``lora.packed``): nothing here
builds one.
"""

from __future__ import annotations

import torch

from graftlm.lora.site import LoraSite
from graftlm.lora.targets import Target
from graftlm.models.primitives import activation, gated
from graftlm.native import layer_calls as native_layer
from graftlm.native import ops as native_ops
from graftlm.quant import QWeight, config, linear
from graftlm.step.batch import Batch, LoraRows


def add_delta(
    site: LoraSite, y: torch.Tensor, x: torch.Tensor, rows: LoraRows, exact: bool
) -> torch.Tensor:
    """y plus the delta of x on `site` for rows: natively where the step is fast and the site's
    adapters are packed (ways 2 and 3 of the module's docstring); in place when y is
    contiguous."""
    table = None if exact else site.native()
    if table is not None and native_ops.lora_delta(y, x, table.site(rows.scales)):
        return y
    return site.add_delta(y, x, rows)


def one_pass(
    weight: QWeight, x: torch.Tensor, site: LoraSite, scales: torch.Tensor
) -> torch.Tensor | None:
    """Way 1 of the module's docstring for x (B, T, n_in), T tokens a row of scales (B,
    n_slots), or None where it does not run (the caller takes way 2 or 3)."""
    if (
        x.dim() != 3
        or x.dtype is not torch.float32
        or x.device.type != "cpu"
        or not x.is_contiguous()
        or scales.dtype is not torch.float32
        or not scales.is_contiguous()
    ):
        return None
    b, t, _ = x.shape
    w = weight.native()  # (None first for a kernel the native product does not know)
    if w is None or b * t == 0 or not config.use_fused(weight.kernel, b * t):
        return None
    table = site.native()
    if table is None:
        return None
    y = torch.empty(b, t, weight.shape[0])
    native_layer.proj(w, table.site(scales), x, y)
    return y


def _one_pass(
    weight: QWeight, x: torch.Tensor, site: LoraSite, batch: Batch
) -> torch.Tensor | None:
    """Way 1 of the module's docstring for a step, or None where it does not run."""
    if batch.lora is None or batch.exact:
        return None
    return one_pass(weight, x, site, batch.lora.scales)


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
        """Whether the fast base product rounds x to int8 (Kernel.rounds_x)."""
        return self.weight.rounds_x

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
