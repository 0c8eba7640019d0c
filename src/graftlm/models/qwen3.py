"""qwen3: the llama block with an RMS norm over each head of q and k (QK-norm) before RoPE, RoPE
over halves, no biases. Llama's block, prompt and native layer take the norms where the block
has them."""

from __future__ import annotations

from graftlm.config import ModelConfig
from graftlm.models.base import Weights
from graftlm.models.llama import Llama, LlamaBlock


class Qwen3Block(LlamaBlock):
    def __init__(self, cfg: ModelConfig, w: Weights, i: int) -> None:
        super().__init__(cfg, w, i)
        p = f"blk.{i}."
        self.attn_q_norm = w.vector(p + "attn_q_norm.weight", cfg.head_dim)  # shared by all heads
        self.attn_k_norm = w.vector(p + "attn_k_norm.weight", cfg.head_dim)


class Qwen3(Llama):
    arch = "qwen3"
    Block = Qwen3Block
    blocks: list[Qwen3Block]
