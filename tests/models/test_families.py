"""Every supported family against transformers (and PEFT) on the tiny fixture models.

The bound is 1e-3 relative (largest logit difference over the largest logit) on the float32
reference path; the engines agree to about 1e-6 in practice.
"""

from __future__ import annotations

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
    load,
    one_thread,  # noqa: F401 (an autouse fixture: tiny models run on one thread)
    reference,
    rel_err,
    spy_served,
    with_adapter,
)

from graftlm.config import ModelConfig, build_config
from graftlm.gguf import GGUFFile
from graftlm.models import ARCHITECTURES
from graftlm.native import ops as native_ops
from graftlm.step.batch import Batch

TOL = 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family: str) -> None:
    ours = forward(load(family), IDS)
    assert rel_err(ours, reference(family, "base")) < TOL


@pytest.mark.parametrize("source", ["lora-f32.gguf", "peft"], ids=["gguf", "peft-dir"])
@pytest.mark.parametrize("family", WITH_PEFT)
def test_adapter_matches_peft(family: str, source: str) -> None:
    """The fixture adapter, as llama.cpp's GGUF conversion and as the PEFT directory itself."""
    model = with_adapter(load(family), family_dir(family) / source)
    ours = forward(model, IDS, scale=1.0)
    ref = reference(family, "peft")
    # the adapter must matter, or this test would pass without it
    assert rel_err(reference(family, "base"), ref) > 100 * TOL
    assert rel_err(ours, ref) < TOL
    # scale 0: exactly the base model
    assert rel_err(forward(model, IDS, scale=0.0), reference(family, "base")) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_matches_transformers_on_the_same_weights(family: str) -> None:
    ours = forward(load(family, "q8_0"), IDS)
    assert rel_err(ours, reference(family, "Q8_0")) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_close_to_f32(family: str) -> None:
    """The looser, weight-only bound: q8_0 changes each weight by ~0.5%; these random models
    amplify it to ~3% of the logits. Mixtral's routing flips on near ties, so its bound is loose."""
    ours = forward(load(family, "q8_0", prefer="fast"), IDS)
    f32 = reference(family, "base")
    assert rel_err(ours, f32) < (0.5 if family in ROUTED else 0.1)
    agree = (ours.argmax(-1) == f32.argmax(-1)).float().mean()
    assert agree > (0.6 if family in ROUTED else 0.8)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_steps_match_one_pass(family: str) -> None:
    """Prefill in two chunks, then decode one token, through the KV cache: the same logits as one
    pass over all tokens (covers the sliding-window masks across steps for gemma2)."""
    model = load(family)
    full = forward(model, IDS)
    model.allocate_cache(1)
    with torch.no_grad():
        a = model.forward(Batch.single(IDS[:20]), all_logits=True)
        b = model.forward(Batch.single(IDS[20:39], start=20), all_logits=True)
        c = model.forward(Batch.single(IDS[39:], start=39))
    steps = torch.cat([a, b, c.unsqueeze(1)], dim=1)
    assert rel_err(steps, full) < 1e-5


@pytest.mark.parametrize("family", NATIVE)
def test_prompts_take_the_native_attention_and_gates(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every family's prompt computes each layer's attention (gemma2's soft-capped scores
    included) and its gated FFN natively: spies count the calls that were served. The logits
    are those of the PyTorch twins, which run when the native ops are refused."""
    served = spy_served(monkeypatch, "attn_prefill", "gated")
    model = load(family)
    ours = forward(model, IDS)
    n_layer = model.cfg.n_layer
    assert served["attn_prefill"] == [True] * n_layer
    # one gated call a layer; mixtral: one a routed expert that has tokens
    assert all(served["gated"]) and len(served["gated"]) >= n_layer
    for name in served:
        monkeypatch.setattr(native_ops, name, lambda *args, **kwargs: None)
    assert rel_err(ours, forward(model, IDS)) < 1e-4  # float32 sums in another order


def test_registry_has_every_family() -> None:
    families = {"llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "gpt-oss"}
    assert families <= set(ARCHITECTURES)


def _config(family: str) -> ModelConfig:
    f = GGUFFile(family_dir(family) / "model-f32.gguf")
    return build_config(f.metadata, set(f.tensors), str(f.path))


def test_family_configs() -> None:
    """The per-family facts that are easy to get silently wrong."""
    llama, mistral, qwen2 = _config("llama"), _config("mistral"), _config("qwen2")
    assert not llama.rope_neox and not llama.tied_head
    assert mistral.head_dim == 48 and mistral.n_head * mistral.head_dim != mistral.n_embd
    assert qwen2.tied_head and qwen2.rope_neox
    assert _config("qwen3").rope_neox and _config("phi3").rope_neox
    gemma2 = _config("gemma2")
    assert gemma2.sliding_window == (16, 0, 16)  # even layers slide
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (5.0, 8.0)
    assert gemma2.rope_neox and gemma2.tied_head and gemma2.scale == pytest.approx(32**-0.5)
    mixtral = _config("mixtral")
    assert (mixtral.n_expert, mixtral.n_expert_used) == (8, 2)
    qwen3moe = _config("qwen3moe")  # the experts' width, not the dense feed_forward_length
    assert (qwen3moe.n_expert, qwen3moe.n_expert_used, qwen3moe.n_ff) == (16, 4, 64)
    assert qwen3moe.rope_neox and qwen3moe.head_dim == 48
    gpt_oss = _config("gpt-oss")  # even layers slide; YaRN over 4096 tokens
    assert gpt_oss.sliding_window == (16, 0) and gpt_oss.rope_neox and gpt_oss.head_dim == 48
    assert (gpt_oss.n_expert, gpt_oss.n_expert_used, gpt_oss.n_ff) == (16, 4, 64)
    assert (gpt_oss.yarn_factor, gpt_oss.n_ctx_orig) == (32.0, 4096)
    assert (gpt_oss.yarn_beta_fast, gpt_oss.yarn_beta_slow) == (32.0, 1.0)


def test_phi3_adapter_lands_on_the_fused_projections() -> None:
    """phi3 keeps `attn_qkv` and the fused gate/up `ffn_up` as one projection each, so the
    adapter's tensors map one to one, with no row split."""
    model = with_adapter(load("phi3"), family_dir("phi3") / "lora-f32.gguf")
    proj = model.projections()
    assert proj["blk.0.attn_qkv"].lora and proj["blk.0.attn_qkv"].n_out == 128 + 2 * 64
    assert proj["blk.0.ffn_up"].lora and proj["blk.0.ffn_up"].n_out == 2 * 256
    assert "blk.0.attn_qkv" not in model.seams.parts  # no stacked parts to map rows into


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_match_single_rows(family: str) -> None:
    """Two sequences of different lengths in one padded step give each its own logits."""
    model = load(family)
    short = IDS[5:30]
    rows = torch.zeros(2, len(IDS), dtype=torch.long)  # padding with token 0
    rows[0], rows[1, : len(short)] = torch.tensor(IDS), torch.tensor(short)
    model.allocate_cache(2)
    with torch.no_grad():
        both = model.forward(Batch(rows, [0, 1], [0, 0], [len(IDS), len(short)]))  # (2, n_vocab)
    assert rel_err(both[0], forward(model, IDS)[0, -1]) < 1e-5
    assert rel_err(both[1], forward(model, short)[0, -1]) < 1e-5
