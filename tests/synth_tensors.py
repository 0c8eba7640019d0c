"""Synthetic GGUF tensors for tests and benchmarks.

``gguf.quants.quantize`` only implements F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (and a few
exotic types); for the others (K-quants, IQ types) valid raw blocks are made directly: random
bytes everywhere, except that each block's fp16 scale fields are overwritten with small finite
values so that the dequantized weights are finite and of a realistic size.  Random codes exercise
every bit of the unpacking, which is what a bit-exact dequantization test needs.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import QuantError, quantize

T = GGMLQuantizationType

# Byte offsets of the fp16 fields of each block (everything else may be random bytes).
FP16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.IQ1_S: (0,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
}
# Byte offsets of e8m0 exponents (a random byte would overflow to inf).
E8M0_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {T.MXFP4: (0,)}


def random_blocks(
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    rng: np.random.Generator,
    scale: float = 0.01,
) -> np.ndarray:
    """Valid random raw blocks of ``qtype``: uint8 (n_out, row_bytes)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_out, n_in = shape
    if n_in % block:
        raise ValueError(f"{qtype.name} needs n_in % {block} == 0, got {n_in}")
    raw = rng.integers(0, 256, (n_out * n_in // block, size), dtype=np.uint8)
    for at in FP16_FIELDS.get(qtype, ()):
        d = np.abs(rng.normal(0.0, scale, (raw.shape[0], 1))).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8)
    for at in E8M0_FIELDS.get(qtype, ()):
        raw[:, at] = rng.integers(115, 125, raw.shape[0], dtype=np.uint8)  # 2**-12 .. 2**-3
    return raw.reshape(n_out, n_in // block * size)


def gguf_tensor(
    qtype: GGMLQuantizationType, shape: tuple[int, int], seed: int = 0, prefer_quantize: bool = True
) -> tuple[np.ndarray, str]:
    """(raw uint8 (n_out, row_bytes), how it was made) for a random ``qtype`` weight.

    how is "gguf.quantize" (gguf quantized normal weights), or "random blocks" when gguf cannot
    quantize the type (or prefer_quantize is False, which is much faster for big tensors).
    """
    rng = np.random.default_rng(seed)
    if prefer_quantize:
        w = rng.normal(0.0, 0.05, shape).astype(np.float32)
        try:
            q = quantize(w, qtype)
        except (NotImplementedError, QuantError):
            pass
        else:
            return np.ascontiguousarray(q).view(np.uint8).reshape(shape[0], -1), "gguf.quantize"
    if qtype in (T.F32, T.F16, T.BF16):
        w = rng.normal(0.0, 0.05, shape).astype(np.float32)
        raw = quantize(w, qtype) if qtype != T.BF16 else _bf16(w)
        return np.ascontiguousarray(raw).view(np.uint8).reshape(shape[0], -1), "cast"
    return random_blocks(qtype, shape, rng), "random blocks"


def _bf16(w: np.ndarray) -> np.ndarray:
    return (w.view(np.uint32) >> 16).astype(np.uint16)
