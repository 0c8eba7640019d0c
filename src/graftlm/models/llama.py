"""llama: Llama 2/3, Mistral, SmolLM2, Mixtral (GQA, RoPE over adjacent pairs, SwiGLU).

Optional pieces, each present when its tensor is: llama3 RoPE frequency factors
(`rope_freqs.weight`), Q/K/V/output biases (`attn_q.bias`...), per-head Q/K norms (qwen3.py's
block sets them), and mixture-of-experts FFNs (`ffn_gate_inp` + `ffn_{gate,up,down}_exps`, see
moe.py) when `expert_count` is set.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from graftlm.config import ModelConfig
from graftlm.errors import ModelFileError
from graftlm.models.base import Transformer, Weights
from graftlm.models.fused import LayerSpec, MoeSpec
from graftlm.models.moe import Experts, GatedExperts, moe_ffn
from graftlm.models.primitives import Rope, rms_norm
from graftlm.models.seam import Projection
from graftlm.step.batch import Batch


def _bias(w: Weights, name: str, n: int) -> torch.Tensor | None:
    return w.vector(name, n) if w.has(name) else None


def _plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # biases stay outside the projection seam: adapters never touch them
    return y if bias is None else y + bias


class LlamaBlock:
    def __init__(self, cfg: ModelConfig, w: Weights, i: int) -> None:
        p = f"blk.{i}."
        d, vd = cfg.n_embd, cfg.v_head_dim
        self.attn_norm = w.vector(p + "attn_norm.weight", cfg.n_embd)
        self.attn_qkv = w.attn_qkv(cfg, i)
        self.attn_output: Projection = w.proj(p + "attn_output", cfg.n_head * vd, d)
        self.attn_q_bias = _bias(w, p + "attn_q.bias", cfg.n_head * cfg.head_dim)
        self.attn_k_bias = _bias(w, p + "attn_k.bias", cfg.n_head_kv * cfg.head_dim)
        self.attn_v_bias = _bias(w, p + "attn_v.bias", cfg.n_head_kv * vd)
        self.attn_output_bias = _bias(w, p + "attn_output.bias", d)
        # per-head RMS norms of q and k before RoPE (QK-norm): qwen3's block sets them
        self.attn_q_norm: torch.Tensor | None = None
        self.attn_k_norm: torch.Tensor | None = None
        self.ffn_norm = w.vector(p + "ffn_norm.weight", cfg.n_embd)
        if cfg.n_expert:
            shape, down = (cfg.n_expert, cfg.n_ff, d), (cfg.n_expert, d, cfg.n_ff)
            self.ffn_gate_inp: Projection = w.proj(p + "ffn_gate_inp", d, cfg.n_expert)
            self.ffn_gate_up_exps = GatedExperts(
                w, p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight", shape
            )
            self.ffn_down_exps = Experts(w, p + "ffn_down_exps.weight", down)
        else:
            self.ffn_gate_up = w.ffn_gate_up(cfg, i)
            self.ffn_down: Projection = w.proj(p + "ffn_down", cfg.n_ff, d)


class Llama(Transformer):
    arch = "llama"
    # a family that adds tensors to the block sets its own
    Block: ClassVar[type[LlamaBlock]] = LlamaBlock

    def __init__(self, cfg: ModelConfig, w: Weights, n_ctx: int) -> None:
        super().__init__(cfg, w, n_ctx)
        if w.has("rope_freqs.weight"):
            factors = w.vector("rope_freqs.weight")
            if factors.numel() != cfg.rope_dim // 2:
                raise ModelFileError(
                    f"{w.file.path}: tensor 'rope_freqs.weight' has {factors.numel()} values, "
                    f"expected rope_dim / 2 = {cfg.rope_dim // 2}"
                )
            self.rope_of_layer = [
                Rope(cfg.rope_dim, b, n_ctx, cfg.rope_neox, factors) for b in cfg.rope_base_layer
            ]
        self.blocks = [self.Block(cfg, w, i) for i in range(cfg.n_layer)]

    def layer_spec(self, i: int) -> LayerSpec | None:
        cfg, b = self.cfg, self.blocks[i]
        extra = {"q_bias": b.attn_q_bias, "k_bias": b.attn_k_bias, "v_bias": b.attn_v_bias,
                  "o_bias": b.attn_output_bias, "q_norm": b.attn_q_norm,
                  "k_norm": b.attn_k_norm}  # fmt: skip
        if cfg.n_expert:
            experts = b.ffn_gate_up_exps
            if experts.stacked is None:  # gate and up of two types: the composed block
                return None
            down = b.ffn_down_exps
            moe = MoeSpec(b.ffn_gate_inp, experts.stacked, down.weights, cfg.n_expert_used,
                          seams=(experts.seams, down.seams))  # fmt: skip
            return LayerSpec(b.attn_qkv.projections(), b.attn_output, None, None, b.attn_norm,
                             b.ffn_norm, moe=moe, **extra)  # fmt: skip
        return LayerSpec.of(b.attn_qkv, b.attn_output, b.ffn_gate_up, b.ffn_down, b.attn_norm,
                            b.ffn_norm, **extra)  # fmt: skip

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, b = self.cfg, self.blocks[i]
        h = rms_norm(x, b.attn_norm, cfg.rms_eps)
        q, k, v = b.attn_qkv(h, batch)
        q, k, v = _plus(q, b.attn_q_bias), _plus(k, b.attn_k_bias), _plus(v, b.attn_v_bias)
        a = self.attend(i, q, k, v, batch, b.attn_q_norm, b.attn_k_norm)
        x = x + _plus(b.attn_output(a, batch), b.attn_output_bias)
        h = rms_norm(x, b.ffn_norm, cfg.rms_eps)
        if cfg.n_expert:
            routed = self.native_routed_ffn(i, h, batch)  # (a prompt's, in one native call)
            return x + (self.composed_routed_ffn(i, h, batch) if routed is None else routed)
        return x + b.ffn_down(b.ffn_gate_up.gated(h, batch, "silu"), batch)

    def composed_routed_ffn(self, i: int, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Layer i's routed FFN of h (B, T, n_embd), normed: the router's logits, then moe_ffn
        (native_routed_ffn's twin; tests/routed_twins.py and bench/moe_prompt_ab.py call it)."""
        b = self.blocks[i]
        logits = b.ffn_gate_inp(h, batch)  # (B, T, n_expert)
        experts = b.ffn_gate_up_exps, b.ffn_down_exps
        return moe_ffn(h, logits, *experts, self.cfg.n_expert_used, batch.lora, batch.exact)

    @property
    def nbytes(self) -> int:
        # the base counts projections and tensors; routed experts are neither
        experts = [
            getattr(b, n, None) for b in self.blocks for n in ("ffn_gate_up_exps", "ffn_down_exps")
        ]
        return super().nbytes + sum(e.nbytes for e in experts if e is not None)
