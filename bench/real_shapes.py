"""Random-weight GGUF models of real shapes, in the quant mixes people download, plus a rank-16
LoRA adapter on every projection, to time beside llama.cpp:

    python bench/real_shapes.py DIR --shape llama-1b --mix q4_k_m [--adapter]
    python bench/real_shapes.py DIR --shape qwen3-30b-a3b-6l --adapter --expert-adapter --no-model
    python bench/real_shapes.py DIR --all            # every shape x q4_k_m, q5_k_m, q8_0
    python bench/real_shapes.py --list

The tensors are valid random blocks of each type (`random_blocks` of tests/synth_tensors.py: random
codes, small finite scales), written with `gguf.GGUFWriter` under llama.cpp's names and
metadata, with the real vocabulary size (a byte-level BPE vocabulary padded with tokens no merge
reaches) so the output head costs what it costs. The mixes follow llama.cpp's
`llama_tensor_get_type` for the common cases: q4_k_m / q5_k_m put Q6_K on the output (or the tied
embedding) and on attn_v and ffn_down of the layers llama.cpp gives more bits (the first and last
eighth and every third between), and fall back to Q5_0 / Q5_1 / Q8_0 where a row is not a
multiple of 256 (Qwen2.5-0.5B's 896). iq4_xs / iq4_nl are IQ4_XS / IQ4_NL with Q6_K in those
places (llama.cpp's own IQ4 mixes differ in detail: Q5_K on some attn_v / ffn_down). The
small-memory mixes iq3_xxs / iq2_xxs / iq2_xs put IQ3_XXS / IQ2_XXS / IQ2_XS everywhere else, IQ3_S /
IQ2_S / IQ3_XXS in the more-bits places and Q5_K on the output, as llama.cpp does without an
importance matrix in the common cases (its attn_v takes Q4_K where a model has 4+ query heads a
KV head or 8+ experts; here the more-bits type). Layer counts are cut for the 4B-7B shapes
(`--layers` overrides): decode speed per layer is what is compared.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synth_tensors
from synth_tensors import random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    arch: str
    d: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ff: int
    n_layer: int
    vocab: int
    tied: bool = True
    n_expert: int = 0
    n_expert_used: int = 0
    rope_base: float = 500000.0


SHAPES = {
    "llama-1b": Shape("llama", 2048, 32, 8, 64, 8192, 16, 128256),
    "qwen2.5-0.5b": Shape("qwen2", 896, 14, 2, 64, 4864, 24, 151936, rope_base=1e6),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 12, 2, 128, 8960, 28, 151936, rope_base=1e6),
    "qwen3-0.6b": Shape("qwen3", 1024, 16, 8, 128, 3072, 28, 151936, rope_base=1e6),
    "phi3-mini-8l": Shape("phi3", 3072, 32, 32, 96, 8192, 8, 32064, tied=False, rope_base=1e4),
    "gemma2-2b": Shape("gemma2", 2304, 8, 4, 256, 9216, 26, 256000, rope_base=1e4),
    "mistral-7b-8l": Shape("llama", 4096, 32, 8, 128, 14336, 8, 32768, tied=False, rope_base=1e6),
    "mixtral-small": Shape("llama", 1024, 16, 4, 64, 2048, 8, 32000, False, 8, 2, 1e6),
    # Qwen3-30B-A3B with 6 of its 48 layers: 128 experts of width 768, 8 a token
    "qwen3-30b-a3b-6l": Shape("qwen3moe", 2048, 32, 4, 128, 768, 6, 151936, False, 128, 8, 1e6),
    # gpt-oss-20b: 64 heads of 64 (q 4096 wide, d 2880), 32 experts of width 2880, 4 a token,
    # a sliding window of 128 on even layers, sinks and biases; its mix is "mxfp4" (`--layers 4`)
    "gpt-oss-20b": Shape("gpt-oss", 2880, 64, 8, 64, 2880, 24, 201088, False, 32, 4, 150000.0),
}

# (default type, the "more bits" type); llama.cpp's fallback where n_in % 256 != 0
MIXES = {
    "q4_k_m": (Q.Q4_K, Q.Q6_K),
    "q5_k_m": (Q.Q5_K, Q.Q6_K),
    "q6_k": (Q.Q6_K, Q.Q6_K),
    "q8_0": (Q.Q8_0, Q.Q8_0),
    "q4_0": (Q.Q4_0, Q.Q6_K),
    "q3_k_m": (Q.Q3_K, Q.Q5_K),
    "q2_k": (Q.Q2_K, Q.Q4_K),
    "iq4_xs": (Q.IQ4_XS, Q.Q6_K),
    "iq4_nl": (Q.IQ4_NL, Q.Q6_K),
    "iq3_xxs": (Q.IQ3_XXS, Q.IQ3_S),
    "iq2_xxs": (Q.IQ2_XXS, Q.IQ2_S),
    "iq2_xs": (Q.IQ2_XS, Q.IQ3_XXS),
    # one grid type everywhere (the routed experts too), Q5_K output: roughly llama.cpp's IQ2_M
    # (IQ2_S) and IQ3_S files
    "iq2_s": (Q.IQ2_S, Q.IQ2_S),
    "iq3_s": (Q.IQ3_S, Q.IQ3_S),
    "f16": (Q.F16, Q.F16),  # what export-lora writes by default
    "bf16": (Q.BF16, Q.BF16),
    # gpt-oss as released (llama-quantize's MXFP4_MOE): routed experts MXFP4, the rest Q8_0
    "mxfp4": (Q.Q8_0, Q.Q8_0),
}
EXPERT_TYPE = {"mxfp4": Q.MXFP4}  # the routed experts' type where a mix sets one
EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
E8M0_RANGE = (116, 121)  # MXFP4 block exponents: weights of about 0.002-0.1 with random codes
FALLBACK = {
    Q.Q4_K: Q.Q5_0,
    Q.Q5_K: Q.Q5_1,
    Q.Q6_K: Q.Q8_0,
    Q.Q3_K: Q.Q4_0,
    Q.Q2_K: Q.Q4_0,
    Q.IQ4_XS: Q.IQ4_NL,
    **dict.fromkeys((Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S), Q.IQ4_NL),
}
OUTPUT = dict.fromkeys(
    ("iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_s"), Q.Q5_K
)  # the output's type, where not `more`
# a block scale that gives weights of about 0.01-0.03 with random codes
SCALE = {Q.Q4_0: 2e-3, Q.Q4_1: 2e-3, Q.Q5_0: 1e-3, Q.Q5_1: 1e-3, Q.Q8_0: 2e-4,
         Q.Q2_K: 2e-4, Q.Q3_K: 1e-4, Q.Q4_K: 3e-5, Q.Q5_K: 2e-5, Q.Q6_K: 3e-5,
         Q.IQ4_NL: 1.5e-4, Q.IQ4_XS: 6e-6, Q.IQ2_XXS: 4e-4, Q.IQ2_XS: 4e-4, Q.IQ2_S: 4e-4,
         Q.IQ3_XXS: 1.5e-4, Q.IQ3_S: 1.5e-4}  # fmt: skip


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mix: str, role: str, layer: int, n_layer: int, n_in: int) -> Q:
    base, more = MIXES[mix]
    if role in EXPERT_ROLES and mix in EXPERT_TYPE:
        return EXPERT_TYPE[mix]
    if role == "output":
        t = OUTPUT.get(mix, more)
    elif role in ("attn_v", "ffn_down", "ffn_down_exps") and more_bits(layer, n_layer):
        t = more
    else:
        t = base
    block = gguf.GGML_QUANT_SIZES[t][0]
    return FALLBACK.get(t, Q.Q8_0) if n_in % block else t


def _tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary (no merge reaches the padding), the real size."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]  # never produced: the merges below are empty
    specials = ["<|endoftext|>", "<|bos|>", "<|end|>"]
    ascii_ = [chr(c) for c in range(33, 127)]
    tokens = specials + ascii_ + byte_tokens
    tokens += [f"tok{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (vocab - len(specials)))
    w.add_token_merges(["t o", "to k"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)


def _spm_tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    """A SentencePiece vocabulary with byte fallback, as Phi-3's files have: llama.cpp's phi3
    loader refuses the byte-level BPE one (`unordered_map::at`)."""
    specials = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>",
                "<|system|>"]  # fmt: skip
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["\u2581" + chr(c) for c in range(33, 127)]
    tokens += [f"\u2581tok{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(
        [2] + [3] * (len(specials) - 1) + [6] * 256 + [1] * (vocab - len(specials) - 256)
    )
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)


def tensors(s: Shape) -> list[tuple[str, str, int, tuple[int, ...]]]:
    """(name, role, layer, torch shape (rows, cols) or (E, rows, cols)); vectors are (n,)."""
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out: list[tuple[str, str, int, tuple[int, ...]]] = [
        ("token_embd.weight", "output" if s.tied else "token_embd", -1, (s.vocab, s.d)),
        ("output_norm.weight", "norm", -1, (s.d,)),
    ]
    if not s.tied:
        out.append(("output.weight", "output", -1, (s.vocab, s.d)))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        if s.arch == "gpt-oss":
            out += _gpt_oss_layer(s, i)
            continue
        norms = ["attn_norm", "ffn_norm"]
        if s.arch == "gemma2":
            norms += ["post_attention_norm", "post_ffw_norm"]
        out += [(p + n + ".weight", "norm", i, (s.d,)) for n in norms]
        if s.arch in ("qwen3", "qwen3moe"):
            out += [
                (p + n + ".weight", "norm", i, (s.head_dim,))
                for n in ("attn_q_norm", "attn_k_norm")
            ]
        if s.arch == "qwen2":
            out += [(p + "attn_q.bias", "bias", i, (q,)), (p + "attn_k.bias", "bias", i, (kv,)),
                    (p + "attn_v.bias", "bias", i, (kv,))]  # fmt: skip
        if s.arch == "phi3":
            out.append((p + "attn_qkv.weight", "attn_qkv", i, (q + 2 * kv, s.d)))
        else:
            out += [(p + "attn_q.weight", "attn_q", i, (q, s.d)),
                    (p + "attn_k.weight", "attn_k", i, (kv, s.d)),
                    (p + "attn_v.weight", "attn_v", i, (kv, s.d))]  # fmt: skip
        out.append((p + "attn_output.weight", "attn_output", i, (s.d, q)))
        if s.n_expert:
            e = s.n_expert
            out += [(p + "ffn_gate_inp.weight", "router", i, (e, s.d)),
                    (p + "ffn_gate_exps.weight", "ffn_gate_exps", i, (e, s.ff, s.d)),
                    (p + "ffn_up_exps.weight", "ffn_up_exps", i, (e, s.ff, s.d)),
                    (p + "ffn_down_exps.weight", "ffn_down_exps", i, (e, s.d, s.ff))]  # fmt: skip
        elif s.arch == "phi3":
            out += [(p + "ffn_up.weight", "ffn_up", i, (2 * s.ff, s.d)),
                    (p + "ffn_down.weight", "ffn_down", i, (s.d, s.ff))]  # fmt: skip
        else:
            out += [(p + "ffn_gate.weight", "ffn_gate", i, (s.ff, s.d)),
                    (p + "ffn_up.weight", "ffn_up", i, (s.ff, s.d)),
                    (p + "ffn_down.weight", "ffn_down", i, (s.d, s.ff))]  # fmt: skip
    return out


def _gpt_oss_layer(s: Shape, i: int) -> list[tuple[str, str, int, tuple[int, ...]]]:
    """gpt-oss's layer i as llama.cpp's converter names it (gguf's MODEL_TENSORS[GPT_OSS]): the
    attention with biases and sinks, post_attention_norm before the router, the router's bias
    and the experts' biases beside their weights."""
    p, q, kv, e = f"blk.{i}.", s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_expert
    return [
        (p + "attn_norm.weight", "norm", i, (s.d,)),
        (p + "post_attention_norm.weight", "norm", i, (s.d,)),
        (p + "attn_q.weight", "attn_q", i, (q, s.d)), (p + "attn_q.bias", "bias", i, (q,)),
        (p + "attn_k.weight", "attn_k", i, (kv, s.d)), (p + "attn_k.bias", "bias", i, (kv,)),
        (p + "attn_v.weight", "attn_v", i, (kv, s.d)), (p + "attn_v.bias", "bias", i, (kv,)),
        (p + "attn_output.weight", "attn_output", i, (s.d, q)),
        (p + "attn_output.bias", "bias", i, (s.d,)),
        (p + "attn_sinks.weight", "bias", i, (s.n_head,)),
        (p + "ffn_gate_inp.weight", "router", i, (e, s.d)),  # float32: llama.cpp never quantizes it
        (p + "ffn_gate_inp.bias", "bias", i, (e,)),
        (p + "ffn_gate_exps.weight", "ffn_gate_exps", i, (e, s.ff, s.d)),
        (p + "ffn_gate_exps.bias", "bias", i, (e, s.ff)),
        (p + "ffn_up_exps.weight", "ffn_up_exps", i, (e, s.ff, s.d)),
        (p + "ffn_up_exps.bias", "bias", i, (e, s.ff)),
        (p + "ffn_down_exps.weight", "ffn_down_exps", i, (e, s.d, s.ff)),
        (p + "ffn_down_exps.bias", "bias", i, (e, s.d)),
    ]  # fmt: skip


def _metadata(w: gguf.GGUFWriter, name: str, s: Shape, mix: str, ctx: int = 4096) -> None:
    w.add_type("model")
    w.add_name(f"random-{name}-{mix}")
    w.add_block_count(s.n_layer)
    w.add_context_length(ctx)
    w.add_embedding_length(s.d)
    w.add_feed_forward_length(s.ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-5 if s.arch == "gpt-oss" else 1e-6)
    w.add_rope_freq_base(s.rope_base)
    w.add_vocab_size(s.vocab)
    if s.arch != "gemma2":
        w.add_rope_dimension_count(s.head_dim)
    if s.arch == "phi3":
        w.add_uint32("phi3.rope.scaling.original_context_length", 4096)
    if s.arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", 50.0)
        w.add_float32("gemma2.final_logit_softcapping", 30.0)
        w.add_sliding_window(4096)
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
    if s.arch in ("qwen3moe", "gpt-oss"):
        w.add_expert_feed_forward_length(s.ff)  # (feed_forward_length is the dense width)
    if s.arch == "gpt-oss":  # as the converter writes gpt-oss-20b's config
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)


