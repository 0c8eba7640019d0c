"""The command line's answers to a user's slips: a misspelt flag gets its command's usage and the
closest flags, a reader that leaves a pipe early is no error, a prompt that fills the context
says how much context it needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import TinySpec, write_tiny_model

from graftlm.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_a_misspelt_flag_is_named_with_the_closest_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--tmep", "0", "-p", "hi"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "graftlm run: error: unrecognized arguments: --tmep 0" in err
    assert "--tmep: did you mean --temp" in err
    assert err.startswith("usage: graftlm run")  # the command's usage, not the top level's


def test_a_reader_that_leaves_the_pipe_early_is_no_error(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", TinySpec(n_layer=12))
    cmd = f"{sys.executable} -m graftlm inspect {model} | head -1"
    r = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {cmd}"],
        capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and r.stdout.count("\n") == 1


def test_a_full_context_says_what_generation_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", TinySpec())
    assert main(["run", "-m", str(model), "-c", "16", "-p", "a" * 16, "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert "the prompt has 16 tokens; the context size is 16: generating needs at least 17" in err
