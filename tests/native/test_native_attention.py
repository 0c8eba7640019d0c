"""The native attention against its twins: decode and prompt attention against torch's (masked
SDPA), the paged cache's writes and reads, soft-capping, RoPE, the q8_0 cache's quantization and
the bfloat16 pairs at depth."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attention_twins import (
    BF16_ATTN,
    PREFILL_ATOL,
    PREFILL_RTOL,
    as_attn,
    masked_sdpa,
    paged_cache,
    q8_scores,
    rounded,
    row_index,
)
from gguf import GGMLQuantizationType as Q
from gguf import quants

import graftlm
from graftlm.native import (
    disabled,
    features,
    library,
    ops,
    unavailable_reason,
)
from graftlm.step.batch import Batch
from graftlm.step.kv_cache import kv_dtype, q8_0_pack, q8_0_unpack

pytestmark = pytest.mark.skipif(library() is None, reason=f"native: {unavailable_reason()}")


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
    cache = paged_cache(dense, kv_dtype(kv), seed=t)
    out = ops.attn_prefill(q, cache, 0, row_index(slots, starts, t), d**-0.5, window)
    assert out is not None
    kc, vc = rounded(dense, kv_dtype(kv)), rounded(dense.flip(-1), kv_dtype(kv))
    if q8_scores(kv, False):  # exact products of q as q8_0 and the keys as cached
        q_seen, k_seen = rounded(q, torch.uint8), kc
    else:
        q_seen, k_seen = as_attn(q), as_attn(kc)
    ref = masked_sdpa(q_seen, k_seen, as_attn(vc), slots, starts, d**-0.5, window)
    torch.testing.assert_close(out, ref, rtol=PREFILL_RTOL, atol=PREFILL_ATOL)
    # an exact step's (scoring's) products are float32 on every CPU
    exact = ops.attn_prefill(q, cache, 0, row_index(slots, starts, t), d**-0.5, window, exact=True)
    ref = masked_sdpa(q, kc, vc, slots, starts, d**-0.5, window)
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
    cache = paged_cache(dense, torch.float32, seed=t)
    out = ops.attn_prefill(q, cache, 0, row_index(slots, starts, t), d**-0.5, window, cap)
    assert out is not None
    plain = ops.attn_prefill(q, cache, 0, row_index(slots, starts, t), d**-0.5, window)
    assert plain is not None and not torch.allclose(out, plain, atol=1e-2)  # the cap matters
    for r, (s, p0) in enumerate(zip(slots, starts, strict=True)):
        pos = torch.arange(p0, p0 + t).view(t, 1)
        key = torch.arange(p0 + t).view(1, -1)
        mask = (key <= pos) & ((pos - key < window) if window else True)
        keys = as_attn(dense[s, :, : p0 + t]).repeat_interleave(h // hkv, 0)  # (h, L, d)
        values = as_attn(dense[s, :, : p0 + t].flip(-1)).repeat_interleave(h // hkv, 0)
        qr = as_attn(q[r]).transpose(0, 1)
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
    twin, ours = (
        paged_cache(torch.randn(4, hkv, n_ctx, d, generator=g), kv_dtype(kv)) for _ in "ab"
    )
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
    cache = paged_cache(dense, kv_dtype(kv))
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
        keys = torch.cat([rounded(dense[s, :, :p], dt),
                          rounded(k[r, 0].view(hkv, 1, d), dt)], 1)  # fmt: skip
        values = torch.cat([rounded(dense[s, :, :p].flip(-1), dt),
                            rounded(v[r, 0].view(hkv, 1, d), dt)], 1)  # fmt: skip
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
    cache = paged_cache(torch.zeros(2, 1, 16, 32), torch.float32)
    q = torch.zeros(1, 4, 2, 32)
    assert (
        ops.attn_prefill(q, cache, 0, row_index([0], [12], 4), 1.0, 0) is not None
    )  # 12..15: fits
    assert ops.attn_prefill(q, cache, 0, row_index([0], [13], 4), 1.0, 0) is None  # 16: past it
    assert ops.attn_prefill(q, cache, 0, row_index([2], [0], 4), 1.0, 0) is None  # no slot 2
    assert row_index([-1], [0], 4) is None  # a negative slot never becomes an index
    assert ops.attn_prefill(q.double(), cache, 0, row_index([0], [0], 4), 1.0, 0) is None
    odd = paged_cache(torch.zeros(2, 1, 16, 24), torch.float32)  # head size not a multiple of 16
    assert (
        ops.attn_prefill(torch.zeros(1, 4, 2, 24), odd, 0, row_index([0], [0], 4), 1.0, 0) is None
    )


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
