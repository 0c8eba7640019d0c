"""The AVX2 variant of the native kernels against the variant this CPU gets (AVX-512, VNNI where
the CPU has them): the same products, bit for bit, since both sum the same integer dots exactly and
round the same float operations in the same order. The AVX2 variant is built in a subprocess
(GRAFTLM_NATIVE_ISA=avx2), so an AVX-512 machine tests both. Where the CPU's variant has the
512-bit VNNI kernels (two groups of outputs a pass), the "ymm" variant (the same CPU's 256-bit
kernels) is compared with it too. The shape's 5 groups of 8 outputs take both: two pairs, and one
left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from synth_tensors import gguf_tensor

from graftlm.native import features, library
from graftlm.native.build import _cpu_flags
from graftlm.quant import QWeight

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q5_0, Q.Q5_1, Q.Q6_K, Q.Q3_K, Q.Q2_K, Q.Q8_0, Q.IQ4_NL,
         Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S]  # fmt: skip
SHAPE = (40, 512)
# a decode row, two (and four: the grid quants' few-row kernel), a batch, the tiles' remainders,
# a batched decode step of 16 and of 32 rows (its last tile asks for the next task's weights), a
# prompt, one whose pairs are unpacked once for 48 rows (k16_pair_rows) with a remainder, one in
# two passes over the tasks (proj_run's rows)
ROWS = (1, 2, 3, 4, 7, 16, 32, 33, 100, 1100)

PRODUCTS = """
import sys, torch
from gguf import GGMLQuantizationType as Q
from graftlm.native import features, isa
from graftlm.quant import QWeight
from synth_tensors import gguf_tensor
torch.set_num_threads(1)
out = {"isa": isa(), "features": features()}
for name in sys.argv[2].split(","):
    qt = Q[name]
    raw, _ = gguf_tensor(qt, (40, 512), seed=3)
    w = QWeight.from_gguf(raw, qt, (40, 512), name="w")
    out[name + ":kernel"] = w.kernel
    for m in (1, 2, 3, 4, 7, 16, 32, 33, 100, 1100):  # ROWS
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        out[f"{name}:{m}"] = w.matmul(x)
    out[name + ":deq"] = w.dequantize()
    # the 512-bit pairs serving every row count (one row too), where this variant has them
    from graftlm.native import library
    before = library().gl_set_pair_rows(1)
    for m in (1, 3):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        out[f"{name}:{m}:pairs"] = w.matmul(x)
    library().gl_set_pair_rows(before)
# the LoRA delta alone (gl_lora): two packed adapters, prompt rows and one-token rows (in pairs,
# alone, runs on one adapter), a tail block, float32 and bfloat16 B (Q8_0 A)
from graftlm.lora.site import LoraSite
from graftlm.models.seam import add_delta
from graftlm.step.batch import LoraRows
g = torch.Generator().manual_seed(5)
for compact in (False, True):
    site = LoraSite(512, 72, compact=compact)
    for slot in (0, 2):
        a, b = torch.randn(16, 512, generator=g), torch.randn(72, 16, generator=g)
        b[:40, 3] = 0.0  # a column whose span starts past the first block
        site.put(slot, a, b)
    for rows, t in ((3, 11), (6, 1)):
        scales = torch.rand(rows, 3, generator=g)
        scales[:, 1] = 0.0
        scales[1, 0] = 0.0  # a row whose adapters differ from its neighbours'
        x = torch.randn(rows, t, 512, generator=g)
        y = torch.randn(rows, t, 72, generator=g)
        out[f"lora:{compact}:{t}"] = add_delta(site, y, x, LoraRows(scales, (0, 2)), exact=False)
