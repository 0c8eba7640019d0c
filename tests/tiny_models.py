"""Tiny random GGUF models (and adapters) written with gguf.GGUFWriter, for fast tests.

Tensor names, metadata keys and layouts are llama.cpp's; the weights are random, so only
engine-internal properties (caching, batching, adapters, kernels) are tested on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from synth_tensors import random_blocks

T = gguf.GGMLQuantizationType


def _byte_unicode() -> list[str]:
    """GPT-2's byte-to-printable mapping, so a byte-level BPE vocab can hold every byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=False))
    return [chr(table[b]) for b in range(256)]


@dataclass
class TinySpec:
    arch: str = "llama"
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 96
    n_layer: int = 2
    n_ctx: int = 256
    tied: bool = True
    qtype: T = T.F32  # type of the projection weights
    embd_type: T = T.F32
    sliding_window: int = 8


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer(w: gguf.GGUFWriter, spec: TinySpec) -> int:
    if spec.arch == "gemma3":
        tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
        tokens += ["▁", "▁the", "▁a", "the", "<start_of_turn>", "<end_of_turn>"]
        types = [3, 3, 3, 2] + [6] * 256 + [1, 1, 1, 1, 3, 3]
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * 260 + [-1.0, -2.0, -3.0, -4.0, 0.0, 0.0])
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
        return len(tokens)
    tokens = SPECIALS + _byte_unicode() + ["Ġt", "he", "Ġthe"]
    types = [3] * len(SPECIALS) + [1] * 259
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    return len(tokens)


# types gguf.quants cannot write, with the block scale (times std) that gives weights of about std
RANDOM_CODES = {T.IQ4_NL: 1 / 60, T.IQ4_XS: 1 / 960, T.IQ2_XXS: 1 / 50, T.IQ2_XS: 1 / 50,
                T.IQ2_S: 1 / 50, T.IQ3_XXS: 1 / 130, T.IQ3_S: 1 / 128}  # fmt: skip


def _matrix(
    w: gguf.GGUFWriter,
    name: str,
    rows: int,
    cols: int,
    qtype: T,
    rng: np.random.Generator,
    std: float,
) -> None:
    a = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
    if qtype == T.F32:
        w.add_tensor(name, a)
    elif qtype == T.F16:
        w.add_tensor(name, a.astype(np.float16))
    elif qtype in RANDOM_CODES:  # gguf cannot quantize to it: valid random blocks of that size
        raw = random_blocks(qtype, (rows, cols), rng, std * RANDOM_CODES[qtype])
        w.add_tensor(name, raw, raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def write_tiny_model(path: Path, spec: TinySpec | None = None, seed: int = 0) -> Path:
    spec = spec or TinySpec()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), spec.arch)
    a = spec.arch
    w.add_type("model")
    w.add_name(f"tiny-{a}")
    n_vocab = _tokenizer(w, spec)
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    if a == "gemma3":
        w.add_sliding_window(spec.sliding_window)
    else:
        w.add_rope_dimension_count(spec.head_dim)
    d, hd = spec.n_embd, spec.head_dim
    _matrix(w, "token_embd.weight", n_vocab, d, spec.embd_type, rng, 0.5)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    if not spec.tied:
        _matrix(w, "output.weight", n_vocab, d, spec.qtype, rng, 0.1)
    norms = ["attn_norm", "ffn_norm"]
    if a == "gemma3":
        norms += ["post_attention_norm", "post_ffw_norm"]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        for n in norms:
            w.add_tensor(p + n + ".weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
        if a in ("gemma3", "qwen3"):
            for n in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(
                    p + n + ".weight", (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
                )
        if a == "qwen2":  # Q/K/V biases
            for n, rows in (("attn_q", spec.n_head * hd), ("attn_k", spec.n_head_kv * hd),
                            ("attn_v", spec.n_head_kv * hd)):  # fmt: skip
                w.add_tensor(p + n + ".bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
        std = 1.0 / np.sqrt(d)
        _matrix(w, p + "attn_q.weight", spec.n_head * hd, d, spec.qtype, rng, std)
        _matrix(w, p + "attn_k.weight", spec.n_head_kv * hd, d, spec.qtype, rng, std)
        _matrix(w, p + "attn_v.weight", spec.n_head_kv * hd, d, spec.qtype, rng, std)
        _matrix(
            w,
            p + "attn_output.weight",
            d,
            spec.n_head * hd,
            spec.qtype,
            rng,
            1.0 / np.sqrt(spec.n_head * hd),
        )
        _matrix(w, p + "ffn_gate.weight", spec.n_ff, d, spec.qtype, rng, std)
        _matrix(w, p + "ffn_up.weight", spec.n_ff, d, spec.qtype, rng, std)
        _matrix(w, p + "ffn_down.weight", d, spec.n_ff, spec.qtype, rng, 1.0 / np.sqrt(spec.n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_adapter(
    path: Path,
    spec: TinySpec | None = None,
    targets: dict[str, tuple[int, int]] | None = None,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 1,
    arch: str | None = None,
    overrides: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    metadata: dict[str, object] | None = None,
    n_vocab: int | None = None,
) -> Path:
    """A GGUF LoRA adapter in llama.cpp's layout. targets: base name -> (n_in, n_out) in torch
    terms; token_embd takes (n_vocab, n_embd). overrides: tensor base name -> (A, B) as stored
    (torch order of the GGUF shapes), for writing deliberately broken files."""
    spec = spec or TinySpec()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch or spec.arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for k, v in (metadata or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
    if targets is None:
        d, hd = spec.n_embd, spec.head_dim
        targets = {}
        for i in range(spec.n_layer):
            p = f"blk.{i}."
            targets[p + "attn_q"] = (d, spec.n_head * hd)
            targets[p + "attn_v"] = (d, spec.n_head_kv * hd)
            targets[p + "ffn_down"] = (spec.n_ff, d)
    for base, (n_in, n_out) in targets.items():
        if overrides and base in overrides:
            a, b = overrides[base]
        elif base == "token_embd":
            a = rng.standard_normal((n_in, rank)).astype(np.float32) * 0.5  # torch (n_vocab, r)
            b = rng.standard_normal((n_out, rank)).astype(np.float32) * 0.5  # torch (n_embd, r)
        else:
            a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * 0.2).astype(np.float32)
        w.add_tensor(base + ".weight.lora_a", a)
        w.add_tensor(base + ".weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
