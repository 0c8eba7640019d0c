"""Where an adapter tensor lands in the engine: the mapping from a base tensor name to the
projections (and row ranges) that hold it, and the refusals for what is not a projection."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graftlm.lora.adapter import EMBEDDING

if TYPE_CHECKING:
    from graftlm.models.base import Transformer

_EXPERT = re.compile(r"_exps$|_exps\.|_shexp_gate")
_NORM_OR_BIAS = re.compile(r"(norm|\.bias$|_b$)")


@dataclass(frozen=True)
class Target:
    """A base tensor seen from the adapter: which engine projection holds its rows.

    rows: the slice of the file tensor's output rows this projection holds (a fused file tensor is
    split over several projections); at: where those rows sit in the projection's own output."""

    projection: str
    n_in: int
    n_out: int  # output rows of the whole file tensor
    rows: slice
    at: slice


def resolve_target(model: Transformer, base: str) -> list[Target] | str:
    """The targets of base tensor `base` ("blk.0.attn_q"), or the reason it cannot take an adapter."""
    if _EXPERT.search(base):
        return (
            "routed-expert tensor: per-expert adapters are not served (only attention and shared "
            "projections of mixture-of-experts models take adapters)"
        )
    cfg = model.cfg
    if base == EMBEDDING:
        return [
            Target(EMBEDDING, cfg.n_vocab, cfg.n_embd, slice(0, cfg.n_embd), slice(0, cfg.n_embd))
        ]
    proj = model.projections()
    if base in proj:
        p = proj[base]
        return [Target(base, p.n_in, p.n_out, slice(0, p.n_out), slice(0, p.n_out))]
    mapped = model.fused_targets(base)
    if mapped:
        return mapped
    if _NORM_OR_BIAS.search(base):
        return "norm or bias tensor: LoRA applies to projections only"
    return "not a projection of this model"
