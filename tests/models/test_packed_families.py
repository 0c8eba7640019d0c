"""Packed prefill (Batch.packed) on every tiny family: sliding windows (mistral, gemma2's every
other layer, gpt-oss), gemma2's soft-capped scores, attention sinks, QK-norms, routed experts,
phi3's fused projections, with the fixture adapter at a different scale on each row (0: the
base's bits). Each sequence of a packed step is that chunk prefilled alone: bit for bit on the
native products (q8_0, prefer "fast"), whose rows are computed each on its own; to float32
rounding on the reference's (PyTorch's float32 matmul blocks its sums differently for other row
counts) and for a chunk of one token, which alone is a decode-shaped step (its own attention
and expert kernels)."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, IDS, family_dir, load, one_thread, rel_err, with_adapter

from graftlm.models import Transformer
from graftlm.step.batch import Batch, LoraRows

__all__ = ["one_thread"]  # (the fixture, used by every test here)

# (tokens, start): a chunk past gemma2's window of 16, a short one, one token, and a chunk that
# starts past a cached first piece
ROWS = [(IDS, 0), (IDS[5:14], 0), (IDS[20:21], 0), (IDS[3:33], 12)]
SCALES = [1.0, 0.0, -0.5, 2.0]


def _alone(model: Transformer, ids: list[int], start: int, scale: float | None) -> torch.Tensor:
    model.allocate_cache(1, dtype=torch.float32)
    lora = None if scale is None else LoraRows(torch.tensor([[scale]]), (0,))
    if start:
        model.forward(Batch.single(ids[:start], 0, 0, lora))
    return model.forward(Batch.single(ids[start:], 0, start, lora))[0]


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_packed_rows_equal_each_chunk_alone(family: str, quant: str) -> None:
    if not (family_dir(family) / f"model-{quant}.gguf").exists():
        pytest.skip(f"no {quant} fixture for {family}")
    prefer = "reference" if quant == "f32" else "fast"
    model = load(family, quant, prefer=prefer)
    adapter = family_dir(family) / "lora-f32.gguf"
    if adapter.exists():  # (mixtral's fixture has none)
        model = with_adapter(model, adapter)
    model.allocate_cache(len(ROWS), dtype=torch.float32)
    scales = torch.tensor(SCALES).view(-1, 1)

    def lora(rows: slice) -> LoraRows | None:
        return LoraRows(scales[rows], (0,)) if adapter.exists() else None

    for slot, (ids, start) in enumerate(ROWS):
        if start:
            model.forward(Batch.single(ids[:start], slot, 0, lora(slice(slot, slot + 1))))
    chunks = [ids[start:] for ids, start in ROWS]
    starts = [start for _, start in ROWS]
    packed = model.forward(Batch.packed(chunks, range(len(ROWS)), starts, lora(slice(None))))
    for i, (ids, start) in enumerate(ROWS):
        alone = _alone(model, ids, start, SCALES[i] if adapter.exists() else None)
        if prefer == "fast" and len(chunks[i]) > 1:
            assert torch.equal(packed[i], alone), f"row {i}: {(packed[i] - alone).abs().max()}"
        else:
            assert rel_err(packed[i], alone) < 1e-5
