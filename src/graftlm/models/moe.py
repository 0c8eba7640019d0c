"""Mixture-of-experts feed-forward (Mixtral-style `llama`): a router picks the top-k experts of
every token, each a SwiGLU, and mixes their outputs with the renormalized router weights.

The expert tensors are 3-D in GGUF (`ffn_gate_exps` (n_expert, n_ff, n_embd) in torch order);
each expert is kept as its own 2-D QWeight over a view of the file's bytes, so experts stay as
compact as every other weight. An expert's gate and up are stacked into one weight when the file
holds them in one type (as a dense layer's are), so a token's pass through an expert is two
products and one native gating. The router `ffn_gate_inp` is an ordinary projection.

Routed experts take per-expert adapters (llama.cpp's `build_lora_mm_id`): expert e of a file
tensor is a seam of its own (`ExpertSeam`, "blk.0.ffn_gate_up_exps[3]"), each with its slots, and
its delta is added to the expert's product on the expert's tokens, each token at its row's scale:
on a fast step from the seam's packed adapters in the product's own native pass (``gl_proj``, the
factors and kernels the native decode layer's routed FFN adds them with: models.fused; where the
product has rows enough for AMX tiles, B's delta in bfloat16, as a dense projection's), after the
product (``gl_lora``) where the expert's weight has no native kernel, on an exact step (or where
they are not packed) in PyTorch (`LoraSite.add_token_delta`), in float32 on the factors
as the site holds them: read back from the packed form, the slot's one copy (lora.site), or the
float32 factors where there is none. A stacked expert's gate and up rows are parts of one seam,
as a dense layer's are.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from graftlm.gguf import TensorEntry
from graftlm.lora.site import LoraSite
from graftlm.lora.targets import Target
from graftlm.models.base import Weights
from graftlm.models.primitives import gated
from graftlm.models.seam import one_pass
from graftlm.native import ops as native_ops
from graftlm.quant import QWeight, linear
from graftlm.quant.base import release_pages
from graftlm.step.batch import LoraRows


def _entry(w: Weights, name: str, shape: tuple[int, int, int]) -> TensorEntry:
    """The 3-D expert tensor `name` of this shape (n_expert, n_out, n_in), marked used."""
    return w.entry(name, shape, "(n_expert, n_out, n_in)")


class ExpertSeam:
    """One routed expert's weight as adapters see it (lora.targets.Seam): its sizes and slots."""

    def __init__(self, name: str, weight: QWeight) -> None:
        self.name = name  # "blk.0.ffn_down_exps[3]"
        self.weight = weight
        self.lora: LoraSite | None = None

    @property
    def n_in(self) -> int:
        return int(self.weight.shape[1])

    @property
    def n_out(self) -> int:
        return int(self.weight.shape[0])

    @property
    def approximate(self) -> bool:
        return bool(self.weight.rounds_x)


def _seams(w: Weights, weights: list[QWeight], name: str) -> list[ExpertSeam]:
    """Every expert's seam of file tensor(s) stacked as `name` ("blk.0.ffn_down_exps.weight"),
    entered in the model's table."""
    base = name.removesuffix(".weight")
    seams = [ExpertSeam(f"{base}[{e}]", q) for e, q in enumerate(weights)]
    if w.seams is not None:
        for s in seams:
            w.seams.projections[s.name] = s
    return seams


def _enter(w: Weights, file_name: str, seams: list[ExpertSeam], rows: slice) -> None:
    """File tensor `file_name`'s rows `rows` of each expert's seam: its adapter's targets."""
    if w.seams is None:
        return
    n_out = rows.stop - rows.start
    w.seams.experts[file_name.removesuffix(".weight")] = [
        Target(s.name, s.n_in, n_out, slice(0, n_out), rows, expert=e) for e, s in enumerate(seams)
    ]


class _Adapted:
    """The adapter slots attached to any of a tensor's experts, found again only when the
    model's adapters change (its Generation): a step asks once a layer, not once an expert."""

    def __init__(self, w: Weights) -> None:
        self.generation = w.seams.generation if w.seams is not None else None
        self.seams: list[ExpertSeam] = []
        self._seen: tuple[int, frozenset[int]] = (-1, frozenset())

    def slots(self) -> frozenset[int]:
        g = self.generation.value if self.generation is not None else 0
        if self._seen[0] != g:
            found = frozenset(s for x in self.seams if x.lora is not None for s in x.lora.slot_ids)
            self._seen = (g, found)
        return self._seen[1]


def adapted_rows(rows: LoraRows | None, *experts: _Adapted) -> LoraRows | None:
    """The step's rows when some adapter active in it is attached to one of these experts."""
    if rows is None or not rows.active:
        return None
    return rows if any(s in x.slots() for x in experts for s in rows.active) else None


# an expert's tokens whose delta runs on one thread: the delta of a few rows costs less than
# starting a parallel region (tens of microseconds; milliseconds on a loaded machine)
ONE_THREAD_ROWS = 64


