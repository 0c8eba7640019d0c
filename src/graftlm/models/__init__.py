"""Model families, one file each, behind a registry keyed by `general.architecture`."""

from __future__ import annotations

from graftlm import hugepages
from graftlm.config import build_config, whole_field
from graftlm.errors import ModelFileError, UnsupportedArchitectureError
from graftlm.gguf import GGUFFile
from graftlm.models.base import Transformer, Weights
from graftlm.models.gemma2 import Gemma2
from graftlm.models.gemma3 import Gemma3
from graftlm.models.gpt_oss import GptOss
from graftlm.models.llama import Llama
from graftlm.models.phi3 import Phi3
from graftlm.models.qwen2 import Qwen2
from graftlm.models.qwen3 import Qwen3, Qwen3Moe

ARCHITECTURES: dict[str, type[Transformer]] = {
    cls.arch: cls for cls in (Llama, Qwen2, Qwen3, Qwen3Moe, Phi3, Gemma2, Gemma3, GptOss)
}


def context_size(file: GGUFFile, requested: int) -> int:
    """The context a model is built for: `requested` up to the file's training context
    (`<arch>.context_length`); requested <= 0: the training context (4096 when the file has
    none). The field is checked as the config checks it."""
    key = f"{file.architecture}.context_length"
    trained = file.get(key)
    if trained is not None:
        trained = whole_field(trained, key, str(file.path), 1, 1 << 31)
    if requested > 0:
        return min(requested, trained) if trained is not None else requested
    return trained if trained is not None else 4096


def build_model(
    file: GGUFFile, n_ctx: int, prefer: str = "fast", progress: bool = False
) -> Transformer:
    """The model of a GGUF file, weights memory-mapped and kept compact."""
    if file.file_type == "adapter":
        raise ModelFileError(
            f"{file.path}: is a LoRA adapter (general.type = adapter), not a model; "
            "pass it with --lora and give the base model with -m"
        )
    arch = file.architecture
    if arch is None:
        raise ModelFileError(f"{file.path}: no general.architecture in the metadata")
    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"{file.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    cfg = build_config(file.metadata, set(file.tensors), str(file.path))
    w = Weights(file, prefer, progress)
    try:
        return cls(cfg, w, n_ctx)
    finally:
        hugepages.end_pool()  # the next model's small buffers: chunks of their own
        if w.bar is not None:
            w.bar.close()


__all__ = ["ARCHITECTURES", "Transformer", "build_model", "context_size"]
