"""Where an adapter tensor lands in a model: the model's table of seams (every place an adapter
can attach), the mapping from a base tensor name to the projections (and row ranges) that hold
it, and the refusals for what is not a projection.

The models build the table as they load their weights (`graftlm.models`); adapter code reads it
through the `Base` protocol and never looks inside a model's blocks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from graftlm.config import ModelConfig
from graftlm.lora.adapter import EMBEDDING
from graftlm.lora.site import Generation, LoraSite

_EXPERT = re.compile(r"_exps|_shexp_gate")
# a routed-expert file tensor that takes a per-expert adapter (llama.cpp's build_lora_mm_id):
# its layer and which projection
ROUTED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps")
# the families whose routed FFN adds per-expert deltas (models.moe.moe_ffn, gpt-oss's
# routed_ffn)
EXPERT_ADAPTER_ARCHS = {"gpt-oss", "llama", "qwen3moe"}
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
    expert: int | None = None  # a routed expert's index: its own (n_out, n_in) weight


class Seam(Protocol):
    """One projection as adapters see it: its sizes and its slots."""

    name: str
    lora: LoraSite | None

    @property
    def n_in(self) -> int: ...

    @property
    def n_out(self) -> int: ...

    @property
    def approximate(self) -> bool:
        """Whether the base product rounds its input (int8 activations): its adapter's fast form
        may then round too (LoraSite.compact)."""
        ...


@dataclass
class SeamTable:
    """Every place of a model an adapter can attach, filled as the weights load.

    projections: by GGUF base name ("blk.0.attn_q", "output"), each the engine's projection;
    parts: file tensors the engine stacked into one projection (Q/K/V, gate/up), with their rows;
    embedding: the slots on the token embedding (made on the first adapter that has one);
    experts: routed-expert file tensors ("blk.0.ffn_gate_exps"), each expert e's Target in a
        projection of its own (the expert's own weight, `models.moe`), in expert order;
    generation: changes whenever any slot of the model changes."""

    n_vocab: int
    n_embd: int
    projections: dict[str, Seam] = field(default_factory=dict)
    parts: dict[str, Target] = field(default_factory=dict)
    experts: dict[str, list[Target]] = field(default_factory=dict)
    embedding: LoraSite | None = None
    generation: Generation = field(default_factory=Generation)

    def sites(self) -> list[LoraSite]:
        """Every site with slots, the embedding's included."""
        out = [p.lora for p in self.projections.values() if p.lora is not None]
        return out + ([self.embedding] if self.embedding is not None else [])


class Base(Protocol):
    """What reading and attaching an adapter needs of a base model."""

    cfg: ModelConfig
    base_tensor_names: set[str]
    seams: SeamTable

    @property
    def device(self) -> torch.device: ...

    def projections(self) -> Mapping[str, Seam]: ...


def resolve_target(model: Base, base: str) -> list[Target] | str:
    """The targets of base tensor `base` ("blk.0.attn_q"), or the reason it cannot take an adapter."""
    table = model.seams
    if _EXPERT.search(base):
        experts = table.experts.get(base) if ROUTED.fullmatch(base) else None
        if experts and model.cfg.arch in EXPERT_ADAPTER_ARCHS:
            return experts
        return (
            "routed-expert tensor, but this model has no such routed experts that take adapters "
            "(per-expert adapters apply to ffn_gate_exps, ffn_up_exps and ffn_down_exps of "
            f"{', '.join(sorted(EXPERT_ADAPTER_ARCHS))} models)"
        )
    if base == EMBEDDING:
        d = table.n_embd
        return [Target(EMBEDDING, table.n_vocab, d, slice(0, d), slice(0, d))]
    p = table.projections.get(base)
    if p is not None:
        return [Target(base, p.n_in, p.n_out, slice(0, p.n_out), slice(0, p.n_out))]
    part = table.parts.get(base)
    if part is not None:
        return [part]
    if _NORM_OR_BIAS.search(base):
        return "norm or bias tensor: LoRA applies to projections only"
    return "not a projection of this model"
