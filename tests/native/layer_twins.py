"""Twins shared by the native layer tests (test_native_layer.py, test_native_families.py): x
rounded as the kernels round activations, and a model made to run its PyTorch blocks."""

from __future__ import annotations

import pytest
import torch


def compose(mp: pytest.MonkeyPatch) -> None:
    """From here on the model runs its PyTorch blocks: no native layer, alone or all at once,
    and no native routed FFN (a prompt's)."""
    from graftlm.models.base import Transformer

    mp.setattr(Transformer, "native_layers", lambda self, x, batch: None)
    mp.setattr(Transformer, "native_block", lambda self, i, x, batch: None)
    mp.setattr(Transformer, "native_routed_ffn", lambda self, i, h, batch: None)


def q8_x(x: torch.Tensor) -> torch.Tensor:
    """x (..., 32 k) rounded as the kernels round activations, per 32 values: d = max|v| / 127,
    q = round(v * 127 / max|v|), float32 d."""
    v = x.reshape(-1, 32)
    amax = v.abs().amax(dim=1, keepdim=True)
    q = torch.where(amax > 0, torch.round(v * (127 / torch.where(amax > 0, amax, 1))), 0)
    return (q * (amax / 127)).reshape(x.shape)
