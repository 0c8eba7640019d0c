"""PEFT LoRA on routed experts, in the two forms PEFT saves it, read into one pair an expert.

Per-expert nn.Linear (transformers before 5: Qwen3-MoE's mlp.experts.N.gate_proj, Mixtral's
block_sparse_moe.experts.N.w1), which llama.cpp's converter stacks per layer: A (r, n_in),
B (n_out, r), for expert N of the stacked base tensor.

target_parameters (transformers 5: PEFT's ParamWrapper on a (n_expert, n_out, n_in) parameter,
mlp.experts.gate_up_proj or mlp.experts.down_proj): A (r * n_expert, n_in) whose rows are
expert-major, B (n_out, r * n_expert) whose columns are rank-major (expert e's: e::n_expert);
gate_up_proj's rows are [gate; up], except gpt-oss's, whose gate and up rows alternate
(GptOssExperts: gate_up[..., ::2] is the gate, as llama.cpp's converter splits the base weight).
gpt-oss's parameters are stored (n_expert, n_in, n_out) (x @ W), and PEFT does not swap in and out
for them, so its factors have the same shapes and meaning as the other families'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from graftlm.lora.arch_rules import ARCH_RULES, gate_up_rows
from graftlm.lora.peft_base import BaseInfo, LoraPair, dtype_problems, fit_problems
from graftlm.lora.peft_config import CONFIG_FILE, PeftConfig

# every family's per-expert nn.Linear names (arch_rules.ExpertLinears): "w1" -> "ffn_gate_exps"
_LINEARS = [r.expert_linears for r in ARCH_RULES.values() if r.expert_linears is not None]
_EXPERT_KIND = {name: f"ffn_{kind}_exps" for x in _LINEARS for kind, name in x.names.items()}
# a routed expert as its own nn.Linear: layers.N.{stem}.E.{name}, in any family's names
_EXPERT_LINEAR = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:"
    + "|".join(sorted({re.escape(x.stem) for x in _LINEARS}))
    + r")\.(\d+)\.("
    + "|".join(_EXPERT_KIND)
    + ")"
)
# the experts' 3-D parameters as PEFT's target_parameters wraps them (transformers 5): one
# ParamWrapper a parameter, nested (".base_layer") when a module has several
_EXPERT_PARAMS = re.compile(r"(?:.*\.)?layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)")


@dataclass(frozen=True)
class _Factors:
    """An expert module's lora_A / lora_B: their keys and header shapes, and its config's rank."""

    module: str
    where: str  # "adapter_model.safetensors: module '...'", how problems name the module
    a_key: str
    b_key: str
    sa: list[int]
    sb: list[int]
    rank: int
    alpha: float


def stacked_experts_module(module: str) -> bool:
    """Whether a PEFT module name is the `target_parameters` form on a layer's experts (its A
    stacks the experts' factors), as read_experts reads it."""
    return _EXPERT_PARAMS.fullmatch(module) is not None


def read_experts(
    st: Any,
    module: str,
    parts: dict[str, tuple[str, bool]],
    cfg: PeftConfig,
    base: BaseInfo,
    problems: list[str],
    where: str,
) -> list[LoraPair] | None:
    """A routed expert's LoRA, one pair an expert and file tensor; None when `module` is no
    expert, [] when it is one that does not fit (`problems` says why)."""
    lin, par = _EXPERT_LINEAR.fullmatch(module), _EXPERT_PARAMS.fullmatch(module)
    if lin is None and par is None:
        return None
    layer = int((lin or par).group(1))  # type: ignore[union-attr]
    f = _factors(st, module, parts, cfg, layer, base, problems, where)
    if f is None:
        return []
    if lin is not None:
        e, kind = int(lin.group(2)), _EXPERT_KIND[lin.group(3)]
        return _read_linear(st, f, cfg, f"blk.{layer}.{kind}", e, base, problems)
    return _read_parameter(st, f, cfg, layer, base, problems)


def _factors(
    st: Any,
    module: str,
    parts: dict[str, tuple[str, bool]],
    cfg: PeftConfig,
    layer: int,
    base: BaseInfo,
    problems: list[str],
    where: str,
) -> _Factors | None:
    """The checks both forms share (the layer, the tensors' layout, 2-D shapes from the header:
    nothing is read yet); None, with the problem, where one fails."""
    if layer >= base.n_layer:
        problems.append(f"{where}: layer {layer}, but the base has {base.n_layer} layers")
        return None
    if parts["a"][1] or parts["b"][1]:
        problems.append(f"{where}: expected lora_A/B.weight tensors for an expert")
        return None
    sa = list(st.get_slice(parts["a"][0]).get_shape())
    sb = list(st.get_slice(parts["b"][0]).get_shape())
    if len(sa) != 2 or len(sb) != 2:
        problems.append(f"{where}: lora_A {sa} and lora_B {sb} must both be 2-D")
        return None
    bad = dtype_problems(st, parts["a"][0], parts["b"][0])
    if bad:
        problems.append(f"{where}: " + "; ".join(bad))
        return None
    r_cfg, alpha = cfg.rank_alpha(module)
    return _Factors(module, where, parts["a"][0], parts["b"][0], sa, sb, r_cfg, alpha)


