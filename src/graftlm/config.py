"""The model configuration, built from GGUF metadata in one function."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypedDict

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
    # Mixture of experts (llama/Mixtral, qwen3moe): experts per layer and experts used per token
    # (0 = dense); n_ff is then an expert's width.
    n_expert: int = 0
    n_expert_used: int = 0
    # LongRoPE (phi3): the training context that picks long or short factors, and the multiplier on
    # cos/sin (`rope.scaling.attn_factor`).
    n_ctx_orig: int = 0
    rope_attn_factor: float = 1.0
    # YaRN (gpt-oss; other families ignore `rope.scaling.type = yarn` as before): the context's
    # stretch `rope.scaling.factor` over n_ctx_orig (0 = no YaRN), the ramp's rotation counts, its
    # extrapolation mix, and the cos/sin multiplier (0: llama.cpp's default 1 + 0.1 ln(factor)).
    yarn_factor: float = 0.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ext_factor: float = 1.0
    yarn_attn_factor: float = 0.0

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)


def _req(meta: dict[str, Any], key: str, path: str) -> Any:
    if key not in meta:
        raise ModelFileError(f"{path}: missing metadata field {key!r}")
    return meta[key]


MAX_LAYERS = 1024  # deepest model known is ~200 layers
MAX_DIM = 1 << 20  # widths, heads, vocabulary: far past any model, short of a made-up size


def whole_field(value: Any, key: str, path: str, lo: int = 1, hi: int = MAX_DIM) -> int:
    """value as an int in [lo, hi], or ModelFileError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(
            f"{path}: metadata field {key!r} must be a whole number, got {type(value).__name__} "
            f"{value!r}"[:300]
        )
    if not lo <= value <= hi:
        raise ModelFileError(f"{path}: metadata field {key!r} is {value}; expected {lo}..{hi}")
    return value


