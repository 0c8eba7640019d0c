"""Tiny fixture families that ../shared/fixtures/tiny does not hold, made the same way: a random
transformers checkpoint (float32, hidden 128, 2 layers, the shared vocabulary of 1000), converted
by llama.cpp's own `convert_hf_to_gguf.py` to `model-f32.gguf` and `model-q8_0.gguf`, with a
random PEFT LoRA (r=4, alpha=8) in `peft/` and its conversion by `convert_lora_to_gguf.py` in
`lora-f32.gguf`.

Made once into a cache outside the repository ($GRAFTLM_CACHE, else ~/.cache/graftlm), keyed by
this file's and the converter driver's text; about 20 s a family on two cores.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from shared_data import SHARED, TINY

HERE = Path(__file__).resolve().parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json")  # fmt: skip


def _qwen3moe(transformers: Any) -> Any:
    """Qwen3-30B-A3B's block at a tiny size: QK-norm, 16 experts, 4 a token, normalized weights
    (as the released checkpoints set `norm_topk_prob`), head_dim 48 != hidden / heads."""
    return transformers.Qwen3MoeConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1e6,
    )  # fmt: skip


def _gpt_oss(transformers: Any) -> Any:
    """gpt-oss-20b's block at a tiny size: attention sinks, biases on q/k/v/o, a sliding window
    (16, so the 40 test tokens pass it) on even layers, YaRN (factor 32 over 4096, its betas 32
    and 1), 16 experts with biases, 4 a token, the clamped SwiGLU; head_dim 48 != hidden / heads.
    YaRN's correction range is truncated to whole dimensions, as llama.cpp computes it (the
    released config sets `truncate: false`, which ggml has no way to express)."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": True,
        "original_max_position_embeddings": 4096,
    }
    return transformers.GptOssConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=48, num_local_experts=16,
        num_experts_per_tok=4, sliding_window=16, rope_parameters=yarn, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    )  # fmt: skip


def _gpt_oss_weights(model: Any) -> None:
    """Expert gate/up weights wide enough that the SwiGLU's clamps (+-7) bite on many rows, and
    sinks large enough to take a share of the softmax beside scores of ~7 (as trained ones do)."""
    for layer in model.model.layers:
        layer.mlp.experts.gate_up_proj.normal_(0.0, 0.4)
        layer.self_attn.sinks.uniform_(4.0, 10.0)


# family -> (its config, the modules of its PEFT adapter, a change to the random weights)
MADE: dict[str, tuple[Callable[[Any], Any], list[str], Callable[[Any], None] | None]] = {
    "qwen3moe": (_qwen3moe, ["q_proj", "k_proj", "v_proj", "o_proj"], None),
    "gpt-oss": (_gpt_oss, ["q_proj", "k_proj", "v_proj", "o_proj"], _gpt_oss_weights),
}


def cache_dir() -> Path:
    return Path(os.environ.get("GRAFTLM_CACHE", Path.home() / ".cache" / "graftlm")) / "tiny"


def _key() -> str:
    text = b"".join((HERE / f).read_bytes() for f in ("made_families.py", "convert_tiny.py"))
    return hashlib.sha256(text).hexdigest()[:12]


def tiny_dir(family: str) -> Path | None:
    """The tiny fixture folder of `family`: ../shared's, else the one made here, else None."""
    shared = TINY / family
    return shared if shared.is_dir() else made_dir(family)


def made_dir(family: str) -> Path | None:
    """The made fixture folder of `family` (made now if it is not cached), or None where it
    cannot be made here (no transformers, PEFT or llama.cpp's converter)."""
    if family not in MADE:
        return None
    done = cache_dir() / f"{family}-{_key()}"
    if (done / "lora-f32.gguf").exists():
        return done
    try:
        import peft
        import transformers
    except ImportError:
        return None
    vocab = TINY / "qwen3" / "model-f32.gguf"
    converter = SHARED / "llama.cpp" / "convert" / "convert_hf_to_gguf.py"
    if not vocab.exists() or not converter.exists():
        return None
    done.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=done.parent) as tmp:
        work = Path(tmp) / family
        _make(family, work, vocab, transformers, peft)
        try:
            work.rename(done)
        except OSError:  # made meanwhile by another process
            if not (done / "lora-f32.gguf").exists():
                raise
    for old in done.parent.glob(f"{family}-*"):  # made by an older version of these files
        if old != done:
            shutil.rmtree(old, ignore_errors=True)
    return done


def _make(family: str, out: Path, vocab: Path, transformers: Any, peft: Any) -> None:
    config, targets, edit = MADE[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(transformers))
    with torch.no_grad():  # weights large enough that the logits are far from uniform
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
            else:
                p.uniform_(0.5, 1.5)
        if edit is not None:
            edit(model)
    hf = out / "hf"
    model.save_pretrained(hf)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / "qwen3" / "hf" / name, hf / name)
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
    )
    with torch.no_grad():  # PEFT's random init leaves B small: make the adapter matter
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    lora.save_pretrained(out / "peft")
    for outtype in ("f32", "q8_0"):
        _convert(
            vocab, "model", hf, "--outtype", outtype, "--outfile", out / f"model-{outtype}.gguf"
        )
    _convert(vocab, "lora", out / "peft", "--base", hf, "--outtype", "f32",
             "--outfile", out / "lora-f32.gguf")  # fmt: skip


def _convert(vocab: Path, which: str, *args: object) -> None:
    cmd = [sys.executable, str(HERE / "convert_tiny.py"), str(vocab), which, *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
