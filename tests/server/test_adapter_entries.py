"""The adapter registry's refusals of what can never fit (adapter_entries.py): more adapters
than --max-loras, more bytes than --max-lora-memory, a rank above --max-lora-rank (from the
header, before the read), names against the runtime rule. Scales whose deltas leave float16's
range: test_adapter_scales.py; waiting for room: test_adapter_room.py; the rest of the registry:
test_server_adapters.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from registry_helpers import BASE, tiny_registry
from server_fixtures import FIXTURES, SPEC
from tiny_models import write_tiny_adapter

from graftlm.errors import AdapterError, RequestError
from graftlm.lora.prepare import bytes_floor
from graftlm.runtime.service import EngineService
from graftlm.server.registry import AdapterRegistry


def test_a_request_for_more_adapters_than_max_loras_is_refused_at_once(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """A request naming more adapters at once than --max-loras holds (counting the pinned ones
    it does not use) can never run: it is refused at once, nothing attached or held, where it
    held two adapters while it waited for the budget's room and then got a 503 'retry'."""

    async def go() -> None:
        reg = tiny_registry(svc, tiny_files, max_loras=2)
        for model, names in ((None, ["alpha", "beta", "gamma"]), ("alpha", ["beta", "gamma"])):
            with pytest.raises(RequestError) as exc:
                await reg.lease(model, None, BASE, {n: 0.5 for n in names})
            assert exc.value.code == "too_many_adapters"
            assert "uses 3 adapters at once (alpha, beta, gamma)" in str(exc.value)
            assert "at most 2 can be attached (--max-loras 2)" in str(exc.value)
            assert not reg.by_id and all(e.refs == 0 for e in reg.names.values())
        reg.release(await reg.lease("alpha", None, BASE, {"beta": 0.5}))  # two: served
        pinned = reg.preload(str(tiny_files["delta"]), 0.0, "delta")
        with pytest.raises(RequestError) as exc:  # (delta holds one place for good)
            await reg.lease(None, None, BASE, {"alpha": 0.5, "beta": 0.5})
        assert (
            "at most 1 can be attached beside 1 pinned or at a global scale, never evicted "
            "(--max-loras 2)" in str(exc.value)
        )
        alpha_id, delta_id = reg.names["alpha"].id, pinned.id
        assert alpha_id is not None and delta_id is not None
        with pytest.raises(RequestError) as exc:  # by ids too: alpha and delta, and beta
            await reg.lease(None, {alpha_id: 1.0, delta_id: 1.0}, BASE, {"beta": 0.5})
        assert "uses 3 adapters at once (alpha, beta, delta)" in str(exc.value)
        lease = await reg.lease("alpha", {delta_id: 1.0}, BASE)  # alpha and delta: served
        assert lease.labels == ["alpha", "delta"]
        reg.release(lease)

    asyncio.run(go())


