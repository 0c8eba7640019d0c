"""The tiny fixture families (../shared/fixtures/tiny) and their oracles: transformers' own forward
on the Hugging Face checkpoint, with PEFT for adapters. Shared by the tests in this folder."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from made_families import tiny_dir
from shared_data import TINY

from graftlm.gguf import GGUFFile
from graftlm.lora.adapter_set import AdapterSet
from graftlm.models import Transformer, build_model
from graftlm.native import ops as native_ops
from graftlm.step.batch import Batch, LoraRows

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "mixtral", "qwen3moe",
            "gpt-oss"]  # fmt: skip
WITH_PEFT = [f for f in FAMILIES if f != "mixtral"]
ROUTED = ("mixtral", "qwen3moe", "gpt-oss")  # routing flips on near ties when the weights move
# the families the native attention and decoder layer serve (gpt-oss's sinks included)
NATIVE = list(FAMILIES)
N_CTX = 64
# 40 tokens: past gemma2's sliding window of 16, and enough to route every mixtral expert
IDS = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These models are tiny: one thread is fastest, and on a shared two-core machine two threads
    spin against each other (a 20 ms forward measured at seconds). Restored after each test.
    (A fixture here, not in a conftest.py: a second conftest module would shadow tests/conftest.py
    for the tests that import from it.)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def family_dir(family: str) -> Path:
    """The fixture folder: ../shared's, or one made_families.py makes from transformers."""
    d = tiny_dir(family)
    if d is None:
        pytest.skip(f"fixture {TINY / family} is not available and cannot be made here")
    return d


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference relative to the largest reference logit."""
    return float((ours - ref).abs().max() / ref.abs().max())


def load(
    family: str, quant: str = "f32", n_ctx: int = N_CTX, prefer: str = "reference"
) -> Transformer:
    model = build_model(GGUFFile(family_dir(family) / f"model-{quant}.gguf"), n_ctx, prefer=prefer)
    model.allocate_cache(1, dtype=torch.float32)  # (see forward)
    return model


def forward(model: Transformer, ids: list[int], scale: float | None = None) -> torch.Tensor:
    """(1, T, n_vocab) logits of one fresh sequence; with `scale`, adapter slot 0 at that scale."""
    lora = None if scale is None else LoraRows(torch.tensor([[scale]]), (0,))
    # float32 keys and values, as the references compute them: a float16 cache moves the
    # routers' inputs by ~1e-4, enough to flip qwen3moe's near ties between its 16 experts
    model.allocate_cache(1, dtype=torch.float32)
    with torch.no_grad():
        return model.forward(Batch.single(ids, lora=lora), all_logits=True)


def with_adapter(model: Transformer, path: Path, scale: float = 1.0) -> Transformer:
    adapters = AdapterSet(model)
    adapters.attach(adapters.load(path), scale)
    return model


# -- transformers / PEFT -------------------------------------------------------------------------
def hf_model(family: str, edit: Callable[[Any], None] | None = None) -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(family_dir(family) / "hf")
    if edit is not None:
        edit(cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        family_dir(family) / "hf", config=cfg, dtype=torch.float32
    )
    return model.eval()


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits  # (1, T, n_vocab)


@functools.cache
def reference(family: str, variant: str) -> torch.Tensor:
    """transformers' logits on IDS. variant: "base", "peft" (the fixture adapter through PEFT), or a
    GGUF type name ("Q8_0", "Q4_1", ...): every weight a GGUF file of that type quantizes,
    round-tripped through gguf's quantizer, as `model-q8_0.gguf` or `requantize` made it."""
    model = hf_model(family)
    if variant == "peft":
        peft = pytest.importorskip("peft")
        model = peft.PeftModel.from_pretrained(model, family_dir(family) / "peft").eval()
    elif variant != "base":
        round_trip(model, gguf.GGMLQuantizationType[variant])
    return hf_logits(model, IDS)


def _round_trip(a: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).reshape(a.shape)


# gpt-oss's (n_expert, n_in, n_out) expert tensors, which GGUF holds as (n_expert, n_out, n_in)
# (Mixtral's and Qwen3-MoE's are (n_expert, n_out, n_in) in transformers already)
_TRANSPOSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def round_trip(model: Any, qtype: gguf.GGMLQuantizationType) -> None:
    """What llama.cpp's converter does to a checkpoint at --outtype q8_0, done in place for any
    type: every matrix but the MoE router is quantized (blocks along the input dimension, so the
    llama Q/K row permutation and phi3's row fusion commute with it); norms and biases (gpt-oss's
    experts' are 2-D) stay float32."""
    transposed = model.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith(("mlp.gate.weight", "mlp.router.weight", "_bias")):
                continue
            if transposed and name.endswith(_TRANSPOSED):  # blocks along GGUF's rows (n_in)
                a = p.detach().transpose(-1, -2).contiguous().numpy()
                p.copy_(torch.from_numpy(_round_trip(a, qtype)).transpose(-1, -2))
            else:
                p.copy_(torch.from_numpy(_round_trip(p.detach().numpy(), qtype)))


# -- GGUF files made from the fixtures ----------------------------------------------------------
def requantize(family: str, qtype: gguf.GGMLQuantizationType, dst: Path) -> Path:
    """The fixture's f32 GGUF with the tensors llama.cpp would quantize (matrices but the MoE
    router and biases; token_embd included) stored as `qtype`, quantized by gguf's own
    quantizer."""
    reader = gguf.GGUFReader(family_dir(family) / "model-f32.gguf")
    keep = {t.name for t in reader.tensors
            if len(t.shape) < 2 or "ffn_gate_inp" in t.name or not t.name.endswith(".weight")}  # fmt: skip
    replace = {t.name: np.asarray(t.data) for t in reader.tensors if t.name not in keep}
    return rewrite_gguf(reader, dst, replace_as=(qtype, replace))


def rewrite_gguf(
    src: Path | gguf.GGUFReader,
    dst: Path,
    meta: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    replace_as: tuple[gguf.GGMLQuantizationType, dict[str, np.ndarray]] | None = None,
) -> Path:
    """A copy of GGUF file `src` with metadata keys set or replaced, float32 tensors added, and
    (replace_as) some float32 tensors stored quantized to another type."""
    reader = src if isinstance(src, gguf.GGUFReader) else gguf.GGUFReader(src)
    qtype, replace = replace_as or (gguf.GGMLQuantizationType.F32, {})
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    meta = meta or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, vtype) in meta.items():
        w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name in replace:
            w.add_tensor(t.name, gguf.quants.quantize(replace[t.name], qtype), raw_dtype=qtype)
            continue
        # t.data is shaped as stored (rows of block bytes for quantized types): the writer
        # recovers the logical shape from it
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, data in (tensors or {}).items():
        w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def spy_served(monkeypatch: pytest.MonkeyPatch, *names: str) -> dict[str, list[bool]]:
    """Spies on these native ops: each call's entry in served[name], whether it was served
    (returned something, not None)."""
    served: dict[str, list[bool]] = {name: [] for name in names}
    for name, got in served.items():

        def spy(*args: object, _real: object = getattr(native_ops, name), _got: list[bool] = got,
                **kwargs: object) -> object:  # fmt: skip
            out = _real(*args, **kwargs)  # type: ignore[operator]
            _got.append(out is not None)
            return out

        monkeypatch.setattr(native_ops, name, spy)
    return served
