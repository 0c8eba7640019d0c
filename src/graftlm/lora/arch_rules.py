"""What llama.cpp's converter (`convert_hf_to_gguf.py`) did to each architecture's weights, as
an adapter must follow it: Hugging Face module names to GGUF base tensor names and back, and the
Q/K rows permuted for RoPE on llama-architecture files (`LlamaModel.permute`), and how each
family's routed experts are laid out in PEFT (per-expert modules, gate and up rows). PEFT
directories are read (peft.py, peft_experts.py) and written (convert.py, convert_experts.py)
through these rules.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import gguf
import torch

# Hugging Face module for each GGUF tensor kind: the way back from GGUF to PEFT. (The way there is
# gguf's TensorNameMap; a test checks that each of these maps forward to its own kind.)
_HF_MODULES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output": "lm_head",
    "attn_q": "model.layers.{bid}.self_attn.q_proj",
    "attn_k": "model.layers.{bid}.self_attn.k_proj",
    "attn_v": "model.layers.{bid}.self_attn.v_proj",
    "attn_output": "model.layers.{bid}.self_attn.o_proj",
    "ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "ffn_up": "model.layers.{bid}.mlp.up_proj",
    "ffn_down": "model.layers.{bid}.mlp.down_proj",
}


@dataclass(frozen=True)
class ExpertLinears:
    """A family's routed experts as per-expert nn.Linear modules (transformers before 5, the
    layout llama.cpp's converter reads): expert E of layer N is `model.layers.N.{stem}.E.{name}`."""

    stem: str  # "mlp.experts"
    names: Mapping[str, str]  # "gate", "up", "down" -> the module's own name ("gate_proj")


@dataclass(frozen=True)
class ArchRules:
    """What llama.cpp's `convert_hf_to_gguf.py` did to one architecture's projection weights."""

    model_arch: gguf.MODEL_ARCH
    # LlamaModel.undo_permute: Q/K rows reordered per head from HF's halves to adjacent pairs
    rope_permuted: bool
    hf_modules: Mapping[str, str] = field(default_factory=lambda: _HF_MODULES)
    # routed experts: their per-expert nn.Linear modules, None where the family has none (gpt-oss:
    # PEFT's target_parameters on mlp.experts.gate_up_proj / down_proj only)
    expert_linears: ExpertLinears | None = None
    # the experts' gate_up_proj alternates gate and up rows (expert e's gate rows 0::2; as
    # GptOssExperts reads it, and llama.cpp's converter splits the base weight), not [gate; up]
    gate_up_interleaved: bool = False


ARCH_RULES: dict[str, ArchRules] = {
    # also Mistral, SmolLM2 and Mixtral (its routed experts)
    "llama": ArchRules(
        gguf.MODEL_ARCH.LLAMA,
        rope_permuted=True,
        expert_linears=ExpertLinears(
            "block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"}
        ),
    ),
    "gemma3": ArchRules(gguf.MODEL_ARCH.GEMMA3, rope_permuted=False),
    "gemma2": ArchRules(gguf.MODEL_ARCH.GEMMA2, rope_permuted=False),
    "qwen2": ArchRules(gguf.MODEL_ARCH.QWEN2, rope_permuted=False),
    "qwen3": ArchRules(gguf.MODEL_ARCH.QWEN3, rope_permuted=False),
    # every layer routed: attention and the router take adapters (the experts are 3-D tensors)
    "qwen3moe": ArchRules(
        gguf.MODEL_ARCH.QWEN3MOE,
        rope_permuted=False,
        hf_modules={
            **{k: v for k, v in _HF_MODULES.items() if not k.startswith("ffn_")},
            "ffn_gate_inp": "model.layers.{bid}.mlp.gate",
        },
        expert_linears=ExpertLinears(
            "mlp.experts", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        ),
    ),
    # attention only: the router (GptOssTopKRouter) is no nn.Linear PEFT wraps, and the experts
    # are 3-D parameters
    "gpt-oss": ArchRules(
        gguf.MODEL_ARCH.GPT_OSS,
        rope_permuted=False,
        hf_modules={k: v for k, v in _HF_MODULES.items() if not k.startswith("ffn_")},
        gate_up_interleaved=True,
    ),
    # phi3 keeps its fused qkv_proj and gate_up_proj as attn_qkv and ffn_up (gate rows first)
    "phi3": ArchRules(
        gguf.MODEL_ARCH.PHI3,
        rope_permuted=False,
        hf_modules={
            **{
                k: v
                for k, v in _HF_MODULES.items()
                if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate")
            },
            "attn_qkv": "model.layers.{bid}.self_attn.qkv_proj",
            "ffn_up": "model.layers.{bid}.mlp.gate_up_proj",
        },
    ),
}
PERMUTED_KINDS = {"attn_q": "n_head", "attn_k": "n_head_kv"}
# Hugging Face checkpoints that nest the text model, as llama.cpp's LoRA converter strips them
_LM_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))


def arch_rules(arch: str) -> ArchRules | None:
    """The conversion rules of a GGUF architecture; None: PEFT names cannot be mapped for it."""
    return ARCH_RULES.get(arch)


def gate_up_rows(arch: str, n_ff: int) -> tuple[slice, slice]:
    """The gate rows and the up rows of a routed expert's (2 n_ff)-row gate_up_proj on `arch`."""
    rules = ARCH_RULES.get(arch)
    if rules is not None and rules.gate_up_interleaved:
        return slice(0, 2 * n_ff, 2), slice(1, 2 * n_ff, 2)
    return slice(0, n_ff), slice(n_ff, 2 * n_ff)


def hf_to_gguf(arch: str, n_layer: int, module: str) -> str | None:
    """GGUF base tensor name ("blk.0.attn_q") of a Hugging Face module name, or None."""
    rules = ARCH_RULES[arch]
    for prefix, repl in _LM_PREFIXES:
        if module.startswith(prefix):
            module = repl + module[len(prefix) :]
            break
    return _name_map(rules.model_arch, n_layer).get_name(module)


@functools.cache
def _name_map(arch: gguf.MODEL_ARCH, n_layer: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(arch, n_layer)  # builds a dict over every block: keep it


def gguf_to_hf(arch: str, base: str) -> str | None:
    """Hugging Face module name of a GGUF base tensor name, or None."""
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        template = ARCH_RULES[arch].hf_modules.get(parts[2])
        return (
            None if template is None or "{bid}" not in template else template.format(bid=parts[1])
        )
    template = ARCH_RULES[arch].hf_modules.get(base)
    return None if template is None or "{bid}" in template else template


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute over the rows of w (n_out, ...): per head, HF's two halves
    (x_0..x_{d/2-1}, y_0..y_{d/2-1}) become adjacent pairs (x_0, y_0, x_1, y_1, ...)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `permute_rows`."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
