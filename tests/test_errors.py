"""Bad input: a one-line error that names the problem, never a traceback."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import TinySpec, write_tiny_adapter

import graftlm
from graftlm.cli import main
from graftlm.errors import GraftError, RequestError


def _run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    return code, err


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return err


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run_cli(["run", "-m", str(tmp_path / "nope.gguf"), "-p", "x"], capsys)
    assert code != 0
    assert "nope.gguf: no such file" in _one_line_error(err)


def test_not_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "text.gguf"
    p.write_text("hello, I am not a model")
    code, err = _run_cli(["run", "-m", str(p), "-p", "x"], capsys)
    assert code != 0
    assert "not a GGUF file" in _one_line_error(err)


def test_truncated(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_llama.read_bytes()[:5000])
    code, err = _run_cli(["run", "-m", str(p), "-p", "x"], capsys)
    assert code != 0
    assert "truncated or corrupt" in _one_line_error(err)


def test_adapter_passed_as_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write_tiny_adapter(tmp_path / "a.gguf", TinySpec())
    code, err = _run_cli(["run", "-m", str(p), "-p", "x"], capsys)
    assert code != 0
    assert "is a LoRA adapter" in _one_line_error(err)


def test_unsupported_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_type("model")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, err = _run_cli(["run", "-m", str(p), "-p", "x"], capsys)
    assert code != 0
    err = _one_line_error(err)
    assert "architecture 'mamba' is not supported" in err
    assert "llama" in err and "gemma3" in err


def test_inspect_lists_tensors(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    assert "general.architecture = 'llama'" in out
    assert "blk.0.attn_q.weight" in out and "F32" in out


# -- the Python API's own arguments ------------------------------------------------------------
@pytest.mark.parametrize("n_seq", [0, -1, 1.5, True])
def test_load_refuses_no_sequences(tiny_llama: Path, n_seq: object) -> None:
    """n_seq=0 left the engine without a slot: generate() waited forever."""
    with pytest.raises(GraftError, match="n_seq must be .* at least 1"):
        graftlm.load(tiny_llama, n_seq=n_seq)  # type: ignore[arg-type]


def test_api_arguments_get_clear_errors(tiny_llama: Path) -> None:
    m = graftlm.load(tiny_llama, ctx_size=64)
    n = m.config.n_vocab
    with pytest.raises(RequestError, match="the ids are empty"):
        m.logits([])
    with pytest.raises(RequestError, match="top must be a whole number >= 0, got -1"):
        m.logprobs([1, 2, 3], top=-1)
    everything = m.logprobs([1, 2, 3], top=10**6)  # at most the whole vocabulary
    assert [len(p["top"]) for p in everything] == [n, n]
    with pytest.raises(RequestError, match=rf"out of range \[0, {n}\): \[{n}\]"):
        m.detokenize([1, n])
    with pytest.raises(TypeError, match="tokenize takes a str, got int"):
        m.tokenize(5)  # type: ignore[arg-type]
