"""graftlm: a GGUF base model, quantized as downloaded, with LoRA adapters mounted at runtime.

`load` and `Model` (graftlm.api, the top of the package) are imported on first use, so importing
a lower floor (graftlm.quant, graftlm.step, ...) loads nothing above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graftlm.errors import AdapterError, GraftError, ModelFileError, RequestError

if TYPE_CHECKING:
    from graftlm.api import Model, load

__version__ = "0.1.0"

__all__ = ["AdapterError", "GraftError", "Model", "ModelFileError", "RequestError", "load"]


def __getattr__(name: str) -> Any:
    if name in ("Model", "load"):
        from graftlm import api

        return getattr(api, name)
    raise AttributeError(f"module 'graftlm' has no attribute {name!r}")
