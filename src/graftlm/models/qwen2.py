"""qwen2: Qwen 2 / 2.5. The llama block with Q/K/V biases (loaded by LlamaBlock when present) and
RoPE over halves: llama.cpp's converter does not permute qwen2's Q/K rows (config.py sets neox)."""

from __future__ import annotations

from graftlm.models.llama import Llama


class Qwen2(Llama):
    arch = "qwen2"
