"""Reading (and writing) GGUF files."""

from graftlm.gguf.file import GGUFFile, TensorEntry

__all__ = ["GGUFFile", "TensorEntry"]
