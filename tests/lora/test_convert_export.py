"""export-lora: adapters merged into the base file give what the runtime gives with the same
adapters and scales; everything not merged is copied byte for byte."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from shared_data import TINY

import graftlm
from graftlm.errors import AdapterError
from graftlm.gguf import GGUFFile
from graftlm.lora.export import export_lora

IDS = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(2)).tolist()
T = gguf.GGMLQuantizationType


pytestmark = pytest.mark.usefixtures("one_thread")


def runtime_logprobs(base: Path, adapters: list[tuple[Path, float]]) -> torch.Tensor:
    model = graftlm.load(base, ctx_size=64, reference=True)
    lora = [{"id": model.add_lora(p, scale=0.0), "scale": s} for p, s in adapters]
    return torch.log_softmax(model.logits(IDS, lora=lora).float(), dim=-1)


def merged_logprobs(path: Path) -> torch.Tensor:
    model = graftlm.load(path, ctx_size=64, reference=True)
    return torch.log_softmax(model.logits(IDS).float(), dim=-1)


def test_merge_equals_the_runtime(
    tmp_path: Path, make_peft: Callable[..., tuple[Path, Any]]
) -> None:
    """A llama.cpp GGUF adapter at 0.5 and a PEFT directory (rsLoRA, patterns) at 1.5."""
    base = TINY / "llama" / "model-f32.gguf"
    peft_dir, _ = make_peft(
        "llama",
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "up_proj"],
        rank_pattern={"k_proj": 2},
        std=0.2,
    )
    adapters = [(TINY / "llama" / "lora-f32.gguf", 0.5), (peft_dir, 1.5)]
    out = tmp_path / "merged.gguf"
    notes = export_lora(base, adapters, out, outtype="f32")
    assert notes[-1] == f"wrote {out}: merged 14 tensors from 2 adapters, copied 8"
    got, ref = merged_logprobs(out), runtime_logprobs(base, adapters)
    assert (got - ref).abs().max() < 1e-3
    assert (got - merged_logprobs(base)).abs().mean() > 0.01  # the adapters did something

    b, m = GGUFFile(base), GGUFFile(out)
    assert set(m.tensors) == set(b.tensors)
    assert {k: v for k, v in m.metadata.items() if k != "general.file_type"} == {
        k: v for k, v in b.metadata.items() if k != "general.file_type"
    }
    untouched = [n for n in b.tensors if "attn_" not in n and "ffn_" not in n or "norm" in n]
    assert len(untouched) == 8
    for name in untouched:
        assert m.tensors[name].ggml_type == b.tensors[name].ggml_type
        assert (
            np.asarray(m.tensors[name].data).tobytes() == np.asarray(b.tensors[name].data).tobytes()
        )


def test_tied_base_is_untied(tmp_path: Path, make_peft: Callable[..., tuple[Path, Any]]) -> None:
    """An embedding LoRA on a tied base changes the lookup only: the merged file gets its own
    output.weight (the original table) so the head stays as it was."""
    base = TINY / "qwen2" / "model-f32.gguf"
    d, _ = make_peft("qwen2", r=4, lora_alpha=8, target_modules=["embed_tokens", "v_proj"])
    out = tmp_path / "merged.gguf"
    notes = export_lora(base, [(d, 1.0)], out, outtype="f32")
    assert any("written out as output.weight" in n for n in notes)
    m = GGUFFile(out)
    assert "output.weight" in m.tensors and "output.weight" not in GGUFFile(base).tensors
    got, ref = merged_logprobs(out), runtime_logprobs(base, [(d, 1.0)])
    assert (got - ref).abs().max() < 1e-3


def test_outtypes_on_a_quantized_base(tmp_path: Path) -> None:
    base = TINY / "llama" / "model-q8_0.gguf"
    adapters = [(TINY / "llama" / "lora-f32.gguf", 1.0)]
    ref = runtime_logprobs(base, adapters)
    # what quantizing to Q8_0 costs on this model, measured: merged-then-requantized weights
    # should cost no more than that
    q8_cost = (runtime_logprobs(TINY / "llama" / "model-f32.gguf", adapters) - ref).abs().mean()
    for outtype, merged_type in (("same", T.Q8_0), ("f16", T.F16), ("q8_0", T.Q8_0)):
        out = tmp_path / f"{outtype}.gguf"
        export_lora(base, adapters, out, outtype=outtype)
        m = GGUFFile(out)
        assert m.tensors["blk.0.attn_q.weight"].ggml_type == merged_type
        assert m.tensors["blk.0.attn_norm.weight"].ggml_type == T.F32  # copied as it was
        assert (merged_logprobs(out) - ref).abs().mean() < 1.2 * q8_cost, outtype


def test_f16_keeps_float32_tensors(tmp_path: Path) -> None:
    """llama.cpp's rule: merged float32 tensors stay float32 at the default outtype."""
    out = tmp_path / "m.gguf"
    export_lora(TINY / "llama" / "model-f32.gguf", [(TINY / "llama" / "lora-f32.gguf", 1.0)], out)
    assert GGUFFile(out).tensors["blk.0.attn_q.weight"].ggml_type == T.F32
    assert GGUFFile(out).metadata["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)


def test_refusals_write_nothing(tmp_path: Path) -> None:
    base = TINY / "llama" / "model-f32.gguf"
    out = tmp_path / "m.gguf"
    with pytest.raises(AdapterError) as exc:
        export_lora(
            base, [(TINY / "mistral" / "peft", 1.0), (TINY / "qwen2" / "lora-f32.gguf", 1.0)], out
        )
    msg = str(exc.value)
    assert "lora_B [192, 4] (output size, r) does not fit the base's output size 128" in msg
    assert "general.architecture is 'qwen2', the base is 'llama'" in msg
    assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(AdapterError, match="outtype 'q4_k'"):
        export_lora(base, [(TINY / "llama" / "peft", 1.0)], out, outtype="q4_k")
    with pytest.raises(AdapterError, match="no adapter to merge"):
        export_lora(base, [], out)


def test_an_output_folder_that_does_not_exist_is_named_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """convert-lora (both ways) and export-lora say which folder is missing before any work, and
    print what they wrote once."""
    from graftlm.cli import main

    base, missing = TINY / "llama" / "model-f32.gguf", tmp_path / "no" / "such"
    runs = [
        ["convert-lora", str(TINY / "llama" / "peft"), "--base", str(base), "-o"],
        [
            "convert-lora",
            "--to-peft",
            str(TINY / "llama" / "lora-f32.gguf"),
            "--base",
            str(base),
            "-o",
        ],
        ["export-lora", "-m", str(base), "--lora", str(TINY / "llama" / "lora-f32.gguf"), "-o"],
    ]
    for argv in runs:
        assert main([*argv, str(missing / "out")]) == 1
        err = capsys.readouterr().err
        assert f"cannot write {missing / 'out'}: the folder {missing} does not exist" in err
    assert not (tmp_path / "no").exists()
    assert main([*runs[0], str(tmp_path / "a.gguf")]) == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == 1 and f"wrote {tmp_path / 'a.gguf'}: " in out


def test_export_copies_every_key_with_its_type(tmp_path: Path) -> None:
    """The merged file's header is the base's, key for key and type for type (read back with the
    gguf package's reader, the reference), general.file_type aside."""
    base, out = TINY / "llama" / "model-f32.gguf", tmp_path / "m.gguf"
    export_lora(base, [(TINY / "llama" / "lora-f32.gguf", 1.0)], out, outtype="f32")
    want, got = gguf.GGUFReader(base).fields, gguf.GGUFReader(out).fields
    assert want.keys() == got.keys()
    for key, field in want.items():
        assert got[key].types == field.types, key
        if key != "general.file_type":
            assert got[key].contents() == field.contents(), key
