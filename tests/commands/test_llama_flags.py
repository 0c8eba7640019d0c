"""llama.cpp's flag habits: each accepted flag is noted, mapped or refused in one line, never read
as another flag; `--version`; the lines that say what is slow; a short error for another base."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

from graftlm.cli import build_parser, main
from graftlm.commands import short_error
from graftlm.native import amx, build

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("flags") / "tiny.gguf", TinySpec())


def _graftlm(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -m graftlm ARGS`; `timeout` a hang's bound (the native library is built before
    any test: only a call with its own fresh GRAFTLM_CACHE compiles, and is given more)."""
    full = dict(os.environ)
    full["PYTHONPATH"] = str(SRC) + os.pathsep + full.get("PYTHONPATH", "")
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "graftlm", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
    )


@pytest.mark.parametrize("command", ["run", "serve", "bench"])
def test_gpu_layers_and_friends_are_never_read_as_other_flags(command: str) -> None:
    p = build_parser()
    a = p.parse_args([command, "-ngl", "99", "-fa", "--mlock", "--no-mmap", "-b", "512"])
    assert a.n_gpu_layers == "99" and a.flash_attn == "on" and a.mlock and a.no_mmap
    assert a.batch_size == 512  # -ngl is not `-n gl`
    assert getattr(a, "n_predict", getattr(a, "n_gen", None)) in (-1, [128])
    a = p.parse_args([command, "--n-gpu-layers", "all", "-ub", "128", "--flash-attn", "off"])
    assert a.n_gpu_layers == "all" and a.ubatch_size == 128 and a.flash_attn == "off"
    if command == "run":
        assert p.parse_args(["run", "-fa", "-f", "x.txt"]).file == "x.txt"  # -fa is not `-f a`


