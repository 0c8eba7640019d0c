"""Hostile adapter_config.json files: a pattern that would backtrack for ever, a pattern that does
not compile, values of the wrong type or out of range, a config nested thousands deep. Each is one
AdapterError naming the field, in well under a second; nothing is attached."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

import graftlm
from graftlm.errors import AdapterError
from graftlm.lora.peft_config import parse_config

TINY = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "tiny"
# catastrophic on a module name ending in "j": 2^n ways to fail (the `regex` engine gives up
# early on the issue's `(.|.)*X`, whose X is nowhere: that one is checked to finish)
EVIL = "(.|.)*j."


@pytest.fixture(scope="module")
def llama() -> graftlm.Model:
    return graftlm.load(TINY / "llama" / "model-f32.gguf", ctx_size=64, reference=True)


def _with_config(tmp_path: Path, edit: dict[str, Any] | str) -> Path:
    d = tmp_path / "peft"
    shutil.copytree(TINY / "llama" / "peft", d)
    cfg = d / "adapter_config.json"
    if isinstance(edit, str):
        cfg.write_text(edit)
    else:
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **edit}))
    return d


def _refused(model: graftlm.Model, d: Path, *needles: str) -> str:
    before = [dict(x) for x in model.loras]
    # (the CPU time of all the process's threads, torch's and the native kernels' too: the
    # pauses of a loaded machine do not count)
    t0 = time.process_time()
    with pytest.raises(AdapterError) as info:
        model.add_lora(d)
    assert time.process_time() - t0 < 5
    assert model.loras == before
    for n in needles:
        assert n in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"target_modules": EVIL}, "target_modules"),
        ({"exclude_modules": EVIL}, "exclude_modules"),
        ({"rank_pattern": {EVIL: 4}}, "rank_pattern"),
        ({"alpha_pattern": {EVIL: 4}}, "alpha_pattern"),
    ],
)
def test_catastrophic_patterns_are_cut_off(
    llama: graftlm.Model, tmp_path: Path, edit: dict[str, Any], field: str
) -> None:
    _refused(llama, _with_config(tmp_path, edit), field, "catastrophic backtracking")


def test_the_reported_pattern_finishes(llama: graftlm.Model, tmp_path: Path) -> None:
    """`(.|.)*X` froze the server with Python's re; now it is an ordinary non-matching pattern."""
    _refused(llama, _with_config(tmp_path, {"target_modules": "(.|.)*X"}), "not selected")


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        ({"target_modules": "("}, ("target_modules", "does not compile")),
        ({"rank_pattern": {"[": 4}}, ("rank_pattern", "does not compile")),
        ({"layers_pattern": ["("], "layers_to_transform": [0]}, ("layers_pattern",)),
        ({"target_modules": 5}, ("target_modules must be a string",)),
        ({"exclude_modules": [1]}, ("exclude_modules must be a string",)),
        ({"layers_to_transform": ["0"]}, ("layers_to_transform must be",)),
        ({"lora_alpha": 1e308}, ("lora_alpha must be a positive number",)),
        ({"alpha_pattern": {"q_proj": float("inf")}}, ("alpha_pattern must map",)),
        ({"r": 10**9}, ("r = 1000000000",)),
        ({"alora_invocation_tokens": ["x"]}, ("alora_invocation_tokens",)),
        ({"alora_invocation_tokens": 7}, ("alora_invocation_tokens",)),
    ],
)
def test_bad_fields_are_named(
    llama: graftlm.Model, tmp_path: Path, edit: dict[str, Any], needles: tuple[str, ...]
) -> None:
    _refused(llama, _with_config(tmp_path, edit), *needles)


def test_deeply_nested_and_huge_configs(llama: graftlm.Model, tmp_path: Path) -> None:
    deep = '{"peft_type": "LORA", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    _refused(llama, _with_config(tmp_path / "a", deep), "nested too deep")
    _refused(llama, _with_config(tmp_path / "b", " " * (2 << 20)), "a PEFT config is a few KB")


def test_patterns_keep_peft_semantics() -> None:
    """Compiled once and matched with a time limit, the patterns still mean what PEFT means."""
    problems: list[str] = []
    cfg = parse_config(
        {
            "peft_type": "LORA",
            "r": 8,
            "lora_alpha": 16,
            "target_modules": r".*\.(q|v)_proj",
            "exclude_modules": r".*layers\.1\..*",
            "rank_pattern": {"q_proj": 4},
        },
        "x",
        problems,
    )
    assert cfg is not None and not problems
    assert cfg.targets("model.layers.0.self_attn.q_proj")
    assert not cfg.targets("model.layers.0.self_attn.k_proj")
    assert not cfg.targets("model.layers.1.self_attn.q_proj")  # excluded
    assert cfg.rank_alpha("model.layers.0.self_attn.q_proj") == (4, 16.0)
    assert cfg.rank_alpha("model.layers.0.self_attn.v_proj") == (8, 16.0)


def test_a_huge_declared_tensor_is_refused_from_the_header(
    llama: graftlm.Model, tmp_path: Path
) -> None:
    """A safetensors header declaring an 8 GiB lora_A (a sparse file: no disk used) is refused by
    its shape before a byte of it is read."""
    import struct

    d = _with_config(tmp_path, {})
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    n = 1 << 20
    header = {
        f"{q}.lora_A.weight": {"dtype": "F32", "shape": [n, 2048], "data_offsets": [0, n * 8192]},
        f"{q}.lora_B.weight": {
            "dtype": "F32",
            "shape": [128, 4],
            "data_offsets": [n * 8192, n * 8192 + 2048],
        },
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(d / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + n * 8192 + 2048)
    _refused(llama, d, "lora_A [1048576, 2048]", "does not fit")


def test_mutated_configs_load_or_fail_cleanly(llama: graftlm.Model, tmp_path: Path) -> None:
    """A seeded fuzzer over adapter_config.json: every field of the real config in turn set to
    a value of another type or an extreme one. Each case attaches (and is detached) or is one
    AdapterError; no other exception, nothing left attached, none slow."""
    import random

    rng = random.Random(3)
    real = json.loads((TINY / "llama" / "peft" / "adapter_config.json").read_text())
    values: list[Any] = [
        None, True, 0, -1, 2**40, 1e308, float("inf"), "", "(", EVIL, "x" * 3000, [], [1],
        ["q_proj", 5], {}, {"q_proj": "x"}, {"(": 2}, [[["deep"]]],
    ]  # fmt: skip
    keys = [*real, "alora_invocation_tokens", "layers_pattern", "rank_pattern", "use_dora"]
    n = len(llama.loras)
    for i in range(60):
        edit = {rng.choice(keys): rng.choice(values)}
        d = _with_config(tmp_path / str(i), edit)
        # (the CPU time of all the process's threads, torch's and the native kernels' too: the
        # pauses of a loaded machine do not count)
        t0 = time.process_time()
        try:
            llama.remove_lora(llama.add_lora(d))
        except AdapterError:
            pass
        assert time.process_time() - t0 < 5, edit
        assert len(llama.loras) == n
