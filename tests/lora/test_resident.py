"""An adapter is held in one form a projection (issue 36): where it has a native form, the
packed factors are its only copy, and the PyTorch twin (exact steps) reads the factors back from
them; elsewhere the float32 factors stay."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from tiny_models import TinySpec, write_tiny_adapter

import graftlm
from graftlm.lora import packed
from graftlm.lora.adapter import EMBEDDING
from graftlm.lora.site import LoraSite
from graftlm.models import moe, seam
from graftlm.native import library
from graftlm.step.batch import LoraRows

pytestmark = pytest.mark.skipif(library() is None, reason="no native library")


def _pair(g: torch.Generator, r: int, n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B, B with the zero blocks of a stacked projection (outputs 40..71 untouched)."""
    b = torch.randn(n_out, r, generator=g)
    b[40:72] = 0
    return torch.randn(r, n_in, generator=g), b


def _q8(a: torch.Tensor) -> torch.Tensor:
    """A through Q8_0 as gguf quantizes and dequantizes it."""
    raw = quants.quantize(a.numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize(("r", "n_in"), [(16, 64), (5, 96), (3, 40)])
def test_factors_read_back_are_the_values_held(compact: bool, r: int, n_in: int) -> None:
    """A packed slot gives back, bit for bit, the factors its kernels multiply by: on a compact
    site A through Q8_0 (bfloat16 where n_in is not whole blocks of 32) and B in bfloat16; on
    any other site the float32 factors themselves. Packed again, they give the same bytes (what
    a site coming back to the CPU does)."""
    g = torch.Generator().manual_seed(r)
    a, b = _pair(g, r, n_in, 100)
    (p,) = packed.pack_many([(a, b)], compact)
    assert p is not None
    got_a, got_b = p.factors()
    assert got_a.dtype == got_b.dtype == torch.float32
    if not compact:
        want_a, want_b = a, b
    else:
        want_a = _q8(a) if n_in % 32 == 0 else a.bfloat16().float()
        want_b = b.bfloat16().float()
    assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b)
    again = packed.PackedSlot(got_a, got_b, compact)
    assert [(q.c0, q.r, q.lo, q.hi) for q in again.parts] == [
        (q.c0, q.r, q.lo, q.hi) for q in p.parts
    ]
    for x, y in zip(again.parts, p.parts, strict=True):
        assert torch.equal(x.data, y.data)
    for x, y in zip(again.aq or (), p.aq or (), strict=True):
        assert torch.equal(x, y)
    assert (again.a is None) == (p.a is None)
    if p.a is not None:
        assert again.a is not None and torch.equal(again.a, p.a)


@pytest.mark.parametrize("compact", [True, False])
def test_a_site_keeps_one_copy(compact: bool) -> None:
    """A projection's slot is its packed form alone: nbytes is the packed form's, and the
    float32 factors put in are let go (where the packed form has no use for them)."""
    g = torch.Generator().manual_seed(0)
    a, b = _pair(g, 8, 64, 100)
    site = LoraSite(64, 100, compact=compact)
    gone_b = weakref.ref(b)
    site.put(1, a, b)
    del b
    gc.collect()
    assert gone_b() is None  # B lives on only as its parts
    held = site._packed[1]
    assert site.nbytes(1) == held.nbytes and not site._factors
    if compact:
        assert held.a is None and held.aq is not None
        # A as Q8_0 codes and scales, B in bfloat16 (its blocks of 32 outputs): under half
        # the float32 factors' bytes
        assert held.nbytes < (8 * 64 + 100 * 8) * 4 // 2
    else:
        assert held.a is a  # A's one copy, the float32 A itself
    # a gathering site (the embedding) has no native form: its float32 factors stay
    emb = LoraSite(32, 16, gather=True)
    ea, eb = torch.randn(32, 4, generator=g), torch.randn(16, 4, generator=g)
    emb.put(0, ea, eb)
    assert emb.factors(0)[0] is ea and emb.factors(0)[1] is eb
    assert emb.nbytes(0) == (32 * 4 + 16 * 4) * 4 and not emb._packed


