"""Constants of the matmul seam: the decode/prefill switch-over and the chunk sizes.

The precision of a product is not a setting of the process: it is chosen per call
(``linear(x, w, exact=...)``), and the model takes it from the step's batch (``Batch.exact``).
Fast (the default): quantized weights use fused kernels for small batches of rows. Those are
graftlm's native kernels where they built (x quantized to int8 per 32 values, as llama.cpp does:
~5e-3 relative error), else torch's weight-only kernels, which take bfloat16 activations (~3e-3
relative). Exact: every quantized matmul goes through exact float32 dequantization + float32
GEMM, slower for decode but equal to ``x @ w.dequantize().T`` up to float32 summation order.
"""

from __future__ import annotations

# Rows M of x at or above which fused weight-only kernels lose to "dequantize a chunk of rows to
# float32 + float32 GEMM" (measured on an AVX2 core, see bench/qweight_matmul.py).  Per kernel, since
# a two-plane int4pack weight costs twice a one-plane one per row of x.
# The native int8-activation kernels (graftlm.native) never lose: `python bench/kernels.py` on the
# 2-core AVX2 machine gives them 45-58 GMAC/s at M=512 against 31-38 for float32 chunks.
NEVER = 1 << 30
PREFILL_M = {"int4pack": 96, "int4pack2": 48, "int8g": 16, "native-u4": NEVER, "native-k4": NEVER,
             "native-k16": NEVER, "native-s8": NEVER, "native-float": NEVER,
             "native-mx4": NEVER, "native-iq": NEVER}  # fmt: skip

# Elements of weight dequantized per chunk in the float32 paths: bounds the temporary memory of a
# matmul to a few CHUNK_ELEMS * 4 bytes whatever the weight's size, and keeps the temporaries in
# cache (and out of fresh, page-faulting allocations).
CHUNK_ELEMS = 1 << 18
LOAD_CHUNK_ELEMS = 1 << 20  # the same, for repacking at load time


def use_fused(kernel: str, m: int, exact: bool = False) -> bool:
    """Whether a fused kernel should serve a matmul with m rows of x (never an exact one)."""
    return not exact and m < PREFILL_M[kernel]


def chunk_rows(n_in: int, multiple: int = 1, elems: int | None = None) -> int:
    """Rows per chunk of ``elems`` (default CHUNK_ELEMS) weights, a multiple of ``multiple``."""
    rows = max(multiple, (elems or CHUNK_ELEMS) // max(n_in, 1))
    return rows - rows % multiple
