"""A prompt's routed FFN in native calls (FusedLayer.routed_ffn, gl_moe_ffn) against its composed
twin (models/moe.py's moe_ffn, models/gpt_oss.py's routed_ffn) on the same normed inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import graftlm
from graftlm.models import fused
from graftlm.step.batch import Batch, LoraRows


def composed(model: Any, i: int, h: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Layer i's routed FFN of h (B, T, n_embd) as its family's block composes it."""
    y: torch.Tensor = model.composed_routed_ffn(i, h, batch)
    return y


def native(model: Any, i: int, h: torch.Tensor, batch: Batch) -> torch.Tensor:
    y = model.native_routed_ffn(i, h, batch)
    assert y is not None, f"layer {i}: the native routed FFN did not serve the step"
    return y


def check_twins(m: graftlm.Model, settings: list[dict[int, float]]) -> None:
    """Prompt rows of 9 tokens, one a setting of `settings` (a row with none among them), in
    every layer: the native routed FFN within 2e-5 of the composed one (the same kernels over
    the same rows; the router's softmax and the mix's products in C's arithmetic, not torch's:
    ~1e-6 apart), bit-identical on one thread and two and in calls of 5 tokens (each token's
    arithmetic is its own); at no adapter the same as with every adapter at scale 0."""
    model = m.model
    n, t, d = len(settings), 9, m.config.n_embd
    rows = m.engine.lora_rows(settings)
    ids = torch.zeros(n, t, dtype=torch.long)
    batch = Batch(ids, list(range(n)), [0] * n, [t] * n, rows)
    h = torch.randn(n, t, d, generator=torch.Generator().manual_seed(3))
    h = h / h.pow(2).mean(-1, keepdim=True).sqrt()  # (as a norm's output: rms 1)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for i in range(m.config.n_layer):
                got = native(model, i, h, batch)
                torch.testing.assert_close(got, composed(model, i, h, batch), rtol=2e-5, atol=2e-5)
                torch.set_num_threads(2)
                assert torch.equal(native(model, i, h, batch), got)
                torch.set_num_threads(threads)
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(fused, "MOE_ROWS", 5)
                    assert torch.equal(native(model, i, h, batch), got)
                plain = Batch(ids, list(range(n)), [0] * n, [t] * n, None)
                zero = LoraRows(torch.zeros_like(rows.scales), rows.active)
                zeros = Batch(ids, list(range(n)), [0] * n, [t] * n, zero)
                p = native(model, i, h, plain)
                assert torch.equal(native(model, i, h, zeros), p)
                torch.testing.assert_close(p, composed(model, i, h, plain), rtol=2e-5, atol=2e-5)
                for r, s in enumerate(settings):  # a row's adapters move its outputs, or not
                    assert torch.equal(got[r], p[r]) == (not any(s.values())), (i, r)
    finally:
        torch.set_num_threads(threads)