def test_no_effect_flags_say_so_in_one_line_each(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["run", "-m", str(tiny), "-p", "hi", "-n", "2", "--temp", "0"]
        + ["-ngl", "99", "-fa", "--mlock", "-b", "512", "-ub", "128", "--numa", "distribute"]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    notes = [ln for ln in err.splitlines() if ln.startswith("note: ")]
    assert notes == [
        "note: -ngl 99: no effect; the model runs on the CPU (--device cuda puts every layer on "
        "the GPU)",
        "note: -fa on: no effect; graftlm's attention is always fused",
        "note: --mlock/--no-mmap: no effect; weights are memory-mapped from the file",
        "note: -b/-ub: no effect; graftlm chooses its own prompt chunks",
        "note: --numa: no effect",
    ]


@pytest.mark.parametrize(
    "args, words",
    [
        (["run", "-hf", "ggml-org/gemma-3-1b-it-GGUF"], "-hf ggml-org/gemma-3-1b-it-GGUF: graftlm"),
        (["serve", "--hf-repo", "x/y"], "does not download models"),
        (["run", "-p", "x", "-ctk", "f16", "-ctv", "f32"], "K and V in one type"),
        (["run", "-p", "x", "-ctk", "q4_0"], "cache type 'q4_0' is not supported"),
        (["serve", "--no-cont-batching"], "always batches requests continuously"),
    ],
)
def test_refused_flags_exit_non_zero_with_one_line(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(args)
    captured = capsys.readouterr()
    assert code == 1
    assert captured.err.startswith("error: ") and words in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "usage:" not in captured.err


def test_cont_batching_is_noted_as_always_on() -> None:
    from graftlm.commands.llama_flags import llama_flag_notes

    a = build_parser().parse_args(["serve", "-cb", "-ngl", "0", "--device", "cuda"])
    assert llama_flag_notes(a) == [
        "-ngl 0: no effect; the model is on cuda whole",
        "--cont-batching: always on",
    ]


def test_version_names_torch_and_the_native_kernels() -> None:
    done = _graftlm("--version")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "graftlm 0.1.0"
    assert lines[1].startswith("torch ")
    assert lines[2].startswith("native kernels: ")
    if amx():  # the tiles in use, and from how many rows
        assert f"amx from {build.amx_rows()} rows" in lines[2]
        none = _graftlm("--version", env={"GRAFTLM_AMX_ROWS": "0"})
        assert "amx unused" in none.stdout.splitlines()[2]
    off = _graftlm("run", "--version", env={"GRAFTLM_NATIVE": "0"})
    assert off.stdout.splitlines()[2] == "native kernels: off (disabled by GRAFTLM_NATIVE)"


def test_slow_paths_are_announced(tiny: Path, tmp_path: Path) -> None:
    """A first compile says so; no compiler (an empty PATH) or GRAFTLM_NATIVE=0 warns once."""
    args = ("run", "-m", str(tiny), "-p", "hi", "-n", "2", "--temp", "0")
    # (a first compile of the native kernels took 103 s wall for 41 s of CPU at load 7.5; the
    # native tests give theirs 900 s)
    fresh = _graftlm(*args, env={"GRAFTLM_CACHE": str(tmp_path / "cache")}, timeout=900)
    assert fresh.returncode == 0, fresh.stderr
    if "native kernels are off" not in fresh.stderr:  # this machine can build them
        assert fresh.stderr.count("compiling native kernels (once)...") == 1
        again = _graftlm(*args, env={"GRAFTLM_CACHE": str(tmp_path / "cache")})
        assert "compiling" not in again.stderr
    for env, reason in [
        ({"GRAFTLM_NATIVE": "0"}, "disabled by GRAFTLM_NATIVE"),
        ({"PATH": "", "GRAFTLM_CACHE": str(tmp_path / "nocc")}, "no C compiler"),
    ]:
        done = _graftlm(*args, env=env)
        assert done.returncode == 0, done.stderr
        warnings = [ln for ln in done.stderr.splitlines() if ln.startswith("warning: ")]
        assert len(warnings) == 1 and reason in warnings[0]
        assert "runs several times slower" in warnings[0]


def test_adapter_for_another_base_is_refused_before_loading_in_one_line(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = TinySpec(arch="gemma3", n_embd=96, n_head=2, n_head_kv=1, head_dim=32, n_layer=6)
    other = write_tiny_adapter(tmp_path / "g3.gguf", spec)
    code = main(["run", "-m", str(tiny), "--lora", str(other), "-p", "hi"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip() == (
        f"error: {other}: general.architecture is 'gemma3' (hidden size 96) but the base model "
        "tiny.gguf is 'llama' (hidden size 64); cannot attach"
    )
    assert "loaded" not in err  # refused before the base loaded


def test_adapter_for_another_base_at_attach_time_fits_three_lines(
    tiny: Path, tmp_path: Path
) -> None:
    """The Python API lists every problem; the terminal shows the first and how many more."""
    import graftlm
    from graftlm.errors import AdapterError

    spec = TinySpec(arch="gemma3", n_embd=96, n_head=2, n_head_kv=1, head_dim=32, n_layer=6)
    other = write_tiny_adapter(tmp_path / "g3.gguf", spec)
    model = graftlm.load(tiny)
    with pytest.raises(AdapterError) as exc:
        model.add_lora(other)
    full = str(exc.value)
    assert full.splitlines()[0] == (
        f"{other}: general.architecture is 'gemma3' (hidden size 96) but the base model is "
        "'llama' (hidden size 64); cannot attach:"
    )
    n = len(full.splitlines()) - 1
    assert n > 3
    short = short_error(full).splitlines()
    assert len(short) == 3 and short[0] == full.splitlines()[0]
    assert short[1] == full.splitlines()[1] and short[2] == f"  - and {n - 1} more"


def test_short_error_leaves_short_lists_alone() -> None:
    assert short_error("x:\n  - a\n  - b\n  - c") == "x:\n  - a\n  - b\n  - c"
    assert short_error("one line") == "one line"
    assert short_error("x:\n  - a\n  - b\n  - c\n  - d") == "x:\n  - a\n  - and 3 more"


@pytest.mark.real
@pytest.mark.parametrize("adapter", ["gpirate-f32.gguf", "gpirate"])
def test_a_gemma3_adapter_on_smollm2_in_at_most_three_lines(adapter: str) -> None:
    """The issue's case: llama.cpp's conversion and the PEFT directory of a gemma-3 adapter."""
    from shared_data import FIXTURES

    path = FIXTURES / "gemma3" / adapter
    if not path.exists():
        pytest.skip(f"no gemma-3 adapter fixture at {path}")
    done = _graftlm("run", "--lora", str(path), "-p", "hi", "-n", "1")
    assert done.returncode == 1
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith(("error: ", "  - "))]
    assert 1 <= len(lines) <= 3 and "Traceback" not in done.stderr, done.stderr
    assert "gemma" in lines[0] and "llama" in lines[0] and "hidden size 640" in lines[0]
    assert "hidden size 576" in lines[0]


def test_cache_type_flags_choose_the_kv_cache_type(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from graftlm.commands.llama_flags import cache_type

    p = build_parser()
    assert cache_type(p.parse_args(["run", "-ctk", "BF16"])) == "bf16"
    assert cache_type(p.parse_args(["run", "-ctv", "f32", "-ctk", "f32"])) == "f32"
    assert cache_type(p.parse_args(["run"])) is None
    assert main(["run", "-m", str(tiny), "-p", "hi", "-n", "2", "-ctk", "f32"]) == 0
    assert "error" not in capsys.readouterr().err
