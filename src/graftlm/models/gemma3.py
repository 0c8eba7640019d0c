"""gemma3: sliding-window attention on 5 of every 6 layers, QK-norm, pre- and post-norms,
embeddings scaled by sqrt(n_embd), GELU-tanh gated FFN, RoPE over halves.

GGUF gemma norms already hold (1 + w): llama.cpp's converter adds the one.
"""

from __future__ import annotations

import torch

from graftlm.config import ModelConfig
from graftlm.models.base import Transformer, Weights
from graftlm.models.fused import LayerSpec
from graftlm.models.primitives import rms_norm
from graftlm.models.seam import Projection
from graftlm.step.batch import Batch


class Gemma3Block:
    def __init__(self, cfg: ModelConfig, w: Weights, i: int) -> None:
        p = f"blk.{i}."
        d, vd = cfg.n_embd, cfg.v_head_dim
        self.attn_norm = w.vector(p + "attn_norm.weight", cfg.n_embd)
        self.attn_qkv = w.attn_qkv(cfg, i)
        self.attn_q_norm = w.vector(p + "attn_q_norm.weight", cfg.head_dim)
        self.attn_k_norm = w.vector(p + "attn_k_norm.weight", cfg.head_dim)
        self.attn_output: Projection = w.proj(p + "attn_output", cfg.n_head * vd, d)
        self.post_attention_norm = w.vector(p + "post_attention_norm.weight", cfg.n_embd)
        self.ffn_norm = w.vector(p + "ffn_norm.weight", cfg.n_embd)
        self.ffn_gate_up = w.ffn_gate_up(cfg, i)
        self.ffn_down: Projection = w.proj(p + "ffn_down", cfg.n_ff, d)
        self.post_ffw_norm = w.vector(p + "post_ffw_norm.weight", cfg.n_embd)


class Gemma3(Transformer):
    arch = "gemma3"

    def __init__(self, cfg: ModelConfig, w: Weights, n_ctx: int) -> None:
        super().__init__(cfg, w, n_ctx)
        self.blocks = [Gemma3Block(cfg, w, i) for i in range(cfg.n_layer)]

    def layer_spec(self, i: int) -> LayerSpec | None:
        b = self.blocks[i]
        return LayerSpec.of(
            b.attn_qkv, b.attn_output, b.ffn_gate_up, b.ffn_down, b.attn_norm, b.ffn_norm,
            act="gelu_tanh", q_norm=b.attn_q_norm, k_norm=b.attn_k_norm,
            post_attn_norm=b.post_attention_norm, post_ffw_norm=b.post_ffw_norm,
        )  # fmt: skip

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, b = self.cfg, self.blocks[i]
        eps = cfg.rms_eps
        h = rms_norm(x, b.attn_norm, eps)
        q, k, v = b.attn_qkv(h, batch)
        a = self.attend(i, q, k, v, batch, b.attn_q_norm, b.attn_k_norm)
        x = x + rms_norm(b.attn_output(a, batch), b.post_attention_norm, eps)
        h = rms_norm(x, b.ffn_norm, eps)
        h = b.ffn_gate_up.gated(h, batch, "gelu_tanh")
        return x + rms_norm(b.ffn_down(h, batch), b.post_ffw_norm, eps)
