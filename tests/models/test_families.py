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
    WITH_PEFT,
    family_dir,
    forward,
    load,
    reference,
    rel_err,
    with_adapter,
)

from graftlm.models import ARCHITECTURES

TOL = 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family: str) -> None:
    ours = forward(load(family), IDS)
    assert rel_err(ours, reference(family, "base")) < TOL


@pytest.mark.parametrize("family", WITH_PEFT)
def test_gguf_adapter_matches_peft(family: str) -> None:
    model = with_adapter(load(family), family_dir(family) / "lora-f32.gguf")
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
    assert rel_err(ours, reference(family, "q8_0")) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_close_to_f32(family: str) -> None:
    """The looser, weight-only bound: q8_0 changes each weight by ~0.5%; these random models
    amplify it to ~3% of the logits. Mixtral's routing flips on near ties, so its bound is loose."""
    ours = forward(load(family, "q8_0", prefer="fast"), IDS)
    f32 = reference(family, "base")
    assert rel_err(ours, f32) < (0.5 if family == "mixtral" else 0.1)
    agree = (ours.argmax(-1) == f32.argmax(-1)).float().mean()
    assert agree > (0.6 if family == "mixtral" else 0.8)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_steps_match_one_pass(family: str) -> None:
    """Prefill in two chunks, then decode one token, through the KV cache: the same logits as one
    pass over all tokens (covers the sliding-window masks across steps for gemma2)."""
    from graftlm.runtime.batch import Batch

    model = load(family)
    full = forward(model, IDS)
    model.allocate_cache(1)
    with torch.no_grad():
        a = model.forward(Batch.single(IDS[:20]), all_logits=True)
        b = model.forward(Batch.single(IDS[20:39], start=20), all_logits=True)
        c = model.forward(Batch.single(IDS[39:], start=39))
    steps = torch.cat([a, b, c.unsqueeze(1)], dim=1)
    assert rel_err(steps, full) < 1e-5


def test_registry_has_every_family() -> None:
    assert {"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"} <= set(ARCHITECTURES)


def test_family_configs() -> None:
    """The per-family facts that are easy to get silently wrong."""
    llama, mistral, gemma2 = load("llama").cfg, load("mistral").cfg, load("gemma2").cfg
    assert not llama.rope_neox and not llama.tied_head
    assert mistral.head_dim == 48 and mistral.n_head * mistral.head_dim != mistral.n_embd
    assert load("qwen2").cfg.tied_head and load("qwen2").cfg.rope_neox
    assert gemma2.sliding_window == (16, 0, 16)  # even layers slide
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (5.0, 8.0)
    mixtral = load("mixtral").cfg
    assert (mixtral.n_expert, mixtral.n_expert_used) == (8, 2)


def test_phi3_adapter_lands_on_the_fused_projections() -> None:
    """phi3 keeps `attn_qkv` and the fused gate/up `ffn_up` as one projection each, so the
    adapter's tensors map one to one, with no row split."""
    model = with_adapter(load("phi3"), family_dir("phi3") / "lora-f32.gguf")
    proj = model.projections()
    assert proj["blk.0.attn_qkv"].lora and proj["blk.0.attn_qkv"].n_out == 128 + 2 * 64
    assert proj["blk.0.ffn_up"].lora and proj["blk.0.ffn_up"].n_out == 2 * 256
    assert model.fused_targets("blk.0.attn_qkv") is None
