"""The native kernels against their twins: llama.cpp's int8-activation arithmetic written out in
numpy, torch's RMS norm, the library's build and fallbacks, and a decode step's scratch. The
layers: test_native_layer.py; attention: test_native_attention.py."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from synth_tensors import random_blocks

import graftlm
from graftlm.native import (
    build,
    disabled,
    library,
    ops,
    release_threads,
    unavailable_reason,
)
from graftlm.quant import QWeight
from graftlm.step.batch import Batch

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


def _stand_in_cc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """A stand-in compiler that logs its calls and copies the library this session loaded, over
    a copy of csrc/ (build.CSRC) and a cache under tmp_path: (it, its log, that library)."""
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
    return stand_in, calls, loaded


def test_build_is_cached_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build lands whole in $GRAFTLM_CACHE/native (no .partial left), is not made again while
    the sources, the flags and the compiler stay the same, and is made anew when a source or a
    flag changes. The compiler is a stand-in that logs its calls and copies the library this
    session loaded (each real compile is 36 s of CPU here): a real one into a fresh cache, every
    run, is test_slow_paths_are_announced's (tests/commands/test_llama_flags.py), the same
    `_build`, as is the session's first build wherever the sources changed."""
    stand_in, calls, loaded = _stand_in_cc(tmp_path, monkeypatch)
    csrc = build.CSRC
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


def test_the_build_cache_is_pruned_after_a_compile_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One library a source version and variant piled up in the cache, never removed (a dev
    machine's: hundreds, 240 MB). After a compile, libraries not used for PRUNE_DAYS days and
    .so.partial files of compiles killed over a day ago are removed; recent ones, one being
    written now, and other files stay. A cache hit prunes nothing and refreshes its own file's
    mtime when it is a day old, so a library in use is never taken; one pruned by another
    process between the look and the dlopen is built anew (`_open`)."""
    stand_in, calls, _ = _stand_in_cc(tmp_path, monkeypatch)
    day = build.DAY_S
    used = build._build(str(stand_in))
    cache = used.parent
    ages = {  # name -> days since its mtime
        "graftlm-0123456789abcdef.so": build.PRUNE_DAYS + 1,  # (gone after a compile)
        "graftlm-fedcba9876543210.so": build.PRUNE_DAYS - 1,
        "tmpkilled.so.partial": build.PARTIAL_DAYS + 0.5,  # (gone after a compile)
        "tmpwriting.so.partial": 0.01,
        "graftlm-0123456789abcdef.so.asm.txt": 400,  # (not the cache's: kept)
    }
    now = time.time()
    for name, days in ages.items():
        (cache / name).write_bytes(b"x")
        os.utime(cache / name, (now - days * day, now - days * day))
    os.utime(used, (now - 40 * day, now - 40 * day))
    assert build._build(str(stand_in)) == used  # a hit: nothing pruned, its mtime refreshed
    assert sorted(p.name for p in cache.iterdir()) == sorted([*ages, used.name])
    assert time.time() - used.stat().st_mtime < 60
    fresh = used.stat().st_mtime_ns
    assert build._build(str(stand_in)) == used and used.stat().st_mtime_ns == fresh  # (a day)
    other = build._build(str(stand_in), ("-DGL_COUNT_ALLOC",))  # a compile: pruned
    kept = {"graftlm-fedcba9876543210.so", "tmpwriting.so.partial"}
    kept |= {"graftlm-0123456789abcdef.so.asm.txt", used.name, other.name}
    assert {p.name for p in cache.iterdir()} == kept
    assert len(calls.read_text().splitlines()) == 2
    # pruned by another process after the look, before the dlopen: built again and loaded
    real = build._build

    def pruned_at_once(cc: str, extra: tuple[str, ...] = ()) -> Path:
        path = real(cc, extra)
        if len(calls.read_text().splitlines()) == 2:
            path.unlink()
        return path

    monkeypatch.setattr(build, "_build", pruned_at_once)
    assert build._open(str(stand_in)).gl_features() >= 0
    assert len(calls.read_text().splitlines()) == 3 and used.exists()


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


def test_a_decode_step_allocates_nothing_once_its_scratch_has_grown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native decode steps carve their buffers from scratch kept between steps (one per
    FusedStack and FusedLayer). Counted in a build that counts the library's heap allocations:
    a step allocates only to grow its scratch, when it has more rows or adapters than any step
    before it. A step that finds the scratch in use (another thread on the same model) takes a
    block of its own and leaves the scratch alone."""
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model
    from variants import variant_open

    from graftlm.models.base import Transformer
    from graftlm.native import abi
    from graftlm.native import layer_calls as native_layer

    counting = variant_open("-DGL_COUNT_ALLOC")
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