torch.save(out, sys.argv[1])
"""


def products(path: Path, isa: str) -> dict[str, object]:
    # the VNNI kernels in every variant: AMX's bfloat16 products have a twin of their own (test_amx)
    env = {**os.environ, "GRAFTLM_NATIVE_ISA": isa, "GRAFTLM_AMX_ROWS": "0"}
    # synth_tensors is a module of tests/, beside graftlm's own path
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p
    )
    done = subprocess.run(
        [sys.executable, "-c", PRODUCTS, str(path), ",".join(t.name for t in TYPES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(path)


@pytest.mark.parametrize("other", ["avx2", "ymm", "nogfni"])
def test_other_variants_match_this_cpus(tmp_path: Path, other: str) -> None:
    if library() is None:
        pytest.skip("native kernels unavailable here")
    if not features():
        pytest.skip("this CPU's variant is the AVX2 one: nothing to compare it with")
    if other == "ymm" and "zmm-vnni" not in features():
        pytest.skip("no 512-bit VNNI kernels on this CPU: the ymm variant is this one")
    if other == "nogfni" and not ("gfni" in _cpu_flags().split() and "avx512f" in features()):
        pytest.skip("no GFNI beside AVX-512 on this CPU: the nogfni variant is this one")
    mine = products(tmp_path / "native.pt", "native")
    them = products(tmp_path / f"{other}.pt", other)
    assert them["isa"] == other
    if other == "avx2":
        assert them["features"] == []
        assert "vnni" in mine["features"] or "avx512bw+vl" in mine["features"]
    elif other == "nogfni":  # (Q6_K's high bits by shifts and blends, as without GFNI)
        assert them["features"] == mine["features"]
    else:
        assert "zmm-vnni" in mine["features"] and "zmm-vnni" not in them["features"]
        assert "vnni" in them["features"]
    for qt in TYPES:
        assert mine[qt.name + ":kernel"] == them[qt.name + ":kernel"]
        assert str(mine[qt.name + ":kernel"]).startswith("native-"), qt
        assert torch.equal(mine[qt.name + ":deq"], them[qt.name + ":deq"]), qt
        for m in ROWS:
            a, b = mine[f"{qt.name}:{m}"], them[f"{qt.name}:{m}"]
            assert torch.equal(a, b), (qt.name, m, float((a - b).abs().max()))
        for m in (1, 3):  # this CPU's pairs from one row on, against the other's kernels
            a, b = mine[f"{qt.name}:{m}:pairs"], them[f"{qt.name}:{m}"]
            assert torch.equal(a, b), (qt.name, m, "pairs", float((a - b).abs().max()))
    for key in ("lora:False:11", "lora:False:1", "lora:True:11", "lora:True:1"):
        assert torch.equal(mine[key], them[key]), key


def test_variant_asked_for_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from graftlm.native import build

    monkeypatch.setenv("GRAFTLM_NATIVE_ISA", "avx9")
    with pytest.raises(ValueError, match="GRAFTLM_NATIVE_ISA='avx9'"):
        build.isa()


def test_pair_rows_by_cpu_or_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from graftlm.native import build

    monkeypatch.setenv("GRAFTLM_PAIR_ROWS", "3")
    assert build.pair_rows() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("GRAFTLM_PAIR_ROWS", bad)
        with pytest.raises(ValueError, match=f"GRAFTLM_PAIR_ROWS='{bad}'"):
            build.pair_rows()
    monkeypatch.delenv("GRAFTLM_PAIR_ROWS")
    for vendor, rows in (("GenuineIntel", 1), ("AuthenticAMD", 2), ("", 2)):
        monkeypatch.setattr(build, "_cpu_vendor", lambda v=vendor: v)
        assert build.pair_rows() == rows


def test_pairs_at_one_row_match_the_256_bit_kernels() -> None:
    """In this process: one row through the 512-bit pairs and through the 256-bit kernels (the
    pairs' threshold moved between the two), the same bits, for every type that has pairs."""
    lib = library()
    if lib is None or "zmm-vnni" not in features():
        pytest.skip("no 512-bit VNNI kernels on this CPU")
    x = torch.randn(1, SHAPE[1], generator=torch.Generator().manual_seed(11))
    before = lib.gl_set_pair_rows(1)
    try:
        for qt in TYPES:
            raw, _ = gguf_tensor(qt, SHAPE, seed=4)
            w = QWeight.from_gguf(raw, qt, SHAPE, name="w")
            lib.gl_set_pair_rows(1)
            paired = w.matmul(x)
            lib.gl_set_pair_rows(2)
            alone = w.matmul(x)
            assert torch.equal(paired, alone), (qt.name, float((paired - alone).abs().max()))
    finally:
        lib.gl_set_pair_rows(before)


@pytest.mark.parametrize("k", [8192, 8448])
def test_pairs_keeping_their_corrections_match_one_row_at_a_time(k: int) -> None:
    """An s8 weight's pairs (Q8_0, IQ4_NL, IQ4_XS) sum each block's corrections once a task, in
    the first tile of rows that takes the pair, and read them in its other tiles, up to 256 blocks
    a row (k 8192); past that (8448) each tile sums its own. Both, at 7 and 13 rows (two and three
    tiles): the same bits as each row alone."""
    if library() is None:
        pytest.skip("native kernels unavailable here")
    for qt in (Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS):
        raw, _ = gguf_tensor(qt, (SHAPE[0], k), seed=5)
        w = QWeight.from_gguf(raw, qt, (SHAPE[0], k), name="w")
        assert w.kernel.startswith("native"), (qt.name, w.kernel)
        for m in (7, 13):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            alone = torch.cat([w.matmul(x[i : i + 1]) for i in range(m)])
            together = w.matmul(x)
            assert torch.equal(together, alone), (qt.name, m, float((together - alone).abs().max()))


def test_this_process_products_are_native() -> None:
    """The in-process weights of the comparison above are the native kernels (not a fallback
    that would make the comparison vacuous)."""
    if library() is None:
        pytest.skip("native kernels unavailable here")
    raw, _ = gguf_tensor(Q.Q5_K, SHAPE, seed=3)
    assert QWeight.from_gguf(raw, Q.Q5_K, SHAPE, name="w").kernel == "native-k4"
