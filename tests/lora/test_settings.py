"""Adapter settings: one frozen value, built and checked once by the adapter set."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import write_tiny_adapter

import graftlm
from graftlm.errors import AdapterError, RequestError
from graftlm.lora.settings import AdapterSettings


def test_adapter_settings_are_one_frozen_value() -> None:
    x = AdapterSettings({2: 0.5, 0: 1.0, 1: 0.0})
    assert list(x.items()) == [(0, 1.0), (2, 0.5)] and len(x) == 2 and 1 not in x
    assert x == {0: 1.0, 2: 0.5} and x == AdapterSettings([(2, 0.5), (0, 1.0)])
    assert hash(x) == hash(AdapterSettings({0: 1.0, 2: 0.5}))
    assert not AdapterSettings({3: 0.0})
    with pytest.raises(AttributeError):
        x._pairs = ()  # type: ignore[misc]


def test_the_builder_checks_ids_and_scales_once(tiny_llama: Path, tmp_path: Path) -> None:
    m = graftlm.load(tiny_llama, ctx_size=32)
    a = m.add_lora(write_tiny_adapter(tmp_path / "a.gguf"), 0.5)
    s = m.adapters
    assert s.settings(None) == {a: 0.5}  # the global scales
    assert s.settings([{"id": a, "scale": 2}]) == AdapterSettings({a: 2.0})
    assert s.settings([{"id": a, "scale": 0.0}], base={a: 1.0}) == {}  # a listed 0 wins
    assert s.settings(None, base={a: 1.0}) == {a: 1.0}
    with pytest.raises(RequestError, match=r"lora: unknown adapter id 7; valid ids are 0\.\.0"):
        s.settings({7: 1.0}, where="lora: ")
    with pytest.raises(RequestError, match=r"unknown adapter id 0; no adapter is loaded"):
        s.settings({a: 1.0}, among=())
    with pytest.raises(RequestError, match="scale 1e\\+39 is beyond float32's range"):
        s.settings([{"id": a, "scale": 1e39}])
    with pytest.raises(RequestError, match="needs an 'id' and a 'scale'"):
        s.settings([{"id": a}])
    with pytest.raises(AdapterError, match="scale must be a number"):
        s.settings({a: "big"}, error=AdapterError)  # type: ignore[dict-item]