def write_model(
    folder: Path, name: str, mix: str, layers: int | None = None, seed: int = 0, ctx: int = 4096
) -> Path:
    s = SHAPES[name] if layers is None else replace(SHAPES[name], n_layer=layers)
    path = folder / (f"{name}-{mix}.gguf" if ctx == 4096 else f"{name}-{mix}-ctx{ctx}.gguf")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), s.arch)
    _metadata(w, name, s, mix, ctx)
    (_spm_tokenizer if s.arch == "phi3" else _tokenizer)(w, s.vocab)
    for tname, role, layer, shape in tensors(s):
        if role == "norm":
            w.add_tensor(tname, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        elif role == "bias":
            w.add_tensor(tname, (0.02 * rng.standard_normal(shape)).astype(np.float32))
        elif role == "router":
            w.add_tensor(tname, (0.05 * rng.standard_normal(shape)).astype(np.float32))
        else:
            qt = tensor_type(mix, role, layer, s.n_layer, shape[-1])
            if qt in (Q.F16, Q.BF16):  # values of about 0.02, as the quantized mixes hold
                v = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
                if qt == Q.F16:
                    w.add_tensor(tname, v.astype(np.float16))
                else:  # bfloat16: the high half of each float32 (truncated)
                    w.add_tensor(tname, (v.view(np.uint32) >> 16).astype(np.uint16), raw_dtype=qt)
                continue
            rows = int(np.prod(shape[:-1]))
            raw = random_blocks(qt, (rows, shape[-1]), rng, SCALE.get(qt, 1e-3))
            if qt == Q.MXFP4:  # each block's E8M0 exponent (byte 0 of its 17)
                blocks = raw.reshape(-1, 17)
                blocks[:, 0] = rng.integers(*E8M0_RANGE, blocks.shape[0], dtype=np.uint8)
            w.add_tensor(tname, raw.reshape(*shape[:-1], -1), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_adapter(
    folder: Path,
    name: str,
    rank: int = 16,
    layers: int | None = None,
    seed: int = 1,
    experts: bool = False,
) -> Path:
    """A rank-16 float32 GGUF LoRA on every projection (the attention only for an MoE model);
    seeds past 1 give other adapters of the same shape (`-s2`, `-s3`, ... in the name).

    experts (an MoE shape): also on every layer's routed experts' gate, up and down, in
    llama.cpp's layout for `*_exps` tensors (convert_lora_to_gguf.py stacks the experts' factors
    as the base stacks its weights; build_lora_mm_id multiplies them with ggml_mul_mat_id):
    `blk.N.ffn_gate_exps.weight.lora_a` ne=[n_in, r, n_expert] and `.lora_b` ne=[r, n_out,
    n_expert], numpy (n_expert, r, n_in) and (n_expert, n_out, r); file `NAME-experts-lora-rR`."""
    s = SHAPES[name] if layers is None else replace(SHAPES[name], n_layer=layers)
    if experts and not s.n_expert:
        raise ValueError(f"{name} has no routed experts to put an adapter on")
    stem = f"{name}-experts-lora" if experts else f"{name}-lora"
    path = folder / f"{stem}-r{rank}{'' if seed == 1 else f'-s{seed}'}.gguf"
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(2 * rank))
    projections = {"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up",
                   "ffn_down"}  # fmt: skip
    if experts:
        projections |= set(EXPERT_ROLES)
    for tname, role, _, shape in tensors(s):
        if role in projections:
            *stack, n_out, n_in = shape  # stack: [n_expert] for a routed tensor, else []
            a = (rng.standard_normal((*stack, rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((*stack, n_out, rank)) * 0.01).astype(np.float32)
            base = tname.removesuffix(".weight")
            w.add_tensor(base + ".weight.lora_a", a)
            w.add_tensor(base + ".weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, nargs="?")
    ap.add_argument("--shape", choices=sorted(SHAPES), action="append")
    ap.add_argument("--mix", choices=sorted(MIXES), action="append")
    ap.add_argument("--layers", type=int, help="override the shape's layer count")
    ap.add_argument(
        "--ctx",
        type=int,
        default=4096,
        help="the training context written (long-context runs: 40960; file -ctxN)",
    )
    ap.add_argument("--adapter", action="store_true", help="also write a rank-16 adapter")
    ap.add_argument("--adapters", type=int, default=1, help="how many (with --adapter)")
    ap.add_argument(
        "--expert-adapter",
        action="store_true",
        help="with --adapter on an MoE shape: the adapters also on the routed experts",
    )
    ap.add_argument("--no-model", action="store_true", help="write the adapters only")
    ap.add_argument("--all", action="store_true", help="every shape x q4_k_m, q5_k_m, q8_0")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list or args.folder is None:
        for name, s in SHAPES.items():
            print(f"{name:16s} {s}")
        print("mixes:", ", ".join(MIXES))
        return
    args.folder.mkdir(parents=True, exist_ok=True)
    shapes = sorted(SHAPES) if args.all else args.shape or ["llama-1b"]
    mixes = ["q4_k_m", "q5_k_m", "q8_0"] if args.all else args.mix or ["q4_k_m"]
    for name in shapes:
        for mix in mixes if not args.no_model else []:
            p = write_model(args.folder, name, mix, args.layers, ctx=args.ctx)
            print(f"{p}  {p.stat().st_size / 2**20:.0f} MiB")
        for seed in range(1, 1 + args.adapters * args.adapter):
            p = write_adapter(args.folder, name, layers=args.layers, seed=seed,
                              experts=args.expert_adapter)  # fmt: skip
            print(f"{p}  {p.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
