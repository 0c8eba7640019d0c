"""The tiny routed families' expert adapters that the LoRA tests share (tests/lora/conftest.py's
expert_made and gpt_oss_made fixtures, made once a session): PEFT adapters on the experts' 3-D
parameters (`target_parameters`), their per-expert nn.Linear layout, and the converted GGUFs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from made_families import HERE, made_dir
from safetensors.torch import save_file
from shared_data import TINY

from graftlm.lora.convert import peft_to_gguf

R = 4
T = gguf.GGMLQuantizationType
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


# family -> the per-expert modules' layout before transformers 5: (stem, gate, up, down)
LINEAR = {
    "qwen3moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe.experts", "w1", "w3", "w2"),
}


def per_expert(pm: Any, src: Path, out: Path, n_expert: int, family: str) -> None:
    """The target_parameters adapter as per-expert nn.Linear modules (Qwen3-MoE's
    mlp.experts.N.gate_proj, Mixtral's block_sparse_moe.experts.N.w1): the same deltas, in the
    layout llama.cpp's converter reads."""
    where, gate, up, down = LINEAR[family]
    out.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for name, module in pm.named_modules():
        if not hasattr(module, "parameter_name") or "default" not in module.lora_A:
            continue
        layer = name.split("layers.")[1].split(".")[0]
        a = module.lora_A["default"].weight.detach().reshape(n_expert, R, -1)
        b = module.lora_B["default"].weight.detach()
        b = b.reshape(b.shape[0], R, n_expert).permute(2, 0, 1)  # (n_expert, n_out, r)
        stem = f"base_model.model.model.layers.{layer}.{where}"
        for e in range(n_expert):
            if module.parameter_name == "down_proj":
                halves = {down: b[e]}
            else:
                n_ff = b.shape[1] // 2
                halves = {gate: b[e][:n_ff], up: b[e][n_ff:]}
            for proj, be in halves.items():
                tensors[f"{stem}.{e}.{proj}.lora_A.weight"] = a[e].clone()
                tensors[f"{stem}.{e}.{proj}.lora_B.weight"] = be.clone()
    for name, p in pm.named_parameters():
        if "q_proj.lora_" in name:
            key = name.replace(".default", "")
            tensors[key] = p.detach().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", gate, up, down]
    cfg["target_parameters"] = None
    (out / "adapter_config.json").write_text(json.dumps(cfg))


def routed_made(family: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny Qwen3-MoE's or Mixtral's expert adapter (PEFT target_parameters in tmp/params,
    its per-expert modules converted by llama.cpp in tmp/lora.gguf): the PEFT model, the base,
    its tmp folder, the experts and n_ff (tests/lora/conftest.py's expert_made)."""
    folder = made_dir(family) if family == "qwen3moe" else TINY / family
    if folder is None or not (folder / "hf").is_dir():
        pytest.skip("no transformers, PEFT or llama.cpp converter here")
    tmp = tmp_path_factory.mktemp("expert_lora")
    pm = expert_adapter(folder, tmp / "params")
    config = pm.get_base_model().config
    n_expert = getattr(config, "num_experts", None) or config.num_local_experts
    per_expert(pm, tmp / "params", tmp / "linear", n_expert, family)
    cmd = [sys.executable, str(HERE / "convert_tiny.py"), str(TINY / "qwen3" / "model-f32.gguf"),
           "lora", str(tmp / "linear"), "--base", str(folder / "hf"), "--outtype", "f32",
           "--outfile", str(tmp / "lora.gguf")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"pm": pm, "base": folder / "model-f32.gguf", "tmp": tmp, "n_expert": n_expert,
            "n_ff": config.moe_intermediate_size if family == "qwen3moe"
            else config.intermediate_size}  # fmt: skip


def expert_adapter(folder: Path, out: Path, seed: int = 1) -> Any:
    """A PEFT adapter (q_proj and both expert parameters, r=4) on the tiny checkpoint in
    `folder`, saved to `out`: the PEFT model."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf", dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        r=R, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    pm.save_pretrained(out)
    return pm


def gpt_oss_made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny gpt-oss's expert adapter (PEFT in tmp/params, convert-lora's GGUF in
    tmp/lora.gguf): the PEFT model, the base, its folder, the experts and n_ff."""
    folder = made_dir("gpt-oss")
    if folder is None:
        pytest.skip("no transformers, PEFT or llama.cpp converter here")
    tmp = tmp_path_factory.mktemp("gpt_oss_expert_lora")
    pm = expert_adapter(folder, tmp / "params")
    base = folder / "model-f32.gguf"
    peft_to_gguf(tmp / "params", base, tmp / "lora.gguf")
    return {"pm": pm, "base": base, "folder": folder, "tmp": tmp,
            "n_expert": pm.base_model.model.config.num_local_experts,
            "n_ff": pm.base_model.model.config.intermediate_size}  # fmt: skip


def mxfp4_base(src: Path, dst: Path) -> Path:
    """The f32 file with its expert weights in MXFP4 (gguf's quantizer), as released files
    hold them."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name.endswith(EXPERTS):
            w.add_tensor(t.name, gguf.quants.quantize(data, T.MXFP4), raw_dtype=T.MXFP4)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
