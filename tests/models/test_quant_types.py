"""Every family with the GGUF types gguf's own quantizer writes, beyond llama.cpp's f32 and q8_0
fixture files: the f32 fixture requantized (`families.requantize`), against transformers on the
same round-tripped weights. K-quants are not here: their 256-wide blocks do not fit these models'
128-wide rows (llama.cpp itself falls back to other types for such tensors)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from families import (
    FAMILIES,
    IDS,
    NATIVE,
    ROUTED,
    WITH_PEFT,
    family_dir,
    forward,
    one_thread,  # noqa: F401 (an autouse fixture: tiny models run on one thread)
    reference,
    rel_err,
    requantize,
    with_adapter,
)
from spies import stack_calls

from graftlm.gguf import GGUFFile
from graftlm.models import build_model
from graftlm.native import bf16_dots, library
from graftlm.step.batch import Batch, LoraRows

TYPES = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_type_matches_transformers_on_the_same_weights(
    family: str, qtype: str, tmp_path: Path
) -> None:
    path = requantize(family, gguf.GGMLQuantizationType[qtype], tmp_path / f"{family}-{qtype}.gguf")
    file = GGUFFile(path)
    assert file.tensors["blk.0.attn_output.weight"].type_name == qtype
    model = build_model(file, 64, prefer="reference")
    assert rel_err(forward(model, IDS), reference(family, qtype)) < 1e-3


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
@pytest.mark.parametrize("family", NATIVE)
def test_float_files_on_the_native_layers_match_transformers(
    family: str, qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F16 and BF16 files on the fast path: the prompt's products and the decode steps' whole
    native layers (csrc/float.c reads the weights in place, x float32) give transformers' logits
    on the same weights; with the family's adapter, the exact path's logits within 1e-5. A BF16
    prompt where the library takes VDPBF16PS rounds x to bfloat16 as llama.cpp's does: 6e-3 to
    9e-3 from transformers here (less than the quantized kinds' int8 x: test_families' 0.1),
    routing flips on near ties as the quantized kinds' do (0.12 measured, their bound 0.5)."""
    served = stack_calls(monkeypatch)
    path = requantize(family, gguf.GGMLQuantizationType[qtype], tmp_path / f"{family}-{qtype}.gguf")

    def run(prefer: str, adapter: bool) -> torch.Tensor:
        model = build_model(GGUFFile(path), 64, prefer=prefer)
        lora = None
        if adapter:
            with_adapter(model, family_dir(family) / "lora-f32.gguf")
            lora = LoraRows(torch.tensor([[1.0]]), (0,))
        model.allocate_cache(1, dtype=torch.float32)
        with torch.no_grad():
            prompt = model.forward(Batch.single(IDS[:36], lora=lora), all_logits=True)
            steps = [model.forward(Batch.single([IDS[i]], start=i, lora=lora))
                     for i in range(36, 40)]  # fmt: skip
        if prefer == "fast" and library() is not None:
            assert model.blocks[0].attn_output.weight.kernel == "native-float"
        return torch.cat([prompt, torch.stack(steps, dim=1)], dim=1)

    native = library() is not None
    dots = qtype == "BF16" and bf16_dots()
    bound = (0.5 if family in ROUTED else 2e-2) if dots else 1e-3
    assert rel_err(run("fast", False), reference(family, qtype)) < bound
    # the prompt is not the stack's; each decode step is one native call
    assert served == ([False] + [True] * 4 if native else [])
    if family in WITH_PEFT:
        served.clear()
        fast = run("fast", True)  # (its float adapters' A and B: not int8 codes)
        assert served == ([False] + [True] * 4 if native else [])
        assert rel_err(fast, run("reference", True)) < (bound if dots else 1e-5)
