"""qwen3: the llama block with an RMS norm over each head of q and k (QK-norm) before RoPE, RoPE
over halves, no biases."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from graftlm.config import ModelConfig
from graftlm.models.base import Weights
from graftlm.models.fused import LayerSpec
from graftlm.models.layers import rms_norm
from graftlm.models.llama import Llama, LlamaBlock
from graftlm.step.batch import Batch


class Qwen3Block(LlamaBlock):
    def __init__(self, cfg: ModelConfig, w: Weights, i: int) -> None:
        super().__init__(cfg, w, i)
        p = f"blk.{i}."
        self.attn_q_norm = w.vector(
            p + "attn_q_norm.weight", cfg.head_dim
        )  # (head_dim,), shared by all heads
        self.attn_k_norm = w.vector(p + "attn_k_norm.weight", cfg.head_dim)


class Qwen3(Llama):
    arch = "qwen3"
    Block = Qwen3Block
    blocks: list[Qwen3Block]

    def layer_spec(self, i: int) -> LayerSpec | None:
        """The llama layer's spec plus the per-head QK-norm (the native layer's gemma-3 path)."""
        spec = super().layer_spec(i)
        if spec is None:
            return None
        b = self.blocks[i]
        return dataclasses.replace(spec, q_norm=b.attn_q_norm, k_norm=b.attn_k_norm)

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, b = self.cfg, self.blocks[i]
        eps = cfg.rms_eps
        h = rms_norm(x, b.attn_norm, eps)
        q, k, v = b.attn_qkv(h, batch)
        a = self.attend(i, q, k, v, batch, b.attn_q_norm, b.attn_k_norm)
        x = x + b.attn_output(a, batch)
        h = rms_norm(x, b.ffn_norm, eps)
        gate, up = b.ffn_gate_up(h, batch)
        return x + b.ffn_down(F.silu(gate) * up, batch)
