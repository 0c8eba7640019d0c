"""The native kernels against their twins: llama.cpp's int8-activation arithmetic written out in
numpy, torch's RMS norm, and the PyTorch attention path of the model."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants
from synth_tensors import random_blocks

import graftlm
from graftlm.models import seam
from graftlm.native import (
    build,
    disabled,
    features,
    library,
    ops,
    release_threads,
    unavailable_reason,
)
from graftlm.quant import QWeight
from graftlm.step.batch import Batch, RowIndex
from graftlm.step.kv_cache import KVCache, kv_dtype, q8_0_pack, q8_0_unpack

pytestmark = pytest.mark.skipif(library() is None, reason=f"native: {unavailable_reason()}")


def int8_twin(x: np.ndarray, w: np.ndarray, qtype: Q) -> np.ndarray:
    """y = x @ w.T with x quantized per 32 values as the kernels do (round half to even),
    in float64: only the kernel's float32 summation order is left to differ."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv)  # the kernel: x * (127 / amax), rounded to nearest even
    xt = (xq * d).reshape(m, k).astype(np.float64)
    return xt @ w.astype(np.float64).T


@pytest.mark.parametrize(
    "qtype",
    [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q8_0, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS,
     Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("m", [1, 3, 4, 9, 16, 32])  # (16, 32: a batched decode step's tiles)
def test_int8_activation_matmul_is_llama_cpp_arithmetic(qtype: Q, m: int) -> None:
    rng = np.random.default_rng(m)
    n, k = 40, 512
    raw = random_blocks(qtype, (n, k), rng)
    w = QWeight.from_gguf(raw, qtype, (n, k))
    assert w.kernel.startswith("native")
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 5] = 0  # a zero and an all-zero block: xd = 0 must not divide by zero
    x[0, 64:96] = 0
    want = int8_twin(x, w.dequantize().numpy(), qtype)
    got = w.matmul(torch.from_numpy(x)).numpy()
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)
    # and the quantization of x is what separates it from the float32 product (~0.5 %)
    exact = x.astype(np.float64) @ w.dequantize().numpy().astype(np.float64).T
    assert np.abs(got - exact).max() < 0.02 * scale


