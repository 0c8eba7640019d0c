"""PEFT directories loaded directly equal the GGUF adapters llama.cpp's converter made from them:
the same resolved deltas (every name, layout, Q/K permutation and factor), and on the real models
the same teacher-forced log-probabilities."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from shared_data import FIXTURES, GOLDEN, REAL_ADAPTERS, TINY, TINY_WITH_PEFT

import graftlm
from graftlm.gguf import GGUFFile
from graftlm.lora.adapter import ResolvedAdapter
from graftlm.lora.arch_rules import gguf_to_hf, hf_to_gguf, permute_rows, unpermute_rows
from graftlm.lora.gguf_adapter import read_gguf_adapter
from graftlm.lora.peft import read_peft_adapter
from graftlm.models import Transformer, build_model

REAL = REAL_ADAPTERS


def tiny_model(family: str) -> Transformer:
    return build_model(GGUFFile(TINY / family / "model-f32.gguf"), n_ctx=64, prefer="reference")


def assert_same(peft: ResolvedAdapter, ref: ResolvedAdapter, tol: float = 1e-6) -> None:
    assert peft.deltas.keys() == ref.deltas.keys()
    for name, d in peft.deltas.items():
        r = ref.deltas[name]
        assert d.a.shape == r.a.shape and d.b.shape == r.b.shape, name
        # the products are what the engine computes; A and B alone may differ by any invertible
        # mixing of the rank, but here they are expected to be the very same factors
        assert torch.allclose(d.a, r.a, atol=tol, rtol=0), name
        assert torch.allclose(d.b, r.b, atol=tol, rtol=0), name


@pytest.mark.parametrize("family", TINY_WITH_PEFT)
def test_tiny_fixture_resolves_like_the_converted_gguf(family: str) -> None:
    model = tiny_model(family)
    peft = read_peft_adapter(TINY / family / "peft", model)
    ref = read_gguf_adapter(TINY / family / "lora-f32.gguf", model, model.base_tensor_names)
    assert peft.source == "peft" and peft.alpha == 8.0
    assert peft.n_tensors == ref.n_tensors
    assert_same(peft, ref)


@pytest.mark.real
@pytest.mark.parametrize(("family", "name"), REAL)
def test_real_fixture_resolves_like_the_converted_gguf(
    family: str, name: str, real_model: Callable[[str], graftlm.Model]
) -> None:
    model = real_model(family).model
    d = FIXTURES / family / name
    peft = read_peft_adapter(d, model)
    ref = read_gguf_adapter(d.parent / f"{name}-f32.gguf", model, model.base_tensor_names)
    assert_same(peft, ref)


def _ids(family: str) -> list[int]:
    """A recorded chat prompt and its continuation (teacher forcing)."""
    case = json.loads((GOLDEN / f"{family}_generate.json").read_text())
    cases = case["cases"] if isinstance(case, dict) and "cases" in case else case
    c = cases[0]
    return list(c["prompt_ids"]) + list(c["generated_ids"])


@pytest.mark.real
@pytest.mark.parametrize("family", ["smollm2", "gemma3"])
def test_real_fixture_logprobs_match_the_converted_gguf(
    family: str, real_model: Callable[[str], graftlm.Model]
) -> None:
    """Every fixture of the family, loaded both ways into one model, scored on the same ids."""
    model = real_model(family)
    ids = _ids(family)

    def logprobs(lora: list[dict[str, float]]) -> torch.Tensor:
        return torch.tensor([t["logprob"] for t in model.logprobs(ids, top=0, lora=lora)])

    base = logprobs([])
    for name in [n for f, n in REAL if f == family]:
        d = FIXTURES / family / name
        scale = 0.1 if name == "grand" else 1.0  # grand is strong: the README suggests ~0.1
        a = model.add_lora(d, scale=0.0)
        b = model.add_lora(d.parent / f"{name}-f32.gguf", scale=0.0)
        try:
            x = logprobs([{"id": a, "scale": scale}])
            y = logprobs([{"id": b, "scale": scale}])
        finally:
            model.remove_lora(a)
            model.remove_lora(b)
        assert (x - y).abs().mean() <= 0.01, name
        assert (x - base).abs().mean() > 0.01, name  # the adapter does change the model


# -- the name map and the permutation ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma2", "qwen2", "qwen3", "phi3"])
def test_name_map_round_trips(arch: str) -> None:
    kinds = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    if arch == "phi3":
        kinds = ["attn_qkv", "attn_output", "ffn_up", "ffn_down"]
    for kind in kinds:
        hf = gguf_to_hf(arch, f"blk.3.{kind}")
        assert hf is not None and hf_to_gguf(arch, 4, hf) == f"blk.3.{kind}"
    assert gguf_to_hf(arch, "token_embd") == "model.embed_tokens"
    assert hf_to_gguf(arch, 4, "model.embed_tokens") == "token_embd"
    assert hf_to_gguf(arch, 4, "model.layers.9.self_attn.q_proj") is None  # past the last layer
    assert hf_to_gguf(arch, 4, "model.layers.0.self_attn.nonsense") is None


def test_permutation_is_llama_cpps_and_inverts() -> None:
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of 8 rows
    p = permute_rows(w, 2)
    # per head, rows (0..3 | 4..7) become pairs (0, 4, 1, 5, 2, 6, 3, 7)
    assert p[:8, 0].tolist() == [w[i, 0].item() for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    assert torch.equal(unpermute_rows(p, 2), w)
