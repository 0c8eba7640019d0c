"""`graftlm bench` on a tiny model: the table, the adapter's self-ratio, the llama.cpp columns
only from a run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiny_models import write_tiny_adapter

from graftlm.cli import main


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.fullmatch(r"(pp|tg)\d+( @ d\d+)?", cells[3]):
            rows[cells[3]] = cells
    return rows


def test_bench_prints_a_row_per_test(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "-m", str(tiny_llama), "-p", "16", "-n", "4", "-r", "2", "--no-llama-cpp"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert set(rows) == {"pp16", "tg4"}
    for cells in rows.values():
        assert cells[0] == tiny_llama.name and cells[1] == "0"
        mean, sd = re.fullmatch(r"([\d.]+) ± +([\d.]+)", cells[4]).groups()  # type: ignore[union-attr]
        assert float(mean) > 0 and float(sd) >= 0
        assert cells[5] == "-" and cells[6] == "-"  # no llama.cpp in this run: no ratio
    assert re.search(r"resident: \d+ MiB \(file \d+ MiB\)", out)


def test_bench_at_depths_prints_llama_benchs_rows(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """-d as llama-bench's: each test again after that many tokens of context, named as
    llama-bench names it; a depth's slot is given back after its test (the generation after the
    prompt test needs it: the model holds one sequence); a negative depth is refused."""
    argv = ["bench", "-m", str(tiny_llama), "-p", "16", "-n", "4", "-r", "2", "--no-llama-cpp"]
    assert main([*argv, "-d", "0", "40", "-ctk", "f32"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"pp16", "pp16 @ d40", "tg4", "tg4 @ d40"}
    assert all(float(c[4].split()[0]) > 0 for c in rows.values())
    assert main([*argv, "-d", "-1"]) == 1
    assert "-d -1" in capsys.readouterr().err


def test_bench_with_an_adapter_prints_its_self_ratio(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lora = write_tiny_adapter(tmp_path / "a.gguf")
    argv = ["bench", "-m", str(tiny_llama), "-p", "8", "-n", "3", "-r", "2", "--no-llama-cpp"]
    assert main([*argv, "--lora", str(lora)]) == 0
    out = capsys.readouterr().out
    assert {c[1] for c in _rows(out).values()} == {"1"}
    for test in ("pp8", "tg3"):
        m = re.search(
            rf"graftlm {test}: with adapters ([\d.]+) t/s, without ([\d.]+) t/s, ratio ([\d.]+)",
            out,
        )
        assert m is not None, out
        assert all(float(g) > 0 for g in m.groups())


@pytest.mark.real
def test_bench_sets_no_llama_cpp_figure_it_did_not_measure(
    smollm2_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without llama.cpp in the same run, its columns stay empty, even for a model whose
    llama.cpp speed is known elsewhere: a figure beside ours comes from this run or not at all."""
    argv = ["bench", "-m", str(smollm2_file), "-p", "128", "-n", "16", "-r", "1", "--no-llama-cpp"]
    assert main(argv) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"pp128", "tg16"}
    for cells in rows.values():
        assert float(cells[4].split()[0]) > 0
        assert cells[5] == "-" and cells[6] == "-"


def test_real_shapes_gpt_oss_is_what_llama_cpp_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/real_shapes.py's gpt-oss-20b layout at a small width: every tensor one of gguf's
    MODEL_TENSORS for gpt-oss, the experts MXFP4 (the rest Q8_0, the router float32), and a file
    graftlm serves with its experts on native-mx4 where the native kernels built."""
    import sys
    from dataclasses import replace

    import gguf
    import torch

    from graftlm.gguf import GGUFFile
    from graftlm.models import build_model
    from graftlm.native import library
    from graftlm.step.batch import Batch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import real_shapes

    small = replace(real_shapes.SHAPES["gpt-oss-20b"], d=128, n_head=4, n_head_kv=2, ff=64,
                    n_expert=8, n_expert_used=2, vocab=1024)  # fmt: skip
    monkeypatch.setitem(real_shapes.SHAPES, "gpt-oss-20b", small)
    path = real_shapes.write_model(tmp_path, "gpt-oss-20b", "mxfp4", layers=2)
    arch = gguf.MODEL_ARCH.GPT_OSS
    names = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    types = {}
    for t in gguf.GGUFReader(path).tensors:
        base = re.sub(r"^blk\.\d+\.", "blk.{bid}.", t.name).rsplit(".", 1)[0]
        assert base in names, t.name
        types[t.name] = t.tensor_type
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.1.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.1.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    model = build_model(GGUFFile(path), 64)
    assert model.blocks[1].ffn_down_exps[0].kernel == (
        "native-mx4" if library() is not None else "blocks"
    )
    model.allocate_cache(1, dtype=torch.float32)
    with torch.no_grad():
        logits = model.forward(Batch.single([5, 6, 7, 8]))
    assert torch.isfinite(logits).all()
