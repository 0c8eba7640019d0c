"""convert-lora: PEFT directories to llama.cpp GGUF adapters (checked against the converter's own
output) and back, and the round trips through graftlm and PEFT."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from shared_data import FIXTURES, REAL_ADAPTERS, TINY, TINY_WITH_PEFT
from tiny_models import TinySpec, write_tiny_adapter

import graftlm
from graftlm.errors import AdapterError
from graftlm.gguf import GGUFFile
from graftlm.lora.arch_rules import gguf_to_hf
from graftlm.lora.convert import gguf_to_peft, peft_to_gguf
from graftlm.lora.gguf_adapter import read_gguf_adapter
from graftlm.lora.peft import read_peft_adapter
from graftlm.lora.peft_config import parse_config
from graftlm.models import build_model

REAL = REAL_ADAPTERS
IDS = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(1)).tolist()
ADAPTER_KEYS = ["general.architecture", "general.type", "adapter.type", "adapter.lora.alpha"]


pytestmark = pytest.mark.usefixtures("one_thread")


def assert_same_gguf(got: Path, ref: Path) -> None:
    """Same metadata that matters, same tensor names, shapes and float32 values."""
    g, r = GGUFFile(got), GGUFFile(ref)
    for k in ADAPTER_KEYS:
        assert g.metadata[k] == r.metadata[k], k
    assert set(g.tensors) == set(r.tensors)
    for name, e in r.tensors.items():
        mine = g.tensors[name]
        assert (
            mine.shape == e.shape and mine.ggml_type == e.ggml_type == gguf.GGMLQuantizationType.F32
        )
        np.testing.assert_allclose(np.asarray(mine.data), np.asarray(e.data), rtol=0, atol=1e-7)


def assert_same_tensors(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float
) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0), k


def peft_logits(pm: Any) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(pm(input_ids=torch.tensor([IDS])).logits[0].float(), dim=-1)


# -- against llama.cpp's converter --------------------------------------------------------------


@pytest.mark.parametrize("family", TINY_WITH_PEFT)
def test_tiny_fixture_converts_like_llama_cpp(family: str, tmp_path: Path) -> None:
    out = tmp_path / "a.gguf"
    notes = peft_to_gguf(TINY / family / "peft", TINY / family / "model-f32.gguf", out)
    assert_same_gguf(out, TINY / family / "lora-f32.gguf")
    assert notes[0] == "adapter.lora.alpha = 8: llama.cpp's alpha / r is PEFT's factor"


@pytest.mark.real
@pytest.mark.parametrize(("family", "name"), REAL)
def test_real_fixture_converts_like_llama_cpp(
    family: str, name: str, tmp_path: Path, real_base: Callable[[str], Path]
) -> None:
    d = FIXTURES / family / name
    out = tmp_path / "a.gguf"
    peft_to_gguf(d, real_base(family), out, "f32")
    assert_same_gguf(out, d.parent / f"{name}-f32.gguf")


# -- and back -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", TINY_WITH_PEFT)
def test_gguf_to_peft_to_gguf(family: str, tmp_path: Path) -> None:
    """llama.cpp's GGUF -> PEFT gives the original PEFT tensors (Q/K rows un-permuted) -> GGUF
    gives the same file back."""
    base = TINY / family / "model-f32.gguf"
    notes = gguf_to_peft(TINY / family / "lora-f32.gguf", base, tmp_path / "peft")
    assert notes[-1].startswith(f"wrote {tmp_path / 'peft'}")
    # the weights readable as the config is (safetensors alone would make them 0600)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "peft").iterdir()}
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"]
    original = load_file(TINY / family / "peft" / "adapter_model.safetensors")
    back = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert_same_tensors(back, original, atol=0)
    peft_to_gguf(tmp_path / "peft", base, tmp_path / "again.gguf")
    assert_same_gguf(tmp_path / "again.gguf", TINY / family / "lora-f32.gguf")


def test_converted_peft_dir_loads_in_peft(tmp_path: Path, hf_tiny: Callable[[str], Any]) -> None:
    peft = pytest.importorskip("peft")
    gguf_to_peft(
        TINY / "llama" / "lora-f32.gguf", TINY / "llama" / "model-f32.gguf", tmp_path / "p"
    )
    ours = peft.PeftModel.from_pretrained(hf_tiny("llama"), tmp_path / "p").eval()
    ref = peft.PeftModel.from_pretrained(hf_tiny("llama"), TINY / "llama" / "peft").eval()
    assert torch.equal(peft_logits(ours), peft_logits(ref))


def test_gguf_to_peft_needs_the_base_to_undo_the_permutation(tmp_path: Path) -> None:
    with pytest.raises(
        AdapterError, match="permuted for RoPE over the base's heads; give the base"
    ):
        gguf_to_peft(TINY / "llama" / "lora-f32.gguf", None, tmp_path / "p")
    assert not (tmp_path / "p").exists()
    # qwen2 has no permutation: no base needed
    gguf_to_peft(TINY / "qwen2" / "lora-f32.gguf", None, tmp_path / "q")
    back = load_file(tmp_path / "q" / "adapter_model.safetensors")
    assert_same_tensors(back, load_file(TINY / "qwen2" / "peft" / "adapter_model.safetensors"), 0)


def test_gguf_to_peft_refuses_another_base(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="the adapter is for 'qwen2' but the base .* is 'llama'"):
        gguf_to_peft(TINY / "qwen2" / "lora-f32.gguf", TINY / "llama" / "model-f32.gguf", tmp_path)
    with pytest.raises(
        AdapterError,
        match=r"attn_q.weight: \(n_in, n_out\) = \(128, 192\) does not fit the base's \(128, 128\)",
    ):
        gguf_to_peft(
            TINY / "mistral" / "lora-f32.gguf", TINY / "llama" / "model-f32.gguf", tmp_path
        )


# -- factors llama.cpp's single alpha cannot express -----------------------------------------


FOLDED = dict(
    r=4,
    lora_alpha=8,
    use_rslora=True,
    target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
    rank_pattern={"q_proj": 6, "model.layers.1.mlp.down_proj": 2},
    alpha_pattern={"k_proj": 3},
)


def test_folded_factors_round_trip(
    tmp_path: Path, make_peft: Callable[..., tuple[Path, Any]], hf_tiny: Callable[[str], Any]
) -> None:
    """rsLoRA with rank / alpha patterns: folded into lora_b with alpha 0; graftlm reads the GGUF
    as it reads the PEFT directory; back to PEFT, rank_pattern / alpha_pattern reproduce PEFT."""
    peft = pytest.importorskip("peft")
    base = TINY / "llama" / "model-f32.gguf"
    d, pm = make_peft("llama", "folded", **FOLDED)
    notes = peft_to_gguf(d, base, tmp_path / "a.gguf")
    assert any("folded into its lora_b and adapter.lora.alpha = 0" in n for n in notes)
    assert GGUFFile(tmp_path / "a.gguf").metadata["adapter.lora.alpha"] == 0.0

    model = build_model(GGUFFile(base), n_ctx=64, prefer="reference")
    from_dir = read_peft_adapter(d, model)
    from_gguf = read_gguf_adapter(tmp_path / "a.gguf", model, model.base_tensor_names)
    assert from_dir.deltas.keys() == from_gguf.deltas.keys()
    for k, x in from_dir.deltas.items():
        assert torch.allclose(x.b @ x.a, from_gguf.deltas[k].b @ from_gguf.deltas[k].a, atol=1e-6)

    gguf_to_peft(tmp_path / "a.gguf", base, tmp_path / "back")
    back = peft.PeftModel.from_pretrained(hf_tiny("llama"), tmp_path / "back").eval()
    assert (peft_logits(back) - peft_logits(pm)).abs().max() < 1e-3  # float32 rounding


def test_embedding_on_a_tied_base(
    tmp_path: Path, make_peft: Callable[..., tuple[Path, Any]], tiny_base: Callable[[str], Path]
) -> None:
    """token_embd is written flipped, as llama.cpp's converter does; PEFT's saved copy of the
    embedding itself is reported, not applied; graftlm gives the same logits both ways."""
    d, pm = make_peft(
        "qwen2", "embed", r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]
    )
    notes = peft_to_gguf(d, tiny_base("qwen2"), tmp_path / "a.gguf", "f32")
    assert any("embed_tokens.base_layer.weight: PEFT's saved copy" in n for n in notes)
    f = GGUFFile(tmp_path / "a.gguf")
    assert f.tensors["token_embd.weight.lora_a"].shape == (1000, 4)  # ne=[r, n_vocab]
    assert f.tensors["token_embd.weight.lora_b"].shape == (128, 4)  # ne=[r, n_embd]
    model = graftlm.load(tiny_base("qwen2"), ctx_size=64, reference=True)
    a, b = model.add_lora(d), model.add_lora(tmp_path / "a.gguf")
    x = model.logits(IDS, lora=[{"id": a, "scale": 1.0}])
    y = model.logits(IDS, lora=[{"id": b, "scale": 1.0}])
    assert (x - y).abs().max() < 1e-4
    gguf_to_peft(tmp_path / "a.gguf", tiny_base("qwen2"), tmp_path / "back")
    back = load_file(tmp_path / "back" / "adapter_model.safetensors")
    orig = {
        k: v for k, v in load_file(d / "adapter_model.safetensors").items() if "base_layer" not in k
    }
    assert_same_tensors(back, orig, atol=0)


def test_head_lora_on_a_tied_base_is_refused(
    tmp_path: Path, make_peft: Callable[..., tuple[Path, Any]], tiny_base: Callable[[str], Path]
) -> None:
    """llama.cpp attaches adapters to tensors the base file holds; a tied base has no output."""
    d, _ = make_peft("qwen2", "head", r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"])
    with pytest.raises(AdapterError, match="tied head .no output.weight.") as exc:
        peft_to_gguf(d, tiny_base("qwen2"), tmp_path / "a.gguf")
    assert "module 'lm_head' -> output.weight" in str(exc.value)
    assert not (tmp_path / "a.gguf").exists()
    d, _ = make_peft(
        "qwen2",
        "tying",
        r=4,
        lora_alpha=8,
        target_modules=["embed_tokens"],
        ensure_weight_tying=True,
    )
    with pytest.raises(AdapterError, match="tied head"):
        peft_to_gguf(d, tiny_base("qwen2"), tmp_path / "a.gguf")


# -- output types ------------------------------------------------------------------------------


@pytest.mark.parametrize(("outtype", "atol"), [("f16", 2e-3), ("bf16", 2e-2), ("q8_0", 2e-2)])
def test_outtypes(outtype: str, atol: float, tmp_path: Path) -> None:
    base = TINY / "llama" / "model-f32.gguf"
    notes = peft_to_gguf(TINY / "llama" / "peft", base, tmp_path / "a.gguf", outtype)
    f = GGUFFile(tmp_path / "a.gguf")
    types = {e.ggml_type.name for e in f.tensors.values()}
    if outtype == "q8_0":
        # lora_a rows are 128 or 256 values (whole Q8_0 blocks); lora_b rows are r = 4 values
        assert types == {"Q8_0", "F16"}
        assert any("14 tensors stored as f16, not q8_0" in n for n in notes)
    else:
        assert types == {outtype.upper()}
    model = build_model(GGUFFile(base), n_ctx=64, prefer="reference")
    ref = read_gguf_adapter(TINY / "llama" / "lora-f32.gguf", model, model.base_tensor_names)
    got = read_gguf_adapter(tmp_path / "a.gguf", model, model.base_tensor_names)
    for k, d in ref.deltas.items():
        assert torch.allclose(got.deltas[k].b @ got.deltas[k].a, d.b @ d.a, atol=atol), k


def test_bad_outtype_and_not_a_base(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="outtype 'q4_0'"):
        peft_to_gguf(
            TINY / "llama" / "peft", TINY / "llama" / "model-f32.gguf", tmp_path / "a", "q4_0"
        )
    with pytest.raises(graftlm.ModelFileError, match="is a LoRA adapter, not a base model"):
        peft_to_gguf(TINY / "llama" / "peft", TINY / "llama" / "lora-f32.gguf", tmp_path / "a")


def test_activated_lora_tokens_are_carried(tmp_path: Path) -> None:
    """aLoRA: the invocation tokens go from PEFT to GGUF and back."""
    d = tmp_path / "alora"
    shutil.copytree(TINY / "llama" / "peft", d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = [5, 6, 7]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    peft_to_gguf(d, TINY / "llama" / "model-f32.gguf", tmp_path / "a.gguf")
    assert GGUFFile(tmp_path / "a.gguf").metadata["adapter.alora.invocation_tokens"] == [5, 6, 7]
    gguf_to_peft(tmp_path / "a.gguf", TINY / "llama" / "model-f32.gguf", tmp_path / "back")
    back = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert back["alora_invocation_tokens"] == [5, 6, 7]


@pytest.mark.parametrize(
    ("targets", "target_modules", "layers"),
    [
        (
            ["blk.0.attn_q", "blk.1.attn_q", "blk.0.ffn_down", "blk.1.ffn_down"],
            ["down_proj", "q_proj"],
            None,
        ),
        (["blk.1.attn_q", "blk.1.attn_v"], ["q_proj", "v_proj"], [1]),
        (
            ["token_embd", "blk.1.attn_q"],
            ["model.embed_tokens", "model.layers.1.self_attn.q_proj"],
            None,
        ),
        (
            ["blk.0.attn_q", "blk.1.attn_v"],
            ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"],
            None,
        ),
    ],
)
def test_target_modules_select_exactly_the_converted_modules(
    targets: list[str],
    target_modules: list[str],
    layers: list[int] | None,
    tmp_path: Path,
    tiny_llama: Path,
) -> None:
    """PEFT's matching of the written target_modules / layers_to_transform picks the modules the
    GGUF adapter had and no others (checked with graftlm's copy of PEFT's rules, itself checked
    against PEFT in test_peft_config.py)."""
    spec = TinySpec()
    f = GGUFFile(tiny_llama)
    shapes = {
        t: (f.tensors[t + ".weight"].shape[1], f.tensors[t + ".weight"].shape[0]) for t in targets
    }
    if "token_embd" in shapes:
        n_vocab, n_embd = f.tensors["token_embd.weight"].shape
        shapes["token_embd"] = (n_vocab, n_embd)  # what write_tiny_adapter takes for it
    write_tiny_adapter(tmp_path / "a.gguf", spec, targets=shapes)
    gguf_to_peft(tmp_path / "a.gguf", tiny_llama, tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == target_modules and cfg["layers_to_transform"] == layers
    problems: list[str] = []
    parsed = parse_config(cfg, "adapter_config.json", problems)
    assert parsed is not None and not problems
    every = [
        gguf_to_hf("llama", f"blk.{i}.{k}")
        for i in range(2)
        for k in ("attn_q", "attn_v", "ffn_down")
    ]
    selected = {m for m in every + ["model.embed_tokens", "lm_head"] if m and parsed.targets(m)}
    assert selected == {gguf_to_hf("llama", t) for t in targets}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
@pytest.mark.parametrize("kill_at", ["weights", "config", "swap"])
def test_to_peft_over_an_existing_adapter_is_the_old_or_the_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_at: str, exchange: bool
) -> None:
    """Killed at any step of the write, the folder holds the whole old adapter or the whole new
    one (the new is written in a fresh folder beside it and swapped in), never a mix and never
    nothing; other files of the folder stay."""
    from safetensors.torch import load_file

    from graftlm.lora import convert

    out = tmp_path / "peft"
    gguf_to_peft(TINY / "qwen2" / "lora-f32.gguf", None, out)
    (out / "README.md").write_text("mine")
    config = out / "adapter_config.json"  # the old adapter told apart from the new one
    config.write_text(config.read_text().replace("{", '{"old": true, ', 1))
    old = {f.name: f.read_bytes() for f in out.iterdir()}
    if not exchange:
        monkeypatch.setattr(convert, "_exchange", lambda a, b: False)

    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    if kill_at == "weights":
        monkeypatch.setattr(convert, "save_file", killed)
    elif kill_at == "config":
        monkeypatch.setattr(convert.os, "chmod", killed)  # (right after the config is written)
    else:
        real = convert.os.rename
        monkeypatch.setattr(convert.os, "rename", lambda a, b: (real(a, b), killed())[1])
        monkeypatch.setattr(convert, "_exchange", lambda a, b: killed() if exchange else False)
    with pytest.raises(KeyboardInterrupt):
        gguf_to_peft(TINY / "qwen2" / "lora-f32.gguf", None, out)
    monkeypatch.undo()
    got = {f.name: f.read_bytes() for f in out.iterdir()} if out.exists() else {}
    if kill_at == "swap" and not exchange:  # killed between the renames: the old one aside,
        assert got == {}  # whole, and put back by the next write
        aside = tmp_path / ".peft.old"
        assert {f.name: f.read_bytes() for f in aside.iterdir()} == old
    else:
        assert got == old
    gguf_to_peft(TINY / "qwen2" / "lora-f32.gguf", None, out)
    assert (out / "README.md").read_text() == "mine" and '"old"' not in config.read_text()
    assert load_file(out / "adapter_model.safetensors")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
