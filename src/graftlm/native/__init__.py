"""graftlm's optional native code: the C files of ``csrc/``, compiled as one unit on first use.

* quantized matrix products over repacked GGUF blocks (``graftlm.quant.native_kernels``);
* decode-step helpers: RMS norm, and attention of one new token per row through the KV cache
  with RoPE (``graftlm.native.ops``).

Everything has a PyTorch twin that runs when the library is unavailable (see ``build``).
"""

from graftlm.native.build import (
    amx,
    bf16_dots,
    disabled,
    features,
    isa,
    library,
    release_threads,
    threads,
    unavailable_reason,
)

__all__ = [
    "amx",
    "bf16_dots",
    "disabled",
    "features",
    "isa",
    "library",
    "release_threads",
    "threads",
    "unavailable_reason",
]
