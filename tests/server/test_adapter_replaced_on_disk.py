"""An adapter's file changed on disk while it is resident (issue 36's bad input): the resident
copy keeps serving what it was (nothing of it is read from the file again, so a file truncated
in place cannot fault the server); the next read after an eviction reads the file as it is now: a
broken file is a clear error naming the adapter and its file, with nothing else disturbed, and a
valid replacement serves its own weights."""

from __future__ import annotations

import asyncio
import shutil
from contextlib import aclosing
from pathlib import Path

import pytest
from server_fixtures import await_until

from graftlm.errors import AdapterError
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.service import EngineService, Job, TokenEvent
from graftlm.server.registry import AdapterRegistry

BASE = {"tiny"}
PROMPT = [9, 40, 120, 7]


async def _answer(svc: EngineService, lora: dict[int, float]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    async with aclosing(svc.stream([Job(PROMPT, params, lora)])) as events:
        return [ev.token async for ev in events if isinstance(ev, TokenEvent)]


async def _served(reg: AdapterRegistry, svc: EngineService, name: str) -> list[int]:
    lease = await reg.lease(name, None, BASE)
    try:
        return await _answer(svc, lease.lora)
    finally:
        reg.release(lease)


def _registry(svc: EngineService, files: dict[str, Path], path: Path) -> AdapterRegistry:
    """`x` registered at `path` (a copy of alpha, written here), and `beta`."""
    shutil.copyfile(files["alpha"], path)
    reg = AdapterRegistry(svc)
    reg.add_module("x", str(path))
    reg.add_module("beta", str(files["beta"]))
    return reg


async def _evicted(reg: AdapterRegistry, svc: EngineService, name: str) -> None:
    """`name` evicted, and detached: the registry lets it go at once, the engine's thread
    detaches it a moment later (waiting for the registry alone left the detach racing the
    checks of what is attached)."""
    adapter_id = reg.names[name].id
    reg.evict(name)

    def missing() -> str:
        left = [
            what
            for what, still in [
                ("the registry to let it go", reg.names[name].resident),
                ("the engine to detach it", adapter_id in svc.adapters.attached),
            ]
            if still
        ]
        return f"{name}'s eviction (adapter id {adapter_id}): {' and '.join(left)}"

    await await_until(
        lambda: not reg.names[name].resident and adapter_id not in svc.adapters.attached,
        60,
        missing,
    )


def test_a_file_broken_in_place_while_resident(
    svc: EngineService, tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / "x.gguf"

    async def go() -> None:
        reg = _registry(svc, tiny_files, path)
        before = await _served(reg, svc, "x")
        base = await _answer(svc, {})
        assert before != base  # the adapter changes the answer: the checks below can fail

        with open(path, "r+b") as f:  # truncated and overwritten in place, same inode
            f.truncate(64)
            f.seek(8)
            f.write(b"\xff" * 56)
        assert await _served(reg, svc, "x") == before  # resident: served from memory

        await _evicted(reg, svc, "x")
        with pytest.raises(AdapterError) as exc:
            await reg.lease("x", None, BASE)
        msg = str(exc.value)
        assert "adapter 'x'" in msg and "x.gguf" in msg, msg
        assert not reg.names["x"].resident and all(e.name != "x" for e in reg.by_id.values())
        assert set(svc.adapters.attached) == set(reg.by_id)

        # nothing else disturbed: the base and another adapter answer as before
        assert await _answer(svc, {}) == base
        beta = await _served(reg, svc, "beta")
        assert beta != base

        shutil.copyfile(tiny_files["alpha"], path)  # mended: served again, as before
        assert await _served(reg, svc, "x") == before

    asyncio.run(go())


def test_a_valid_replacement_serves_its_own_weights_after_eviction(
    svc: EngineService, tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / "x.gguf"

    async def go() -> None:
        reg = _registry(svc, tiny_files, path)
        alpha = await _served(reg, svc, "x")
        beta = await _served(reg, svc, "beta")
        assert alpha != beta

        shutil.copyfile(tiny_files["beta"], path)  # rewritten in place with another adapter
        assert await _served(reg, svc, "x") == alpha  # the resident copy is unchanged
        await _evicted(reg, svc, "x")
        assert await _served(reg, svc, "x") == beta  # read again: the file as it is now

    asyncio.run(go())
