"""phi3: Phi-3 / Phi-3.5 (mini, medium). A llama-like block whose GGUF tensors are fused:
`attn_qkv` holds q, then k, then v rows; `ffn_up` holds the gate rows, then the up rows (there is
no `ffn_gate`). RoPE over halves, with LongRoPE factors when the file has them.

The fused tensors stay one projection each (one matmul, split after), so an adapter on
`attn_qkv` or on the fused `ffn_up` lands on exactly the weight it was trained on: no row mapping
(`fused_targets`) is needed, and a PEFT `qkv_proj` / `gate_up_proj` adapter maps one to one.
"""

from __future__ import annotations

import torch

from graftlm.config import ModelConfig
from graftlm.errors import ModelFileError
from graftlm.models.base import Transformer, Weights
from graftlm.models.fused import LayerSpec
from graftlm.models.primitives import Rope, attention, gated, rms_norm
from graftlm.models.seam import Projection
from graftlm.step.batch import Batch

LONG, SHORT = "rope_factors_long.weight", "rope_factors_short.weight"


class Phi3Block:
    def __init__(self, cfg: ModelConfig, w: Weights, i: int) -> None:
        p = f"blk.{i}."
        d = cfg.n_embd
        n_qkv = cfg.n_head * cfg.head_dim + cfg.n_head_kv * (cfg.head_dim + cfg.v_head_dim)
        self.attn_norm = w.vector(p + "attn_norm.weight", cfg.n_embd)
        self.attn_qkv: Projection = w.proj(p + "attn_qkv", d, n_qkv)  # rows: q | k | v
        self.attn_output: Projection = w.proj(p + "attn_output", cfg.n_head * cfg.v_head_dim, d)
        self.ffn_norm = w.vector(p + "ffn_norm.weight", cfg.n_embd)
        self.ffn_up: Projection = w.proj(p + "ffn_up", d, 2 * cfg.n_ff)  # rows: gate | up
        self.ffn_down: Projection = w.proj(p + "ffn_down", cfg.n_ff, d)


class Phi3(Transformer):
    arch = "phi3"

    def __init__(self, cfg: ModelConfig, w: Weights, n_ctx: int) -> None:
        super().__init__(cfg, w, n_ctx)
        factors = None
        if w.has(LONG) or w.has(SHORT):
            # llama.cpp picks the set once, from the context size (not the sequence length):
            # long when a sequence may run past the training context.
            n_orig = cfg.n_ctx_orig or cfg.n_ctx_train
            name = LONG if n_ctx > n_orig else SHORT
            factors = w.vector(name)
            if factors.numel() != cfg.rope_dim // 2:
                raise ModelFileError(
                    f"{w.file.path}: tensor {name!r} has {factors.numel()} values, "
                    f"expected rope_dim / 2 = {cfg.rope_dim // 2}"
                )
        if factors is not None or cfg.rope_attn_factor != 1.0:
            rope = Rope(
                cfg.rope_dim, cfg.rope_base, n_ctx, cfg.rope_neox, factors, cfg.rope_attn_factor
            )
            self.rope_of_layer = [rope] * cfg.n_layer
        self.blocks = [Phi3Block(cfg, w, i) for i in range(cfg.n_layer)]

    def layer_spec(self, i: int) -> LayerSpec | None:
        """The fused tensors are the stacked projections the native layer takes: attn_qkv's rows
        q | k | v, ffn_up's gate | up (LongRoPE's factors and scale live in the RoPE tables)."""
        b = self.blocks[i]
        return LayerSpec([b.attn_qkv], b.attn_output, b.ffn_up, b.ffn_down, b.attn_norm, b.ffn_norm)

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, b = self.cfg, self.blocks[i]
        B, T, _ = x.shape
        n_q, n_k = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        h = rms_norm(x, b.attn_norm, cfg.rms_eps)
        q, k, v = b.attn_qkv(h, batch).split([n_q, n_k, cfg.n_head_kv * cfg.v_head_dim], dim=-1)
        q = q.reshape(B, T, cfg.n_head, cfg.head_dim)
        k = k.reshape(B, T, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(B, T, cfg.n_head_kv, cfg.v_head_dim)
        rope = self.rope_of_layer[i]
        q, k = rope(q, batch.positions), rope(k, batch.positions)
        assert self.cache is not None
        a = attention(q, k, v, i, batch, self.cache, cfg.scale, cfg.sliding_window[i])
        x = x + b.attn_output(a, batch)
        h = rms_norm(x, b.ffn_norm, cfg.rms_eps)
        return x + b.ffn_down(gated(b.ffn_up(h, batch), "silu"), batch)  # ffn_up: gate | up
