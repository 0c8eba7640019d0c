"""PEFT itself is the oracle: adapters made here with `peft.LoraConfig` on the tiny Hugging Face
checkpoints, loaded by graftlm from the saved directory, give PEFT's log-probabilities.

Covers what the converted fixtures do not: rsLoRA, rank_pattern / alpha_pattern, a regex
target_modules, layers_to_transform, LoRA on embed_tokens (untied and tied bases, with and without
an embedding scale), lm_head on a tied base, ensure_weight_tying, and the llama Q/K permutation
under all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import graftlm

IDS = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # llama: untied head, Q/K rows permuted in the GGUF file
    "llama-rslora-patterns": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=ALL7,
            rank_pattern={"q_proj": 6, "model.layers.1.mlp.down_proj": 2},
            alpha_pattern={"k_proj": 3, "v_proj": 16},
        ),
    ),
    "llama-patterns": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=ALL7,
            rank_pattern={"k_proj": 2, "layers.0.self_attn.q_proj": 8},
            alpha_pattern={"down_proj": 1.5},
        ),
    ),
    "llama-regex": (
        "llama",
        dict(r=4, lora_alpha=4, target_modules=r".*\.1\.self_attn\.(q|k|o)_proj"),
    ),
    "llama-layers": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "down_proj"],
            layers_to_transform=[1],
        ),
    ),
    "llama-embed-head": (
        "llama",
        dict(
            r=4, lora_alpha=8, use_rslora=True, target_modules=["embed_tokens", "lm_head", "k_proj"]
        ),
    ),
    # qwen2: tied head; the embedding LoRA changes the lookup only
    "qwen2-tied-embed": (
        "qwen2",
        dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj", "v_proj"]),
    ),
    "qwen2-tied-head": (
        "qwen2",
        dict(r=4, lora_alpha=8, target_modules=["lm_head", "o_proj"]),
    ),
    "qwen2-weight-tying": (
        "qwen2",
        dict(
            r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], ensure_weight_tying=True
        ),
    ),
    # gemma2: tied head and an embedding scale sqrt(n_embd), which PEFT applies to the delta too
    "gemma2-embed-rslora": (
        "gemma2",
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["embed_tokens", "o_proj", "up_proj"],
            rank_pattern={"up_proj": 2},
        ),
    ),
    # phi3: fused qkv_proj / gate_up_proj, split over graftlm's projections
    "phi3-fused-rslora": (
        "phi3",
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["qkv_proj", "gate_up_proj"],
            alpha_pattern={"gate_up_proj": 2},
        ),
    ),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def peft_logprobs(pm: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = pm(input_ids=torch.tensor([ids])).logits[0, :-1].float()  # (T-1, V)
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1))[:, 0]


def graftlm_logprobs(
    model: graftlm.Model, ids: list[int], lora: list[dict[str, Any]]
) -> torch.Tensor:
    return torch.tensor([t["logprob"] for t in model.logprobs(ids, top=0, lora=lora)])


@pytest.mark.parametrize("case", list(CASES))
def test_matches_peft(
    case: str, make_peft: Callable[..., tuple[Path, Any]], tiny_base: Callable[[str], Path]
) -> None:
    family, kwargs = CASES[case]
    adapter_dir, pm = make_peft(family, case, **kwargs)
    ours = graftlm.load(tiny_base(family), ctx_size=64, reference=True)
    i = ours.add_lora(adapter_dir)
    got = graftlm_logprobs(ours, IDS, [{"id": i, "scale": 1.0}])
    base = graftlm_logprobs(ours, IDS, [])
    ref = peft_logprobs(pm, IDS)
    with pm.disable_adapter():
        ref_base = peft_logprobs(pm, IDS)
    assert (base - ref_base).abs().mean() < 1e-3  # the bases agree: what follows is the adapter
    assert (ref - ref_base).abs().mean() > 0.05, "the adapter should change PEFT's model"
    assert (got - ref).abs().mean() <= 0.06
    # on float32 tiny models the match is much closer than the stated bound
    assert (got - ref).abs().max() < 1e-3


def test_scale_is_linear_in_the_user_scale(
    make_peft: Callable[..., tuple[Path, Any]], tiny_base: Callable[[str], Path]
) -> None:
    """The user's scale multiplies PEFT's factor: scale 0.5 equals an adapter with half alpha."""
    family, kwargs = CASES["llama-rslora-patterns"]
    full, _ = make_peft(family, "full", seed=3, **kwargs)
    halved = dict(kwargs, lora_alpha=4, alpha_pattern={"k_proj": 1.5, "v_proj": 8})
    half, pm = make_peft(family, "half", seed=3, **halved)
    ours = graftlm.load(tiny_base(family), ctx_size=64, reference=True)
    a, b = ours.add_lora(full), ours.add_lora(half)
    x = graftlm_logprobs(ours, IDS, [{"id": a, "scale": 0.5}])
    y = graftlm_logprobs(ours, IDS, [{"id": b, "scale": 1.0}])
    assert (x - y).abs().max() < 1e-4
    assert (y - peft_logprobs(pm, IDS)).abs().max() < 1e-3


def test_activated_lora_matches_peft_and_differs_from_the_plain_lora(
    make_peft: Callable[..., tuple[Path, Any]], tiny_base: Callable[[str], Path]
) -> None:
    """aLoRA (PEFT's alora_invocation_tokens): the delta applies from the start of the last
    occurrence of the invocation on. graftlm gives PEFT's log-probabilities; before the
    invocation they are the base's, after it they differ from the same weights as a plain LoRA."""
    invocation = IDS[14:17]
    kwargs = dict(r=4, lora_alpha=8, target_modules=ALL7)
    alora_dir, pm = make_peft(
        "llama", "alora", seed=5, alora_invocation_tokens=invocation, **kwargs
    )
    plain_dir, _ = make_peft("llama", "plain", seed=5, **kwargs)
    ours = graftlm.load(tiny_base("llama"), ctx_size=64, reference=True)
    a, p = ours.add_lora(alora_dir), ours.add_lora(plain_dir)
    assert ours.loras[a]["alora_invocation_tokens"] == invocation
    assert ours.loras[p]["alora_invocation_tokens"] == []
    got = graftlm_logprobs(ours, IDS, [{"id": a, "scale": 1.0}])
    plain = graftlm_logprobs(ours, IDS, [{"id": p, "scale": 1.0}])
    base = graftlm_logprobs(ours, IDS, [])
    # PEFT's forward takes the activation as alora_offsets (tokens from the end; its generate()
    # finds them itself): the invocation starts at 14
    with torch.no_grad():
        logits = pm(input_ids=torch.tensor([IDS]), alora_offsets=[len(IDS) - 14]).logits
    ref = torch.log_softmax(logits[0, :-1].float(), -1).gather(1, torch.tensor(IDS[1:])[:, None])
    assert (got - ref[:, 0]).abs().max() < 1e-3
    # logprobs[i] is of token i + 1, computed at position i: positions before 14 are the base's
    assert torch.equal(got[:14], base[:14])
    assert (got[14:] - base[14:]).abs().mean() > 0.01
    assert (got[14:] - plain[14:]).abs().mean() > 0.01  # the plain LoRA acts from the start
    assert (plain[:14] - base[:14]).abs().mean() > 0.01
    # without the invocation in the prompt the aLoRA does not apply: the base's log-probabilities
    no_inv = IDS[:14]
    torch.testing.assert_close(
        graftlm_logprobs(ours, no_inv, [{"id": a, "scale": 1.0}]), base[:13], rtol=0, atol=0
    )
