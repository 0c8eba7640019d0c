"""Mixture-of-experts feed-forward (Mixtral-style `llama`): a router picks the top-k experts of
every token, each a SwiGLU, and mixes their outputs with the renormalized router weights.

The expert tensors are 3-D in GGUF (`ffn_gate_exps` (n_expert, n_ff, n_embd) in torch order);
each expert is kept as its own 2-D QWeight over a view of the file's bytes, so experts stay as
compact as every other weight. An expert's gate and up are stacked into one weight when the file
holds them in one type (as a dense layer's are), so a token's pass through an expert is two
products and one native gating. Routed experts take no adapters (lora/targets.py refuses them by
name); the router `ffn_gate_inp` is an ordinary projection and does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from graftlm.gguf import TensorEntry
from graftlm.models.base import Weights
from graftlm.models.primitives import gated
from graftlm.quant import QWeight, linear
from graftlm.quant.base import release_pages


def _entry(w: Weights, name: str, shape: tuple[int, int, int]) -> TensorEntry:
    """The 3-D expert tensor `name` of this shape (n_expert, n_out, n_in), marked used."""
    return w.entry(name, shape, "(n_expert, n_out, n_in)")


class Experts:
    """One 3-D expert tensor of a layer, as n_expert 2-D weights of shape (n_out, n_in)."""

    def __init__(self, w: Weights, name: str, shape: tuple[int, int, int]) -> None:
        entry = _entry(w, name, shape)
        n_expert, n_out, n_in = shape
        # entry.data is (n_expert, n_out, n_in) floats or (n_expert, n_out, row bytes) blocks
        self.weights = [
            w.qweight(entry, entry.data[e], (n_out, n_in), f"{name}[{e}]") for e in range(n_expert)
        ]

    def to(self, device: torch.device) -> Experts:
        """Every expert's weight on `device` (in place; returns self)."""
        self.weights = [q.to(device) for q in self.weights]
        return self

    def __getitem__(self, e: int) -> QWeight:
        return self.weights[e]

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.weights)


class GatedExperts:
    """A layer's gate and up expert tensors: expert e as one stacked (2 n_ff, n_in) weight, rows
    [gate_e; up_e], when the two tensors share a type (`stacked`), else as the two Experts
    (`parts`)."""

    def __init__(self, w: Weights, gate: str, up: str, shape: tuple[int, int, int]) -> None:
        self.stacked: list[QWeight] | None = None
        self.parts: tuple[Experts, Experts] | None = None
        g, u = _entry(w, gate, shape), _entry(w, up, shape)
        if g.ggml_type != u.ggml_type:
            self.parts = (Experts(w, gate, shape), Experts(w, up, shape))
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

    def to(self, device: torch.device) -> GatedExperts:
        """Every expert's weights on `device` (in place; returns self)."""
        if self.parts is not None:
            self.parts = (self.parts[0].to(device), self.parts[1].to(device))
        if self.stacked is not None:
            self.stacked = [q.to(device) for q in self.stacked]
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

    def __call__(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """silu(gate_e(x)) * up_e(x) for x (n, n_in) -> (n, n_ff)."""
        if self.stacked is None:
            gate, up = self.halves(e, x)
            return F.silu(gate) * up
        return gated(linear(x, self.stacked[e]), "silu")

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
    exact: bool = False,
) -> torch.Tensor:
    """h (B, T, n_embd), router_logits (B, T, n_expert) -> (B, T, n_embd); exact: the experts'
    products in float32 (the step's Batch.exact, as quant.linear takes it).

    Semantics (llama.cpp's softmax gating with normalized weights, = Mixtral):
        p = softmax(router_logits); top = the n_used largest p; w = p[top] / sum(p[top])
        out = sum_{e in top} w_e * down_e(silu(gate_e(h)) * up_e(h))
    Tokens are grouped by expert (mix_experts).
    """
    x = h.reshape(-1, h.shape[-1])  # (N, n_embd)
    probs = torch.softmax(router_logits.reshape(x.shape[0], -1).float(), dim=-1)  # (N, n_expert)
    weight, chosen = probs.topk(n_used, dim=-1)  # (N, k)
    weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        if not exact:
            return linear(gate_up(e, xe), down[e])
        gate, up = gate_up.halves(e, xe, exact)
        return linear(F.silu(gate) * up, down[e], exact)  # (n_e, n_embd)

    out = mix_experts(x, chosen, weight, expert)
    return out.view_as(h)


def mix_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weight: torch.Tensor,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x (N, n_embd), chosen and weight (N, k) -> sum_r weight[:, r] * expert(chosen[:, r], x),
    (N, n_embd). Tokens are grouped by expert, so each expert runs once on its own tokens; the
    grouping reads the choices on the host (one small copy, no search)."""
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
        ye = expert(e, x.index_select(0, token))  # (n_e, n_embd)
        out.index_add_(0, token, ye * flat_weight.index_select(0, idx).unsqueeze(1))
    return out