def _read_linear(
    st: Any, f: _Factors, cfg: PeftConfig, gname: str, e: int, base: BaseInfo, problems: list[str]
) -> list[LoraPair]:
    """Expert `e`'s own nn.Linear: one pair for row `e` of the stacked base tensor `gname`."""
    if not cfg.targets(f.module):
        problems.append(f"{f.where}: not selected by target_modules in {CONFIG_FILE}")
        return []
    shape = base.lookup(gname)
    if isinstance(shape, str):
        problems.append(f"{f.where} -> {gname}.weight: {shape}")
        return []
    bad = fit_problems(f.sa, f.sb, *shape, f.rank)
    if e >= base.n_expert:
        bad.append(f"expert {e}, but the base has {base.n_expert} experts")
    if bad:
        problems.append(f"{f.where} -> {gname}.weight[{e}]: " + "; ".join(bad))
        return []
    a, b = st.get_tensor(f.a_key).float(), st.get_tensor(f.b_key).float()
    return [LoraPair(f.module, gname, a, b, cfg.scaling(f.module), f.rank, f.alpha, e)]


def _read_parameter(
    st: Any, f: _Factors, cfg: PeftConfig, layer: int, base: BaseInfo, problems: list[str]
) -> list[LoraPair]:
    """A target_parameters LoRA on all of a layer's experts: one pair an expert (two for
    gate_up_proj: its gate rows and its up rows)."""
    dims = _expert_dims(f, layer, base, problems)
    if dims is None:
        return []
    n, n_embd, n_ff = dims
    param = _which_parameter(f, cfg, n_embd, n_ff, problems)
    if param is None:
        return []
    if f.sa[0] != f.sb[1] or f.sa[0] != f.rank * n:
        problems.append(
            f"{f.where} (experts.{param}): lora_A {f.sa} and lora_B {f.sb} must have r * n_expert "
            f"= {f.rank} * {n} = {f.rank * n} rank rows (r = {f.rank} in {CONFIG_FILE}, {n} "
            "experts in the base)"
        )
        return []
    a = st.get_tensor(f.a_key).float().reshape(n, f.rank, f.sa[1])  # (n_expert, r, n_in)
    b = st.get_tensor(f.b_key).float().reshape(f.sb[0], f.rank, n).permute(2, 0, 1)
    return _per_expert(f, cfg.scaling(f.module), layer, param, a, b, gate_up_rows(base.arch, n_ff))


def _expert_dims(
    f: _Factors, layer: int, base: BaseInfo, problems: list[str]
) -> tuple[int, int, int] | None:
    """(n_expert, n_embd, n_ff) of the layer's routed experts; None, with the problem, where it
    has none."""
    n = base.n_expert
    up, down = base.lookup(f"blk.{layer}.ffn_up_exps"), base.lookup(f"blk.{layer}.ffn_down_exps")
    if isinstance(up, str) or isinstance(down, str) or not n:
        why = up if isinstance(up, str) else down if isinstance(down, str) else "no experts"
        problems.append(f"{f.where}: the base has no routed experts in layer {layer} ({why})")
        return None
    return n, up[0], up[1]


def _which_parameter(
    f: _Factors, cfg: PeftConfig, n_embd: int, n_ff: int, problems: list[str]
) -> str | None:
    """gate_up_proj or down_proj, told by the factors' shapes (the nesting follows the order of
    the module's parameters, not the config's), and listed in target_parameters."""
    params = {"gate_up_proj": (n_embd, 2 * n_ff), "down_proj": (n_ff, n_embd)}
    param = next((k for k, (i, o) in params.items() if [f.sa[1], f.sb[0]] == [i, o]), None)
    if param is None:
        problems.append(
            f"{f.where}: lora_A {f.sa} and lora_B {f.sb} fit neither experts.gate_up_proj "
            f"(n_in {n_embd}, n_out {2 * n_ff}) nor experts.down_proj (n_in {n_ff}, n_out "
            f"{n_embd}) of the base"
        )
        return None
    if not any(t == param or t.endswith("." + param) for t in cfg.target_parameters):
        problems.append(f"{f.where}: experts.{param} is not in target_parameters in {CONFIG_FILE}")
        return None
    return param


def _per_expert(
    f: _Factors,
    s: float,
    layer: int,
    param: str,
    a: torch.Tensor,
    b: torch.Tensor,
    halves: tuple[slice, slice],
) -> list[LoraPair]:
    """a (n_expert, r, n_in), b (n_expert, n_out, r) split into each expert's pairs; `halves`:
    gate_up_proj's gate rows and up rows."""
    out = []
    for e in range(a.shape[0]):
        be = b[e].contiguous()  # (n_out, r)
        if param == "down_proj":
            out.append(
                LoraPair(f.module, f"blk.{layer}.ffn_down_exps", a[e], be, s, f.rank, f.alpha, e)
            )
            continue
        for kind, rows in zip(("ffn_gate_exps", "ffn_up_exps"), halves, strict=True):
            be_rows = be[rows].contiguous()
            out.append(
                LoraPair(f.module, f"blk.{layer}.{kind}", a[e], be_rows, s, f.rank, f.alpha, e)
            )
    return out
