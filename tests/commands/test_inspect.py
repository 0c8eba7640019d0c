"""`graftlm inspect`: type names, natural tensor order, adapter summaries, PEFT directories."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

from graftlm.cli import main
from graftlm.commands.inspect import natural_key


def _inspect(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["inspect", str(path)]) == 0
    return capsys.readouterr().out


def test_natural_order() -> None:
    names = ["blk.10.attn_q.weight", "blk.2.attn_q.weight", "blk.1.ffn_up.weight", "output"]
    assert sorted(names, key=natural_key) == [
        "blk.1.ffn_up.weight",
        "blk.2.attn_q.weight",
        "blk.10.attn_q.weight",
        "output",
    ]


def test_model_types_are_named_and_tensors_in_natural_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = TinySpec(n_layer=12, qtype=gguf.GGMLQuantizationType.Q8_0, n_embd=64, n_ff=96)
    path = write_tiny_model(tmp_path / "m.gguf", spec)
    out = _inspect(path, capsys)
    assert "tensor types: " in out and "Q8_0 x" in out and "F32 x" in out
    rows = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  blk.")]
    layers = [int(r.split(".")[1]) for r in rows]
    assert layers == sorted(layers) and layers[-1] == 11


def test_file_type_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    from shared_data import TINY

    path = TINY / "llama" / "model-q8_0.gguf"
    if not path.exists():
        pytest.skip(f"no tiny fixtures under {TINY}")
    out = _inspect(path, capsys)
    line = next(ln for ln in out.splitlines() if "general.file_type" in ln)
    value = int(line.split("=")[1].split()[0])
    assert line.endswith(f"({gguf.LlamaFileType(value).name})")


def test_gguf_adapter_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = TinySpec()
    path = write_tiny_adapter(tmp_path / "a.gguf", spec, seed=1)
    out = _inspect(path, capsys)
    lines = out.splitlines()
    assert lines[2] == "adapter:"
    assert lines[3].startswith("  rank ") and ", alpha " in lines[3]
    assert lines[4].startswith("  targets: ") and lines[4].endswith(
        f"layers 0-{spec.n_layer - 1} ({spec.n_layer})"
    )


def test_peft_directory(capsys: pytest.CaptureFixture[str]) -> None:
    from shared_data import TINY

    d = TINY / "llama" / "peft"
    if not d.is_dir():
        pytest.skip(f"no tiny fixtures under {TINY}")
    out = _inspect(d, capsys)
    first, base, rank, targets = out.splitlines()[:4]
    assert first.startswith(f"{d}: PEFT LORA adapter, ") and first.endswith(" tensors")
    assert base.startswith("  base model: ")
    assert rank.startswith("  rank ") and "alpha" in rank
    assert targets.startswith("  targets: ") and "q_proj" in targets
    assert "base_model.model.model.layers.0." in out
