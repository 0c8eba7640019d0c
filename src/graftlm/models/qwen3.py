"""qwen3: the llama block with an RMS norm over each head of q and k (QK-norm) before RoPE, RoPE
over halves, no biases. Llama's block, prompt and native layer take the norms where the block
has them.

qwen3moe (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): the same attention, and in every layer a routed
FFN of `expert_count` experts, `expert_used_count` a token, each `expert_feed_forward_length`
wide, mixed with the renormalized softmax weights as Mixtral's are (llama.cpp normalizes them for
this architecture whatever the checkpoint's `norm_topk_prob`); moe.py and the native layer serve
it as they serve Mixtral."""

from __future__ import annotations

from graftlm.config import ModelConfig
from graftlm.errors import ModelFileError
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


class Qwen3Moe(Qwen3):
    arch = "qwen3moe"

    def __init__(self, cfg: ModelConfig, w: Weights, n_ctx: int) -> None:
        if not cfg.n_expert or not cfg.n_expert_used:
            raise ModelFileError(
                f"{w.file.path}: a qwen3moe file needs qwen3moe.expert_count and "
                f"qwen3moe.expert_used_count (got {cfg.n_expert} and {cfg.n_expert_used})"
            )
        super().__init__(cfg, w, n_ctx)
