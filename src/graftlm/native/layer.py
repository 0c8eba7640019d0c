"""Bindings of the native projection and decoder-layer calls: the C structs they take, mirrored
in ctypes, and thin wrappers that take those structs and plain tensors.

What a projection or a layer runs is decided in ``graftlm.models`` (``seam`` and ``fused``), which
fill these structs from the model's weights, adapters and cache; nothing here knows a model.
"""

from __future__ import annotations

import ctypes

import torch

from graftlm.native.build import library, threads

_I64, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Weight(ctypes.Structure):
    _fields_ = [("kind", _I64), ("half", _I64), ("sblk", _I64), ("small", _I64), ("n", _I64),
                ("k", _I64), ("q", _P), ("d", _P), ("m", _P)]  # fmt: skip


class _Lora(ctypes.Structure):
    _fields_ = [("a", _P), ("bb", _P), ("scales", _P), ("span", _P), ("r", _I64), ("bf", _I64),
                ("aq", _P), ("a_scales", _P), ("a_half", _I64)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Weight * 3), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight),
        ("l_qkv", _Lora * 3), ("l_o", _Lora), ("l_gate_up", _Lora), ("l_down", _Lora),
        ("attn_norm", _P), ("ffn_norm", _P),
        ("q_norm", _P), ("k_norm", _P), ("post_attn_norm", _P), ("post_ffw_norm", _P),
        ("kc", _P), ("vc", _P), ("cos_t", _P), ("sin_t", _P),
        ("n_qkv", _I64), ("n_embd", _I64), ("n_head", _I64), ("n_head_kv", _I64),
        ("head_dim", _I64), ("n_ff", _I64), ("n_ctx", _I64), ("rot", _I64), ("neox", _I64),
        ("window", _I64), ("act", _I64), ("eps", _F), ("scale", _F),
    ]  # fmt: skip


ACTS = {"silu": 0, "gelu_tanh": 1}  # gl_layer.act


def proj(weight: _Weight, site: _Lora, x: torch.Tensor, y: torch.Tensor) -> None:
    """y (B, T, n_out) = x (B, T, n_in) @ W.T plus the delta of `site` (its scales a (B, R) row
    of columns per row of x), in one pass (``gl_proj``). x, y float32, contiguous, on the CPU;
    the library loaded (the caller checked)."""
    lib = library()
    assert lib is not None
    b, t, _ = x.shape
    lib.gl_proj(
        ctypes.byref(weight), ctypes.byref(site), x.data_ptr(), b * t, t, y.data_ptr(), threads()
    )


def layer_decode(layer: _Layer, x: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor) -> None:
    """One decoder layer's decode step on x (B, n_embd), in place (``gl_layer_decode``): row b is
    the token at position starts[b] of cache slot slots[b] (both (B,) int64, inside the cache)."""
    lib = library()
    assert lib is not None
    lib.gl_layer_decode(
        ctypes.byref(layer), x.data_ptr(), x.shape[0], slots.data_ptr(), starts.data_ptr(),
        threads(),
    )  # fmt: skip


def layers_decode(
    layers: ctypes.Array[ctypes.c_void_p],
    x: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
) -> None:
    """Every layer of `layers` (addresses of _Layer structs) in turn on x, as layer_decode."""
    lib = library()
    assert lib is not None
    lib.gl_layers_decode(
        layers, len(layers), x.data_ptr(), x.shape[0], slots.data_ptr(), starts.data_ptr(),
        threads(),
    )  # fmt: skip
