"""The native layer on every family: a projection with adapters in one native pass, packed parts
and their inverse, the converted families and the routed experts (Mixtral, Qwen3-MoE, gpt-oss)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from layer_twins import compose, q8_x
from synth_tensors import random_blocks

import graftlm
from graftlm.models import seam
from graftlm.native import (
    library,
    unavailable_reason,
)
from graftlm.quant import QWeight
from graftlm.step.batch import Batch

pytestmark = pytest.mark.skipif(library() is None, reason=f"native: {unavailable_reason()}")


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
        want += scale * (q8_x(x) @ aq.T) @ b.bfloat16().float().T
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
    compose(mp)
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
def test_prompts_take_the_native_routed_ffn(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt step (two rows of 11 tokens) runs every layer's routed FFN in one native call
    (FusedLayer.routed_ffn), its logits within 1e-4 of the composed routed FFN's
    (GRAFTLM_NATIVE_MOE_PROMPT=0's); an exact step (scoring) takes the composed one, and so does
    a process whose prompts' products run on AMX tiles (the native one has no tiles yet)."""
    from made_families import tiny_dir

    from graftlm.models import fused
    from graftlm.native import build

    d = tiny_dir(family)
    if d is None:
        pytest.skip(f"the tiny {family} is not available here")
    m = graftlm.load(d / "model-q8_0.gguf", ctx_size=64, n_seq=2, cache_type="f32")
    model = m.model
    served: list[bool] = []
    routed = fused.FusedLayer.routed_ffn

    def spy(self: fused.FusedLayer, *args: object) -> torch.Tensor | None:
        y = routed(self, *args)  # type: ignore[arg-type]
        served.append(y is not None)
        return y

    monkeypatch.setattr(fused.FusedLayer, "routed_ffn", spy)
    tokens = torch.tensor([[(5 * j + 7 * s) % 50 + 3 for j in range(11)] for s in range(2)])

    def run(exact: bool = False) -> torch.Tensor:
        with torch.inference_mode():
            return model.forward(Batch(tokens, [0, 1], [0, 0], [11, 11], exact=exact), True)

    native = run()
    assert served == [True] * m.config.n_layer
    monkeypatch.setattr(fused, "NATIVE_ROUTED_FFN", False)
    torch.testing.assert_close(native, run(), rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(fused, "NATIVE_ROUTED_FFN", True)
    served.clear()
    run(exact=True)
    assert served == [False] * m.config.n_layer
    served.clear()
    monkeypatch.setattr(build, "amx", lambda: True)  # (no AMX here: as a Xeon with tiles)
    torch.testing.assert_close(native, run(), rtol=1e-4, atol=1e-4)
    assert served == [False] * m.config.n_layer


@pytest.mark.parametrize("family", list(ROUTED))
def test_the_scratch_budget_splits_a_prompts_routed_ffn(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt of 2 x 20 tokens: one native call a layer at the default budget (64 MiB holds
    them); a budget of a byte takes calls of MOE_MIN_ROWS tokens (16, 16, 8), bit-identical, and
    the model's scratch a size that 16 tokens need, not 40."""
    from made_families import tiny_dir

    from graftlm.models import fused
    from graftlm.native import layer_calls

    d = tiny_dir(family)
    if d is None:
        pytest.skip(f"the tiny {family} is not available here")
    m = graftlm.load(d / "model-q8_0.gguf", ctx_size=64, n_seq=2, cache_type="f32")
    model = m.model
    calls: list[int] = []
    moe_ffn = layer_calls.moe_ffn

    def spy(layer: object, h: torch.Tensor, *args: object) -> None:
        calls.append(h.shape[0])
        moe_ffn(layer, h, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_calls, "moe_ffn", spy)
    tokens = torch.tensor([[(5 * j + 7 * s) % 50 + 3 for j in range(20)] for s in range(2)])

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model.forward(Batch(tokens, [0, 1], [0, 0], [20, 20]), True)

    whole = run()
    assert calls == [40] * m.config.n_layer
    layer = model.fused_layer(0).layer
    assert model._moe_scratch.capacity >= layer_calls.moe_bytes(layer, 40)
    model._moe_scratch = None  # (a fresh one: what the budget lets it grow to)
    calls.clear()
    monkeypatch.setattr(fused, "MOE_SCRATCH_BYTES", 1)
    assert torch.equal(run(), whole)
    assert calls == [16, 16, 8] * m.config.n_layer
    assert model._moe_scratch.capacity < layer_calls.moe_bytes(layer, 40)


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


@pytest.mark.parametrize(
    ("raw", "on"),
    [("", True), ("1", True), ("on", True), ("0", False), ("off", False), (" No ", False),
     ("FALSE", False)],
)  # fmt: skip
def test_the_native_moe_prompt_switch(raw: str, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """GRAFTLM_NATIVE_MOE_PROMPT is off at 0, off, no or false (any case), as GRAFTLM_NATIVE."""
    from graftlm.models import fused

    monkeypatch.setenv("GRAFTLM_NATIVE_MOE_PROMPT", raw)
    assert fused.native_routed_ffn_env() is on
