"""Bindings of the native projection and decoder-layer calls, over the C structs that
``graftlm.native.abi`` mirrors: thin wrappers that take those structs and plain tensors.

What a projection or a layer runs is decided in ``graftlm.models`` (``seam`` and ``fused``), which
fill these structs from the model's weights, adapters and cache; nothing here knows a model.
"""

from __future__ import annotations

import ctypes

import torch

from graftlm.native.abi import GlLayer, GlLoraSite, GlWeight, Scratch
from graftlm.native.build import library, threads

ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}  # gl_layer.act
GATINGS = {"softmax_norm": 0, "softmax_chosen": 1}  # gl_layer.gating


def proj(weight: GlWeight, site: GlLoraSite, x: torch.Tensor, y: torch.Tensor) -> None:
    """y (B, T, n_out) = x (B, T, n_in) @ W.T plus the delta of `site` (its scales a (B, R) row
    of columns per row of x), in one pass (``gl_proj``). x, y float32, contiguous, on the CPU;
    the library loaded (the caller checked)."""
    lib = library()
    assert lib is not None
    b, t, _ = x.shape
    lib.gl_proj(
        ctypes.byref(weight), ctypes.byref(site), x.data_ptr(), b * t, t, y.data_ptr(), threads()
    )


def layer_decode(
    layer: GlLayer, x: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, scratch: Scratch
) -> None:
    """One decoder layer's decode step on x (B, n_embd), in place (``gl_layer_decode``): row b is
    the token at position starts[b] of cache slot slots[b] (both (B,) int64, inside the cache);
    its buffers come from `scratch`, kept between steps."""
    lib = library()
    assert lib is not None
    lib.gl_layer_decode(
        ctypes.byref(layer), x.data_ptr(), x.shape[0], slots.data_ptr(), starts.data_ptr(),
        scratch.ref, threads(),
    )  # fmt: skip


def layers_decode(
    layers: ctypes.Array[ctypes.c_void_p],
    x: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    scratch: Scratch,
) -> None:
    """Every layer of `layers` (addresses of gl_layer structs) in turn on x, as layer_decode."""
    lib = library()
    assert lib is not None
    lib.gl_layers_decode(
        layers, len(layers), x.data_ptr(), x.shape[0], slots.data_ptr(), starts.data_ptr(),
        scratch.ref, threads(),
    )  # fmt: skip


def moe_bytes(layer: GlLayer, rows: int) -> int:
    """The bytes of scratch moe_ffn takes for `rows` tokens of layer `layer` at the adapters its
    struct points at now (``gl_moe_bytes``; 0 without a routed FFN)."""
    lib = library()
    assert lib is not None
    return int(lib.gl_moe_bytes(ctypes.byref(layer), rows))


def moe_ffn(layer: GlLayer, h: torch.Tensor, out: torch.Tensor, scratch: Scratch) -> None:
    """Layer `layer`'s routed FFN of h (N, n_embd), normed, into out (N, n_embd) (``gl_moe_ffn``):
    token n at row n of the scale table its sites read; h, out float32, contiguous, on the CPU;
    its buffers from `scratch`."""
    lib = library()
    assert lib is not None
    lib.gl_moe_ffn(
        ctypes.byref(layer), h.data_ptr(), h.shape[0], out.data_ptr(), scratch.ref, threads()
    )