def _token_delta(
    site: LoraSite, y: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, exact: bool
) -> torch.Tensor:
    """y (n, n_out) plus the delta of x (n, n_in), token i at scales[i] (n, n_slots): natively
    from the site's packed adapters on a fast step (in place), else in PyTorch."""
    table = None if exact else site.native()
    if table is not None and scales.dtype is torch.float32 and scales.is_contiguous():
        nth = 1 if x.shape[0] <= ONE_THREAD_ROWS else None
        if native_ops.lora_delta(y, x, table.site(scales), nth):
            return y
    return site.add_token_delta(y, x, scales)


def adapted_product(
    weight: QWeight,
    site: LoraSite | None,
    x: torch.Tensor,
    scales: torch.Tensor | None,
    exact: bool = False,
) -> torch.Tensor:
    """weight's product of x (n, n_in) -> (n, n_out), plus site's delta at the tokens' scales
    (n, n_slots) when given. A fast step takes both in one native pass (the seam's one_pass: x
    quantized once for the product and A's integer dots, each task's outputs given B's delta
    while in cache, the delta on every thread); else the product, then _token_delta."""
    if scales is None or site is None:
        return linear(x, weight, exact)
    if not exact:
        y = one_pass(weight, x.unsqueeze(1), site, scales)  # token i its own row of scales
        if y is not None:
            return y.squeeze(1)
    return _token_delta(site, linear(x, weight, exact), x, scales, exact)


class Experts(_Adapted):
    """One 3-D expert tensor of a layer, as n_expert 2-D weights of shape (n_out, n_in)."""

    def __init__(self, w: Weights, name: str, shape: tuple[int, int, int]) -> None:
        super().__init__(w)
        entry = _entry(w, name, shape)
        n_expert, n_out, n_in = shape
        # entry.data is (n_expert, n_out, n_in) floats or (n_expert, n_out, row bytes) blocks
        self.weights = [
            w.qweight(entry, entry.data[e], (n_out, n_in), f"{name}[{e}]") for e in range(n_expert)
        ]
        self.seams = _seams(w, self.weights, name)
        _enter(w, name, self.seams, slice(0, n_out))

    def product(
        self, e: int, x: torch.Tensor, scales: torch.Tensor | None, exact: bool = False
    ) -> torch.Tensor:
        """Expert e's product of x (n, n_in) -> (n, n_out), plus its adapters' delta at the
        tokens' scales (n, n_slots) when given."""
        return adapted_product(self.weights[e], self.seams[e].lora, x, scales, exact)

    def to(self, device: torch.device) -> Experts:
        """Every expert's weight on `device` (in place; returns self)."""
        self.weights = [q.to(device) for q in self.weights]
        for s, q in zip(self.seams, self.weights, strict=True):
            s.weight = q
        return self

    def __getitem__(self, e: int) -> QWeight:
        return self.weights[e]

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.weights)


