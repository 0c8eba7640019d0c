"""The Python API's adapter scales past float16's range (lora/scales.py `together_overflow`, the
server's check too): a call's own `lora=` scales, `set_lora_scales` and `add_lora(path, scale)`
are refused up front, alone and together, naming the adapters, their scales and how far each
may go; scales within range are taken as before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import TinySpec, write_tiny_adapter

import graftlm
from graftlm.errors import AdapterError, RequestError
from graftlm.lora.adapter import F16_MAX

IDS = [5, 70, 33, 200, 41, 9, 120, 87, 66, 13, 150, 21]
SPEC = TinySpec()
ON_Q = {"blk.0.attn_q": (SPEC.n_embd, SPEC.n_head * SPEC.head_dim)}


@pytest.fixture
def model(tiny_llama: Path) -> graftlm.Model:
    return graftlm.load(tiny_llama, ctx_size=64, n_seq=2)


def _pair(model: graftlm.Model, tmp_path: Path) -> tuple[int, int, float, float]:
    """Two adapters on blk.0's attn_q at scale 0, their ids, and 90% of the largest scale each
    takes alone (F16_MAX over its reach): together at those, their deltas add up past it."""
    ids = [
        model.add_lora(write_tiny_adapter(tmp_path / f"q{s}.gguf", SPEC, ON_Q, seed=s), 0.0)
        for s in (3, 4)
    ]
    near = [0.9 * F16_MAX / model.adapters.attached[i].adapter.reach for i in ids]
    return ids[0], ids[1], near[0], near[1]


def _no_step(model: graftlm.Model, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From here on, each forward pass of the model is counted (a refusal comes before any)."""
    steps: list[int] = []
    forward = model.model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model.model, "forward", counted)
    return steps


def test_a_calls_own_scale_past_float16_is_refused_before_any_step(
    model: graftlm.Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lora=[{"id": 0, "scale": 3e38}]` (a number within float32's range) ran, and the call
    failed later with "logits not finite"; every entry point that takes a call's own scales
    (logits, logprobs, embed, generate, chat) refuses it up front now: RequestError
    invalid_scale naming the adapter, its scale and the largest it takes, with no step run.
    The model's own scales are untouched and a sane scale still runs."""
    a = model.add_lora(write_tiny_adapter(tmp_path / "a.gguf", SPEC), scale=0.25)
    steps = _no_step(model, monkeypatch)
    huge = [{"id": a, "scale": 3e38}]
    calls: list[Callable[[], object]] = [
        lambda: model.logits(IDS, lora=huge),
        lambda: model.logprobs(IDS, lora=huge),
        lambda: model.embed(IDS, lora=huge),
        lambda: model.generate(IDS, max_tokens=2, lora=huge),
        lambda: model.generate(IDS, max_tokens=2, lora=huge, stream=True),
        lambda: model.chat([{"role": "user", "content": "hi"}], max_tokens=2, lora=huge),
    ]
    limit = F16_MAX / model.adapters.attached[a].adapter.reach
    for call in calls:
        with pytest.raises(RequestError) as exc:
            call()
        assert exc.value.code == "invalid_scale"
        words = str(exc.value)
        assert words.startswith(f"lora: adapter {a} (a.gguf): scale 3e+38 takes its delta to ")
        assert "past float16's range (65504): this call would overflow" in words
        assert (
            f"would overflow; on such an input its scale stays within range up to {limit:.4g}"
            in words
        )
    assert steps == [] and model.loras[0]["scale"] == 0.25
    assert torch.isfinite(model.logits(IDS, lora=[{"id": a, "scale": -2.0}])).all()
    assert steps  # (the spy is on the path a call takes)


def test_a_calls_own_scales_that_overflow_only_together_are_refused(
    model: graftlm.Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two adapters on one attn_q, each at 90% of the largest scale it takes alone, in one
    call: refused, naming both and the rows where their deltas add up; each alone, and the
    pair at a third of those scales, pass the check (and run, at scales of order one)."""
    a, b, near_a, near_b = _pair(model, tmp_path)
    steps = _no_step(model, monkeypatch)
    with pytest.raises(RequestError) as exc:
        model.logprobs(IDS, lora=[{"id": a, "scale": near_a}, {"id": b, "scale": -near_b}])
    words = str(exc.value)
    assert exc.value.code == "invalid_scale" and steps == []
    assert f"adapter {a} (q3.gguf) at scale {near_a:g}, adapter {b} (q4.gguf) at scale " in words
    ((site, (lo, hi)),) = model.adapters.attached[a].adapter.rows.items()
    assert f"together their deltas on rows [{lo}, {hi}) of {site} reach" in words
    assert "this call would overflow, though each is within range alone" in words
    for lora in ({a: near_a}, {b: -near_b}, {a: near_a / 3, b: near_b / 3}):
        assert model.adapters.call_settings(lora) == lora
    out = model.logits(IDS, lora=[{"id": a, "scale": 1.5}, {"id": b, "scale": -1.5}])
    assert torch.isfinite(out).all() and steps


def test_model_scales_past_float16_are_refused_by_set_lora_scales_and_add_lora(
    model: graftlm.Model, tmp_path: Path
) -> None:
    """set_lora_scales({id: 3e38}) and add_lora(path, 3e38) were taken, and every call at the
    model's scales then failed with "logits not finite"; a pair each within range alone but
    not together was taken too. Each is an AdapterError now, nothing changed (scales as they
    were, nothing attached); add_lora refuses a scale that is no finite number too."""
    a, b, near_a, near_b = _pair(model, tmp_path)
    for scales in ({a: 3e38}, {a: near_a, b: near_b}):
        with pytest.raises(AdapterError) as exc:
            model.set_lora_scales(scales)
        assert f"adapter {a} (q3.gguf)" in str(exc.value)
        assert "every call at the model's scales would overflow" in str(exc.value)
        assert [x["scale"] for x in model.loras] == [0.0, 0.0]
    model.set_lora_scales({a: near_a})
    path = tmp_path / "q5.gguf"
    write_tiny_adapter(path, SPEC, ON_Q, seed=5)
    with pytest.raises(AdapterError, match=rf"^{path}: scale 3e\+38 takes its delta to "):
        model.add_lora(path, 3e38)
    with pytest.raises(AdapterError) as exc:
        model.add_lora(tmp_path / "q4.gguf", near_b)  # (beside a at its scale)
    assert f"adapter {a} (q3.gguf) at scale {near_a:g}, {tmp_path / 'q4.gguf'} at scale" in str(
        exc.value
    )
    with pytest.raises(AdapterError, match="scale nan is not a finite number"):
        model.add_lora(path, float("nan"))
    assert [x["scale"] for x in model.loras] == [near_a, 0.0]
    c = model.add_lora(path, near_b / 10)
    assert model.loras[-1]["id"] == c and model.loras[-1]["scale"] == near_b / 10
