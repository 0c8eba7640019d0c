"""Every refusal of a PEFT directory: one AdapterError naming the feature or the file, the tensor
and every dimension, listing all problems at once; nothing attached, the model unchanged."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import graftlm
from graftlm.errors import AdapterError

SHARED = Path(__file__).resolve().parents[3] / "shared"
TINY = SHARED / "fixtures" / "tiny"
IDS = [5, 70, 33, 200, 41, 9, 120, 87]
Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def llama() -> graftlm.Model:
    """The tiny llama (hidden 128, 2 layers) that tiny/llama/peft was made for."""
    return graftlm.load(TINY / "llama" / "model-f32.gguf", ctx_size=64, reference=True)


def variant(
    tmp_path: Path,
    src: Path = TINY / "llama" / "peft",
    config: Callable[[dict[str, Any]], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A copy of a PEFT directory with its config and/or tensors edited."""
    d = tmp_path / "variant"
    shutil.copytree(src, d)
    if config is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        config(cfg)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(d / "adapter_model.safetensors")
        tensors(t)
        save_file(t, d / "adapter_model.safetensors")
    return d


def refused(model: graftlm.Model, path: Path) -> str:
    """The message of the AdapterError, after checking that nothing was attached or changed."""
    before = model.logits(IDS)
    n = len(model.loras)
    with pytest.raises(AdapterError) as exc:
        model.add_lora(path)
    assert len(model.loras) == n
    assert torch.equal(model.logits(IDS), before)
    return str(exc.value)


def test_missing_files(llama: graftlm.Model, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    msg = refused(llama, tmp_path / "empty")
    assert "adapter_config.json and adapter_model.safetensors" in msg
    d = variant(tmp_path)
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")
    msg = refused(llama, d)
    assert "missing adapter_model.safetensors" in msg and "adapter_model.bin" in msg
    (d / "adapter_config.json").unlink()
    assert "missing adapter_config.json and adapter_model.safetensors" in refused(llama, d)


def test_other_peft_type(llama: graftlm.Model, tmp_path: Path) -> None:
    msg = refused(llama, variant(tmp_path, config=lambda c: c.update(peft_type="LOKR")))
    assert "peft_type is 'LOKR'; only LORA" in msg and "adapter_config.json" in msg


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(use_dora=True), ["DoRA (use_dora)", "lora_magnitude_vector"]),
        (dict(lora_bias=True), ["lora_bias", "lora_B.bias"]),
        (dict(modules_to_save=["lm_head"]), ["modules_to_save", "lm_head"]),
    ],
)
def test_unsupported_variants_made_by_peft(
    kwargs: dict[str, Any],
    words: list[str],
    llama: graftlm.Model,
    make_peft: Callable[..., tuple[Path, Any]],
) -> None:
    """Saved by PEFT itself: the config refusal and the non-LoRA tensors are both reported."""
    d, _ = make_peft("llama", r=4, lora_alpha=8, target_modules=["q_proj"], **kwargs)
    msg = refused(llama, d)
    for w in words:
        assert w in msg


def test_every_problem_in_one_error(llama: graftlm.Model, tmp_path: Path) -> None:
    def config(c: dict[str, Any]) -> None:
        c.update(use_dora=True, bias="all", layer_replication=[[0, 1]])

    def tensors(t: dict[str, torch.Tensor]) -> None:
        t[Q + ".lora_B.weight"] = torch.zeros(100, 4)  # q_proj has 128 rows
        t["base_model.model.model.norm.weight"] = torch.ones(128)
        t["base_model.model.model.layers.0.self_attn.foo_proj.lora_A.weight"] = torch.zeros(4, 128)
        t["base_model.model.model.layers.0.self_attn.foo_proj.lora_B.weight"] = torch.zeros(128, 4)
        t["base_model.model.model.layers.7.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 128)
        t["base_model.model.model.layers.7.mlp.up_proj.lora_B.weight"] = torch.zeros(256, 4)
        del t["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]

    msg = refused(llama, variant(tmp_path, config=config, tensors=tensors))
    assert "DoRA (use_dora)" in msg
    assert "bias = 'all'" in msg
    assert "layer_replication" in msg
    assert "'base_model.model.model.norm.weight': a full saved layer" in msg
    assert "module 'model.layers.0.self_attn.foo_proj': unknown module name" in msg
    assert "module 'model.layers.7.mlp.up_proj': layer 7, but the base has 2 layers" in msg
    assert "'model.layers.1.mlp.down_proj' has lora_A but no lora_B" in msg
    assert (
        "module 'model.layers.0.self_attn.q_proj' -> blk.0.attn_q.weight: "
        "lora_B [100, 4] (output size, r) does not fit the base's output size 128"
    ) in msg
    assert msg.count("\n  - ") == 8


def test_rank_must_match_the_config(llama: graftlm.Model, tmp_path: Path) -> None:
    msg = refused(llama, variant(tmp_path, config=lambda c: c.update(rank_pattern={"v_proj": 8})))
    assert "rank 4, but adapter_config.json gives r = 8 for this module" in msg
    assert "v_proj" in msg


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.bool])
def test_factors_that_are_not_floating_point(
    llama: graftlm.Model, tmp_path: Path, dtype: torch.dtype
) -> None:
    """An integer or boolean factor (a quantized export without its scales, a mislabeled
    header) is refused by its dtype, named with its tensor; it was read as float32 of its
    integers and attached."""

    def cast(t: dict[str, torch.Tensor]) -> None:
        t[Q + ".lora_A.weight"] = (t[Q + ".lora_A.weight"] * 100).to(dtype)

    msg = refused(llama, variant(tmp_path, tensors=cast))
    name = {torch.int8: "I8", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}[dtype]
    assert f"lora_A '{Q}.lora_A.weight' has dtype {name}; a factor must be one of F32" in msg
    assert "lora_B" not in msg  # (B is float32: only A is named)


