"""The native decoder layer and LoRA delta against the PyTorch block: the delta, the fused layer,
zero-scale identity, packing, Gemma 3's separate q, k, v, rebinding. Projections in one pass,
the converted families and routed experts: test_native_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants
from layer_twins import compose, q8_x

import graftlm
from graftlm.models import seam
from graftlm.native import (
    library,
    ops,
    unavailable_reason,
)
from graftlm.step.batch import Batch

pytestmark = pytest.mark.skipif(library() is None, reason=f"native: {unavailable_reason()}")


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
    compose(monkeypatch)
    composed = run()
    for a, b, c in zip(fused, one_by_one, composed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


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
    want = scale * (q8_x(x) @ aq.T) @ b.bfloat16().float().T
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
    compose(monkeypatch)
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
            compose(mp)
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
