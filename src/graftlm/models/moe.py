"""Mixture-of-experts feed-forward (Mixtral-style `llama`): a router picks the top-k experts of
every token, each a SwiGLU, and mixes their outputs with the renormalized router weights.

The expert tensors are 3-D in GGUF (`ffn_gate_exps` (n_expert, n_ff, n_embd) in torch order);
each expert is kept as its own 2-D QWeight over a view of the file's bytes, so experts stay as
compact as every other weight. Routed experts take no adapters (lora/targets.py refuses them by
name); the router `ffn_gate_inp` is an ordinary projection and does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graftlm.errors import ModelFileError
from graftlm.models.base import Weights
from graftlm.quant import QWeight, linear


class Experts:
    """One 3-D expert tensor of a layer, as n_expert 2-D weights of shape (n_out, n_in)."""

    def __init__(self, w: Weights, name: str, shape: tuple[int, int, int]) -> None:
        entry = w.file.tensors.get(name)
        if entry is None:
            raise ModelFileError(f"{w.file.path}: missing tensor {name!r}")
        if tuple(entry.shape) != shape:
            raise ModelFileError(
                f"{w.file.path}: tensor {name!r} has shape {list(entry.shape)}, "
                f"expected {list(shape)} (n_expert, n_out, n_in)"
            )
        w.used.add(name)
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


def moe_ffn(
    h: torch.Tensor,
    router_logits: torch.Tensor,
    gate: Experts,
    up: Experts,
    down: Experts,
    n_used: int,
) -> torch.Tensor:
    """h (B, T, n_embd), router_logits (B, T, n_expert) -> (B, T, n_embd).

    Semantics (llama.cpp's softmax gating with normalized weights, = Mixtral):
        p = softmax(router_logits); top = the n_used largest p; w = p[top] / sum(p[top])
        out = sum_{e in top} w_e * down_e(silu(gate_e(h)) * up_e(h))
    Tokens are grouped by expert, so each expert runs once per step on its own tokens. Finding the
    groups syncs with the host: acceptable for the reference path, not for a compiled decode step.
    """
    x = h.reshape(-1, h.shape[-1])  # (N, n_embd)
    probs = torch.softmax(router_logits.reshape(x.shape[0], -1).float(), dim=-1)  # (N, n_expert)
    weight, chosen = probs.topk(n_used, dim=-1)  # (N, k)
    weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in chosen.unique().tolist():
        token, slot = (chosen == e).nonzero(as_tuple=True)  # tokens routed to e, and at which rank
        xe = x[token]  # (n_e, n_embd)
        ye = linear(F.silu(linear(xe, gate[e])) * linear(xe, up[e]), down[e])  # (n_e, n_embd)
        out.index_add_(0, token, ye * weight[token, slot].unsqueeze(1))
    return out.view_as(h)