def test_rms_norm_matches_torch() -> None:
    x = torch.randn(3, 5, 576) * 3
    w = torch.randn(576)
    y = ops.rms_norm(x, w, 1e-5)
    assert y is not None
    torch.testing.assert_close(y, F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    assert ops.rms_norm(x.double(), w, 1e-5) is None  # not float32: the caller's twin runs
    assert ops.rms_norm(x.transpose(0, 1), w, 1e-5) is None  # not contiguous


@pytest.mark.parametrize("n", [7, 13, 100, 128, 2048])
def test_rms_norm_sums_the_float_squares_in_double(n: int) -> None:
    """ggml's steps: each square in float32, their mean in float64, the scale and the products
    in float32; rows shorter than a vector and rows with a tail past the last vector."""
    x = torch.randn(64, n) * 3
    w = torch.randn(n)
    y = ops.rms_norm(x, w, 1e-6)
    assert y is not None
    mean = (x * x).double().sum(-1, keepdim=True) / n
    scale = 1.0 / torch.sqrt(mean.float() + 1e-6)
    torch.testing.assert_close(y, (x * scale) * w, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def tiny_llama_wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 96: one 64-wide register block of the weighted sum plus a 32-wide tail."""
    from tiny_models import TinySpec, write_tiny_model

    spec = TinySpec(n_embd=192, n_head=2, n_head_kv=1, head_dim=96)
    return write_tiny_model(tmp_path_factory.mktemp("wide") / "llama96.gguf", spec)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3", "tiny_llama_wide_heads"])
def test_native_decode_attention_equals_torch_attention(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """Prefill three sequences past gemma-3's sliding window (8), then decode them together at
    different positions: native attention (RoPE, cache writes, GQA, window) vs PyTorch's."""
    path: Path = request.getfixturevalue(fixture)
    model = graftlm.load(str(path), ctx_size=64, n_seq=3, cache_type="f32").model
    lens = [5, 12, 17]

    def run(native: bool) -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for s, n in enumerate(lens):
                model.forward(Batch.single([(7 * s + j) % 50 + 3 for j in range(n)], s, 0))
            for step in range(4):
                tokens = torch.tensor([[10 + step + s] for s in range(3)])
                batch = Batch(tokens, [0, 1, 2], [n + step for n in lens], [1, 1, 1])
                assert batch.decode_rows() is not None
                if native:
                    out.append(model.forward(batch))
                else:
                    with disabled():
                        out.append(model.forward(batch))
        return out

    got, want = run(True), run(False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    # one row alone (no mask at all in the torch path) agrees too
    with torch.inference_mode():
        one = Batch(torch.tensor([[13]]), [2], [lens[2] + 4], [1])
        a = model.forward(one)
        model.forward(Batch(torch.tensor([[13]]), [2], [lens[2] + 4], [1]))  # rewrite same cell
        with disabled():
            b = model.forward(Batch(torch.tensor([[13]]), [2], [lens[2] + 4], [1]))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_prefill_and_repeated_places_are_not_decode_rows() -> None:
    assert Batch(torch.tensor([[1, 2]]), [0], [0], [2]).decode_rows() is None
    assert Batch(torch.tensor([[1], [2]]), [0, 0], [3, 3], [1, 1]).decode_rows() is None
    rows = Batch(torch.tensor([[1], [2]]), [1, 0], [3, 4], [1, 1]).decode_rows()
    assert rows is not None and rows[0].tolist() == [1, 0] and rows[1].tolist() == [3, 4]
    # one slot at consecutive positions (a speculative draft's rows): decode rows
    rows = Batch(torch.tensor([[1], [2]]), [0, 0], [3, 4], [1, 1]).decode_rows()
    assert rows is not None and rows[1].tolist() == [3, 4]


def test_a_thread_gives_back_its_openmp_workers() -> None:
    """release_threads frees the calling thread's OpenMP pool (the engine service's starter does,
    so that only the engine thread's workers count against the CPUs); the next native call on
    this thread makes a new one and computes the same."""

    def n_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    x = torch.randn(64, 4096)
    w = torch.rand(4096) + 0.5
    want = ops.rms_norm(x, w, 1e-6)  # a parallel region: this thread's pool is up
    assert want is not None and torch.get_num_threads() >= 2
    before = n_threads()
    assert release_threads()
    assert n_threads() < before
    got = ops.rms_norm(x, w, 1e-6)
    assert got is not None and torch.equal(got, want) and n_threads() == before


def test_disabled_and_missing_compiler_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    with disabled():
        assert library() is None and "disabled" in (unavailable_reason() or "")
        w = QWeight.from_gguf(random_blocks(Q.Q4_1, (64, 256), np.random.default_rng(0)),
                              Q.Q4_1, (64, 256))  # fmt: skip
        assert not w.kernel.startswith("native")
    assert library() is not None
    build.loaded_library.cache_clear()
    try:
        monkeypatch.setattr(build, "_compiler", lambda: None)
        assert library() is None and "compiler" in (unavailable_reason() or "")
    finally:
        build.loaded_library.cache_clear()
        monkeypatch.undo()
    assert library() is not None


def test_build_is_cached_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build lands whole in $GRAFTLM_CACHE/native (no .partial left), is not made again while
    the sources, the flags and the compiler stay the same, and is made anew when a source or a
    flag changes. The compiler is a stand-in that logs its calls and copies the library this
    session loaded (each real compile is 36 s of CPU here): a real one into a fresh cache, every
    run, is test_slow_paths_are_announced's (tests/commands/test_llama_flags.py), the same
    `_build`, as is the session's first build wherever the sources changed."""
    cc = build._compiler()
    assert cc is not None
    loaded = build._build(cc)  # (the session's library, from the cache)
    calls, stand_in, csrc = tmp_path / "calls", tmp_path / "cc", tmp_path / "csrc"
    stand_in.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && { echo "stand-in cc 1"; exit 0; }\n'
        f'echo "$*" >> "{calls}"\n'
        f'while [ $# -gt 1 ]; do [ "$1" = -o ] && cp "{loaded}" "$2"; shift; done\n'
    )
    stand_in.chmod(0o755)
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    monkeypatch.setattr(build, "SOURCE", csrc / build.SOURCE.name)
    monkeypatch.setenv("GRAFTLM_CACHE", str(tmp_path / "cache"))
    first = build._build(str(stand_in))
    assert first.parent == tmp_path / "cache" / "native" and first.exists()
    assert first.read_bytes() == loaded.read_bytes()
    mtime = first.stat().st_mtime_ns
    assert build._build(str(stand_in)) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    made = calls.read_text().splitlines()
    assert len(made) == 1 and made[0].startswith(" ".join(build.FLAGS))
    assert made[0].endswith(str(csrc / "graftlm.c"))
    out = made[0].split(" -o ")[1].split()[0]  # written beside the target, then renamed
    assert Path(out).parent == first.parent and out.endswith(".so.partial")
    other = build._build(str(stand_in), ("-DGL_COUNT_ALLOC",))  # another flag
    with open(csrc / "graftlm.h", "a") as f:
        f.write("\n")  # another source
    edited = build._build(str(stand_in))
    assert len({first, other, edited}) == 3 and len(calls.read_text().splitlines()) == 3
    assert not list(first.parent.glob("*.partial"))
    # another compiler (its --version): built anew; one that fails half way leaves nothing
    stand_in.write_text(stand_in.read_text().replace("stand-in cc 1", "stand-in cc 2"))
    assert build._build(str(stand_in)) != edited and len(calls.read_text().splitlines()) == 4
    broken = tmp_path / "broken-cc"
    broken.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && { echo "broken cc"; exit 0; }\n'
        'while [ $# -gt 1 ]; do [ "$1" = -o ] && echo half > "$2"; shift; done\n'
        'echo "error: out of memory" >&2; exit 1\n'
    )
    broken.chmod(0o755)
    before = set(first.parent.iterdir())
    with pytest.raises(OSError, match=r"could not build graftlm\.c: error: out of memory"):
        build._build(str(broken))
    assert set(first.parent.iterdir()) == before  # no library, no .partial


def test_scales_stay_float16_only_when_exact() -> None:
    """Q4_0's offset -8 d is stored as float16 unless it overflows: then the weight keeps float32
    scales, and dequantization stays bit-exact either way."""
    import gguf

    rng = np.random.default_rng(3)
    raw = random_blocks(Q.Q4_0, (16, 64), rng)
    w = QWeight.from_gguf(raw, Q.Q4_0, (16, 64))
    assert w._k.d.dtype == torch.float16  # type: ignore[attr-defined]
    big = raw.copy().reshape(16, -1)
    big[3, 0:2] = np.frombuffer(np.float16(60000.0).tobytes(), np.uint8)  # -8 d overflows
    w = QWeight.from_gguf(big, Q.Q4_0, (16, 64))
    assert w._k.d.dtype == torch.float32  # type: ignore[attr-defined]
    want = gguf.quants.dequantize(big, Q.Q4_0)
    np.testing.assert_array_equal(w.dequantize().numpy().view(np.int32), want.view(np.int32))


@pytest.mark.parametrize(
    ("scales", "t"),
    [
        ([[1.0, 0.0, 0.5], [0.0, 0.0, -2.0], [0.25, 0.0, 0.0]], 5),
        # one token a row: neighbours on the same columns (at other scales) go two at a time
        (
            [[0.0, 0.0, -2.0], [1.0, 0.0, 0.5], [-1.0, 0.0, 2.0], [0.0, 0.0, 3.0], [0.5, 0.0, 0.0]],
            1,
        ),
    ],
    ids=["tokens", "rows"],
)
def test_native_lora_delta_equals_torch_delta(scales: list[list[float]], t: int) -> None:
    """Rows with different scales (zeros included), several tokens per row or one, added in
    place; 48 outputs: a whole block of 32 and a part of one."""
    from graftlm.lora.site import LoraSite
    from graftlm.step.batch import LoraRows

    g = torch.Generator().manual_seed(0)
    site = LoraSite(64, 48)
    site.put(0, torch.randn(4, 64, generator=g), torch.randn(48, 4, generator=g))
    b2 = torch.randn(48, 8, generator=g)
    b2[:20] = 0  # a part of a stacked projection: outputs 20..47 only
    b2[40:, 3] = 0
    site.put(2, torch.randn(8, 64, generator=g), b2)
    n = len(scales)
    x = torch.randn(n, t, 64, generator=g)
    base = torch.randn(n, t, 48, generator=g)
    s = torch.tensor(scales)

    def delta(native: bool) -> torch.Tensor:
        rows = LoraRows(s, (0, 2))
        y = base.clone()
        if native:
            return seam.add_delta(site, y, x, rows, exact=False)
        return site.add_delta(y, x, rows)  # the PyTorch twin

    table = site.native()
    assert table is not None and table.ids == [0, 2]
    # slot 2's columns all reach blocks 0 and 1 (outputs 20..47; column 3 only to 40): one part
    assert [(p.c0, p.r, p.lo, p.hi) for p in table.slots[1].parts] == [(0, 8, 0, 2)]
    got, want = delta(True), delta(False)  # entries ~50: float32 summation order differs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert not torch.equal(want, base)
    a0, b0 = site.factors(0)
    a2, b2 = site.factors(2)
    explicit = base.clone()
    for r in range(n):
        explicit[r] += s[r, 0] * (x[r] @ a0.T) @ b0.T + s[r, 2] * (x[r] @ a2.T) @ b2.T
    torch.testing.assert_close(got, explicit, rtol=1e-4, atol=1e-3)


def _compose(mp: pytest.MonkeyPatch) -> None:
    """From here on the model runs its PyTorch blocks: no native layer, alone or all at once."""
    from graftlm.models.base import Transformer

    mp.setattr(Transformer, "native_layers", lambda self, x, batch: None)
    mp.setattr(Transformer, "native_block", lambda self, i, x, batch: None)


@pytest.mark.parametrize(
    "arch,qtype",
    [
        ("llama", Q.Q4_1),
        ("llama", Q.Q8_0),
        ("llama", Q.Q4_0),
        ("gemma3", Q.Q5_0),
        ("qwen3", Q.Q8_0),
        ("qwen2", Q.Q4_0),
        ("llama", Q.IQ4_NL),
        ("llama", Q.IQ4_XS),
        ("llama", Q.MXFP4),
        ("llama", Q.IQ3_XXS),
        ("qwen3", Q.IQ2_S),
    ],
)
@pytest.mark.parametrize("n_rows", [3, 1])
def test_fused_layer_equals_the_pytorch_block(
    arch: str, qtype: Q, n_rows: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-call native layer against the same layer composed in Python (same native
    kernels): three rows at different positions (past gemma-3's window of 8), each with its own
    adapters and scales, one with none; every projection carries an adapter. One row (the one
    with two adapters) takes the delta's single-row path: each thread its own columns."""
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

    from graftlm.models.base import Transformer

    extra = {"n_head": 2, "n_head_kv": 1, "head_dim": 32} if arch == "gemma3" else {}
    # IQ4_XS's (the grid types') super-blocks need rows of 256 values
    dims = {"n_embd": 64, "n_ff": 96}
    if qtype in (Q.IQ4_XS, Q.IQ3_XXS, Q.IQ2_S):
        dims = {"n_embd": 256, "n_ff": 512, "head_dim": 64}
    spec = TinySpec(arch=arch, qtype=qtype, embd_type=Q.Q8_0, n_layer=3, **dims,
                    **extra)  # type: ignore[arg-type]  # fmt: skip
    path = write_tiny_model(tmp_path / "m.gguf", spec)
    m = graftlm.load(str(path), ctx_size=64, n_seq=3, cache_type="f32")
    ids = [m.add_lora(write_tiny_adapter(tmp_path / f"a{s}.gguf", spec, seed=s), 0.0)
           for s in (1, 2)]  # fmt: skip
    model = m.model
    settings = [{ids[0]: 1.0}, {ids[0]: 0.5, ids[1]: -1.0}, {}]
    lens = [4, 9, 13]
    if n_rows == 1:
        settings, lens = settings[1:2], lens[1:2]
    rows = m.engine.lora_rows(settings)
    slots = list(range(n_rows))

    def run() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for s, n in enumerate(lens):
                model.forward(Batch.single([(5 * s + j) % 40 + 3 for j in range(n)], s, 0))
            for step in range(3):
                tokens = torch.tensor([[11 + step + s] for s in slots])
                out.append(model.forward(Batch(tokens, slots, [n + step for n in lens],
                                               [1] * n_rows, rows)))  # fmt: skip
        return out

    from graftlm.models.fused import FusedLayer, FusedStack

    served: list[tuple[str, bool]] = []

    def spy(cls: type, kind: str) -> None:
        call = cls.__call__

        def counted(self: object, x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
            y = call(self, x, batch)  # type: ignore[operator]
            served.append((kind, y is not None))
            return y

        monkeypatch.setattr(cls, "__call__", counted)

    spy(FusedLayer, "layer")
    spy(FusedStack, "stack")
    fused = run()
    # every decode step in one call over all layers; the prefills in PyTorch blocks
    assert served.count(("stack", True)) == 3 and ("layer", True) not in served
    monkeypatch.setattr(Transformer, "native_layers", lambda self, x, batch: None)
    served.clear()
    one_by_one = run()  # each layer its own call
    assert served.count(("layer", True)) == 3 * 3
    _compose(monkeypatch)
    composed = run()
    for a, b, c in zip(fused, one_by_one, composed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def _q8_x(x: torch.Tensor) -> torch.Tensor:
    """x (..., 32 k) rounded as the kernels round activations, per 32 values: d = max|v| / 127,
    q = round(v * 127 / max|v|), float32 d."""
    v = x.reshape(-1, 32)
    amax = v.abs().amax(dim=1, keepdim=True)
    q = torch.where(amax > 0, torch.round(v * (127 / torch.where(amax > 0, amax, 1))), 0)
    return (q * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 5])
def test_an_adapter_whose_b_is_zero_adds_nothing(rows: int) -> None:
    """PEFT initialises B to zero: such an adapter has no parts and adds nothing, natively as in
    the twin, alone on a row (one row: the per-thread path) or beside another adapter."""
    from graftlm.lora.site import LoraSite
    from graftlm.step.batch import LoraRows

    g = torch.Generator().manual_seed(7)
    site = LoraSite(64, 80, compact=True)
    site.put(0, torch.randn(8, 64, generator=g), torch.zeros(80, 8))
    site.put(1, torch.randn(4, 64, generator=g), torch.randn(80, 4, generator=g))
    table = site.native()
    assert table is not None and table.slots[0].parts == [] and len(table.slots[1].parts) == 1
    x = torch.randn(rows, 1, 64, generator=g)
    base = torch.randn(rows, 1, 80, generator=g)
    alone = LoraRows(torch.tensor([[1.0, 0.0]] * rows), (0,))
    assert torch.equal(seam.add_delta(site, base.clone(), x, alone, exact=False), base)
    both = LoraRows(torch.tensor([[1.0, 0.5]] * rows), (0, 1))
    got = seam.add_delta(site, base.clone(), x, both, exact=False)
    want = site.add_delta(base.clone(), x, both)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    assert not torch.equal(got, base)


def test_steps_pack_nothing_whatever_adapters_they_mix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter's native form is packed when it is read, never in a step: decode and prompt
    steps over ever-changing sets of adapters (as requests start and end) pack nothing, and
    every row equals its adapter computed alone."""
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

    from graftlm.lora import packed

    spec = TinySpec(qtype=Q.Q8_0, embd_type=Q.Q8_0, n_layer=2)
    m = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=64, n_seq=4)
    ids = [m.add_lora(str(write_tiny_adapter(tmp_path / f"{i}.gguf", spec, seed=i)), 0.0)
           for i in range(1, 5)]  # fmt: skip
    made: list[int] = []
    init = packed.PackedSlot.__init__
    monkeypatch.setattr(
        packed.PackedSlot, "__init__", lambda *a, **k: made.append(1) or init(*a, **k)
    )
    model = m.model
    with torch.inference_mode():
        for s in range(4):
            model.forward(Batch.single([3 + s, 4, 5], s, 0))
        for step in range(4):  # each step another mix: two rows on adapters, rows alone
            settings = [{ids[(r + step) % 4]: 1.0} if (r + step) % 2 else {} for r in range(4)]
            tokens = torch.tensor([[7 + r] for r in range(4)])
            rows = m.engine.lora_rows(settings)
            mixed = model.forward(Batch(tokens, [0, 1, 2, 3], [3 + step] * 4, [1] * 4, rows))
            for r in range(4):  # the same row alone (it writes the same position again)
                alone = model.forward(
                    Batch(
                        tokens[r : r + 1], [r], [3 + step], [1], m.engine.lora_rows([settings[r]])
                    )
                )
                torch.testing.assert_close(alone[0], mixed[r], rtol=1e-4, atol=1e-4)
    assert made == []


def test_compact_lora_stacks_in_fast_mode_only() -> None:
    """A site over an approximate (native, int8-activation) base computes A . x as the base
    products do in the fast mode (x rounded to int8 per 32 values, A as Q8_0) and streams B as
    bfloat16: equal to that arithmetic spelled out, within 1% of the float32 delta. The packed
    form is the slot's one copy: the float32 mode is float32 arithmetic (x not rounded) on the
    factors as held (A through Q8_0, B in bfloat16), also within 1% of the float32 delta."""
    from graftlm.lora.site import LoraSite
    from graftlm.step.batch import LoraRows

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 64, generator=g), torch.randn(40, 8, generator=g)
    site = LoraSite(64, 40, compact=True)
    site.put(3, a, b)
    rows = LoraRows(torch.tensor([[0.0, 0.0, 0.0, 1.5], [0.0, 0.0, 0.0, -1.0]]), (3,))
    x = torch.randn(2, 3, 64, generator=g)
    scale = torch.tensor([1.5, -1.0]).view(2, 1, 1)
    got = seam.add_delta(site, torch.zeros(2, 3, 40), x, rows, exact=False)
    st = site._packed[3]
    assert st is not None and st.a is None and st.aq is not None  # A: the integer dots' alone
    assert all(p.data.dtype == torch.bfloat16 for p in st.parts)
    aq = torch.from_numpy(quants.dequantize(quants.quantize(a.numpy(), Q.Q8_0), Q.Q8_0))
    want = scale * (_q8_x(x) @ aq.T) @ b.bfloat16().float().T
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    exact = scale * (x @ a.T) @ b.T
    assert (got - exact).norm() / exact.norm() < 1e-2
    held = seam.add_delta(site, torch.zeros(2, 3, 40), x, rows, exact=True)
    torch.testing.assert_close(  # the float32 mode: the PyTorch twin on the factors as held
        held,
        scale * (x @ aq.T) @ b.bfloat16().float().T,
        rtol=1e-5,
        atol=1e-4,
    )
    assert (held - exact).norm() / exact.norm() < 1e-2
    assert site.nbytes(3) == st.nbytes  # and nothing beside it


@pytest.mark.real
def test_fused_gemma3_layer_with_separate_q_k_v(
    gemma3_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gemma-3's Q, K (Q5_0) and V (Q8_0) cannot stack: the native layer runs them as three
    products. Two rows decode past the sliding window (512) through the native layer, through
    the composed block (same int8-activation kernels), and through the exact float32 path.

    The layers agree to ~1e-6 relative, but a last-bit difference (GELU's, say) can move an
    activation across a rounding boundary of the next int8 quantization, so the two fast paths
    differ by int8 noise, which on this random-token prompt is a tenth or two: the native layer
    must be as close to the exact path as the composed block is (measured: mean 0.15-0.19 each
    over the exact path's top 20)."""
    m = graftlm.load(str(gemma3_file), ctx_size=1100, n_seq=2)
    model = m.model
    spec = model.layer_spec(0)
    assert spec is not None and len(spec.qkv) == 3 and model.fused_layer(0) is not None

    def run(exact: bool = False) -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            model.forward(Batch.single(list(range(1000, 1520)), 0, 0, exact=exact))
            model.forward(Batch.single(list(range(2000, 2030)), 1, 0, exact=exact))
            for step in range(3):
                batch = Batch(torch.tensor([[300 + step], [400 + step]]), [0, 1],
                              [520 + step, 30 + step], [1, 1], exact=exact)  # fmt: skip
                out.append(torch.log_softmax(model.forward(batch), -1))
        return out

    fused = run()
    exact = run(exact=True)
    _compose(monkeypatch)
    composed = run()
    for f, c, e in zip(fused, composed, exact, strict=True):
        top = e.topk(20, dim=-1).indices
        df = (f.gather(-1, top) - e.gather(-1, top)).abs().mean()
        dc = (c.gather(-1, top) - e.gather(-1, top)).abs().mean()
        print(f"vs exact float32: native layer {df:.4f}, composed block {dc:.4f}")
        assert df <= 1.3 * dc + 0.02


def test_out_of_range_slots_and_positions_never_reach_the_c_code(tiny_llama: Path) -> None:
    """The native steps write the cache at (slot, position): anything out of range is left to the
    PyTorch path, which raises instead of writing past the cache."""
    model = graftlm.load(str(tiny_llama), ctx_size=16, n_seq=2).model
    cache = model.cache
    assert cache is not None
    q = torch.zeros(1, 1, 4 * 16)
    kv = torch.zeros(1, 1, 2 * 16)
    rope = model.rope_of_layer[0]
    for slot, pos in ((2, 3), (0, 16), (-1, 3), (0, -1)):
        out = ops.attn_decode(q, kv, kv, cache, 0, torch.tensor([slot]),
                              torch.tensor([pos]), rope.cos, rope.sin, rope.neox, 1.0, 0)  # fmt: skip
        assert out is None
    with torch.inference_mode(), pytest.raises((IndexError, RuntimeError)):
        model.forward(Batch(torch.tensor([[5]]), [2], [3], [1]))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "swiglu_oai"])
def test_native_gate_matches_torch(act: str) -> None:
    """Against torch in float64: torch's own float32 GELU-tanh rounds 1 + tanh(z) to 0 below
    g = -5 or so, where the kernel's g / (1 + e^-2z) keeps the tiny value. gpt-oss's clamped
    gate: gate and up past both clamps (+-7)."""
    from graftlm.models.gpt_oss import swiglu_oai

    g = torch.Generator().manual_seed(0)
    gu = torch.randn(3, 7, 2 * 100, generator=g) * 4  # a tail past the 8-wide vectors; large |g|
    gu[0, 0, :6] = torch.tensor([0.0, -30.0, 30.0, 1e-3, -90.0, -5.07])
    gate, up = gu.double().split(100, dim=-1)
    if act == "swiglu_oai":
        want = swiglu_oai(gate, up)
    else:
        want = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    got = ops.gated(gu, act)
    assert got is not None and got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert ops.gated(gu.transpose(0, 1), act) is None  # not contiguous: PyTorch's twin runs


def test_fused_layer_rebinds_when_adapters_or_scales_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native layer caches its LoRA binding: new scales, a new active set, an adapter added
    or removed between steps must each reach it (against the composed block)."""
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

    spec = TinySpec(qtype=Q.Q8_0, embd_type=Q.Q8_0)
    m = graftlm.load(
        str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=32, n_seq=2, cache_type="f32"
    )
    a = m.add_lora(write_tiny_adapter(tmp_path / "a.gguf", spec, seed=1), 0.0)
    model = m.model

    def step(settings: list[dict[int, float]]) -> torch.Tensor:
        with torch.inference_mode():
            for s in range(2):
                model.forward(Batch.single([3, 4, 5, 6], s, 0))
            rows = m.engine.lora_rows(settings)
            return model.forward(Batch(torch.tensor([[7], [8]]), [0, 1], [4, 4], [1, 1], rows))

    def both(settings: list[dict[int, float]]) -> tuple[torch.Tensor, torch.Tensor]:
        fused = step(settings)
        with monkeypatch.context() as mp:
            _compose(mp)
            composed = step(settings)
        return fused, composed

    assert model.fused_layer(0) is not None
    outs = [both([{a: 1.0}, {}]), both([{a: -2.0}, {a: 0.5}])]
    b = m.add_lora(write_tiny_adapter(tmp_path / "b.gguf", spec, seed=2), 0.0)
    outs.append(both([{a: 1.0, b: 1.0}, {b: -1.0}]))
    m.remove_lora(a)
    outs.append(both([{b: 1.0}, {}]))
    for fused, composed in outs:
        torch.testing.assert_close(fused, composed, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(outs[0][0], outs[1][0])  # the settings did change the output


# Prompt attention in bfloat16 pairs (the library's "attn-bf16": AVX-512 BF16): q, k, the weights
# and v rounded to bfloat16, so its twin takes q, k, v rounded alike, and the weights' rounding
# (2^-9 of each) is what the tolerance leaves (at most 2^-9 of the largest |v|, about 0.008 here)
BF16_ATTN = "attn-bf16" in features()
PREFILL_RTOL, PREFILL_ATOL = (1e-2, 8e-3) if BF16_ATTN else (1e-5, 2e-5)


def q8_scores(kv: str, exact: bool) -> bool:
    """Whether a prompt step's scores through this cache come from a q8_0 cache's own codes
    against q8_0 queries (csrc/attn_prompt_q8.c): fast steps where the CPU has AVX-512 VNNI and
    BF16 and ops.prompt_route asks for them."""
    route = ops.prompt_route(3, 64, exact)
    return "attn-i8" in features() and route == "q8" and kv == "q8_0"


def _as_attn(x: torch.Tensor) -> torch.Tensor:
    """x as the prompt attention's products see it."""
    return x.to(torch.bfloat16).float() if BF16_ATTN else x


def _rows(slots: list[int], starts: list[int], t: int) -> RowIndex | None:
    """The index a batch of t-token rows at these slots and starts hands the kernels."""
    tokens = torch.zeros(len(slots), t, dtype=torch.long)
    return Batch(tokens, slots, starts, [t] * len(slots)).index()


def _masked_sdpa(q, kc, vc, slots, starts, scale, window):  # type: ignore[no-untyped-def]
    """The twin of attn_prefill: SDPA with an explicit mask, row by row."""
    b, t, h, d = q.shape
    outs = []
    for r in range(b):
        length = starts[r] + t
        pos = torch.arange(starts[r], length).view(t, 1)
        key = torch.arange(length).view(1, length)
        mask = key <= pos
        if window:
            mask &= pos - key < window
        o = F.scaled_dot_product_attention(
            q[r : r + 1].transpose(1, 2), kc[slots[r] : slots[r] + 1, :, :length],
            vc[slots[r] : slots[r] + 1, :, :length], attn_mask=mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        outs.append(o.transpose(1, 2).flatten(2))
    return torch.cat(outs)


def test_a_decode_step_allocates_nothing_once_its_scratch_has_grown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native decode steps carve their buffers from scratch kept between steps (one per
    FusedStack and FusedLayer). Counted in a build that counts the library's heap allocations:
    a step allocates only to grow its scratch, when it has more rows or adapters than any step
    before it. A step that finds the scratch in use (another thread on the same model) takes a
    block of its own and leaves the scratch alone."""
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model
    from variants import variant_path

    from graftlm.models.base import Transformer
    from graftlm.native import abi
    from graftlm.native import layer_calls as native_layer

    counting = ctypes.CDLL(str(variant_path("-DGL_COUNT_ALLOC")))
    abi.bind(counting)
    lib = library()
    assert lib is not None and lib.gl_alloc_count() == -1  # the library in use counts nothing
    spec = TinySpec(qtype=Q.Q8_0, embd_type=Q.Q8_0, n_layer=3)
    m = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=64, n_seq=3)
    aid = m.add_lora(str(write_tiny_adapter(tmp_path / "a.gguf", spec, seed=1)), 0.0)
    model = m.model
    adapters = m.engine.lora_rows([{aid: 1.0}, {aid: -0.5}, {}])
    monkeypatch.setattr(native_layer, "library", lambda: counting)  # the decode steps' calls
    with torch.inference_mode():
        for s in range(3):
            model.forward(Batch.single([3 + s, 4, 5], s, 0))
        pos = [3]

        def step(n: int, lora: bool = False) -> int:  # n rows (3 with the adapters)
            before = counting.gl_alloc_count()
            tokens = torch.tensor([[7 + s] for s in range(n)])
            model.forward(Batch(tokens, list(range(n)), [pos[0]] * n, [1] * n,
                                adapters if lora else None))  # fmt: skip
            pos[0] += 1
            return int(counting.gl_alloc_count() - before)

        assert [step(1), step(1), step(3), step(3), step(1)] == [1, 0, 1, 0, 0]
        # the adapters' buffers (A . x per row, each row's list): grown once at most
        assert step(3, lora=True) <= 1 and [step(3, lora=True), step(3)] == [0, 0]
        stack = model.fused_stack()
        assert stack is not None and stack.scratch.capacity > 0
        cap = stack.scratch.capacity
        stack.scratch.struct.busy = 1  # as while another thread's step runs on it
        assert step(3) == 1 and stack.scratch.capacity == cap and stack.scratch.struct.busy == 1
        stack.scratch.struct.busy = 0
        assert step(3) == 0
        monkeypatch.setattr(Transformer, "native_layers", lambda self, x, batch: None)
        assert [step(3), step(3)] == [spec.n_layer, 0]  # one call a layer, a scratch each


def _paged(dense: torch.Tensor, dtype: torch.dtype, seed: int = 0) -> KVCache:
    """A paged cache holding dense (slots, Hkv, n_ctx, D) as both K and V... of layer 0, its
    blocks scattered over the pool in a random order (and a spare block between them), so that
    every kernel must follow the block table."""
    n_slots, hkv, n_ctx, d = dense.shape
    cache = KVCache(1, n_slots, hkv, n_ctx, d, d, dtype, n_blocks=2 * n_slots * -(-n_ctx // 16) + 1)
    g = torch.Generator().manual_seed(seed)
    order = (torch.randperm(cache.n_blocks - 1, generator=g) + 1).tolist()
    for s in range(n_slots):
        blocks = order[s * cache.max_blocks : (s + 1) * cache.max_blocks]
        cache.set_table(s, blocks)
        for i, b in enumerate(blocks):
            piece = dense[s, :, i * 16 : (i + 1) * 16]
            cache.key_rows(0)[b, :, : piece.shape[1]] = cache._pack(piece)
            cache.v[0][b, :, : piece.shape[1]] = cache._pack(piece.flip(-1))  # V: K reversed
    return cache


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of this type holds it, as float32."""
    return q8_0_unpack(q8_0_pack(x)) if dtype is torch.uint8 else x.to(dtype).float()


@pytest.mark.parametrize(
    ("t", "h", "hkv", "d", "starts", "window", "kv"),
    [
        (512, 4, 1, 256, [0], 0, "f32"),  # gemma-3's prompt: 64 score rows a task, full blocks
        (100, 9, 3, 64, [0], 0, "f16"),  # SmolLM2's heads; partial query and key blocks
        (37, 4, 1, 256, [300], 0, "bf16"),  # a later chunk: keys before the chunk, 301 of them
        (200, 4, 2, 32, [70], 64, "f16"),  # a window shorter than the chunk
        (5, 3, 3, 16, [0, 9, 2], 4, "f32"),  # three rows at their own starts, slots out of order
        (1, 2, 1, 16, [6], 0, "bf16"),  # one query
        (100, 9, 3, 64, [20], 0, "q8_0"),  # ggml's q8_0 blocks
    ],
)
def test_native_prefill_attention_equals_masked_sdpa(
    t: int, h: int, hkv: int, d: int, starts: list[int], window: int, kv: str
) -> None:
    """Through a paged cache whose blocks are scattered, of each cache type, against SDPA on the
    same values (the cache's, as float32) laid out densely."""
    g = torch.Generator().manual_seed(t)
    n_slots, n_ctx = 4, max(starts) + t + 3
    dense = torch.randn(n_slots, hkv, n_ctx, d, generator=g)
    q = torch.randn(len(starts), t, h, d, generator=g) * 2
    slots = [3, 0, 1][: len(starts)]
    cache = _paged(dense, kv_dtype(kv), seed=t)
    out = ops.attn_prefill(q, cache, 0, _rows(slots, starts, t), d**-0.5, window)
    assert out is not None
    kc, vc = _rounded(dense, kv_dtype(kv)), _rounded(dense.flip(-1), kv_dtype(kv))
    if q8_scores(kv, False):  # exact products of q as q8_0 and the keys as cached
        q_seen, k_seen = _rounded(q, torch.uint8), kc
    else:
        q_seen, k_seen = _as_attn(q), _as_attn(kc)
    ref = _masked_sdpa(q_seen, k_seen, _as_attn(vc), slots, starts, d**-0.5, window)
    torch.testing.assert_close(out, ref, rtol=PREFILL_RTOL, atol=PREFILL_ATOL)
    # an exact step's (scoring's) products are float32 on every CPU
    exact = ops.attn_prefill(q, cache, 0, _rows(slots, starts, t), d**-0.5, window, exact=True)
    ref = _masked_sdpa(q, kc, vc, slots, starts, d**-0.5, window)
    torch.testing.assert_close(exact, ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(
    ("t", "h", "hkv", "d", "starts", "window", "cap"),
    [
        (100, 8, 4, 32, [0], 0, 5.0),  # the tiny gemma-2's cap: most scores past its knee
        (37, 4, 1, 64, [70], 16, 50.0),  # gemma-2's own cap; a later chunk in a window
        (5, 3, 3, 16, [0, 9, 2], 4, 0.5),  # three rows at their own starts
    ],
)
def test_native_prefill_attention_soft_caps_the_scores(
    t: int, h: int, hkv: int, d: int, starts: list[int], window: int, cap: float
) -> None:
    """gemma-2's scores cap * tanh(scale q.k / cap), against the same attention written out."""
    g = torch.Generator().manual_seed(t)
    n_ctx = max(starts) + t + 3
    dense = torch.randn(4, hkv, n_ctx, d, generator=g)
    q = torch.randn(len(starts), t, h, d, generator=g) * 4  # scores well past a cap of 5
    slots = [3, 0, 1][: len(starts)]
    cache = _paged(dense, torch.float32, seed=t)
    out = ops.attn_prefill(q, cache, 0, _rows(slots, starts, t), d**-0.5, window, cap)
    assert out is not None
    plain = ops.attn_prefill(q, cache, 0, _rows(slots, starts, t), d**-0.5, window)
    assert plain is not None and not torch.allclose(out, plain, atol=1e-2)  # the cap matters
    for r, (s, p0) in enumerate(zip(slots, starts, strict=True)):
        pos = torch.arange(p0, p0 + t).view(t, 1)
        key = torch.arange(p0 + t).view(1, -1)
        mask = (key <= pos) & ((pos - key < window) if window else True)
        keys = _as_attn(dense[s, :, : p0 + t]).repeat_interleave(h // hkv, 0)  # (h, L, d)
        values = _as_attn(dense[s, :, : p0 + t].flip(-1)).repeat_interleave(h // hkv, 0)
        qr = _as_attn(q[r]).transpose(0, 1)
        scores = torch.tanh(qr @ keys.transpose(1, 2) * d**-0.5 / cap) * cap
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        want = (p @ values).transpose(0, 1).flatten(1)  # (t, h * d)
        torch.testing.assert_close(out[r], want, rtol=PREFILL_RTOL, atol=PREFILL_ATOL)


@pytest.mark.parametrize("kv", ["f32", "f16", "bf16", "q8_0"])
def test_native_prompt_cache_writes_equal_kvcache_write(kv: str) -> None:
    """A prompt step's k and v through gl_kv_write land as KVCache.write puts them, bit for bit:
    three rows at their own slots and starts through scattered blocks, v a column slice of a
    stacked product (rows nqkv apart), a padding row running past the context (KVCache.write
    clamps it onto the last position; the native write leaves that position alone)."""
    g = torch.Generator().manual_seed(3)
    hkv, d, n_ctx, t = 2, 64, 40, 12
    twin, ours = (_paged(torch.randn(4, hkv, n_ctx, d, generator=g), kv_dtype(kv)) for _ in "ab")
    ours.k[0].copy_(twin.k[0])
    ours.v[0].copy_(twin.v[0])
    ours.tables.copy_(twin.tables)
    stacked = torch.randn(3, t, 3 * hkv * d, generator=g)  # q | k | v, one row of each
    k = torch.randn(3, t, hkv, d, generator=g)
    v = stacked[..., 2 * hkv * d :].view(3, t, hkv, d)
    assert not v.is_contiguous()
    batch = Batch(torch.zeros(3, t, dtype=torch.long), [2, 0, 3], [0, 17, 5], [t, t, t])
    rows = batch.index()
    assert rows is not None and ops.kv_write(ours, 0, rows, k, v)
    twin.write(0, batch, k, v)
    assert torch.equal(ours.k[0], twin.k[0]) and torch.equal(ours.v[0], twin.v[0])
    end = ours.max_blocks * 16  # the positions the table holds
    late = Batch(torch.zeros(1, t, dtype=torch.long), [1], [end - 4], [4])  # 8 past the end
    rows = late.index()
    assert rows is not None and ops.kv_write(ours, 0, rows, k[:1], v[:1])
    twin.write(0, late, k[:1], v[:1])
    last = int(twin.tables[1, -1])  # the block of the table's last position, 15 in it
    for pool_ours, pool_twin in ((ours.key_rows(0), twin.key_rows(0)), (ours.v[0], twin.v[0])):
        assert not torch.equal(pool_ours, pool_twin)  # the twin's clamped writes landed on 15
        real = pool_ours.clone()
        real[last, :, 15] = pool_twin[last, :, 15]
        assert torch.equal(real, pool_twin)  # every other position alike
    assert not ops.kv_write(ours, 0, rows, k[:1].double(), v[:1])  # float32 only: the twin runs


@pytest.mark.parametrize("kv", ["f32", "f16", "bf16", "q8_0"])
def test_native_decode_attention_reads_and_writes_the_pages(kv: str) -> None:
    """A decode step of three rows through scattered blocks: the new k and v land in the pool
    block the table names (rotated k, rounded as torch rounds), and the output equals SDPA over
    the same values."""
    g = torch.Generator().manual_seed(1)
    h, hkv, d, n_ctx = 4, 2, 64, 70
    dense = torch.randn(3, hkv, n_ctx, d, generator=g)
    cache = _paged(dense, kv_dtype(kv))
    pos = [69, 16, 5]  # the last position, a block's first, inside the first block
    slots = [1, 2, 0]
    q = torch.randn(3, 1, h * d, generator=g)
    k = torch.randn(3, 1, hkv * d, generator=g)
    v = torch.randn(3, 1, hkv * d, generator=g)
    zero = torch.zeros(n_ctx, d // 2)
    one = torch.ones(n_ctx, d // 2)  # cos 1, sin 0: RoPE leaves the values as they are
    out = ops.attn_decode(q, k, v, cache, 0, torch.tensor(slots), torch.tensor(pos), one, zero,
                          False, d**-0.5, 0)  # fmt: skip
    assert out is not None
    for r, (s, p) in enumerate(zip(slots, pos, strict=True)):
        b = int(cache.tables[s, p // 16])
        assert torch.equal(cache.key_rows(0)[b, :, p % 16], cache._pack(k[r, 0].view(hkv, d)))
        assert torch.equal(cache.v[0][b, :, p % 16], cache._pack(v[r, 0].view(hkv, d)))
        dt = cache.dtype
        keys = torch.cat([_rounded(dense[s, :, :p], dt),
                          _rounded(k[r, 0].view(hkv, 1, d), dt)], 1)  # fmt: skip
        values = torch.cat([_rounded(dense[s, :, :p].flip(-1), dt),
                            _rounded(v[r, 0].view(hkv, 1, d), dt)], 1)  # fmt: skip
        qr = q[r].view(h, d)
        if kv == "q8_0" and "vnni" in features() and "avx512f" in features():
            qr = q8_0_unpack(q8_0_pack(qr))  # q8_0 keys meet the query in int8 codes, as ggml's
        pairs = kv == "bf16" and "attn-bf16" in features()
        if pairs:  # a bfloat16 cache in bfloat16 pairs: the query rounded, and each weight
            qr = qr.to(torch.bfloat16).float()
        want, spread = (F.scaled_dot_product_attention(
            qr.view(1, h, 1, d), keys.unsqueeze(0), x.unsqueeze(0), scale=d**-0.5,
            enable_gqa=True,
        ).flatten() for x in (values, values.abs()))  # fmt: skip
        if pairs:  # within the weights' rounding (test_decode_attention's bound)
            assert bool(((out[r, 0] - want).abs() <= 2.0**-8 * spread + 3e-5).all())
        elif kv == "q8_0" and "vnni" in features() and "avx512f" in features():
            # the values' weights in fixed point: test_decode_attention's bound
            v_h = values.repeat_interleave(h // hkv, 0)
            flat = v_h.abs().amax(-1).amax(-1, keepdim=True).expand(h, d).flatten()
            bound = 1.01 * 2.0**-11 * flat + 1e-5 * want.abs() + 2e-5
            assert bool(((out[r, 0] - want).abs() <= bound).all())
        else:
            torch.testing.assert_close(out[r, 0], want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3"])
def test_model_prompts_take_the_native_attention(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt chunks through the model serve every layer's attention natively (a spy counts it):
    a first chunk, a later chunk past gemma-3's window of 8, and two padded rows prefilled
    together; logits equal the PyTorch path's."""
    path: Path = request.getfixturevalue(fixture)
    model = graftlm.load(str(path), ctx_size=64, n_seq=2, cache_type="f32").model
    served: list[bool] = []
    real = ops.attn_prefill

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        served.append(out is not None)
        return out

    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [
                model.forward(Batch.single(list(range(3, 14)), 0, 0), all_logits=True),
                model.forward(Batch.single(list(range(20, 29)), 0, 11), all_logits=True),
                model.forward(
                    Batch(
                        torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 0, 0]]), [1, 0], [0, 20], [5, 3]
                    ),
                ),
            ]

    monkeypatch.setattr(ops, "attn_prefill", spy)
    got = run()
    assert served and all(served) and len(served) == 3 * model.cfg.n_layer
    with disabled():
        want = run()
    assert not any(served[3 * model.cfg.n_layer :])  # the twin: refused, SDPA ran
    for g, w in zip(got, want, strict=True):  # (short contexts: float32 products everywhere)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_prefill_attention_refuses_what_it_cannot_serve() -> None:
    cache = _paged(torch.zeros(2, 1, 16, 32), torch.float32)
    q = torch.zeros(1, 4, 2, 32)
    assert ops.attn_prefill(q, cache, 0, _rows([0], [12], 4), 1.0, 0) is not None  # 12..15: fits
    assert ops.attn_prefill(q, cache, 0, _rows([0], [13], 4), 1.0, 0) is None  # 16: past it
    assert ops.attn_prefill(q, cache, 0, _rows([2], [0], 4), 1.0, 0) is None  # no slot 2
    assert _rows([-1], [0], 4) is None  # a negative slot never becomes an index
    assert ops.attn_prefill(q.double(), cache, 0, _rows([0], [0], 4), 1.0, 0) is None
    odd = _paged(torch.zeros(2, 1, 16, 24), torch.float32)  # head size not a multiple of 16
    assert ops.attn_prefill(torch.zeros(1, 4, 2, 24), odd, 0, _rows([0], [0], 4), 1.0, 0) is None


def test_scale_board_keeps_its_address_until_it_must_grow() -> None:
    """The decode layers' scale table: the batch's scales copied in once a step (zeros past them
    and for a step without adapters), its address kept until a row or an adapter id passes it:
    the kernels read a scale for every row of every attached adapter, at scale 0 too."""
    from graftlm.lora.site import Generation
    from graftlm.models.fused import ScaleBoard
    from graftlm.step.batch import LoraRows

    adapters = Generation()
    board = ScaleBoard(adapters)
    board.fill(None, 2)  # a step of two rows on no adapter: two rows of zeros
    assert board.buf.shape[0] >= 2 and not board.buf.any()
    at, key = board.buf.data_ptr(), board.key
    rows = LoraRows(torch.tensor([[0.0, 0.5], [0.0, -1.0]]), (1,))
    board.fill(rows, 2)
    assert board.buf.data_ptr() == at and board.key == key
    assert board.buf[:, :3].tolist() == [[0.0, 0.5, 0.0], [0.0, -1.0, 0.0]]
    board.fill(LoraRows(torch.tensor([[2.0]]), (0,)), 1)  # fewer rows and adapters: zeros past
    assert board.buf[:, :2].tolist() == [[2.0, 0.0], [0.0, 0.0]]
    board.fill(None, 2)
    assert not board.buf.any() and board.buf.data_ptr() == at
    board.fill(None, 5)  # more rows than it had, none on an adapter: it grows to zeros
    assert board.buf.shape[0] >= 5 and not board.buf.any() and board.key != key
    key = board.key
    wide = torch.zeros(3, 20)
    wide[2, 19] = 4.0
    board.fill(LoraRows(wide, (19,)), 3)  # adapter 19: it grows, the layers rebind
    assert board.key != key and board.buf.shape[1] >= 20 and board.buf[2, 19] == 4.0
    adapters.bump()
    assert board.key[0] == adapters.value  # an adapter change rebinds too


def test_adapters_at_scale_zero_leave_a_batch_as_the_base(tmp_path: Path) -> None:
    """Adapters attached at scale 0 and a decode step of several rows on none: the native layers
    read every row's scale of every attached adapter, all 0, and the step is the base's, bit for
    bit."""
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

    spec = TinySpec(qtype=Q.Q8_0, embd_type=Q.Q8_0, n_layer=2)
    path = str(write_tiny_model(tmp_path / "m.gguf", spec))
    plain, m = (graftlm.load(path, ctx_size=64, n_seq=6) for _ in range(2))
    for i in range(1, 4):
        m.add_lora(str(write_tiny_adapter(tmp_path / f"{i}.gguf", spec, seed=i)), 0.0)
    outs = []
    with torch.inference_mode():
        for model in (plain.model, m.model):
            for s in range(6):
                model.forward(Batch.single([3 + s, 4, 5], s, 0))
            tokens = torch.tensor([[7 + r] for r in range(6)])
            outs.append(model.forward(Batch(tokens, list(range(6)), [3] * 6, [1] * 6, None)))
    assert m.model.fused_stack() is not None
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [32, 16])
def test_native_rope_equals_the_pytorch_rotation(neox: bool, rot: int) -> None:
    """Prompt RoPE natively: two rows at their own starts, heads split out of a stacked
    projection's output (a strided view), full or partial rotation, either pair order."""
    from graftlm.models.primitives import Rope

    rope = Rope(rot, 10000.0, 64, neox)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 5, 4 * 32 + 2 * 32, generator=g)
    q = qkv[..., : 4 * 32].view(2, 5, 4, 32)  # (B, T, H, D), rows nqkv apart
    positions = torch.tensor([[0, 1, 2, 3, 4], [40, 41, 42, 43, 44]])
    got = ops.rope(q, positions, rope.cos, rope.sin, neox)
    assert got is not None and got.is_contiguous()
    want = rope.rotate(q, positions)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope(q, positions), got, rtol=0, atol=0)  # the model's way in
    # refused, not read out of range: a position past the tables
    assert ops.rope(q, positions + 20, rope.cos, rope.sin, neox) is None


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q5_0])
@pytest.mark.parametrize("shape", [(2, 7), (4, 1), (1, 1)])
def test_projection_with_adapters_in_one_native_pass(
    qtype: Q, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A projection with adapters runs base product and delta in one native pass (gl_proj): the
    same numbers as the product followed by the delta (gl_lora), for prompt rows (T tokens a
    scale row), batched rows and one row; rows with different adapters and scales, one with
    none."""
    from graftlm.lora.site import LoraSite
    from graftlm.models.seam import Projection
    from graftlm.step.batch import LoraRows

    n_out, n_in = 96, 64
    raw = random_blocks(qtype, (n_out, n_in), np.random.default_rng(4))
    w = QWeight.from_gguf(raw, qtype, (n_out, n_in))
    p = Projection("blk.0.ffn_gate_up", w)
    p.lora = LoraSite(n_in, n_out, compact=True)
    g = torch.Generator().manual_seed(5)
    a1, b1 = torch.randn(4, n_in, generator=g), torch.randn(n_out, 4, generator=g)
    a2, b2 = torch.randn(8, n_in, generator=g), torch.randn(n_out, 8, generator=g)
    b2[:40] = 0  # an adapter on part of a stacked projection
    p.lora.put(1, a1, b1)
    p.lora.put(2, a2, b2)
    bsz, t = shape
    table = [[0.0, 1.0, 0.5], [0.0, 0.0, -1.0], [0.0, 0.7, 0.0], [0.0, 0.0, 0.0]][:bsz]
    rows = LoraRows(torch.tensor(table), (1, 2))
    x = torch.randn(bsz, t, n_in, generator=g)
    batch = Batch(
        torch.zeros(bsz, t, dtype=torch.long), list(range(bsz)), [0] * bsz, [t] * bsz, rows
    )
    passes = []
    one_pass = seam._one_pass
    monkeypatch.setattr(seam, "_one_pass", lambda *a: passes.append(one_pass(*a)) or passes[-1])
    fused = p(x, batch)
    assert passes and passes[0] is not None
    monkeypatch.setattr(seam, "_one_pass", lambda *a: None)
    composed = p(x, batch)  # the product, then the delta
    torch.testing.assert_close(fused, composed, rtol=1e-6, atol=1e-5)
    base = w.matmul(x)
    assert not torch.allclose(fused[0], base[0], atol=1e-3)  # the adapters did something
    # spelled out: each row's own adapters at its own scales (int8 x, Q8_0 A, bfloat16 B)
    want = base.clone()
    for slot, (a, b) in ((1, (a1, b1)), (2, (a2, b2))):
        aq = torch.from_numpy(quants.dequantize(quants.quantize(a.numpy(), Q.Q8_0), Q.Q8_0))
        scale = torch.tensor(table)[:, slot].view(bsz, 1, 1)
        want += scale * (_q8_x(x) @ aq.T) @ b.bfloat16().float().T
    torch.testing.assert_close(fused, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    if bsz == 4:
        torch.testing.assert_close(fused[3], base[3], rtol=0, atol=0)  # a row without adapters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_parts_layout_and_its_inverse(dtype: torch.dtype) -> None:
    """B's packed layout: runs of columns reaching the same 32-output blocks are one part, stored
    block by block with each block's columns in turn, zero past n_out; in bfloat16 each 16
    outputs as the pairs (o + u, o + 8 + u). Zero columns are in no part; unpacking gives B
    back exactly."""
    from graftlm.lora import packed

    b = torch.randn(200, 6).to(dtype).float()  # 200 outputs: 7 blocks, the last one partly
    b[64:, 0:2] = 0  # columns 0, 1: outputs 0..63 (blocks 0, 1)
    b[:70, 2:4] = 0  # columns 2, 3: outputs 70..199 (blocks 2..6)
    b[:, 4] = 0  # a zero column
    slot = packed.PackedSlot(torch.randn(6, 64), b, compact=dtype == torch.bfloat16)
    assert [(p.c0, p.r, p.lo, p.hi) for p in slot.parts] == [
        (0, 2, 0, 2),
        (2, 2, 2, 7),
        (5, 1, 0, 7),
    ]
    torch.testing.assert_close(slot.b_dense(), b, rtol=0, atol=0)
    part = slot.parts[1]
    assert part.data.shape == (5, 2, 32) and part.data.dtype == dtype
    block = torch.zeros(2, 32)  # block 6 of columns 2, 3: outputs 192..199, then padding
    block[:, :8] = b[192:, 2:4].T
    if dtype == torch.bfloat16:
        block = block.view(2, 2, 2, 8).transpose(2, 3).reshape(2, 32)
    torch.testing.assert_close(part.data[4].float(), block, rtol=0, atol=0)


def _same_three_ways(
    run: Callable[[], list[torch.Tensor]], fused: list[torch.Tensor], mp: pytest.MonkeyPatch
) -> None:
    """run()'s steps as `fused` computed them (every layer in one native call) again with one
    native call a layer (the same bits), then in the composed blocks (within 1e-4)."""
    from graftlm.models.base import Transformer

    mp.setattr(Transformer, "native_layers", lambda self, x, batch: None)
    one_by_one = run()
    _compose(mp)
    composed = run()
    for a, b, c in zip(fused, one_by_one, composed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2"])
def test_fused_layer_serves_the_converted_families(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's own conversions (Q8_0) of six families (qwen2 with its Q/K/V biases, gemma2
    with soft-capped attention and a window of 16), with their converted adapter: every
    decode step runs in one native call, bit-identical to one call a layer and within 1e-4 of
    the composed blocks, rows with the adapter and without."""
    from shared_data import TINY
    from spies import stack_calls

    d = TINY / family
    m = graftlm.load(d / "model-q8_0.gguf", ctx_size=64, n_seq=2, cache_type="f32")
    aid = m.add_lora(d / "lora-f32.gguf", 0.0)
    model = m.model
    rows = m.engine.lora_rows([{aid: 1.0}, {}])
    served = stack_calls(monkeypatch)

    def run() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for s, n in enumerate((20, 9)):  # row 0 past gemma2's window of 16
                model.forward(Batch.single([(7 * s + j) % 50 + 3 for j in range(n)], s, 0))
            for step in range(3):
                tokens = torch.tensor([[20 + step], [30 + step]])
                out.append(
                    model.forward(Batch(tokens, [0, 1], [20 + step, 9 + step], [1, 1], rows))
                )
        return out

    fused = run()
    assert served.count(True) == 3 and served[-3:] == [True] * 3  # the decode steps
    _same_three_ways(run, fused, monkeypatch)


# family -> (architecture, q rows, experts) of the tiny routed models
ROUTED = {"mixtral": ("llama", 128, 8), "qwen3moe": ("qwen3moe", 4 * 48, 16),
          "gpt-oss": ("gpt-oss", 4 * 48, 16)}  # fmt: skip


@pytest.mark.parametrize("family", list(ROUTED))
@pytest.mark.parametrize("n_rows", [2, 1])
def test_fused_layer_serves_the_routed_experts(
    n_rows: int, family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's Q8_0 conversions of the tiny Mixtral (8 experts, top 2) and Qwen3-MoE (16
    experts, top 4, QK-norm), F32 routers: every decode step in one native call with the routed
    FFN in C, bit-identical to one call a layer and within 1e-4 of the composed blocks (moe.py),
    a row with an adapter on the attention and on the router, a row without."""
    from made_families import tiny_dir
    from spies import stack_calls
    from tiny_models import write_tiny_adapter

    d = tiny_dir(family)
    if d is None:
        pytest.skip(f"the tiny {family} is not available here")
    arch, nq, n_expert = ROUTED[family]
    m = graftlm.load(d / "model-q8_0.gguf", ctx_size=64, n_seq=2, cache_type="f32")
    targets = {f"blk.{i}.{n}": shape for i in range(2)
               for n, shape in (("attn_q", (128, nq)), ("attn_output", (nq, 128)),
                                ("ffn_gate_inp", (128, n_expert)))}  # fmt: skip
    aid = m.add_lora(write_tiny_adapter(tmp_path / "a.gguf", targets=targets, arch=arch), 0.0)
    model = m.model
    assert model.fused_stack() is not None
    rows = m.engine.lora_rows([{aid: 1.0}, {}][:n_rows])
    served = stack_calls(monkeypatch)
    lens = (12, 5)[:n_rows]

    def run() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for s, n in enumerate(lens):
                model.forward(Batch.single([(7 * s + j) % 50 + 3 for j in range(n)], s, 0))
            # decode tokens clear of a routing near-tie: from token 20, a step's 4th and 5th
            # experts of Qwen3-MoE lay within the two paths' rounding of each other, so
            # 1e-6 moves in the attention's softmax flipped which expert the composed blocks
            # chose (the fused call agreed with itself bit for bit either way)
            for step in range(3):
                tokens = torch.tensor([[21 + step + 9 * s] for s in range(n_rows)])
                batch = Batch(tokens, list(range(n_rows)), [n + step for n in lens],
                              [1] * n_rows, rows)  # fmt: skip
                out.append(model.forward(batch))
        return out

    fused = run()
    assert served[-3:] == [True] * 3  # the decode steps
    _same_three_ways(run, fused, monkeypatch)
    rows = None  # the adapter off: row 0 changes, a row without it does not
    plain = run()
    assert not torch.allclose(plain[-1][0], fused[-1][0], rtol=1e-3, atol=1e-3)
    if n_rows == 2:
        torch.testing.assert_close(plain[-1][1], fused[-1][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", list(ROUTED))
def test_routed_experts_by_whole_jobs_are_the_shared_steps(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row decoding on two threads: the routed FFN's threads each take whole experts (their
    jobs split evenly: gl_set_moe_jobs(1), the default) or share every step with barriers
    between (0, its twin): the same bits (gpt-oss: the experts' biases and gating 1 too)."""
    from made_families import tiny_dir
    from spies import stack_calls

    d = tiny_dir(family)
    if d is None:
        pytest.skip(f"the tiny {family} is not available here")
    m = graftlm.load(d / "model-q8_0.gguf", ctx_size=64, n_seq=1, cache_type="f32")
    model, lib = m.model, library()
    if model.fused_stack() is None or lib is None:
        pytest.skip("no native decode layer here")

    def run() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            model.forward(Batch.single([(7 * j) % 50 + 3 for j in range(12)], 0, 0))
            for step in range(3):
                out.append(model.forward(Batch(torch.tensor([[21 + step]]), [0], [12 + step], [1])))
        return out

    served = stack_calls(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = lib.gl_set_moe_jobs(1)
        jobs = run()
        lib.gl_set_moe_jobs(0)
        shared = run()
    finally:
        lib.gl_set_moe_jobs(before)
        torch.set_num_threads(threads)
    assert served.count(True) == 6, served  # both ways' decode steps ran in the native layer
    for a, b in zip(jobs, shared, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_native_expert_limit_is_the_c_one() -> None:
    from graftlm.models.fused import MAX_EXPERTS_USED
    from graftlm.native.build import CSRC

    header = (CSRC / "graftlm.h").read_text()
    assert f"#define GL_MAX_EXPERTS_USED {MAX_EXPERTS_USED} " in header


def test_the_q8_0_cache_stores_what_ggml_quantizes() -> None:
    """The q8_0 cache's bytes are ggml's block_q8_0 (the gguf package quantizes the same values
    the same way), and unpacking gives d * q."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=g) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    packed = q8_0_pack(x)
    assert packed.dtype is torch.uint8 and packed.shape == (5, 96 // 32 * 34)
    want = quants.quantize(x.numpy(), Q.Q8_0)
    assert np.array_equal(packed.numpy(), want.view(np.uint8).reshape(5, -1))
    d = torch.from_numpy(quants.dequantize(want, Q.Q8_0))
    torch.testing.assert_close(q8_0_unpack(packed), d.reshape(5, 96), rtol=0, atol=0)


@pytest.mark.skipif(not BF16_ATTN, reason="this CPU's prompt attention is float32: tested above")
def test_the_float32_prompt_attention_equals_its_twin_too() -> None:
    """Where this CPU's prompt attention takes bfloat16 pairs, its float32 kernels (the ymm
    variant's, every AVX2 CPU's) still run here: the prompt attention's tests again in that
    variant, in a subprocess, with float32's tolerance."""
    env = {**os.environ, "GRAFTLM_NATIVE_ISA": "ymm", "GRAFTLM_AMX_ROWS": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "prefill_attention_equals or soft_caps_the_scores or prompts_take_the_native"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"\b12 passed\b", done.stdout), done.stdout[-1000:]


def test_a_prompt_chunk_at_depth_takes_bfloat16_pairs_where_the_cpu_has_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fast prompt chunk whose last query sees ops.BF16_ATTN_MIN_KEYS positions or more asks
    for bfloat16 pairs (exact=False), one that sees fewer, or an exact step, for float32; the
    logits of a chunk at depth stay within bfloat16's rounding of the exact step's (equal where
    the CPU has no BF16: both float32)."""
    from tiny_models import TinySpec, write_tiny_model

    spec = TinySpec(n_ctx=ops.BF16_ATTN_MIN_KEYS + 128)
    model = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=spec.n_ctx,
                         cache_type="f32").model  # fmt: skip
    asked: list[tuple[int, bool]] = []  # (positions the chunk's last query sees, exact)
    real = ops.attn_prefill

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        asked.append((args[3].max_start + args[0].shape[1], bool(args[7])))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "attn_prefill", spy)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (ops.BF16_ATTN_MIN_KEYS + 64,), generator=g).tolist()
    depth = ops.BF16_ATTN_MIN_KEYS
    with torch.inference_mode():
        for start in range(0, depth, 512):
            model.forward(Batch.single(ids[start : start + 512], 0, start))
        n = len(asked)
        fast = model.forward(Batch.single(ids[depth:], 0, depth), all_logits=True)
        exact = model.forward(Batch.single(ids[depth:], 0, depth, exact=True), all_logits=True)
    layers = model.cfg.n_layer
    assert [e for _, e in asked[:n]] == [seen < depth for seen, _ in asked[:n]]
    assert {seen for seen, e in asked[:n] if e} == {512, 1024, 1536}  # float32 below it
    assert asked[n:] == [(depth + 64, False)] * layers + [(depth + 64, True)] * layers
    err = float((fast - exact).abs().max() / exact.abs().max())
    assert err < (2e-2 if BF16_ATTN else 1e-5), err
