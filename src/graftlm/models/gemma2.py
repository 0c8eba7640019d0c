"""gemma2: soft-capped attention scores and logits (cap * tanh(x / cap)), a sliding window on
even layers, pre- and post-norms around attention and FFN, embeddings scaled by sqrt(n_embd),
GELU-tanh gated FFN, RoPE over halves, tied head.

GGUF gemma norms already hold (1 + w): llama.cpp's converter adds the one.
"""

from __future__ import annotations

import torch

from graftlm.config import ModelConfig
from graftlm.models.base import Transformer, Weights
from graftlm.models.fused import LayerSpec
from graftlm.models.primitives import attention, rms_norm, softcap
from graftlm.models.seam import Projection
from graftlm.step.batch import Batch


class Gemma2Block:
    def __init__(self, cfg: ModelConfig, w: Weights, i: int) -> None:
        p = f"blk.{i}."
        d, vd = cfg.n_embd, cfg.v_head_dim
        self.attn_norm = w.vector(p + "attn_norm.weight", cfg.n_embd)
        self.attn_qkv = w.attn_qkv(cfg, i)
        self.attn_output: Projection = w.proj(p + "attn_output", cfg.n_head * vd, d)
        self.post_attention_norm = w.vector(p + "post_attention_norm.weight", cfg.n_embd)
        self.ffn_norm = w.vector(p + "ffn_norm.weight", cfg.n_embd)
        self.ffn_gate_up = w.ffn_gate_up(cfg, i)
        self.ffn_down: Projection = w.proj(p + "ffn_down", cfg.n_ff, d)
        self.post_ffw_norm = w.vector(p + "post_ffw_norm.weight", cfg.n_embd)


class Gemma2(Transformer):
    arch = "gemma2"

    def __init__(self, cfg: ModelConfig, w: Weights, n_ctx: int) -> None:
        super().__init__(cfg, w, n_ctx)
        self.blocks = [Gemma2Block(cfg, w, i) for i in range(cfg.n_layer)]

    def layer_spec(self, i: int) -> LayerSpec | None:
        """gemma-3's layer without QK-norm, with the soft-capped attention scores."""
        b = self.blocks[i]
        return LayerSpec.of(
            b.attn_qkv, b.attn_output, b.ffn_gate_up, b.ffn_down, b.attn_norm, b.ffn_norm,
            act="gelu_tanh", post_attn_norm=b.post_attention_norm, post_ffw_norm=b.post_ffw_norm,
            softcap=self.cfg.attn_softcap,
        )  # fmt: skip

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, b = self.cfg, self.blocks[i]
        B, T, _ = x.shape
        eps = cfg.rms_eps
        h = rms_norm(x, b.attn_norm, eps)
        q, k, v = b.attn_qkv(h, batch)
        q = q.view(B, T, cfg.n_head, cfg.head_dim)
        k = k.view(B, T, cfg.n_head_kv, cfg.head_dim)
        v = v.view(B, T, cfg.n_head_kv, cfg.v_head_dim)
        rope = self.rope_of_layer[i]
        q, k = rope(q, batch.positions), rope(k, batch.positions)
        assert self.cache is not None
        window, cap = cfg.sliding_window[i], cfg.attn_softcap
        a = attention(q, k, v, i, batch, self.cache, cfg.scale, window, cap)
        x = x + rms_norm(b.attn_output(a, batch), b.post_attention_norm, eps)
        h = b.ffn_gate_up.gated(rms_norm(x, b.ffn_norm, eps), batch, "gelu_tanh")
        return x + rms_norm(b.ffn_down(h, batch), b.post_ffw_norm, eps)

    def forward(self, batch: Batch, all_logits: bool = False, hidden: bool = False) -> torch.Tensor:
        out = super().forward(batch, all_logits, hidden)
        return out if hidden else softcap(out, self.cfg.final_softcap)
