"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with sinks and biases, a sliding window on even
layers, YaRN RoPE over halves, and in every layer a routed FFN of experts with biases and a
clamped SwiGLU, mixed with the softmax of the chosen experts' router logits.

As llama.cpp's `openai-moe-iswa` graph computes it (and transformers' GptOssForCausalLM):

    h = rms_norm(x, attn_norm);  q, k, v = W h + b;  q, k = rope_yarn(q), rope_yarn(k)
    x = x + attn_output(attention(q, k, v) with sinks) + attn_output.bias
    h = rms_norm(x, post_attention_norm)
    l = ffn_gate_inp(h) + ffn_gate_inp.bias;  top = the n_used largest l;  w = softmax(l[top])
    x = x + sum_{e in top} w_e * (down_e(swiglu_oai(gate_e(h) + bg_e, up_e(h) + bu_e)) + bd_e)

A decode step runs the whole layer in one native call (`layer_spec`: the sinks folded into the
attention's softmax sums, the router's and the experts' biases, gating 1 and the clamped SwiGLU
of csrc/layer.c) where every weight has a native kernel; else, and in prompts, these blocks,
their attention through the native kernels with sinks (primitives.attention's written-out scores
are the twin) and the experts' gate through the native one.
Expert weights in MXFP4 (the released files) go through quant/'s native-mx4 kernel where the native
library built (csrc/mxfp4.c), the exact blocks kernel otherwise.

