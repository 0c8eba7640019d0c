"""Quantized GGUF weights and the one matmul seam the model uses.

``QWeight.from_gguf`` keeps a GGUF tensor compact in whichever kernel suits its type and shape;
``linear(x, w)`` is the only place the model multiplies by a weight; ``dequantize_any`` turns any
tensor the gguf package understands into float32.  The model never branches on quantization.

Kernel per GGUF type (first accepting kernel of ``FAST_KERNELS``). Where graftlm's native
library builds (x86-64 with AVX2 and a C compiler; see ``graftlm.native``):

=================  ============  ==========================================================
type               kernel        storage (bytes per weight vs file)
=================  ============  ==========================================================
Q4_0, Q4_1         native-u4     4-bit codes + the file's float16 (d, m) per 32 (1.0x)
Q5_0, Q5_1         native-u4     the same + a plane of fifth bits (1.09x, 1.0x)
Q4_K, Q5_K         native-k4     the super-blocks regrouped by 8 rows (1.03x, 1.02x)
Q8_0               native-s8     int8 codes + the file's float16 d per 32 (1.0x)
Q6_K               native-k16    the super-blocks regrouped by 8 rows (1.0x)
Q3_K, Q2_K         native-k16    the same, the codes in 4 bits (1.35x, 1.95x)
MXFP4              native-mx4    the 4-bit codes + the file's E8M0 exponent per 32 (1.0x)
IQ2_XXS, IQ3_XXS   native-iq     the super-blocks regrouped by 16 rows (AVX-512 VBMI; 1.0x)
IQ2_*, IQ3_*       native-iq     the file's super-blocks in place, zero-copy (1.0x)
=================  ============  ==========================================================

Otherwise, and for every other type:

=================  ============  ==========================================================
type               kernel        storage (bytes per weight vs file)
=================  ============  ==========================================================
F32 / F16 / BF16   dense-*       the file's tensor itself, zero-copy (1.0x)
Q4_0, Q4_1, Q4_K   int4pack      torch int4pack tiles + bf16 (s, z) per 32 (~1.2x)
Q5_0, Q5_1, Q5_K   int4pack2     two int4pack planes, x' = [x | 16 x] (~1.9x)
Q6_K               int4pack2     paired planes per 16-sub-block, x' = [x | 4 x] (~1.6x)
Q8_0, n_out<8192   int4pack2     two planes (~1.24x)
Q8_0, n_out>=8192  int8g         int8 codes per 32-group, _weight_int8pack_mm (~1.06x)
Q2_K, Q3_K, IQ*,   blocks        the GGUF blocks themselves, dequantized per chunk (1.0x)
TQ*, MXFP4, ...
=================  ============  ==========================================================

Every kernel also keeps the file's exact scales, so ``dequantize()`` / ``rows()`` are bit-exact
with ``gguf.quants.dequantize``; ``prefer="reference"`` gives the dense float32 oracle instead.
"""

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
    "dequantize_any",
    "linear",
    "register_kernel",
]
