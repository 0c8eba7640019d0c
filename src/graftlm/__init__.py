"""graftlm: a GGUF base model, quantized as downloaded, with LoRA adapters mounted at runtime."""

from graftlm.api import Model, load
from graftlm.errors import AdapterError, GraftError, ModelFileError, RequestError

__version__ = "0.1.0"

__all__ = ["AdapterError", "GraftError", "Model", "ModelFileError", "RequestError", "load"]
