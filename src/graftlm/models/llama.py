"""llama: Llama 2/3, Mistral, SmolLM2 (GQA, RoPE over adjacent pairs, SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graftlm.config import ModelConfig
from graftlm.models.base import Transformer, Weights
from graftlm.models.layers import Projection, attention, rms_norm
from graftlm.runtime.batch import Batch


class LlamaBlock:
    def __init__(self, cfg: ModelConfig, w: Weights, i: int) -> None:
        p = f"blk.{i}."
        d, hd, vd = cfg.n_embd, cfg.head_dim, cfg.v_head_dim
        self.attn_norm = w.vector(p + "attn_norm.weight")
        self.attn_q: Projection = w.proj(p + "attn_q", d, cfg.n_head * hd)
        self.attn_k: Projection = w.proj(p + "attn_k", d, cfg.n_head_kv * hd)
        self.attn_v: Projection = w.proj(p + "attn_v", d, cfg.n_head_kv * vd)
        self.attn_output: Projection = w.proj(p + "attn_output", cfg.n_head * vd, d)
        self.ffn_norm = w.vector(p + "ffn_norm.weight")
        self.ffn_gate: Projection = w.proj(p + "ffn_gate", d, cfg.n_ff)
        self.ffn_up: Projection = w.proj(p + "ffn_up", d, cfg.n_ff)
        self.ffn_down: Projection = w.proj(p + "ffn_down", cfg.n_ff, d)


class Llama(Transformer):
    arch = "llama"

    def __init__(self, cfg: ModelConfig, w: Weights, n_ctx: int) -> None:
        super().__init__(cfg, w, n_ctx)
        self.blocks = [LlamaBlock(cfg, w, i) for i in range(cfg.n_layer)]

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, b = self.cfg, self.blocks[i]
        B, T, _ = x.shape
        h = rms_norm(x, b.attn_norm, cfg.rms_eps)
        q = b.attn_q(h, batch).view(B, T, cfg.n_head, cfg.head_dim)
        k = b.attn_k(h, batch).view(B, T, cfg.n_head_kv, cfg.head_dim)
        v = b.attn_v(h, batch).view(B, T, cfg.n_head_kv, cfg.v_head_dim)
        rope = self.rope_of_layer[i]
        q, k = rope(q, batch.positions), rope(k, batch.positions)
        a = attention(q, k, v, i, batch, self.cache, cfg.scale, cfg.sliding_window[i])  # type: ignore[arg-type]
        x = x + b.attn_output(a, batch)
        h = rms_norm(x, b.ffn_norm, cfg.rms_eps)
        h = F.silu(b.ffn_gate(h, batch)) * b.ffn_up(h, batch)
        return x + b.ffn_down(h, batch)
