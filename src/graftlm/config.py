"""The model configuration, built from GGUF metadata in one function."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from graftlm.errors import ModelFileError


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key/query head size
    v_head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_neox: bool  # rotate halves (NeoX) rather than adjacent pairs (GPT-J / llama GGUF order)
    # Per-layer attention: sliding window (0 = global) and the RoPE base that layer uses.
    sliding_window: tuple[int, ...] = field(default_factory=tuple)
    rope_base_layer: tuple[float, ...] = field(default_factory=tuple)
    attn_scale: float = 0.0  # multiplier on q.k; 0 means 1/sqrt(head_dim)
    embed_scale: float = 1.0  # multiplier on the token embedding (gemma: sqrt(n_embd))
    tied_head: bool = False  # no output.weight: the head is token_embd
    name: str = ""
    # gemma2: cap * tanh(x / cap) on attention scores and on the logits (0 = off).
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Mixture of experts (llama/Mixtral): experts per layer and experts used per token (0 = dense).
    n_expert: int = 0
    n_expert_used: int = 0
    # LongRoPE (phi3): the training context that picks long or short factors, and the multiplier on
    # cos/sin (`rope.scaling.attn_factor`).
    n_ctx_orig: int = 0
    rope_attn_factor: float = 1.0

    @property
    def n_rep(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)


def _req(meta: dict[str, Any], key: str, path: str) -> Any:
    if key not in meta:
        raise ModelFileError(f"{path}: missing metadata field {key!r}")
    return meta[key]


def _per_layer(value: Any, n_layer: int, key: str, path: str) -> int:
    """GGUF allows a per-layer array for head counts; we need them uniform."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelFileError(f"{path}: per-layer {key} {value} is not supported")
        return int(value[0])
    return int(value)


def build_config(meta: dict[str, Any], tensor_names: set[str], path: str = "<gguf>") -> ModelConfig:
    """Read every hyperparameter the engine uses from GGUF metadata (llama.cpp's key names)."""
    arch = _req(meta, "general.architecture", path)
    p = arch + "."
    n_layer = int(_req(meta, p + "block_count", path))
    n_embd = int(_req(meta, p + "embedding_length", path))
    n_head = _per_layer(_req(meta, p + "attention.head_count", path), n_layer, "head_count", path)
    n_head_kv = _per_layer(
        meta.get(p + "attention.head_count_kv", n_head), n_layer, "head_count_kv", path
    )
    head_dim = int(meta.get(p + "attention.key_length", n_embd // n_head))
    v_head_dim = int(meta.get(p + "attention.value_length", head_dim))
    n_ff = _per_layer(
        _req(meta, p + "feed_forward_length", path), n_layer, "feed_forward_length", path
    )
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(meta.get(p + "vocab_size", len(tokens) if tokens is not None else 0))
    rope_base = float(meta.get(p + "rope.freq_base", 10000.0))
    rms_eps = float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5))
    window = int(meta.get(p + "attention.sliding_window", 0))

    sliding = [0] * n_layer
    rope_layer = [rope_base] * n_layer
    rope_neox = False
    attn_scale = 0.0
    embed_scale = 1.0
    attn_softcap = final_softcap = 0.0
    if arch == "gemma3":
        # llama.cpp: 5 of every 6 layers use the sliding window, with a fixed local RoPE base.
        rope_neox = True
        embed_scale = math.sqrt(n_embd)
        attn_scale = 1.0 / math.sqrt(head_dim)
        for i in range(n_layer):
            if i % 6 < 5:
                sliding[i] = window
                rope_layer[i] = float(meta.get(p + "rope.freq_base_swa", 10000.0))
    elif arch in ("qwen2", "qwen3", "phi3"):
        # their GGUF Q/K rows keep Hugging Face order (no permutation), so RoPE rotates halves.
        # phi3's `attention.sliding_window` is ignored as llama.cpp does (it disables Phi SWA).
        rope_neox = True
    elif arch == "gemma2":
        # llama.cpp: even layers slide (window defaults to 4096), soft-caps default to 50 and 30;
        # the 27B (46 layers) scales q by 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim).
        rope_neox = True
        embed_scale = math.sqrt(n_embd)
        attn_scale = 1.0 / math.sqrt(n_embd // n_head if n_layer == 46 else head_dim)
        window = window or 4096
        sliding = [window if i % 2 == 0 else 0 for i in range(n_layer)]
        attn_softcap = float(meta.get(p + "attn_logit_softcapping", 50.0))
        final_softcap = float(meta.get(p + "final_logit_softcapping", 30.0))

    return ModelConfig(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        n_ff=n_ff,
        n_vocab=n_vocab,
        n_ctx_train=int(meta.get(p + "context_length", 2048)),
        rms_eps=rms_eps,
        rope_base=rope_base,
        rope_dim=int(meta.get(p + "rope.dimension_count", head_dim)),
        rope_neox=rope_neox,
        sliding_window=tuple(sliding),
        rope_base_layer=tuple(rope_layer),
        attn_scale=attn_scale,
        embed_scale=embed_scale,
        tied_head="output.weight" not in tensor_names,
        name=str(meta.get("general.name", "")),
        attn_softcap=attn_softcap,
        final_softcap=final_softcap,
        n_expert=int(meta.get(p + "expert_count", 0)),
        n_expert_used=int(meta.get(p + "expert_used_count", 0)),
        n_ctx_orig=int(meta.get(p + "rope.scaling.original_context_length", 0)),
        rope_attn_factor=float(meta.get(p + "rope.scaling.attn_factor", 1.0)),
    )
