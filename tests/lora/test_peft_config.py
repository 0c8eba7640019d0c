"""adapter_config.json semantics against PEFT's own matching functions, name by name."""

from __future__ import annotations

from typing import Any

import pytest

from graftlm.lora.peft_config import PeftConfig, parse_config

peft = pytest.importorskip("peft")
from peft.tuners.tuners_utils import check_target_module_exists  # noqa: E402
from peft.utils.other import get_pattern_key  # noqa: E402

MODULES = [
    f"model.layers.{i}.{m}"
    for i in (0, 1, 11)
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")
] + ["model.embed_tokens", "lm_head"]

CONFIGS: list[dict[str, Any]] = [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(
        target_modules=["q_proj", "embed_tokens", "lm_head"],
        exclude_modules=["model.layers.1.self_attn.q_proj"],
    ),
    dict(target_modules=r".*layers\.1\d?\.self_attn\.(q|k)_proj"),
    dict(target_modules=["q_proj", "down_proj", "embed_tokens"], layers_to_transform=[1, 11]),
    dict(target_modules=["k_proj"], layers_to_transform=0, layers_pattern="layers"),
    dict(target_modules=["model.layers.0.self_attn.q_proj", "down_proj"], layers_to_transform=[11]),
    dict(target_modules=["q_proj", "k_proj", "v_proj"], exclude_modules=r".*\.1\..*"),
]


def ours(kwargs: dict[str, Any]) -> PeftConfig:
    raw = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, **kwargs}
    problems: list[str] = []
    cfg = parse_config(raw, "adapter_config.json", problems)
    assert cfg is not None and not problems
    return cfg


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_target_selection_matches_peft(kwargs: dict[str, Any]) -> None:
    theirs = peft.LoraConfig(r=8, lora_alpha=16, **kwargs)
    mine = ours(kwargs)
    for m in MODULES:
        expected = bool(check_target_module_exists(theirs, m))
        if type(check_target_module_exists(theirs, m)).__name__ == "_ExcludedModule":
            expected = False
        assert mine.targets(m) == expected, m


def test_rank_and_alpha_patterns_match_peft() -> None:
    rank_pattern = {
        "q_proj": 4,
        "layers.1.self_attn.k_proj": 2,
        "model.layers.11.mlp.down_proj": 12,
    }
    alpha_pattern = {r"layers\.1\d\..*": 3, "v_proj": 5}
    mine = ours(
        dict(target_modules="all-linear", rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    )
    for m in MODULES:
        r = rank_pattern.get(get_pattern_key(list(rank_pattern), m), 8)
        a = alpha_pattern.get(get_pattern_key(list(alpha_pattern), m), 16)
        assert mine.rank_alpha(m) == (r, a), m
        assert mine.scaling(m) == a / r
    rs = ours(dict(target_modules=["q_proj"], use_rslora=True, rank_pattern=rank_pattern))
    assert rs.scaling("model.layers.0.self_attn.q_proj") == 16 / 2.0  # alpha / sqrt(4)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"peft_type": "LOHA"}, "peft_type is 'LOHA'; only LORA"),
        ({"r": 0}, "r must be a positive number, got 0"),
        ({"lora_alpha": "8"}, "lora_alpha must be a positive number, got '8'"),
        ({"rank_pattern": {"q_proj": -1}}, "rank_pattern must map module patterns to positive"),
        ({"use_dora": True}, "DoRA (use_dora)"),
        ({"arrow_config": {"top_k": 2}}, "arrow_config: Arrow routing is not supported"),
        ({"init_lora_weights": "mica"}, "MiCA variant"),
        ({"bias": "lora_only"}, "bias = 'lora_only'"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ],
)
def test_config_refusals(raw: dict[str, Any], words: str) -> None:
    problems: list[str] = []
    parse_config(
        {"peft_type": "LORA", "target_modules": ["q_proj"], **raw},
        "x/adapter_config.json",
        problems,
    )
    assert any(words in p and p.startswith("x/adapter_config.json: ") for p in problems), problems