class GatedExperts(_Adapted):
    """A layer's gate and up expert tensors: expert e as one stacked (2 n_ff, n_in) weight, rows
    [gate_e; up_e], when the two tensors share a type (`stacked`), else as the two Experts
    (`parts`)."""

    def __init__(self, w: Weights, gate: str, up: str, shape: tuple[int, int, int]) -> None:
        super().__init__(w)
        self.stacked: list[QWeight] | None = None
        self.parts: tuple[Experts, Experts] | None = None
        g, u = _entry(w, gate, shape), _entry(w, up, shape)
        if g.ggml_type != u.ggml_type:
            self.parts = (Experts(w, gate, shape), Experts(w, up, shape))
            self.seams = self.parts[0].seams + self.parts[1].seams
            return
        n_expert, n_ff, n_in = shape
        name = gate.removesuffix(".weight").replace("ffn_gate", "ffn_gate_up")
        self.stacked = [
            w.qweight(
                g,
                np.concatenate([np.asarray(g.data[e]), np.asarray(u.data[e])], axis=0),
                (2 * n_ff, n_in),
                f"{name}[{e}]",
            )
            for e in range(n_expert)
        ]
        for entry in (g, u):
            release_pages(entry.data)  # the stacked copies replace the mapped pages
        self.seams = _seams(w, self.stacked, name)
        _enter(w, gate, self.seams, slice(0, n_ff))
        _enter(w, up, self.seams, slice(n_ff, 2 * n_ff))

    def to(self, device: torch.device) -> GatedExperts:
        """Every expert's weights on `device` (in place; returns self)."""
        if self.parts is not None:
            self.parts = (self.parts[0].to(device), self.parts[1].to(device))
        if self.stacked is not None:
            self.stacked = [q.to(device) for q in self.stacked]
            for s, q in zip(self.seams, self.stacked, strict=True):
                s.weight = q
        return self

    def halves(
        self, e: int, x: torch.Tensor, exact: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_e(x), up_e(x) for x (n, n_in), each (n, n_ff); exact as in quant.linear."""
        if self.stacked is None:
            assert self.parts is not None
            return linear(x, self.parts[0][e], exact), linear(x, self.parts[1][e], exact)
        gate, up = linear(x, self.stacked[e], exact).chunk(2, dim=-1)
        return gate, up

    def products(
        self, e: int, x: torch.Tensor, scales: torch.Tensor | None, exact: bool = False
    ) -> torch.Tensor:
        """[gate_e(x) | up_e(x)] (n, 2 n_ff) for x (n, n_in), each plus its adapters' delta at
        the tokens' scales (n, n_slots) when given: the products an activation other than
        `gated`'s SwiGLU takes (gpt-oss's, after its biases)."""
        if self.stacked is None:
            assert self.parts is not None
            gate = self.parts[0].product(e, x, scales, exact)
            return torch.cat([gate, self.parts[1].product(e, x, scales, exact)], dim=-1)
        return adapted_product(self.stacked[e], self.seams[e].lora, x, scales, exact)

    def __call__(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """silu(gate_e(x)) * up_e(x) for x (n, n_in) -> (n, n_ff)."""
        if self.stacked is None:
            gate, up = self.halves(e, x)
            return F.silu(gate) * up
        return gated(linear(x, self.stacked[e]), "silu")

    def gated(
        self, e: int, x: torch.Tensor, scales: torch.Tensor | None, exact: bool = False
    ) -> torch.Tensor:
        """__call__ plus the adapters' deltas on gate and up at the tokens' scales (n, n_slots):
        the base products are the same calls, so a delta of 0 leaves the output as it was.
        exact: the products in float32 and the activation in PyTorch (quant.linear's exact)."""
        if scales is None and not exact:
            return self(e, x)
        gu = self.products(e, x, scales, exact)  # (n, 2 n_ff)
        if exact or self.stacked is None:
            gate, up = gu.chunk(2, dim=-1)
            return F.silu(gate) * up
        return gated(gu, "silu")

    @property
    def nbytes(self) -> int:
        if self.stacked is not None:
            return sum(q.nbytes for q in self.stacked)
        assert self.parts is not None
        return self.parts[0].nbytes + self.parts[1].nbytes


def moe_ffn(
    h: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: GatedExperts,
    down: Experts,
    n_used: int,
    lora: LoraRows | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """h (B, T, n_embd), router_logits (B, T, n_expert) -> (B, T, n_embd); exact: the experts'
    products in float32 (the step's Batch.exact, as quant.linear takes it).

    Semantics (llama.cpp's softmax gating with normalized weights, = Mixtral):
        p = softmax(router_logits); top = the n_used largest p; w = p[top] / sum(p[top])
        out = sum_{e in top} w_e * down_e(silu(gate_e(h)) * up_e(h))
    each of gate_e, up_e, down_e plus its adapters' delta at the token's row's scales (`lora`).
    Tokens are grouped by expert (mix_experts).
    """
    x = h.reshape(-1, h.shape[-1])  # (N, n_embd)
    probs = torch.softmax(router_logits.reshape(x.shape[0], -1).float(), dim=-1)  # (N, n_expert)
    weight, chosen = probs.topk(n_used, dim=-1)  # (N, k)
    weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
    rows = adapted_rows(lora, gate_up, down)
    if rows is None:

        def plain(e: int, xe: torch.Tensor) -> torch.Tensor:
            return down.product(e, gate_up.gated(e, xe, None, exact), None, exact)

        return mix_experts(x, chosen, weight, plain).view_as(h)
    token_scales = rows.scales.repeat_interleave(h.shape[1], dim=0)  # (N, n_slots)

    def expert(e: int, xe: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        s = token_scales.index_select(0, token)  # (n_e, n_slots)
        return down.product(e, gate_up.gated(e, xe, s, exact), s, exact)

    return mix_experts(x, chosen, weight, expert, with_tokens=True).view_as(h)


def mix_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weight: torch.Tensor,
    expert: Callable[..., torch.Tensor],
    with_tokens: bool = False,
) -> torch.Tensor:
    """x (N, n_embd), chosen and weight (N, k) -> sum_r weight[:, r] * expert(chosen[:, r], x),
    (N, n_embd). Tokens are grouped by expert, so each expert runs once on its own tokens; the
    grouping reads the choices on the host (one small copy, no search). with_tokens: expert is
    called as expert(e, x_e, token), token (n_e,) the indices into x of its rows."""
    n_used = chosen.shape[-1]
    groups: dict[int, list[int]] = {}  # expert -> flat (token * k + rank) indices
    for flat, e in enumerate(chosen.reshape(-1).tolist()):
        groups.setdefault(e, []).append(flat)
    flat_weight = weight.reshape(-1)
    out = torch.zeros_like(x)
    for e, picks in sorted(groups.items()):  # ascending, as the native layer adds them: a row's
        # sum then does not depend on which experts the other rows picked first
        idx = torch.tensor(picks, device=x.device)
        token = idx // n_used
        xe = x.index_select(0, token)
        ye = expert(e, xe, token) if with_tokens else expert(e, xe)  # (n_e, n_embd)
        out.index_add_(0, token, ye * flat_weight.index_select(0, idx).unsqueeze(1))
    return out
