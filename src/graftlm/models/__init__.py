"""Model families, one file each, behind a registry keyed by `general.architecture`."""

from __future__ import annotations

from graftlm.config import build_config
from graftlm.errors import ModelFileError, UnsupportedArchitectureError
from graftlm.gguf import GGUFFile
from graftlm.models.base import Transformer, Weights
from graftlm.models.gemma3 import Gemma3
from graftlm.models.llama import Llama

ARCHITECTURES: dict[str, type[Transformer]] = {cls.arch: cls for cls in (Llama, Gemma3)}


def build_model(file: GGUFFile, n_ctx: int, prefer: str = "fast") -> Transformer:
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
    return cls(cfg, Weights(file, prefer), n_ctx)


__all__ = ["ARCHITECTURES", "Transformer", "build_model"]
