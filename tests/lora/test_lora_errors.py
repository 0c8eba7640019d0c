"""Each refusal's message, and a refused adapter leaves the model exactly as it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import TinySpec, write_tiny_adapter

import graftlm
from graftlm.commands.lora_args import lora_specs, parse_lora_scaled

IDS = [5, 70, 33, 200, 41, 9]
SPEC = TinySpec()
D, QO = SPEC.n_embd, SPEC.n_head * SPEC.head_dim


@pytest.fixture
def model(tiny_llama: Path) -> graftlm.Model:
    return graftlm.load(tiny_llama, ctx_size=64)


def _refused(model: graftlm.Model, path: Path, *needles: str) -> str:
    before = model.logits(IDS)
    with pytest.raises(graftlm.AdapterError) as info:
        model.add_lora(path)
    msg = str(info.value)
    assert str(path) in msg
    for n in needles:
        assert n in msg, msg
    assert model.loras == []
    assert torch.equal(model.logits(IDS), before)  # bit-identical: nothing was attached
    return msg


def test_wrong_architecture(model: graftlm.Model, tmp_path: Path) -> None:
    _refused(
        model,
        write_tiny_adapter(tmp_path / "a.gguf", arch="qwen2"),
        "general.architecture is 'qwen2'",
        "'llama'",
    )


def test_missing_base_tensor_and_every_shape_problem_in_one_error(
    model: graftlm.Model, tmp_path: Path
) -> None:
    r = np.zeros
    f32 = np.float32
    overrides = {
        "blk.0.attn_q": (r((4, D + 1), f32), r((QO, 4), f32)),  # wrong n_in
        "blk.0.attn_v": (r((4, D), f32), r((QO + 3, 4), f32)),  # wrong n_out
        "blk.1.attn_q": (r((4, D), f32), r((QO, 5), f32)),  # ranks differ
    }
    targets = {k: (D, QO) for k in overrides} | {"blk.7.attn_q": (D, QO)}
    msg = _refused(
        model,
        write_tiny_adapter(tmp_path / "a.gguf", targets=targets, overrides=overrides),
        "blk.0.attn_q.weight: lora_a ne=[65, 4] does not fit the base's input size 64",
        "blk.0.attn_v.weight: lora_b ne=[4, 67] does not fit the base's output size 32",
        "blk.1.attn_q.weight: ranks differ: lora_a ne=[64, 4] has rank 4, lora_b ne=[5, 64] has rank 5",
        "blk.7.attn_q.weight: not a projection of this model",
    )
    assert msg.count("\n  - ") == 4


def test_norm_and_expert_tensors_are_refused_by_name(model: graftlm.Model, tmp_path: Path) -> None:
    targets = {"blk.0.attn_norm": (D, D), "blk.0.ffn_up_exps": (D, 96)}
    _refused(
        model,
        write_tiny_adapter(tmp_path / "a.gguf", targets=targets),
        "blk.0.attn_norm.weight: norm or bias tensor",
        "blk.0.ffn_up_exps.weight: routed-expert tensor",
    )


def test_bad_metadata_types(model: graftlm.Model, tmp_path: Path) -> None:
    p = write_tiny_adapter(
        tmp_path / "a.gguf",
        metadata={"adapter.lora.task_name": 7, "adapter.lora.prompt_prefix": 1.5},
    )
    _refused(
        model,
        p,
        "'adapter.lora.task_name' is int 7, expected str",
        "'adapter.lora.prompt_prefix' is float",
    )


def test_model_file_passed_as_adapter(model: graftlm.Model, tiny_llama: Path) -> None:
    _refused(
        model,
        tiny_llama,
        "general.type is 'model', expected 'adapter' (a model file, not an adapter)",
    )


def test_truncated_and_missing_adapter(model: graftlm.Model, tmp_path: Path) -> None:
    good = write_tiny_adapter(tmp_path / "a.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    _refused(model, cut, "truncated or corrupt")
    _refused(model, tmp_path / "missing.gguf", "no such file")


def test_rank_zero_is_refused_by_name(model: graftlm.Model, tmp_path: Path) -> None:
    """A pair of rank 0 (its scale alpha / r divided by zero: a ZeroDivisionError, a 500 from
    the server) is a problem naming the tensor and its dimensions; and a stacked expert pair."""
    from graftlm.lora.convert_experts import stacked_problem

    empty = (np.zeros((0, D), np.float32), np.zeros((QO, 0), np.float32))
    path = write_tiny_adapter(
        tmp_path / "r0.gguf", targets={"blk.0.attn_q": (D, QO)}, overrides={"blk.0.attn_q": empty}
    )
    _refused(
        model, path, f"blk.0.attn_q.weight: rank 0: lora_a ne=[{D}, 0] and lora_b ne=[0, {QO}]"
    )
    said = stacked_problem("blk.0.ffn_up_exps", (4, 0, 8), (4, 16, 0), None)
    assert said is not None and "ne=[8, 0, 4]" in said and "rank 0" in said


def test_an_adapter_without_tensors_is_refused(model: graftlm.Model, tmp_path: Path) -> None:
    """It was attached, changing nothing, under whatever name it was served (a PEFT directory
    without tensors, and `graftlm convert` of either, were refused)."""
    _refused(
        model, write_tiny_adapter(tmp_path / "empty.gguf", targets={}), "holds no LoRA tensors"
    )


def test_adapter_metadata_is_listed(model: graftlm.Model, tmp_path: Path) -> None:
    p = write_tiny_adapter(
        tmp_path / "a.gguf",
        metadata={
            "adapter.lora.task_name": "pirate",
            "adapter.lora.prompt_prefix": "Arr: ",
            "adapter.alora.invocation_tokens": [5, 6],
        },
    )
    i = model.add_lora(p, scale=0.5)
    (info,) = model.loras
    assert info == {
        "id": i,
        "path": str(p),
        "scale": 0.5,
        "alpha": 8.0,
        "task_name": "pirate",
        "prompt_prefix": "Arr: ",
        "n_tensors": 12,
        "bytes": info["bytes"],
        "alora_invocation_tokens": [5, 6],
    }
    # float32, rank 4, A (r, n_in) + B (r, n_out) per target as read: attn_q and attn_v land
    # on the stacked Q/K/V projection (64 + 32 + 32 rows), ffn_down on its own; two layers.
    # Where the library is, each target's packed form (the native delta's) is its one copy
    # instead: smaller (B's columns only over the rows they reach), and what the sites hold
    float32 = 4 * 4 * ((64 + 128) + (64 + 128) + (96 + 64)) * 2
    deltas = model.adapters.attached[i].adapter.deltas.values()
    packed = sum(d.packed.nbytes for d in deltas if d.packed is not None)
    assert packed == 0 or all(d.packed is not None for d in deltas)
    assert info["bytes"] == (packed or float32)
    assert packed == 0 or packed < float32
    sites = [p.lora for p in model.model.seams.projections.values() if p.lora is not None]
    assert sum(s.nbytes(i) for s in sites) == info["bytes"]
    assert model.adapters.attached[i].adapter.invocation_tokens == [5, 6]


def test_lora_scaled_parsing() -> None:
    assert parse_lora_scaled("C:/x/a.gguf:0.5").path == "C:/x/a.gguf"
    assert parse_lora_scaled("C:/x/a.gguf:0.5").scale == 0.5
    assert parse_lora_scaled("a.gguf:-1").scale == -1.0
    with pytest.raises(ValueError, match="'big' is not a number"):
        parse_lora_scaled("a.gguf:big")
    with pytest.raises(ValueError, match="'nan' is not a finite number"):
        parse_lora_scaled("a.gguf:nan")
    with pytest.raises(ValueError, match="'1e39' is beyond float32's range"):
        parse_lora_scaled("a.gguf:1e39")
    with pytest.raises(ValueError, match="the file name is empty"):
        parse_lora_scaled(":0.5")
    with pytest.raises(ValueError, match="expected FNAME:SCALE"):
        parse_lora_scaled("a.gguf")
    specs = lora_specs(["a.gguf,b.gguf", "c.gguf"], ["d.gguf:0.5,e.gguf:2"])
    assert [(s.path, s.scale) for s in specs] == [
        ("a.gguf", 1.0),
        ("b.gguf", 1.0),
        ("c.gguf", 1.0),
        ("d.gguf", 0.5),
        ("e.gguf", 2.0),
    ]
    assert {s.scale for s in lora_specs(["a.gguf"], ["d.gguf:0.5"], init_without_apply=True)} == {
        0.0
    }
