"""Phi-3 LongRoPE: `rope_factors_long/short.weight` divide the RoPE frequencies and
`rope.scaling.attn_factor` multiplies cos/sin. The fixture has none, so this test adds them to a
copy of the phi3 GGUF and the same parameters to the transformers config.

Which set applies: llama.cpp picks from the context size (long when n_ctx > the original context),
transformers from the sequence length (long when it passes the original context); with the original
context at 16, a 40-token run with n_ctx 64 is long in both, a 12-token run with n_ctx 16 short.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from families import (
    IDS,
    family_dir,
    forward,
    hf_logits,
    hf_model,
    one_thread,  # noqa: F401 (an autouse fixture: tiny models run on one thread)
    rel_err,
    rewrite_gguf,
)

from graftlm.gguf import GGUFFile
from graftlm.models import build_model

N_ORIG, N_MAX = 16, 64
V = gguf.GGUFValueType
rng = np.random.default_rng(0)
LONG = (1.0 + 7.0 * rng.random(16)).round(3)  # rope_dim / 2 = 16 factors
SHORT = (1.0 + 0.5 * rng.random(16)).round(3)
ATTN_FACTOR = math.sqrt(1 + math.log(N_MAX / N_ORIG) / math.log(N_ORIG))  # the converter's rule


def _longrope(cfg: Any) -> None:
    cfg.max_position_embeddings = N_MAX
    cfg.original_max_position_embeddings = N_ORIG
    cfg.rope_parameters = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
        "long_factor": LONG.tolist(),
        "short_factor": SHORT.tolist(),
        "original_max_position_embeddings": N_ORIG,
        "attention_factor": ATTN_FACTOR,
    }


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = family_dir("phi3") / "model-f32.gguf"
    meta = {
        "phi3.context_length": (N_MAX, V.UINT32),
        "phi3.rope.scaling.original_context_length": (N_ORIG, V.UINT32),
        "phi3.rope.scaling.attn_factor": (ATTN_FACTOR, V.FLOAT32),
    }
    tensors = {"rope_factors_long.weight": LONG, "rope_factors_short.weight": SHORT}
    return rewrite_gguf(src, tmp_path_factory.mktemp("phi3") / "longrope.gguf", meta, tensors)


@pytest.mark.parametrize(("n_ctx", "n_tokens"), [(N_MAX, 40), (N_ORIG, 12)], ids=["long", "short"])
def test_longrope_matches_transformers(phi3_longrope: Path, n_ctx: int, n_tokens: int) -> None:
    ids = IDS[:n_tokens]
    ref = hf_logits(hf_model("phi3", _longrope), ids)
    model = build_model(GGUFFile(phi3_longrope), n_ctx, prefer="reference")
    assert rel_err(forward(model, ids), ref) < 1e-3
    # and the factors matter: the plain fixture differs
    plain = build_model(GGUFFile(family_dir("phi3") / "model-f32.gguf"), n_ctx, prefer="reference")
    assert rel_err(forward(plain, ids), ref) > 1e-2