def test_half_precision_factors_load(llama: graftlm.Model, tmp_path: Path) -> None:
    def half(t: dict[str, torch.Tensor]) -> None:
        for k in t:
            t[k] = t[k].to(torch.bfloat16 if "lora_A" in k else torch.float16)

    llama.remove_lora(llama.add_lora(variant(tmp_path, tensors=half)))


def test_tensor_not_selected_by_the_config(llama: graftlm.Model, tmp_path: Path) -> None:
    msg = refused(llama, variant(tmp_path, config=lambda c: c.update(layers_to_transform=[1])))
    assert "'model.layers.0.self_attn.q_proj': not selected by target_modules" in msg
    assert "layers.1" not in msg


def test_activated_lora_loads_with_its_invocation(llama: graftlm.Model, tmp_path: Path) -> None:
    """(It was refused before graftlm served aLoRA; its behaviour is tested against PEFT in
    test_peft_reference.)"""
    d = variant(tmp_path, config=lambda c: c.update(alora_invocation_tokens=[5, 6]))
    i = llama.add_lora(d)
    try:
        assert llama.adapters.invocations() == {i: (5, 6)}
    finally:
        llama.remove_lora(i)


def test_saved_base_layer_other_than_the_embedding(llama: graftlm.Model, tmp_path: Path) -> None:
    d = variant(
        tmp_path, tensors=lambda t: t.update({Q + ".base_layer.weight": torch.zeros(128, 128)})
    )
    assert "q_proj.base_layer.weight': a full saved layer is not supported" in refused(llama, d)


def test_adapter_for_another_hidden_size(tiny_llama: Path) -> None:
    """tiny/llama/peft (hidden 128) on a llama of hidden 64: every dimension is named."""
    model = graftlm.load(tiny_llama, ctx_size=64)
    msg = refused(model, TINY / "llama" / "peft")
    assert str(TINY / "llama" / "peft") in msg
    assert (
        "module 'model.layers.0.self_attn.q_proj' -> blk.0.attn_q.weight: lora_A [4, 128] "
        "(r, input size) does not fit the base's input size 64; lora_B [128, 4] (output size, r) "
        "does not fit the base's output size 64"
    ) in msg
    assert model.loras == []


def test_adapter_for_another_architecture(llama: graftlm.Model) -> None:
    """phi3's fused projections have no place in a llama; mistral's heads do not fit it."""
    msg = refused(llama, TINY / "phi3" / "peft")
    assert (
        "module 'model.layers.0.self_attn.qkv_proj': unknown module name for a llama model" in msg
    )
    msg = refused(llama, TINY / "mistral" / "peft")
    assert "blk.0.attn_q.weight: lora_B [192, 4] (output size, r)" in msg


@pytest.mark.real
def test_gemma3_adapter_on_smollm2(real_model: Callable[[str], graftlm.Model]) -> None:
    model = real_model("smollm2")
    msg = refused(model, SHARED / "fixtures" / "gemma3" / "grand")
    assert "lora_A [4, 640] (r, input size) does not fit the base's input size 576" in msg
    assert "-> blk.0.attn_q.weight" in msg  # names map: only the shapes are wrong