Routed experts take per-expert adapters as Mixtral's and Qwen3-MoE's do (models.moe: each expert
a seam of its own, [gate; up] stacked): each delta is added to the expert's product before its
bias, in routed_ffn and in the native layer (`MoeSpec.seams`). PEFT's gate_up_proj interleaves
gate and up columns; lora.peft_experts splits its B to fit.
"""

from __future__ import annotations

import torch

from graftlm.config import ModelConfig
from graftlm.errors import ModelFileError
from graftlm.models.base import Transformer, Weights
from graftlm.models.fused import LayerSpec, MoeSpec
from graftlm.models.moe import Experts, GatedExperts, adapted_rows, mix_experts
from graftlm.models.primitives import Rope, rms_norm, yarn
from graftlm.models.seam import Projection
from graftlm.native import ops as native_ops
from graftlm.step.batch import Batch, LoraRows

# the clamped SwiGLU's constants: fixed in llama.cpp's graph (the GGUF carries none) and the
# released config's swiglu_alpha and swiglu_limit
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def swiglu_oai(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT
) -> torch.Tensor:
    """Semantics (ggml_swiglu_oai; transformers' GptOssExperts._apply_gate):
    g = min(gate, limit); u = clamp(up, -limit, limit); g * sigmoid(alpha * g) * (u + 1)."""
    g = gate.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (up.clamp(-limit, limit) + 1)


def _tensor(w: Weights, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A small float tensor (a bias, the sinks) of exactly this shape (torch order), float32."""
    w.entry(name, shape)
    return w.vector(name).view(shape)


class GptOssBlock:
    def __init__(self, cfg: ModelConfig, w: Weights, i: int) -> None:
        p = f"blk.{i}."
        d, n_q, n_kv = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        n_expert, n_ff = cfg.n_expert, cfg.n_ff
        self.attn_norm = _tensor(w, p + "attn_norm.weight", (d,))
        self.attn_qkv = w.attn_qkv(cfg, i)
        self.attn_q_bias = _tensor(w, p + "attn_q.bias", (n_q,))
        self.attn_k_bias = _tensor(w, p + "attn_k.bias", (n_kv,))
        self.attn_v_bias = _tensor(w, p + "attn_v.bias", (cfg.n_head_kv * cfg.v_head_dim,))
        self.attn_output: Projection = w.proj(p + "attn_output", cfg.n_head * cfg.v_head_dim, d)
        self.attn_output_bias = _tensor(w, p + "attn_output.bias", (d,))
        self.attn_sinks = _tensor(w, p + "attn_sinks.weight", (cfg.n_head,))  # a logit a head
        self.post_attention_norm = _tensor(w, p + "post_attention_norm.weight", (d,))
        self.ffn_gate_inp: Projection = w.proj(p + "ffn_gate_inp", d, n_expert)
        self.ffn_gate_inp_bias = _tensor(w, p + "ffn_gate_inp.bias", (n_expert,))
        self.ffn_gate_up_exps = GatedExperts(
            w, p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight", (n_expert, n_ff, d)
        )
        self.ffn_down_exps = Experts(w, p + "ffn_down_exps.weight", (n_expert, d, n_ff))
        gate_bias = _tensor(w, p + "ffn_gate_exps.bias", (n_expert, n_ff))
        up_bias = _tensor(w, p + "ffn_up_exps.bias", (n_expert, n_ff))
        # expert e's [gate; up] bias, as its stacked weight's rows: (n_expert, 2 n_ff)
        self.ffn_gate_up_exps_bias = torch.cat([gate_bias, up_bias], dim=1)
        self.ffn_down_exps_bias = _tensor(w, p + "ffn_down_exps.bias", (n_expert, d))


def routed_ffn(
    h: torch.Tensor,
    router_logits: torch.Tensor,
    b: GptOssBlock,
    n_used: int,
    lora: LoraRows | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """h (B, T, n_embd), router_logits (B, T, n_expert) with the router's bias -> (B, T, n_embd);
    exact: the experts' products in float32 (the step's Batch.exact, as quant.linear takes it).

    Semantics (llama.cpp's SOFTMAX_WEIGHT gating; transformers' GptOssTopKRouter):
        top = the n_used largest logits; w = softmax(logits[top])
        out = sum_{e in top} w_e * (down_e(swiglu_oai(gate_e(h) + bg_e, up_e(h) + bu_e)) + bd_e)
    each of gate_e, up_e, down_e plus its adapters' delta at the token's row's scales (`lora`;
    llama.cpp's build_lora_mm_id, before the bias). Tokens are grouped by expert, a row's experts
    added in ascending order (moe.mix_experts).
    """
    x = h.reshape(-1, h.shape[-1])  # (N, n_embd)
    top, chosen = router_logits.reshape(x.shape[0], -1).float().topk(n_used, dim=-1)  # (N, k)
    weight = torch.softmax(top, dim=-1).to(x.dtype)

    experts, bias, down = b.ffn_gate_up_exps, b.ffn_gate_up_exps_bias, b.ffn_down_exps
    rows = adapted_rows(lora, experts, down)
    # (N, n_slots): each token's row's scales
    scales = None if rows is None else rows.scales.repeat_interleave(h.shape[1], dim=0)
    native = experts.stacked is not None and not exact

    def expert(e: int, xe: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        s = None if scales is None else scales.index_select(0, token)  # (n_e, n_slots)
        gate_up = experts.products(e, xe, s, exact) + bias[e]  # (n_e, 2 n_ff)
        act = native_ops.gated(gate_up, "swiglu_oai") if native else None
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = swiglu_oai(gate, up)
        return down.product(e, act, s, exact) + b.ffn_down_exps_bias[e]  # (n_e, n_embd)

    out = mix_experts(x, chosen, weight, expert, with_tokens=True)
    return out.view_as(h)


class GptOss(Transformer):
    arch = "gpt-oss"
    blocks: list[GptOssBlock]

    def __init__(self, cfg: ModelConfig, w: Weights, n_ctx: int) -> None:
        path = w.file.path
        if not cfg.n_expert or not cfg.n_expert_used:
            raise ModelFileError(
                f"{path}: a gpt-oss file needs gpt-oss.expert_count and gpt-oss.expert_used_count "
                f"(got {cfg.n_expert} and {cfg.n_expert_used})"
            )
        if cfg.n_expert_used > cfg.n_expert:
            raise ModelFileError(
                f"{path}: gpt-oss.expert_used_count = {cfg.n_expert_used} is more than "
                f"gpt-oss.expert_count = {cfg.n_expert}"
            )
        if not cfg.sliding_window[0]:
            raise ModelFileError(
                f"{path}: a gpt-oss file needs gpt-oss.attention.sliding_window (its even layers "
                "attend to that many tokens)"
            )
        super().__init__(cfg, w, n_ctx)
        if cfg.yarn_factor:
            factors, mscale = yarn(
                cfg.rope_dim, cfg.rope_base, cfg.yarn_factor, cfg.n_ctx_orig or cfg.n_ctx_train,
                cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.yarn_ext_factor, cfg.yarn_attn_factor,
            )  # fmt: skip
            rope = Rope(cfg.rope_dim, cfg.rope_base, n_ctx, cfg.rope_neox, factors, mscale)
            self.rope_of_layer = [rope] * cfg.n_layer
        self.blocks = [GptOssBlock(cfg, w, i) for i in range(cfg.n_layer)]

    def layer_spec(self, i: int) -> LayerSpec | None:
        cfg, b = self.cfg, self.blocks[i]
        experts = b.ffn_gate_up_exps
        if experts.stacked is None:  # gate and up of two types: the composed block
            return None
        moe = MoeSpec(b.ffn_gate_inp, experts.stacked, b.ffn_down_exps.weights, cfg.n_expert_used,
                      router_bias=b.ffn_gate_inp_bias, gate_up_bias=b.ffn_gate_up_exps_bias,
                      down_bias=b.ffn_down_exps_bias, gating="softmax_chosen",
                      seams=(experts.seams, b.ffn_down_exps.seams))  # fmt: skip
        return LayerSpec(b.attn_qkv.projections(), b.attn_output, None, None, b.attn_norm,
                         b.post_attention_norm, act="swiglu_oai", q_bias=b.attn_q_bias,
                         k_bias=b.attn_k_bias, v_bias=b.attn_v_bias, o_bias=b.attn_output_bias,
                         sinks=b.attn_sinks, moe=moe)  # fmt: skip

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, b = self.cfg, self.blocks[i]
        h = rms_norm(x, b.attn_norm, cfg.rms_eps)
        q, k, v = b.attn_qkv(h, batch)
        q, k, v = q + b.attn_q_bias, k + b.attn_k_bias, v + b.attn_v_bias
        a = self.attend(i, q, k, v, batch, sinks=b.attn_sinks)
        x = x + (b.attn_output(a, batch) + b.attn_output_bias)
        h = rms_norm(x, b.post_attention_norm, cfg.rms_eps)
        routed = self.native_routed_ffn(i, h, batch)  # (a prompt's, in one native call)
        return x + (self.composed_routed_ffn(i, h, batch) if routed is None else routed)

    def composed_routed_ffn(self, i: int, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Layer i's routed FFN of h (B, T, n_embd), normed: the router's logits (with its
        bias), then routed_ffn (native_routed_ffn's twin; tests/routed_twins.py and
        bench/moe_prompt_ab.py call it)."""
        b = self.blocks[i]
        logits = b.ffn_gate_inp(h, batch) + b.ffn_gate_inp_bias  # (B, T, n_expert)
        return routed_ffn(h, logits, b, self.cfg.n_expert_used, batch.lora, batch.exact)

    @property
    def nbytes(self) -> int:
        # the base counts projections and tensors; routed experts are neither
        experts = [(b.ffn_gate_up_exps, b.ffn_down_exps) for b in self.blocks]
        return super().nbytes + sum(g.nbytes + d.nbytes for g, d in experts)
