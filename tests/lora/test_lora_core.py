"""Adapters at runtime on tiny models: exactness, bit-identity where nothing applies, stacking."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import TinySpec, write_tiny_adapter

import graftlm
from graftlm.lora.site import LoraSite
from graftlm.step.batch import LoraRows

IDS = [5, 70, 33, 200, 41, 9, 120, 87, 66, 13, 150, 21]


@pytest.fixture
def model(tiny_llama: Path) -> graftlm.Model:
    return graftlm.load(tiny_llama, ctx_size=64, n_seq=2)


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    return write_tiny_adapter(tmp_path / "a.gguf", TinySpec())


def test_no_adapter_and_scale_zero_are_bit_identical(model: graftlm.Model, adapter: Path) -> None:
    base = model.logits(IDS)
    model.add_lora(adapter, scale=0.0)
    assert torch.equal(model.logits(IDS), base)
    assert torch.equal(model.logits(IDS, lora=[{"id": 0, "scale": 0.0}]), base)
    assert not torch.equal(model.logits(IDS, lora=[{"id": 0, "scale": 1.0}]), base)


def test_add_then_remove_is_bit_identical(
    model: graftlm.Model, adapter: Path, tmp_path: Path
) -> None:
    base = model.logits(IDS)
    a = model.add_lora(adapter)
    one = model.logits(IDS)
    b = model.add_lora(write_tiny_adapter(tmp_path / "b.gguf", TinySpec(), seed=9))
    assert not torch.equal(model.logits(IDS), one)
    model.remove_lora(b)
    assert torch.equal(model.logits(IDS), one)
    model.remove_lora(a)
    assert torch.equal(model.logits(IDS), base)
    assert model.loras == []


def test_adapters_sum(model: graftlm.Model, tmp_path: Path) -> None:
    """Two adapters at once: each projection gets the sum of their deltas (checked on one layer
    through the site, and end to end against running the pair as one merged adapter file)."""
    spec = TinySpec()
    t = {"blk.0.ffn_down": (spec.n_ff, spec.n_embd)}
    a = model.add_lora(write_tiny_adapter(tmp_path / "a.gguf", spec, targets=t, seed=1))
    b = model.add_lora(write_tiny_adapter(tmp_path / "b.gguf", spec, targets=t, seed=2))
    site = model.model.projections()["blk.0.ffn_down"].lora
    assert site is not None
    x = torch.randn(1, 3, spec.n_ff)
    y0 = torch.zeros(1, 3, site.n_out)
    # add_delta adds into the projection's fresh output: give each call its own
    both = site.add_delta(y0.clone(), x, LoraRows(torch.tensor([[0.7, -0.4]]), (a, b)))
    only_a = site.add_delta(y0.clone(), x, LoraRows(torch.tensor([[0.7, 0.0]]), (a,)))
    only_b = site.add_delta(y0.clone(), x, LoraRows(torch.tensor([[0.0, -0.4]]), (b,)))
    torch.testing.assert_close(both, only_a + only_b, rtol=1e-5, atol=1e-6)


def test_delta_matches_merged_weight(model: graftlm.Model, adapter: Path) -> None:
    """y = W x + s * (alpha/r) * B A x equals (W + s (alpha/r) B A) x on every projection, the
    stacked Q/K/V projection included (an adapter on attn_v lands on its rows only)."""
    import gguf as g

    from graftlm.lora.targets import resolve_target
    from graftlm.step.batch import Batch

    model.add_lora(adapter, scale=0.6)
    projections = model.model.projections()
    assert "blk.0.attn_qkv" in projections  # the tiny F32 model stacks Q/K/V
    merged = {name: p.weight.dequantize().clone() for name, p in projections.items()}
    for t in g.GGUFReader(str(adapter)).tensors:
        if not t.name.endswith(".lora_a"):
            continue
        base = t.name[: -len(".weight.lora_a")]
        a = torch.from_numpy(t.data.copy())  # (r, n_in)
        b = next(
            torch.from_numpy(u.data.copy())
            for u in g.GGUFReader(str(adapter)).tensors
            if u.name == base + ".weight.lora_b"
        )
        (target,) = resolve_target(model.model, base)  # type: ignore[misc]
        merged[target.projection][target.at] += 0.6 * (8.0 / a.shape[0]) * (b[target.rows] @ a)
    batch = Batch.single([1, 2], lora=LoraRows(torch.tensor([[0.6], [0.6]]), (0,)))
    for name, p in projections.items():
        x = torch.randn(2, 5, p.n_in)
        if p.lora is None:
            assert torch.equal(merged[name], p.weight.dequantize())
            continue
        torch.testing.assert_close(p(x, batch), x @ merged[name].T, rtol=1e-4, atol=1e-4)


def test_scale_rule_and_negative_scale(model: graftlm.Model, tmp_path: Path) -> None:
    """alpha/r per tensor: an adapter with alpha 8 at rank 4 equals alpha 0 (no rule) with B*2."""
    spec = TinySpec()
    t = {"blk.1.ffn_down": (spec.n_ff, spec.n_embd)}
    ruled = model.add_lora(
        write_tiny_adapter(tmp_path / "r.gguf", spec, targets=t, alpha=8.0, rank=4)
    )
    plain = model.add_lora(
        write_tiny_adapter(tmp_path / "p.gguf", spec, targets=t, alpha=0.0, rank=4)
    )
    lr = model.logits(IDS, lora=[{"id": ruled, "scale": -0.5}])
    lp = model.logits(IDS, lora=[{"id": plain, "scale": -1.0}])
    torch.testing.assert_close(lr, lp, rtol=1e-5, atol=1e-5)


def test_per_call_lora_never_changes_model_scales(model: graftlm.Model, adapter: Path) -> None:
    a = model.add_lora(adapter, scale=0.25)
    model.logits(IDS, lora=[{"id": a, "scale": 1.0}])
    assert model.loras[0]["scale"] == 0.25
    model.set_lora_scales({})
    assert model.loras[0]["scale"] == 0.0
    with pytest.raises(graftlm.GraftError, match=r"unknown adapter id 5; valid ids are 0\.\.0"):
        model.set_lora_scales({5: 1.0})
    with pytest.raises(graftlm.GraftError, match="unknown adapter id 3"):
        model.logits(IDS, lora=[{"id": 3, "scale": 1.0}])
    with pytest.raises(graftlm.GraftError, match="scale must be a number"):
        model.logits(IDS, lora=[{"id": a, "scale": "big"}])


def test_mixed_rows_in_one_batch_equal_each_alone(
    model: graftlm.Model, adapter: Path, tmp_path: Path
) -> None:
    """Rows with different adapters and scales share one decode step and match running alone."""
    from graftlm.lora.settings import AdapterSettings
    from graftlm.runtime.sampling import SamplingParams
    from graftlm.runtime.scheduler import Request

    a = model.add_lora(adapter, scale=0.0)
    b = model.add_lora(write_tiny_adapter(tmp_path / "b.gguf", TinySpec(), seed=4), scale=0.0)
    settings = [{}, {a: 1.0}, {a: 0.5, b: -1.0}, {b: 2.0}]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    model.engine = type(model.engine)(model.model, n_slots=4)
    alone = []
    for s in settings:
        r = model.engine.submit(Request(IDS[:6], greedy, AdapterSettings(s)))
        model.engine.run(r)
        alone.append(r.generated)
    reqs = [model.engine.submit(Request(IDS[:6], greedy, AdapterSettings(s))) for s in settings]
    while any(not r.done for r in reqs):
        model.engine.step()
    assert [r.generated for r in reqs] == alone
    assert len({tuple(g) for g in alone}) > 1  # the adapters do change the output


def test_embedding_adapter_on_tied_base_changes_lookup_only(
    model: graftlm.Model, tmp_path: Path
) -> None:
    spec = TinySpec()
    n_vocab = model.config.n_vocab
    p = write_tiny_adapter(
        tmp_path / "e.gguf", spec, targets={"token_embd": (n_vocab, spec.n_embd)}
    )
    base = model.logits(IDS)
    i = model.add_lora(p)
    assert model.model.embd_lora is not None and model.model.output.lora is None
    assert not torch.equal(model.logits(IDS), base)
    model.remove_lora(i)
    assert torch.equal(model.logits(IDS), base)


def test_site_computes_nothing_for_inactive_slots() -> None:
    site = LoraSite(8, 6)
    site.put(0, torch.randn(2, 8), torch.randn(6, 2))
    y = torch.randn(1, 1, 6)
    out = site.add_delta(y, torch.randn(1, 1, 8), LoraRows(torch.zeros(1, 3), (2,)))
    assert out is y  # slot 2 is not here: no work, the same tensor back


def test_the_embedding_reach_bounds_every_tokens_row_as_tightly_as_its_rows_allow(
    model: graftlm.Model, tmp_path: Path
) -> None:
    """The embedding delta's reach (the float16-range refusal's) was sum over r of max |A[:, r]|
    max |B[:, r]|, as if one token held every column's largest value: r times too loose for an
    adapter whose tokens each use one column. It is max over tokens t of sum over r of
    |A[t, r]| max |B[:, r]|: still a bound on every token's row, equal to the largest row there."""
    spec, n_vocab = TinySpec(), model.config.n_vocab
    target = {"token_embd": (n_vocab, spec.n_embd)}
    one_hot = torch.zeros(n_vocab, 4)  # torch (n_vocab, r): token t uses column t % 4 alone
    one_hot[torch.arange(n_vocab), torch.arange(n_vocab) % 4] = 1.0
    flat = (one_hot.numpy(), torch.full((spec.n_embd, 4), 3.0).numpy())
    for seed, over in ((1, None), (2, {"token_embd": flat})):
        path = tmp_path / f"e{seed}.gguf"
        write_tiny_adapter(path, spec, target, alpha=4.0, seed=seed, overrides=over)  # (r = 4)
        resolved = model.adapters.load(path)
        d = resolved.deltas["token_embd"]
        a, b = d.a.double(), d.b.double()  # (n_vocab, r), (n_embd, r)
        largest = float((a @ b.T).abs().max())  # every token's row, exactly
        loose = float((a.abs().amax(dim=0) * b.abs().amax(dim=0)).sum())
        bound = resolved.reaches["token_embd"]
        assert largest <= bound * (1 + 1e-6) and bound <= loose * (1 + 1e-6)
        if over is not None:
            assert bound == pytest.approx(3.0) and largest == pytest.approx(3.0)
            assert loose == pytest.approx(12.0)
