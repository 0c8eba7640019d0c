"""Quantized GGUF weights and the one matmul seam the model uses.

``QWeight.from_gguf`` keeps a GGUF tensor compact in whichever kernel suits its type and shape;
``linear(x, w)`` is the only place the model multiplies by a weight; ``dequantize_any`` turns any
tensor the gguf package understands into float32.
"""

from graftlm.quant.config import compute_dtype, get_compute_dtype, set_compute_dtype
from graftlm.quant.qweight import (
    FAST_KERNELS,
    QWeight,
    dequantize_any,
    linear,
    register_kernel,
)

__all__ = [
    "FAST_KERNELS",
    "QWeight",
    "compute_dtype",
    "dequantize_any",
    "get_compute_dtype",
    "linear",
    "register_kernel",
    "set_compute_dtype",
]