@pytest.mark.parametrize("compact", [True, False])
def test_twin_on_the_factors_held_equals_the_native_delta(compact: bool) -> None:
    """The PyTorch twin, on the factors read back, against the native delta from the same
    packed form, at the bounds the native delta's tests hold: over float weights within
    float32 summation order (rtol 1e-4, atol 1e-3 on entries ~50); over a compact site, where
    the native delta also rounds x to int8 per 32 values, within 1% (norm) of the twin. The
    same for a routed expert's tokens (models.moe, each token its own scale row)."""
    g = torch.Generator().manual_seed(2)
    site = LoraSite(64, 100, compact=compact)
    site.put(0, *_pair(g, 4, 64, 100))
    site.put(2, *_pair(g, 8, 64, 100))
    scales = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, -2.0], [0.25, 0.0, 0.0]])
    rows = LoraRows(scales, (0, 2))
    x = torch.randn(3, 5, 64, generator=g)
    base = torch.randn(3, 5, 100, generator=g)
    twin = site.add_delta(base.clone(), x, rows)
    native = seam.add_delta(site, base.clone(), x, rows, exact=False)
    exact = seam.add_delta(site, base.clone(), x, rows, exact=True)
    assert torch.equal(exact, twin)  # an exact step is the twin on the factors held
    (a0, b0), (a2, b2) = site.factors(0), site.factors(2)
    spelled = base.clone()
    for r in range(3):
        spelled[r] += scales[r, 0] * (x[r] @ a0.T) @ b0.T + scales[r, 2] * (x[r] @ a2.T) @ b2.T
    torch.testing.assert_close(twin, spelled, rtol=1e-5, atol=1e-4)
    tokens = x.reshape(15, 64)
    token_scales = scales.repeat_interleave(5, dim=0)  # (15, n_slots)
    y = base.reshape(15, 100)
    token_twin = moe._token_delta(site, y.clone(), tokens, token_scales, exact=True)
    token_native = moe._token_delta(site, y.clone(), tokens, token_scales, exact=False)
    torch.testing.assert_close(token_twin.view(3, 5, 100), twin, rtol=1e-5, atol=1e-4)
    for got, want in ((native, twin), (token_native, token_twin)):
        if compact:
            assert (got - want).norm() / (want - base.reshape(want.shape)).norm() < 1e-2
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def _devices() -> list[str]:
    return ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("compact", [True, False])
def test_site_moves_off_the_cpu_and_back(device: str, compact: bool) -> None:
    """to(device): a packed slot is read back to its float32 factors, which move (no native
    form off the CPU: the twin serves); back on the CPU they are packed again, the same bytes.
    (On `meta` only the way out: it holds no values.)"""
    g = torch.Generator().manual_seed(3)
    site = LoraSite(64, 100, compact=compact)
    site.put(0, *_pair(g, 4, 64, 100))
    site.put(5, *_pair(g, 8, 64, 100))
    before = {s: site._packed[s] for s in site.slot_ids}
    held = {s: site.factors(s) for s in site.slot_ids}
    assert site.native() is not None
    site.to(device)
    assert site.device.type == device and not site._packed and site.native() is None
    for s, (a, b) in held.items():
        ta, tb = site.factors(s)
        assert ta.device.type == tb.device.type == device
        assert ta.shape == a.shape and tb.shape == b.shape and ta.dtype == torch.float32
        assert site.nbytes(s) == (a.numel() + b.numel()) * 4
        if device != "meta":
            assert torch.equal(ta.cpu(), a) and torch.equal(tb.cpu(), b)
    if device == "meta":
        return
    site.to("cpu")
    assert not site._factors and site.native() is not None
    for s, p in before.items():
        q = site._packed[s]
        assert q.nbytes == p.nbytes
        for x, y in zip(q.parts, p.parts, strict=True):
            assert torch.equal(x.data, y.data)
        for x, y in zip(q.aq or (), p.aq or (), strict=True):
            assert torch.equal(x, y)


def test_an_attached_adapter_is_held_once(tiny_llama: Path, tmp_path: Path) -> None:
    """Through the model: each projection's delta keeps only its packed form (the float32
    factors read with the file are let go), the sites hold those very objects, the listed
    bytes are theirs; the embedding's delta keeps its factors. Scoring (an exact step) still
    changes with the adapter and is bit-identical to the base at scale 0."""
    spec = TinySpec()
    model = graftlm.load(tiny_llama, ctx_size=64)
    ids = [5, 70, 33, 200, 41, 9]
    base = model.logits(ids)
    n_vocab = model.config.n_vocab
    p = write_tiny_adapter(
        tmp_path / "a.gguf",
        spec,
        targets={
            "blk.0.attn_q": (spec.n_embd, spec.n_embd),
            "blk.1.ffn_down": (spec.n_ff, spec.n_embd),
            "token_embd": (n_vocab, spec.n_embd),
        },
    )
    i = model.add_lora(p, scale=0.0)
    deltas = model.adapters.attached[i].adapter.deltas
    table = model.model.seams
    for name, d in deltas.items():
        if name == EMBEDDING:
            assert d.packed is None and d._a is not None
            continue
        assert d.packed is not None and d._a is None and d._b is None
        site = table.projections[name].lora
        assert site is not None and site._packed[i] is d.packed and not site._factors
        assert site.nbytes(i) == d.nbytes == d.packed.nbytes
        assert torch.equal(d.a, site.factors(i)[0]) and d.width == d.packed.r
    (info,) = model.loras
    assert info["bytes"] == sum(d.nbytes for d in deltas.values())
    assert torch.equal(model.logits(ids), base)
    assert not torch.equal(model.logits(ids, lora=[{"id": i, "scale": 1.0}]), base)
