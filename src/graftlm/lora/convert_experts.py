"""Routed experts' LoRA between llama.cpp's GGUF adapters and PEFT's layouts (convert-lora,
export-lora).

llama.cpp stacks a routed-expert tensor's experts into one pair (build_lora_mm_id):
`blk.N.ffn_{gate,up,down}_exps.weight.lora_a` ne=[n_in, r, n_expert] and `.lora_b`
ne=[r, n_out, n_expert], torch A (n_expert, r, n_in) and B (n_expert, n_out, r). PEFT holds
them as peft_experts.py reads them: per-expert nn.Linear modules (Mixtral, Qwen3-MoE) or
target_parameters on the 3-D parameters (gpt-oss, whose gate_up_proj interleaves gate and up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graftlm.lora.arch_rules import arch_rules, gate_up_rows
from graftlm.lora.peft_base import BaseInfo, LoraPair
from graftlm.lora.targets import EXPERT_ADAPTER_ARCHS, ROUTED


def stack_experts(pairs: list[LoraPair], n_expert: int) -> list[LoraPair]:
    """`pairs` with each routed-expert tensor's per-expert pairs stacked into one pair, as
    llama.cpp's adapters hold them: a (n_expert, r, n_in), b (n_expert, n_out, r), expert None.
    An expert the adapter leaves out has zero factors, ranks that differ are padded with zeros to
    the largest, and experts whose factors differ have theirs folded into b (scaling 1): the
    stacked pair's delta on every expert is the one the pairs gave."""
    out: list[LoraPair] = []
    groups: dict[str, list[LoraPair]] = {}
    for p in pairs:
        if p.expert is None:
            out.append(p)
        else:
            groups.setdefault(p.base, []).append(p)
    for base, group in groups.items():
        g0 = group[0]
        r = max(int(p.a.shape[0]) for p in group)
        same = all(p.scaling == g0.scaling for p in group)
        a = torch.zeros(n_expert, r, g0.a.shape[1])
        b = torch.zeros(n_expert, g0.b.shape[0], r)
        for p in group:
            k = p.a.shape[0]
            a[p.expert, :k] = p.a
            b[p.expert, :, :k] = p.b if same else p.b * p.scaling
        scaling, alpha = (g0.scaling, g0.alpha) if same else (1.0, float(r))
        out.append(LoraPair(g0.module, base, a, b, scaling, r, alpha))
    return out


def stacked_problem(
    name: str, a_shape: Sequence[int], b_shape: Sequence[int], base: BaseInfo | None
) -> str | None:
    """How llama.cpp's stacked pair of routed-expert tensor `name`, A (n_expert, r, n_in) and
    B (n_expert, n_out, r) (torch order), fails to fit itself and the base, if given (None where
    it fits); every dimension named in GGML's order, as the file holds them."""
    ne_a, ne_b = list(reversed(a_shape)), list(reversed(b_shape))
    where = f"tensor {name}.weight: routed-expert tensor: lora_a ne={ne_a} and lora_b ne={ne_b}"
    if len(a_shape) != 3 or len(b_shape) != 3:
        return f"{where} must both be 3-D (ne=[n_in, r, n_expert] and ne=[r, n_out, n_expert])"
    bad = []
    if a_shape[0] != b_shape[0]:
        bad.append(f"lora_a has {a_shape[0]} experts and lora_b {b_shape[0]}")
    if a_shape[1] != b_shape[2]:
        bad.append(f"ranks differ: {a_shape[1]} and {b_shape[2]}")
    elif a_shape[1] == 0:
        bad.append("rank 0: they hold no values")
    shape = base.lookup(name) if base is not None else None
    if isinstance(shape, str):
        bad.append(shape)
    elif base is not None:
        if (a_shape[2], b_shape[1]) != shape:
            bad.append(f"(n_in, n_out) = ({a_shape[2]}, {b_shape[1]}), the base's {shape}")
        if a_shape[0] != base.n_expert or b_shape[0] != base.n_expert:
            bad.append(f"the base has {base.n_expert} experts")
    return f"{where}: " + "; ".join(bad) if bad else None


@dataclass
class PeftExperts:
    """Stacked expert pairs laid out as PEFT modules: `linear`, per-expert nn.Linear modules
    (module -> (A (r, n_in), B (n_out, r))); or `params`, the target_parameters form (module ->
    (A (r n_expert, n_in), B (n_out, r n_expert))) whose parameters `target_parameters` lists, of
    rank `rank`."""

    linear: dict[str, tuple[torch.Tensor, torch.Tensor]]
    params: dict[str, tuple[torch.Tensor, torch.Tensor]]
    target_parameters: list[str]
    rank: int | None

    def note(self) -> str:
        """Which of the two forms, for the user."""
        if self.params:
            return (
                f"routed experts as target_parameters ({', '.join(self.target_parameters)}) on "
                f"{len(self.params)} modules"
            )
        return (
            f"routed experts as {len(self.linear)} per-expert modules (the layout before "
            "transformers 5, which llama.cpp's converter reads)"
        )