def test_pinned_adapters_past_max_loras_are_refused_at_start(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """More pinned adapters (--lora) than --max-loras: refused when the second is given, where
    the server started and then refused every request, a base one too, as too many adapters."""

    async def go() -> None:
        reg = tiny_registry(svc, tiny_files, max_loras=1)
        delta = reg.preload(str(tiny_files["delta"]), 0.0, "delta")
        with pytest.raises(AdapterError, match="more pinned adapters .* than --max-loras 1"):
            reg.preload(str(tiny_files["alpha"]), 0.0, "alpha-pinned")
        assert set(reg.by_id) == {delta.id} and "alpha-pinned" not in reg.names
        reg.release(await reg.lease(None, None, BASE))  # a base request: served
        lease = await reg.lease("delta", None, BASE)
        # delta unloaded while a request uses it: it holds its place only until that request
        # ends, so a request for alpha waits for it (it was refused as too many adapters)
        await reg.unload("delta")
        waiting = asyncio.ensure_future(reg.lease("alpha", None, BASE))
        await asyncio.sleep(0.05)
        reg.release(lease)
        got = await waiting
        assert got.labels == ["alpha"] and set(reg.by_id) == {reg.names["alpha"].id}
        reg.release(got)

    asyncio.run(go())


def test_lora_modules_names_follow_the_runtime_rule(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """--lora-modules names follow load_lora_adapter's rule (they were all registered)."""
    reg = AdapterRegistry(svc)
    path = str(tiny_files["alpha"])
    for name, words in (
        ("", "may not be empty"),
        ("bad\nname", "bidirectional characters (U+000A)"),
        ("a\u202eb", "bidirectional characters (U+202E)"),
        (" padded", "white space"),
        ("x" * 257, "at most 256 characters, got 257"),
    ):
        with pytest.raises(ValueError) as exc:
            reg.add_module(name, path)
        assert str(exc.value).startswith("--lora-modules ") and words in str(exc.value)
    assert not reg.names
    reg.add_module("org/名前-v1", path)
    assert list(reg.names) == ["org/名前-v1"]


def test_memory_budget_in_bytes(
    svc: EngineService, tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    async def go() -> None:
        probe = AdapterRegistry(svc)
        probe.add_module("alpha", str(tiny_files["alpha"]))
        lease = await probe.lease("alpha", None, BASE)
        nbytes = probe.resident_bytes
        probe.release(lease)
        await probe.unload("alpha")
        await asyncio.sleep(0.05)
        reg = tiny_registry(svc, tiny_files, max_bytes=int(nbytes * 2.5))
        for name in ("alpha", "beta", "gamma", "alpha", "beta"):
            reg.release(await reg.lease(name, None, BASE))
            assert reg.resident_bytes <= nbytes * 2.5 and len(reg.by_id) <= 2
        small = AdapterRegistry(svc, max_bytes=nbytes // 2)
        small.add_module("alpha", str(tiny_files["alpha"]))
        with pytest.raises(RequestError, match="budget") as exc:
            await small.lease("alpha", None, BASE)
        assert exc.value.code == "adapters_too_large"  # (a 400)

    asyncio.run(go())


def test_adapters_that_together_pass_the_memory_budget_are_refused_at_once(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """Two adapters that each fit --max-lora-memory but not together: the request is a 400
    naming them, their sizes and the limit, nothing attached or held, where it held the first
    while it waited --lora-wait for room no request's end could make, then got a 503."""

    async def go() -> None:
        reg = tiny_registry(svc, tiny_files)
        reg.release(await reg.lease("alpha", None, BASE))
        nbytes = reg.resident_bytes
        reg = tiny_registry(svc, tiny_files, max_bytes=nbytes * 3 // 2)
        reg.room_wait_s = 30.0  # (it waited this long before)
        reg.release(await reg.lease("gamma", None, BASE))  # one alone fits
        with pytest.raises(RequestError) as exc:  # (before: a 503 after room_wait_s)
            await reg.lease("alpha", None, BASE, {"beta": 0.5})
        assert exc.value.code == "adapters_too_large"
        text = str(exc.value)
        assert (
            f"take {2 * nbytes} bytes at once (alpha: {nbytes} bytes, beta: {nbytes} bytes)" in text
        )
        assert f"the LoRA budget is {nbytes * 3 // 2} bytes (--max-lora-memory)" in text
        assert not reg.names["alpha"].resident and not reg.names["beta"].resident
        assert all(e.refs == 0 and e.loading is None for e in reg.names.values())
        reg.release(await reg.lease("beta", None, BASE))  # each alone: served

    asyncio.run(go())


def test_max_lora_rank(svc: EngineService, tmp_path: Path) -> None:
    big = write_tiny_adapter(tmp_path / "r8.gguf", SPEC, rank=8)

    async def go() -> None:
        reg = AdapterRegistry(svc, max_rank=4)
        reg.add_module("big", str(big))
        with pytest.raises(AdapterError, match="rank 8"):
            await reg.lease("big", None, BASE)
        assert not reg.by_id

    asyncio.run(go())


def test_max_lora_rank_refuses_from_the_header_before_reading(
    svc: EngineService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter above --max-lora-rank (GGUF or PEFT) is refused from its header: none of its
    factors is read, packed or held (they were, then refused); one at the limit loads."""
    big = write_tiny_adapter(tmp_path / "r8.gguf", SPEC, rank=8)
    peft = FIXTURES / "smollm2" / "caps"  # r = 4 (another base: refused before that is seen)
    reads: list[str] = []
    real = svc.prepare_adapter
    monkeypatch.setattr(svc, "prepare_adapter", lambda path: reads.append(str(path)) or real(path))

    async def go() -> None:
        reg = AdapterRegistry(svc, max_rank=3)
        reg.add_module("big", str(big))
        reg.add_module("peft", str(peft))
        for name, rank in (("big", 8), ("peft", 4)):
            with pytest.raises(AdapterError) as exc:
                await reg.lease(name, None, BASE)
            assert f"adapter {name!r}: " in str(exc.value)
            assert f"rank {rank} or more (its header) is above --max-lora-rank 3" in str(exc.value)
        with pytest.raises(AdapterError, match="rank 8 or more"):
            reg.preload(str(big), 0.0)
        assert reads == [] and not reg.by_id
        reg.max_rank = 8
        reg.release(await reg.lease("big", None, BASE))  # at the limit: read and attached
        assert reads == [str(big)]

    asyncio.run(go())


def test_max_lora_memory_refuses_from_the_header_before_reading(
    svc: EngineService, tiny_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter whose header already shows more bytes than --max-lora-memory (its A factors, a
    byte an element at least) is refused before its factors are read (they were read, checked
    and packed, then refused); one between that floor and its packed size is refused after."""
    path = str(tiny_files["gamma"])
    reads: list[str] = []
    real = svc.prepare_adapter
    monkeypatch.setattr(svc, "prepare_adapter", lambda p: reads.append(str(p)) or real(p))
    floor = bytes_floor(path)

    async def go() -> None:
        probe = AdapterRegistry(svc)
        probe.add_module("gamma", path)
        probe.release(await probe.lease("gamma", None, BASE))
        nbytes = probe.resident_bytes
        await probe.unload("gamma")
        assert 0 < floor <= nbytes, (floor, nbytes)
        reads.clear()
        reg = AdapterRegistry(svc, max_bytes=floor - 1)
        reg.add_module("gamma", path)
        with pytest.raises(RequestError) as exc:
            await reg.lease("gamma", None, BASE)
        assert exc.value.code == "adapters_too_large" and reads == []
        assert f"adapter 'gamma': {path}: {floor} bytes or more once read" in str(exc.value)
        assert f"LoRA budget of {floor - 1} bytes (--max-lora-memory)" in str(exc.value)
        reg.max_bytes = nbytes - 1  # (past the floor: read, then refused)
        with pytest.raises(RequestError, match="budget"):
            await reg.lease("gamma", None, BASE)
        assert reads == [path] and not reg.by_id

    asyncio.run(go())
