"""The decode products' and routed experts' work claimed by the threads as they go
(csrc/graftlm.h's share_take, the default) against the static split, its twin
(GRAFTLM_DYNAMIC=0): the same bits, since each output is computed whole by one thread in the
same order whichever thread that is. In every build variant the tests run (a subprocess each,
split_cases.py), on 1 and 2 threads, one row and a few, with and without adapters (the one-row
and the many-row delta, and the delta alone), every weight kind, and the decoder layers of a
dense and a routed model (with an adapter on the experts, by whole jobs and by shared steps).
The drills (gl_set_dynamic 2 and 3) make threads steal on every run: the steals are counted, so
the comparison is not of two static splits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graftlm.native import features, library
from graftlm.native.build import _cpu_flags

HERE = Path(__file__).resolve().parent


def cases(path: Path, isa: str) -> dict:  # type: ignore[type-arg]
    # the VNNI kernels in every variant (AMX's tiles keep the static split: test_amx)
    env = {**os.environ, "GRAFTLM_NATIVE_ISA": isa, "GRAFTLM_AMX_ROWS": "0"}
    env.pop("GRAFTLM_DYNAMIC", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH")) if p
    )
    done = subprocess.run(
        [sys.executable, str(HERE / "split_cases.py"), str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(path)  # type: ignore[no-any-return]


@pytest.mark.parametrize("variant", ["native", "avx2", "ymm", "nogfni"])
def test_claimed_work_is_the_static_split_bit_for_bit(tmp_path: Path, variant: str) -> None:
    if library() is None:
        pytest.skip("native kernels unavailable here")
    if variant == "avx2" and not features():
        pytest.skip("this CPU's variant is the AVX2 one: the native case covers it")
    if variant == "ymm" and "zmm-vnni" not in features():
        pytest.skip("no 512-bit VNNI kernels on this CPU: the ymm variant is the native one")
    if variant == "nogfni" and not ("gfni" in _cpu_flags().split() and "avx512f" in features()):
        pytest.skip("no GFNI beside AVX-512 on this CPU: the nogfni variant is the native one")
    got = cases(tmp_path / f"{variant}.pt", variant)
    assert got["isa"] == variant
    missing = [k for k, v in got["cases"].items() if k.split(":")[1] == "missing"]
    compared = {k: v for k, v in got["cases"].items() if k.split(":")[1] != "missing"}
    assert len(compared) >= 2 * (7 * 3 * 3 + 2 * 3), sorted(compared)
    for key, outs in compared.items():
        static, *claimed = outs
        for way, o in enumerate(claimed, 1):
            assert torch.equal(static, o), (key, way, float((static - o).abs().max()))
    # the comparison is of something: the adapters moved the outputs, steps ran, threads stole
    for t in (1, 2):
        assert not torch.equal(compared[f"{t}:proj:Q4_K:1x1:True"][0],
                               compared[f"{t}:proj:Q4_K:1x1:None"][0])  # fmt: skip
        assert not torch.equal(compared[f"{t}:proj:Q6_K:4x1:False"][0],
                               compared[f"{t}:proj:Q6_K:4x1:None"][0])  # fmt: skip
        stolen = got["stolen"][t]
        assert stolen[0] == 0, stolen  # the static split steals nothing
        assert stolen[3] > 0, stolen  # the absent owner's drill: everything is stolen
        if t == 2:
            assert stolen[2] > 0, stolen  # thread 1 takes from the back of thread 0's all
    for t in (1, 2):  # (a tiny model that cannot be made here: its layers are not compared)
        for family in ("llama", "qwen3moe"):
            if f"{t}:missing:{family}" not in missing:
                on = compared[f"{t}:layer:{family}:1:True:1"][0]
                assert not torch.equal(on, compared[f"{t}:layer:{family}:1:False:1"][0]), family


def test_the_switch_is_read_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from graftlm.native import build

    for raw, want in (("", True), ("1", True), ("0", False), ("off", False)):
        monkeypatch.setenv("GRAFTLM_DYNAMIC", raw)
        assert build.dynamic() is want
    monkeypatch.setenv("GRAFTLM_DYNAMIC", "sometimes")
    with pytest.raises(ValueError, match="GRAFTLM_DYNAMIC='sometimes'"):
        build.dynamic()


def test_one_row_ranges_flushed_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """proj.c's one-row delta is added over the ranges of tasks a thread did, flushed when its
    PROJ_RANGES are full: built with room for one range, every claim after the first flushes
    (stolen ones included); still the static split's bits, with an adapter and without."""
    sys.path.insert(0, str(HERE))
    import split_cases
    from variants import variant_library

    lib = variant_library(monkeypatch, "-DPROJ_RANGES=1")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out: dict = {}  # type: ignore[type-arg]
        stolen: dict = {}  # type: ignore[type-arg]
        split_cases.products(lib, out, stolen)
    finally:
        torch.set_num_threads(threads)
    assert stolen[3] > 0 and stolen[0] == 0, stolen
    one_row = {k: v for k, v in out.items() if ":1x1:" in k and not k.endswith(":None")}
    assert len(one_row) >= 2 * 7
    for key, (static, *claimed) in out.items():
        for way, o in enumerate(claimed, 1):
            assert torch.equal(static, o), (key, way, float((static - o).abs().max()))
