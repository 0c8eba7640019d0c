"""Every family with the GGUF types gguf's own quantizer writes, beyond llama.cpp's f32 and q8_0
fixture files: the f32 fixture requantized (`families.requantize`), against transformers on the
same round-tripped weights. K-quants are not here: their 256-wide blocks do not fit these models'
128-wide rows (llama.cpp itself falls back to other types for such tensors)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from families import (
    FAMILIES,
    IDS,
    forward,
    one_thread,  # noqa: F401 (an autouse fixture: tiny models run on one thread)
    reference,
    rel_err,
    requantize,
)

from graftlm.gguf import GGUFFile
from graftlm.models import build_model

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