def _number(value: Any, key: str, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelFileError(
            f"{path}: metadata field {key!r} must be a finite number, got {value!r}"[:300]
        )
    return float(value)


def _per_layer(value: Any, n_layer: int, key: str, path: str, lo: int = 1) -> int:
    """GGUF allows a per-layer array for head counts; we need them uniform."""
    if isinstance(value, list):  # (an array of arrays: found by the field-type fuzzer)
        if any(isinstance(v, list) for v in value) or len(set(value)) != 1:
            raise ModelFileError(f"{path}: per-layer {key} {value[:8]} is not supported"[:300])
        value = value[0]
    return whole_field(value, key, path, lo)


def _check_blocks(n_layer: int, tensor_names: set[str], key: str, path: str) -> None:
    """Every block the metadata declares has tensors, and no tensor names a block past them."""
    present = {
        int(n.split(".")[1])
        for n in tensor_names
        if n.startswith("blk.") and n.split(".")[1].isdigit()
    }
    if present != set(range(n_layer)):
        have = f"blocks {min(present)}..{max(present)}" if present else "no block tensors"
        raise ModelFileError(f"{path}: {key} = {n_layer}, but the file has tensors for {have}")


def build_config(meta: dict[str, Any], tensor_names: set[str], path: str = "<gguf>") -> ModelConfig:
    """Read every hyperparameter the engine uses from GGUF metadata (llama.cpp's key names)."""
    arch = _req(meta, "general.architecture", path)
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: metadata field 'general.architecture' must be a string")
    p = arch + "."
    n_layer = whole_field(
        _req(meta, p + "block_count", path), p + "block_count", path, 1, MAX_LAYERS
    )
    _check_blocks(n_layer, tensor_names, p + "block_count", path)
    widths = _widths(meta, p, n_layer, path)
    rope_base = _number(meta.get(p + "rope.freq_base", 10000.0), p + "rope.freq_base", path)
    key = p + "attention.layer_norm_rms_epsilon"
    rms_eps = _number(meta.get(key, 1e-5), key, path)
    key = p + "attention.sliding_window"
    window = whole_field(meta.get(key, 0), key, path, 0, 1 << 31)
    family = _family_attention(arch, meta, n_layer, widths, window, rope_base, path)
    head_dim = widths["head_dim"]
    key = p + "rope.scaling.attn_factor"
    cfg = ModelConfig(
        arch=arch,
        n_layer=n_layer,
        **widths,
        n_ctx_train=whole_field(
            meta.get(p + "context_length", 2048), p + "context_length", path, 1, 1 << 31
        ),
        rms_eps=rms_eps,
        rope_base=rope_base,
        rope_dim=whole_field(
            meta.get(p + "rope.dimension_count", head_dim),
            p + "rope.dimension_count",
            path,
            0,
            head_dim,
        ),
        **family,
        tied_head="output.weight" not in tensor_names,
        name=str(meta.get("general.name", "")),
        n_expert_used=whole_field(
            meta.get(p + "expert_used_count", 0), p + "expert_used_count", path, 0, 1024
        ),
        n_ctx_orig=whole_field(
            meta.get(p + "rope.scaling.original_context_length", 0),
            p + "rope.scaling.original_context_length",
            path,
            0,
            1 << 31,
        ),
        rope_attn_factor=_number(meta.get(key, 1.0), key, path),
        **(_yarn(meta, p, path) if arch == "gpt-oss" else {}),
    )
    # last, so that a value out of range is named as such: the stored types, as llama.cpp
    # checks them (a context length stored as INT64 or FLOAT32, a RoPE base as UINT32)
    refusal = _type_refusal(meta, [k for k in meta if k.startswith((p, "general."))])
    if refusal:
        raise ModelFileError(f"{path}: {refusal}")
    return cfg


def _type_refusal(meta: dict[str, Any], keys: list[str]) -> str | None:
    """The keys stored as another type than llama.cpp reads them as, in its words: metadata read
    from a file (graftlm.gguf's Metadata, a floor above this one) compares them with the spec;
    a plain dict has no stored types."""
    check = getattr(meta, "type_refusal", None)
    return check(keys) if check is not None else None


def _yarn(meta: dict[str, Any], p: str, path: str) -> dict[str, float]:
    """ModelConfig's yarn_* fields from `rope.scaling.*` where the type is yarn, else none."""
    if meta.get(p + "rope.scaling.type") != "yarn":
        return {}
    out: dict[str, float] = {}
    for field_name, key, default in (
        ("yarn_factor", "rope.scaling.factor", None),
        ("yarn_beta_fast", "rope.scaling.yarn_beta_fast", 32.0),
        ("yarn_beta_slow", "rope.scaling.yarn_beta_slow", 1.0),
        ("yarn_ext_factor", "rope.scaling.yarn_ext_factor", 1.0),
        ("yarn_attn_factor", "rope.scaling.yarn_attn_factor", 0.0),
    ):
        value = _req(meta, p + key, path) if default is None else meta.get(p + key, default)
        out[field_name] = _number(value, p + key, path)
    if not out["yarn_factor"] >= 1.0:
        raise ModelFileError(
            f"{path}: metadata field {p + 'rope.scaling.factor'!r} is {out['yarn_factor']}; "
            "YaRN stretches the context by a factor of at least 1"
        )
    return out


class _Widths(TypedDict):
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    v_head_dim: int
    n_ff: int
    n_expert: int
    n_vocab: int


class _FamilyAttention(TypedDict):
    rope_neox: bool
    sliding_window: tuple[int, ...]
    rope_base_layer: tuple[float, ...]
    attn_scale: float
    embed_scale: float
    attn_softcap: float
    final_softcap: float


def _widths(meta: dict[str, Any], p: str, n_layer: int, path: str) -> _Widths:
    """The model's sizes (ModelConfig's fields of those names): width, heads and their sizes,
    the feed-forward's (an expert's, with experts), experts, vocabulary."""
    n_embd = whole_field(_req(meta, p + "embedding_length", path), p + "embedding_length", path)
    key = p + "attention.head_count"
    n_head = _per_layer(_req(meta, key, path), n_layer, key, path)
    key = p + "attention.head_count_kv"
    n_head_kv = _per_layer(meta.get(key, n_head), n_layer, key, path)
    if n_head % n_head_kv:
        raise ModelFileError(
            f"{path}: {n_head} attention heads cannot share {n_head_kv} key/value heads evenly"
        )
    key = p + "attention.key_length"
    head_dim = whole_field(meta.get(key, n_embd // n_head), key, path)
    key = p + "attention.value_length"
    v_head_dim = whole_field(meta.get(key, head_dim), key, path)
    key = p + "feed_forward_length"
    n_ff = _per_layer(_req(meta, key, path), n_layer, key, path, lo=0)
    n_expert = whole_field(meta.get(p + "expert_count", 0), p + "expert_count", path, 0, 1024)
    key = p + "expert_feed_forward_length"
    if n_expert and key in meta:  # qwen3moe: every layer routed, its experts this wide
        n_ff = whole_field(meta[key], key, path)
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else 0
    n_vocab = whole_field(meta.get(p + "vocab_size", n_tokens), p + "vocab_size", path)
    return _Widths(
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        n_ff=n_ff,
        n_expert=n_expert,
        n_vocab=n_vocab,
    )


def _family_attention(
    arch: str,
    meta: dict[str, Any],
    n_layer: int,
    widths: _Widths,
    window: int,
    rope_base: float,
    path: str,
) -> _FamilyAttention:
    """What a family does to attention and embedding as llama.cpp runs it (ModelConfig's fields
    of those names): RoPE layout, per-layer sliding windows and RoPE bases, scales, soft-caps."""
    p = arch + "."
    n_embd, n_head, head_dim = widths["n_embd"], widths["n_head"], widths["head_dim"]
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
        key = p + "rope.freq_base_swa"
        local_base = _number(meta.get(key, 10000.0), key, path)
        for i in range(n_layer):
            if i % 6 < 5:
                sliding[i] = window
                rope_layer[i] = local_base
    elif arch in ("qwen2", "qwen3", "qwen3moe", "phi3"):
        # their GGUF Q/K rows keep Hugging Face order (no permutation), so RoPE rotates halves.
        # phi3's `attention.sliding_window` is ignored as llama.cpp does (it disables Phi SWA).
        rope_neox = True
    elif arch == "gpt-oss":
        # llama.cpp: even layers slide (`attention.sliding_window`, 128 in the released models),
        # odd layers attend to the whole context; RoPE over halves
        rope_neox = True
        sliding = [window if i % 2 == 0 else 0 for i in range(n_layer)]
    elif arch == "gemma2":
        # llama.cpp: even layers slide (window defaults to 4096), soft-caps default to 50 and 30;
        # the 27B (46 layers) scales q by 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim).
        rope_neox = True
        embed_scale = math.sqrt(n_embd)
        attn_scale = 1.0 / math.sqrt(n_embd // n_head if n_layer == 46 else head_dim)
        window = window or 4096
        sliding = [window if i % 2 == 0 else 0 for i in range(n_layer)]
        key = p + "attn_logit_softcapping"
        attn_softcap = _number(meta.get(key, 50.0), key, path)
        key = p + "final_logit_softcapping"
        final_softcap = _number(meta.get(key, 30.0), key, path)
    return _FamilyAttention(
        rope_neox=rope_neox,
        sliding_window=tuple(sliding),
        rope_base_layer=tuple(rope_layer),
        attn_scale=attn_scale,
        embed_scale=embed_scale,
        attn_softcap=attn_softcap,
        final_softcap=final_softcap,
    )