def peft_layout(
    arch: str,
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    n_layer: int | None,
    problems: list[str],
) -> PeftExperts:
    """llama.cpp's stacked expert pairs (name -> A (n_expert, r, n_in), B (n_expert, n_out, r),
    checked against the base) as PEFT holds them: gpt-oss's (no per-expert modules exist for it)
    as target_parameters on experts.gate_up_proj (gate and up rows interleaved: one A for both,
    so gate's and up's A must be equal, as a conversion of a PEFT adapter gives) and
    experts.down_proj; Mixtral's and Qwen3-MoE's as per-expert nn.Linear modules, which hold any
    of llama.cpp's adapters exactly."""
    out = PeftExperts({}, {}, [], None)
    rules = arch_rules(arch)
    linears = rules.expert_linears if rules is not None else None
    if linears is not None:
        for name, (a, b) in pairs.items():
            m = ROUTED.fullmatch(name)
            assert m is not None
            proj = linears.names[m.group(2)]
            for e in range(a.shape[0]):
                module = f"model.layers.{m.group(1)}.{linears.stem}.{e}.{proj}"
                out.linear[module] = (a[e], b[e])
        return out
    if arch not in EXPERT_ADAPTER_ARCHS:  # (those without per-expert modules: gpt-oss's params)
        problems.append(f"routed-expert tensors: no PEFT layout is known for {arch}'s experts")
        return out
    return _params(arch, pairs, n_layer, problems)


def _params(
    arch: str,
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    n_layer: int | None,
    problems: list[str],
) -> PeftExperts:
    """peft_layout's target_parameters form. PEFT wraps the listed parameters of every layer's
    experts, nested in the module's order (gate_up_proj as `.base_layer` under down_proj when
    both are listed): a layer the adapter leaves out gets zero factors, so every key is there."""
    if n_layer is None:  # the layer numbers in the file's names are no bound on the layers
        problems.append(
            "routed-expert tensors: PEFT's target_parameters hold every layer's experts; give the "
            "base model file for its layers and the experts' shapes"
        )
        return PeftExperts({}, {}, [], None)
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, ab in pairs.items():
        m = ROUTED.fullmatch(name)
        assert m is not None
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = ab
    by_rank: dict[int, list[str]] = {}
    for name, (a, _) in sorted(pairs.items()):
        by_rank.setdefault(int(a.shape[1]), []).append(f"{name}.weight")
    if len(by_rank) > 1:
        which = "; ".join(
            f"rank {rank}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
            for rank, names in sorted(by_rank.items())
        )
        problems.append(
            f"routed-expert tensors of differing ranks ({which}): PEFT's target_parameters give "
            "every expert parameter one rank"
        )
        return PeftExperts({}, {}, [], None)
    r = next(iter(by_rank))
    shapes = {k: (int(a.shape[0]), int(a.shape[2]), int(b.shape[1])) for lay in layers.values()
              for k, (a, b) in lay.items()}  # fmt: skip
    gate_up = bool({"gate", "up"} & set(shapes))
    params = (["gate_up_proj"] if gate_up else []) + (["down_proj"] if "down" in shapes else [])
    out = PeftExperts({}, {}, [f"mlp.experts.{p}" for p in params], r)
    for layer in range(n_layer):
        got = layers.get(layer, {})
        module = f"model.layers.{layer}.mlp.experts"
        if gate_up:
            ab = _gate_up(arch, layer, got, shapes, r, problems)
            out.params[module + (".base_layer" if "down" in shapes else "")] = ab
        if "down" in shapes:
            n, n_in, n_out = shapes["down"]
            a, b = got.get("down", (torch.zeros(n, r, n_in), torch.zeros(n, n_out, r)))
            out.params[module] = _flat(a, b)
    return out


def _gate_up(
    arch: str,
    layer: int,
    got: dict[str, tuple[torch.Tensor, torch.Tensor]],
    shapes: dict[str, tuple[int, int, int]],
    r: int,
    problems: list[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's gate and up pairs as gate_up_proj's factors (one A, B's rows gate and up)."""
    n, n_in, n_ff = shapes.get("gate") or shapes["up"]
    zero = (torch.zeros(n, r, n_in), torch.zeros(n, n_ff, r))
    ag, bg = got.get("gate", (None, None))
    au, bu = got.get("up", (None, None))
    if ag is not None and au is not None and not torch.equal(ag, au):
        problems.append(
            f"tensors blk.{layer}.ffn_gate_exps.weight.lora_a and blk.{layer}.ffn_up_exps."
            "weight.lora_a differ, but PEFT's experts.gate_up_proj has one A for gate and up"
        )
    a = ag if ag is not None else au if au is not None else zero[0]
    b = torch.empty(n, 2 * n_ff, r)
    gate, up = gate_up_rows(arch, n_ff)
    b[:, gate] = bg if bg is not None else zero[1]
    b[:, up] = bu if bu is not None else zero[1]
    return _flat(a, b)


def _flat(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a (n_expert, r, n_in), b (n_expert, n_out, r) as PEFT's target_parameters factors: A
    (n_expert r, n_in) expert-major, B (n_out, r n_expert) rank-major."""
    n, r, n_in = a.shape
    # a view, not a copy, where r or n_expert is 1: safetensors writes contiguous tensors only
    b_flat = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
    return a.reshape(n * r, n_in).contiguous(), b_flat
