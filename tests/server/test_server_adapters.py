"""The adapter registry under a budget (LRU eviction, never an adapter in use), replacement under
a running request, and vLLM's runtime load/unload API over HTTP."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Coroutine
from contextlib import aclosing
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from server_fixtures import FIXTURES, SPEC, TinyServer, await_until, error_of, wait_until
from tiny_models import write_tiny_adapter

import graftlm
from graftlm.errors import AdapterError, RequestError
from graftlm.lora.adapter import F16_MAX
from graftlm.lora.prepare import bytes_floor
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.service import EngineService, FinishEvent, Job, TokenEvent
from graftlm.server.registry import AdapterRegistry, Lease

BASE = {"tiny"}


def _registry(svc: EngineService, files: dict[str, Path], **limits: int) -> AdapterRegistry:
    reg = AdapterRegistry(svc, room_wait_s=0.3, **limits)  # a short wait before the 503
    for name in ("alpha", "beta", "gamma"):
        reg.add_module(name, str(files[name]))
    return reg


def _attached(svc: EngineService) -> set[int]:
    return set(svc.adapters.attached)


async def _settled(svc: EngineService, reg: AdapterRegistry) -> None:
    """The engine attaches exactly the registry's resident adapters, once the detaches the
    registry asked for (on the engine thread, after the release that freed them) have landed."""
    await await_until(
        lambda: _attached(svc) == set(reg.by_id),
        60,
        lambda: f"attached {sorted(_attached(svc))} against resident {sorted(reg.by_id)}",
    )


def test_lru_eviction_never_takes_an_adapter_in_use(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=2)
        a, b, c = (reg.names[n] for n in ("alpha", "beta", "gamma"))
        reg.release(await reg.lease("alpha", None, BASE))
        reg.release(await reg.lease("beta", None, BASE))
        held_c = await reg.lease("gamma", None, BASE)  # evicts alpha, the least recently used
        assert not a.resident and b.resident and c.resident
        assert len(reg.by_id) == 2
        await _settled(svc, reg)
        held_a = await reg.lease("alpha", None, BASE)  # gamma is in use: beta goes
        assert a.resident and not b.resident and c.resident
        with pytest.raises(RequestError) as exc:  # both resident adapters are in use
            await reg.lease("beta", None, BASE)
        assert exc.value.code == "adapter_memory_busy"
        assert a.resident and c.resident and a.refs == 1 and c.refs == 1
        reg.release(held_a)
        reg.release(held_c)
        lease = await reg.lease("beta", None, BASE)
        assert b.resident and lease.lora == {b.id: 1.0} and lease.labels == ["beta"]
        reg.release(lease)
        await _settled(svc, reg)

    asyncio.run(go())


def test_a_request_for_more_adapters_than_max_loras_is_refused_at_once(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """A request naming more adapters at once than --max-loras holds (counting the pinned ones
    it does not use) can never run: it is refused at once, nothing attached or held, where it
    held two adapters while it waited for the budget's room and then got a 503 'retry'."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=2)
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
        reg = _registry(svc, tiny_files, max_loras=1)
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


def test_a_request_waits_for_room_instead_of_failing(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """Both resident adapters in use: a third request waits in the queue (it used to get a 503
    at once) and is served as soon as one of them is released."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=2)
        reg.room_wait_s = 30.0
        held_a = await reg.lease("alpha", None, BASE)
        held_b = await reg.lease("beta", None, BASE)
        waiting = asyncio.ensure_future(reg.lease("gamma", None, BASE))
        await await_until(lambda: reg.room_wait_since is not None, 60, "gamma's wait for room")
        assert not waiting.done() and reg.queued == 1  # queued, not refused
        reg.release(held_a)
        lease = await asyncio.wait_for(waiting, 120)
        assert reg.names["gamma"].resident and not reg.names["alpha"].resident
        reg.release(lease)
        reg.release(held_b)

    asyncio.run(go())


def test_two_requests_never_hold_part_of_their_adapters_while_waiting(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """Under --max-loras 2, A needs {alpha, beta} and B needs {gamma, delta}: each took its
    first adapter, then both waited for room the other held, and both got a 503 (a hold-and-wait
    deadlock; with the short wait here, A's 503 came first). A request takes all of its adapters
    at once or none, first come first served: A is served, then B when A ends."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=2)
        reg.add_module("delta", str(tiny_files["delta"]))
        first = asyncio.ensure_future(reg.lease(None, None, BASE, {"alpha": 0.5, "beta": 0.5}))
        second = asyncio.ensure_future(reg.lease(None, None, BASE, {"gamma": 0.5, "delta": 0.5}))
        lease_a = await asyncio.wait_for(first, 120)
        assert sorted(lease_a.labels) == ["alpha", "beta"]
        assert not second.done()  # (B holds nothing while it waits for room A holds)
        assert reg.names["gamma"].refs == 0 and reg.names["delta"].refs == 0
        reg.release(lease_a)
        lease_b = await asyncio.wait_for(second, 120)
        assert sorted(lease_b.labels) == ["delta", "gamma"]
        assert not reg.names["alpha"].resident and not reg.names["beta"].resident
        reg.release(lease_b)
        await _settled(svc, reg)

    asyncio.run(go())


def _at_once(coro: Coroutine[Any, Any, Lease]) -> Lease:
    """The lease `coro` returns without awaiting anything (it fails when the lease would wait)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("the lease waited")


def test_requests_for_resident_adapters_do_not_queue_behind_one_waiting_for_room(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """--max-loras 1, alpha held, a request for beta waiting for room: a request for the base
    and one for alpha (resident) are served at once, where they queued behind beta's (every
    request did while one waited for room), and beta's is served when alpha is released."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=1)
        reg.room_wait_s = 3600.0  # (its quarter, when alpha's would be held back, never reached)
        alpha, beta = reg.names["alpha"], reg.names["beta"]
        first = await reg.lease("alpha", None, BASE)
        other = asyncio.ensure_future(reg.lease("beta", None, BASE))
        await await_until(lambda: beta.waiting > 0, 30, "beta's request to wait for room")
        base = _at_once(reg.lease(None, None, BASE))
        assert base.labels == [] and not base.entries
        again = _at_once(reg.lease("alpha", None, BASE))
        assert again.labels == ["alpha"] and alpha.refs == 2 and not other.done()
        reg.release(base)
        reg.release(first)
        reg.release(again)
        lease_b = await asyncio.wait_for(other, 120)
        assert lease_b.labels == ["beta"] and not alpha.resident
        reg.release(lease_b)

    asyncio.run(go())


def test_a_request_waiting_for_room_is_served_under_steady_traffic_on_resident_adapters(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """--max-loras 2, gamma at a global scale, a steady stream of requests for alpha (each
    begins before the one before it ends), a request for beta waiting for room: every request
    for alpha took it at once, alpha was never idle, and beta's request waited out --lora-wait
    for its 503. Once beta's has waited past its share of --lora-wait (0 here), a new request
    for alpha queues behind it: alpha drains, beta is served, then the queued request; requests
    for the base (at the global scales) and for gamma (never evicted) are never held."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=2)
        reg.room_wait_s, reg.starve_share = 10.0, 0.0
        alpha, beta, gamma = (reg.names[n] for n in ("alpha", "beta", "gamma"))
        reg.release(await reg.lease("gamma", None, BASE))
        assert gamma.id is not None
        await reg.set_scales({gamma.id: 0.5})
        prev = await reg.lease("alpha", None, BASE)
        waiter = asyncio.ensure_future(reg.lease("beta", None, BASE))
        await await_until(lambda: reg.room_wait_since is not None, 30, "beta's wait for room")
        nxt = None
        while not waiter.done():
            nxt = asyncio.ensure_future(reg.lease("alpha", None, BASE))
            # it took alpha, or it queued behind beta's request: then the one before it ends
            await await_until(lambda n=nxt: n.done() or reg.queued == 2, 30, "the next request")
            for model in (None, "gamma"):  # (never held)
                other = _at_once(reg.lease(model, None, BASE))
                assert other.labels == ["gamma"]
                reg.release(other)
            reg.release(prev)
            if not nxt.done():
                break
            prev = await nxt
        lease_b = await asyncio.wait_for(waiter, 120)  # (a 503 here: starved)
        assert lease_b.labels == ["beta"] and not alpha.resident and nxt is not None
        assert not nxt.done() and reg.queued == 1
        reg.release(lease_b)
        last = await asyncio.wait_for(nxt, 120)
        assert last.labels == ["alpha"] and alpha.resident and not beta.resident
        reg.release(last)

    asyncio.run(go())


async def _held_behind_beta(
    reg: AdapterRegistry, behind: tuple[str, ...] = ()
) -> tuple[Lease, asyncio.Future[Lease], list[asyncio.Future[Lease]], asyncio.Future[Lease]]:
    """gamma at a global scale, alpha held, a request for beta waiting for room, requests for
    the adapters `behind` queued behind it for the admission, and then one for alpha held back
    by the rule (beta's wait past its share: 0). Returns the lease on alpha, beta's request,
    those queued behind it, and alpha's."""
    gamma = reg.names["gamma"]
    reg.release(await reg.lease("gamma", None, BASE))
    assert gamma.id is not None
    await reg.set_scales({gamma.id: 0.5})
    prev = await reg.lease("alpha", None, BASE)
    waiter = asyncio.ensure_future(reg.lease("beta", None, BASE))
    await await_until(lambda: reg.room_wait_since is not None, 60, "beta's wait for room")
    queued = [asyncio.ensure_future(reg.lease(name, None, BASE)) for name in behind]
    # (read, and queued for the admission: asyncio.Lock's own queue)
    in_line = len(behind)
    await await_until(
        lambda: len(reg._admission._waiters or ()) == in_line, 60, "the requests behind beta's"
    )
    assert reg.queued == 1 + len(behind)
    reg.starve_share = 0.0
    held = asyncio.ensure_future(reg.lease("alpha", None, BASE))
    await await_until(lambda: reg.queued == 2 + len(behind), 60, "alpha's to be held back")
    assert not held.done() and reg.names["alpha"].refs == 1  # (it holds nothing)
    return prev, waiter, queued, held


def test_a_request_held_back_waits_for_the_wait_for_room_not_the_requests_queued_for_room(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """--max-loras 3: gamma at a global scale, alpha and delta held; a request for beta waits
    for room, one for a0 queues behind it for the admission, and then one for alpha is held
    back by the rule. It joined the admission's queue: when beta's request was served (delta
    released), it waited out a0's request too (room held by alpha's own lease: until a0's
    503), each room-needer ahead of it up to --lora-wait. Now it waits for beta's wait alone,
    outside that queue: it is served once beta's is, while a0's still waits."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=3)
        for name in ("delta", "a0"):
            reg.add_module(name, str(tiny_files[name]))
        reg.room_wait_s = 20.0
        spare = await reg.lease("delta", None, BASE)
        prev, waiter, (for_a0,), held = await _held_behind_beta(reg, ("a0",))
        # a wait for room begun from here (a0's) is not past its share at once, as served
        reg.starve_share = 0.25
        reg.release(spare)  # beta's room: delta evicted
        lease_b = await asyncio.wait_for(waiter, 120)
        assert lease_b.labels == ["beta"] and not reg.names["delta"].resident
        await await_until(lambda: held.done() or for_a0.done(), 120, "alpha's or a0's request")
        assert held.done() and not for_a0.done()  # (before: a0's 503 came first)
        lease_a = held.result()
        assert lease_a.labels == ["alpha"] and reg.names["alpha"].refs == 2 and reg.queued == 1
        reg.release(lease_a)
        reg.release(prev)
        lease_0 = await asyncio.wait_for(for_a0, 120)  # alpha evicted for it
        assert lease_0.labels == ["a0"] and not reg.names["alpha"].resident
        reg.release(lease_0)
        reg.release(lease_b)

    asyncio.run(go())


def test_a_request_held_back_is_served_at_once_when_the_wait_for_room_is_cancelled(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """A request for alpha held back by beta's wait for room (--lora-wait 600 s): beta's
    request is cancelled (its client went); alpha's is served then, not at beta's deadline,
    and nothing is left waiting."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=2)
        reg.room_wait_s = 600.0
        prev, waiter, _, held = await _held_behind_beta(reg)
        waiter.cancel()
        await await_until(held.done, 60, "alpha's request")  # (not 600 s)
        lease = held.result()
        assert waiter.cancelled() and lease.labels == ["alpha"] and reg.names["alpha"].refs == 2
        assert reg.room_wait_since is None and reg.queued == 0 and reg._room_wait is None
        assert reg.names["beta"].waiting == 0 and not reg.names["beta"].resident
        reg.release(lease)
        reg.release(prev)

    asyncio.run(go())


def test_a_request_held_back_whose_file_went_meanwhile_hears_which_file(
    svc: EngineService, tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    """A request for alpha arrived while alpha was resident, held back by beta's wait for
    room; alpha, released, was evicted for beta, and its file was removed meanwhile: read
    again, it fails with a 400 naming the adapter and the file (as any read)."""
    path = tmp_path / "alpha.gguf"
    path.write_bytes(tiny_files["alpha"].read_bytes())

    async def go() -> None:
        reg = AdapterRegistry(svc, room_wait_s=600.0, max_loras=2)
        for name, file in (("alpha", path), ("beta", tiny_files["beta"])):
            reg.add_module(name, str(file))
        reg.add_module("gamma", str(tiny_files["gamma"]))
        prev, waiter, _, held = await _held_behind_beta(reg)
        path.unlink()
        reg.release(prev)
        lease_b = await asyncio.wait_for(waiter, 120)
        assert not reg.names["alpha"].resident
        with pytest.raises(AdapterError) as exc:
            await asyncio.wait_for(held, 120)
        assert f"adapter 'alpha': {path}: no such file" in str(exc.value)
        assert reg.queued == 0 and reg.names["alpha"].refs == 0
        reg.release(lease_b)

    asyncio.run(go())


def test_an_adapter_named_by_id_is_not_evicted_for_its_own_request(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """A request for beta by name and alpha by id (idle, resident) under --max-loras 2 with
    gamma in use: making room for beta evicted alpha, and the request was a 400 'lora: unknown
    adapter id'. alpha is taken with beta: the request waits for gamma's release."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=2)
        reg.room_wait_s = 30.0
        alpha, beta = reg.names["alpha"], reg.names["beta"]
        reg.release(await reg.lease("alpha", None, BASE))
        held_c = await reg.lease("gamma", None, BASE)
        a_id = alpha.id
        assert a_id is not None
        both = asyncio.ensure_future(reg.lease("beta", {a_id: 0.5}, BASE))
        await await_until(lambda: beta.waiting > 0, 30, "the request to wait for room")
        assert alpha.resident and alpha.id == a_id and not both.done()
        reg.release(held_c)
        lease = await asyncio.wait_for(both, 120)
        assert lease.labels == ["alpha", "beta"] and dict(lease.lora) == {a_id: 0.5, beta.id: 1.0}
        assert alpha.refs == 1 and beta.refs == 1 and not reg.names["gamma"].resident
        reg.release(lease)

    asyncio.run(go())


def test_a_failed_read_drops_the_reads_of_the_others(
    svc: EngineService, tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    """{alpha, broken}: alpha read, broken's read fails; alpha's read (a whole prepared adapter,
    in no budget) stayed on its entry until a later request for it."""

    async def go() -> None:
        reg = _registry(svc, tiny_files)
        bad = tmp_path / "broken.gguf"
        bad.write_bytes(b"not a gguf file at all")
        reg.add_module("broken", str(bad))
        with pytest.raises((AdapterError, RequestError), match="broken"):
            await reg.lease(None, None, BASE, {"alpha": 0.5, "broken": 0.5})
        alpha = reg.names["alpha"]
        assert alpha.loading is None and not alpha.resident and alpha.refs == 0
        reg.release(await reg.lease("alpha", None, BASE))  # (read again)

    asyncio.run(go())


def test_an_adapter_evicted_by_hand_wakes_a_request_waiting_for_room(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """--max-loras 2, alpha at a nonzero global scale (never evicted to make room) and gamma in
    use, a request for beta waiting: a router's evict of alpha freed the room without waking it,
    and it waited out --lora-wait for its 503."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=2)
        reg.room_wait_s = 600.0
        alpha, beta = reg.names["alpha"], reg.names["beta"]
        reg.release(await reg.lease("alpha", None, BASE))
        assert alpha.id is not None
        await reg.set_scales({alpha.id: 0.5})
        held_c = await reg.lease("gamma", None, BASE)
        waiting = asyncio.ensure_future(reg.lease("beta", None, BASE))
        await await_until(lambda: beta.waiting > 0, 30, "beta's request to wait for room")
        reg.evict("alpha")
        lease = await asyncio.wait_for(waiting, 60)  # (not room_wait_s)
        assert lease.labels == ["beta"] and not alpha.resident
        reg.release(lease)
        reg.release(held_c)
        await reg.set_scales({})

    asyncio.run(go())


def test_an_adapter_just_attached_waits_for_its_requests(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """Room for one adapter, two requests for two adapters at once: the second attach waits
    until the first adapter's request has run, instead of evicting it before that request woke
    up (which cost a third load here, and under many adapters refused requests after eight
    evictions in a row). Then sixteen requests over four adapters through room for two."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=1)
        reg.add_module("delta", str(tiny_files["delta"]))
        reg.room_wait_s = 30.0
        loads: list[str] = []
        reg.on_attach.append(lambda name, load, wait: loads.append(name))

        async def one(name: str) -> str:
            lease = await reg.lease(name, None, BASE)
            await asyncio.sleep(0.01)
            reg.release(lease)
            return lease.labels[0]

        got = await asyncio.wait_for(asyncio.gather(one("alpha"), one("beta")), 60)
        assert got == ["alpha", "beta"] and sorted(loads) == ["alpha", "beta"]
        reg.max_loras = 2
        names = ["alpha", "beta", "gamma", "delta"]
        for r in range(4):
            many = [one(names[(i + r) % 4]) for i in range(16)]
            assert sorted(await asyncio.wait_for(asyncio.gather(*many), 60)) == sorted(names * 4)
            assert len(reg.by_id) <= 2
            await _settled(svc, reg)

    asyncio.run(go())


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
        reg = _registry(svc, tiny_files, max_bytes=int(nbytes * 2.5))
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
        reg = _registry(svc, tiny_files)
        reg.release(await reg.lease("alpha", None, BASE))
        nbytes = reg.resident_bytes
        reg = _registry(svc, tiny_files, max_bytes=nbytes * 3 // 2)
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


def test_a_global_scale_that_overflows_every_request_is_refused(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """POST /lora-adapters with a scale of 1e30 was taken, and every request at the global
    scales then got a 400 'logits not finite' until they were reset. A scale at which the
    adapter's delta on an input of +-1 values leaves float16's range is a 400 naming the adapter
    and the largest magnitude it takes; scales short of that (4, -1) are taken as before."""

    async def go() -> None:
        reg = _registry(svc, tiny_files)
        entry = await reg.load("fresh-alpha", str(tiny_files["alpha"]))
        assert entry.id is not None and entry.facts is not None and entry.facts.reach > 0
        for huge in (1e30, -1e30):
            with pytest.raises(RequestError) as exc:
                await reg.set_scales({entry.id: huge})
            assert exc.value.code == "invalid_scale"
            assert f"adapter {entry.id} (fresh-alpha): scale {huge:g}" in str(exc.value)
            assert "a bound for one input of +-1 values, not a guarantee" in str(exc.value)
            assert reg.adapters.scales().get(entry.id, 0.0) == 0.0
        for fine in (4.0, -1.0, 0.0):
            await reg.set_scales({entry.id: fine})
            assert reg.adapters.scales().get(entry.id, 0.0) == fine
        await reg.unload("fresh-alpha")
        with pytest.raises(AdapterError, match=r"--lora-scaled .*alpha.gguf: scale 1e\+30 takes"):
            reg.preload(str(tiny_files["alpha"]), 1e30)  # (it was attached at 1e30)
        assert len(reg.by_id) == 0

    asyncio.run(go())


def test_adapters_whose_global_scales_overflow_only_together_are_refused(
    svc: EngineService, tmp_path: Path
) -> None:
    """Two adapters on one attn_q, each at 90% of the largest global scale it takes alone: each
    scale was checked alone and both were taken, and every request at the global scales could
    then overflow where their deltas add up. POST /lora-adapters refuses the pair (a 400
    naming both adapters and scales, the scales left as they were), as --lora-scaled does at
    start (next test); one on another layer's attn_q beside it (deltas that never add up) is
    taken, as are the two at half those scales."""
    shape = (SPEC.n_embd, SPEC.n_head * SPEC.head_dim)
    paths = {
        "q1": write_tiny_adapter(tmp_path / "q1.gguf", SPEC, {"blk.0.attn_q": shape}, seed=3),
        "q2": write_tiny_adapter(tmp_path / "q2.gguf", SPEC, {"blk.0.attn_q": shape}, seed=4),
        "other": write_tiny_adapter(tmp_path / "o.gguf", SPEC, {"blk.1.attn_q": shape}, seed=5),
    }

    async def go() -> None:
        reg = AdapterRegistry(svc)
        entries = {name: await reg.load(name, str(path)) for name, path in paths.items()}
        ids, near = {}, {}
        for name, e in entries.items():
            assert e.id is not None and e.facts is not None and e.facts.reach > 0
            ids[name], near[name] = e.id, 0.9 * F16_MAX / e.facts.reach
            await reg.set_scales({e.id: near[name]})  # each alone: taken
        q1, q2 = (entries[n].facts for n in ("q1", "q2"))
        assert q1 is not None and q2 is not None
        (site,) = q1.reaches  # blk.0's attn_q (in the model's fused projection)
        assert near["q1"] * q1.reaches[site] + near["q2"] * q2.reaches[site] > F16_MAX
        await reg.set_scales({ids["q1"]: near["q1"], ids["other"]: -near["other"]})
        with pytest.raises(RequestError) as exc:
            await reg.set_scales({ids["q1"]: near["q1"], ids["q2"]: -near["q2"]})
        assert exc.value.code == "invalid_scale"
        words = str(exc.value)
        assert f"adapter {ids['q1']} (q1) at scale {near['q1']:g}, " in words
        assert f"adapter {ids['q2']} (q2) at scale {-near['q2']:g}: " in words
        assert f"together their deltas on {site} reach" in words and "other" not in words
        assert dict(reg.adapters.scales()) == {ids["q1"]: near["q1"], ids["other"]: -near["other"]}
        await reg.set_scales({ids["q1"]: near["q1"] / 2, ids["q2"]: near["q2"] / 2})

    asyncio.run(go())


def test_adapters_on_disjoint_rows_of_a_fused_projection_do_not_add_up(
    svc: EngineService, tmp_path: Path
) -> None:
    """A Q-only and a V-only adapter on blk.0 (one fused QKV projection in the model), each at
    90% of the largest global scale it takes alone: their reaches were summed on the fused
    projection (up to twice the true bound) and the pair refused, though their deltas reach
    disjoint rows (Q's, V's) and never add up. The pair is taken; Q-only beside a Q-and-V
    adapter (rows shared) is still refused."""
    hd = SPEC.head_dim
    n_q, n_kv = SPEC.n_head * hd, SPEC.n_head_kv * hd
    on_q = {"blk.0.attn_q": (SPEC.n_embd, n_q)}
    on_v = {"blk.0.attn_v": (SPEC.n_embd, n_kv)}
    paths = {
        "q": write_tiny_adapter(tmp_path / "q.gguf", SPEC, on_q, seed=3),
        "v": write_tiny_adapter(tmp_path / "v.gguf", SPEC, on_v, seed=4),
        "qv": write_tiny_adapter(tmp_path / "qv.gguf", SPEC, {**on_q, **on_v}, seed=5),
    }

    async def go() -> None:
        reg = AdapterRegistry(svc)
        entries = {name: await reg.load(name, str(path)) for name, path in paths.items()}
        ids, near = {}, {}
        for name, e in entries.items():
            assert e.id is not None and e.facts is not None and e.facts.reach > 0
            ids[name], near[name] = e.id, 0.9 * F16_MAX / e.facts.reach
        q, v, qv = (entries[n].facts for n in ("q", "v", "qv"))
        assert q is not None and v is not None and qv is not None
        (site,) = q.reaches
        assert set(v.reaches) == {site} and near["q"] * q.reach + near["v"] * v.reach > F16_MAX
        assert q.rows[site] == (0, n_q) and v.rows[site] == (n_q + n_kv, n_q + 2 * n_kv)
        await reg.set_scales({ids["q"]: near["q"], ids["v"]: -near["v"]})  # (refused before)
        assert dict(reg.adapters.scales()) == {ids["q"]: near["q"], ids["v"]: -near["v"]}
        with pytest.raises(RequestError, match=f"together their deltas on {site} reach"):
            await reg.set_scales({ids["q"]: near["q"], ids["qv"]: near["qv"]})

    asyncio.run(go())


def test_adapters_whose_lora_scaled_overflow_only_together_are_refused_at_start(
    svc: EngineService, tmp_path: Path
) -> None:
    """--lora-scaled a.gguf S --lora-scaled b.gguf S on the same projection, each within range
    alone: both were attached, every request at the global scales at risk. The second is
    refused at start, naming both adapters and their scales; at a third of S it is taken."""
    on_q = {"blk.0.attn_q": (SPEC.n_embd, SPEC.n_head * SPEC.head_dim)}
    a = write_tiny_adapter(tmp_path / "a.gguf", SPEC, targets=on_q, seed=3)
    b = write_tiny_adapter(tmp_path / "b.gguf", SPEC, targets=on_q, seed=3)  # (the same)
    reg = AdapterRegistry(svc)
    limit = F16_MAX / svc.prepare_adapter(str(a)).facts.reach
    first = reg.preload(str(a), 0.75 * limit)
    assert first.facts is not None
    with pytest.raises(AdapterError) as exc:
        reg.preload(str(b), -0.75 * limit)
    words = str(exc.value)
    assert f"--lora-scaled {a} at scale {0.75 * limit:g}, " in words
    assert f"--lora-scaled {b} at scale {-0.75 * limit:g}: " in words
    assert f"together their deltas on {next(iter(first.facts.reaches))} reach" in words
    assert len(reg.by_id) == 1
    reg.preload(str(b), 0.25 * limit)
    assert len(reg.by_id) == 2


def test_an_embedding_adapters_scale_is_refused_only_past_its_rows_bound(
    svc: EngineService, tmp_path: Path
) -> None:
    """An embedding LoRA whose tokens each use one of its 4 columns (every row of its delta at
    most 3): its reach was bounded by 12 (every column's largest value, summed), and a global
    scale of F16_MAX / 6, rows at half of float16's range, was refused as past it. Bounded by
    3 now: that scale is taken; F16_MAX / 2, rows at 1.5 times the range, is still refused."""
    n_vocab = int(svc.adapters.model.seams.n_vocab)
    one_hot = np.zeros((n_vocab, 4), np.float32)  # (n_vocab, r): token t uses column t % 4
    one_hot[np.arange(n_vocab), np.arange(n_vocab) % 4] = 1.0
    factors = {"token_embd": (one_hot, np.full((SPEC.n_embd, 4), 3.0, np.float32))}
    path = write_tiny_adapter(
        tmp_path / "e.gguf",
        SPEC,
        {"token_embd": (n_vocab, SPEC.n_embd)},
        alpha=4.0,
        overrides=factors,
    )

    async def go() -> None:
        reg = AdapterRegistry(svc)
        entry = await reg.load("embed", str(path))
        assert entry.id is not None and entry.facts is not None
        await reg.set_scales({entry.id: F16_MAX / 6})  # (refused: "takes its delta to 1.31e+05")
        assert entry.facts.reach == pytest.approx(3.0)
        assert reg.adapters.scales() == {entry.id: F16_MAX / 6}
        with pytest.raises(RequestError, match=r"\(embed\): scale 32752 takes its delta to 9"):
            await reg.set_scales({entry.id: F16_MAX / 2})

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


def test_one_file_loaded_under_two_names_is_one_resident_copy(
    svc: EngineService, tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    """load_lora_adapter of the same file (path, size, mtime) under two names attached two
    copies (1000 names: 1000 copies, unbounded without --max-loras). The names now share one:
    unloading one leaves the other served; a file changed on disk is a copy of its own."""

    async def go() -> None:
        reg = _registry(svc, tiny_files)
        path = tmp_path / "same.gguf"
        path.write_bytes(tiny_files["alpha"].read_bytes())
        one = await reg.load("one", str(path))
        size = reg.resident_bytes
        two = await reg.load("two", str(tmp_path / "." / "same.gguf"))
        assert two is one and len(reg.by_id) == 1 and reg.resident_bytes == size
        lease = await reg.lease("two", None, BASE)
        assert lease.lora == {one.id: 1.0}
        reg.release(lease)
        await reg.unload("one")
        assert one.resident and not one.retired
        reg.release(await reg.lease("two", None, BASE))  # still served
        mtime = path.stat().st_mtime_ns
        path.write_bytes(tiny_files["beta"].read_bytes())  # changed on disk: not the same file
        os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # (a later mtime, however coarse)
        three = await reg.load("three", str(path))
        assert three is not one and len(reg.by_id) == 2
        assert await reg.load("four", str(path)) is three
        reg.forget("four")  # (unloaded on another replica: the name goes, its copy stays)
        assert three.resident and not three.retired and "four" in reg.unloaded
        await reg.unload("two")
        await await_until(
            lambda: one.retired and not one.resident and set(reg.by_id) == {three.id},
            60,
            "two's unload",
        )
        await _settled(svc, reg)
        await reg.unload("three")

    asyncio.run(go())


def _gated_reads(svc: EngineService, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Adapter reads wait in their thread until the event returned is set."""
    gate, real = threading.Event(), svc.prepare_adapter
    monkeypatch.setattr(svc, "prepare_adapter", lambda p: gate.wait(60) and real(p))
    return gate


def test_a_shared_copy_unloaded_while_another_name_loads_it(
    svc: EngineService,
    tiny_files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "one" loaded, then evicted; "two" loads the same file (a read: it awaits) while "one" is
    unloaded: "two" was bound to the retired entry (dropped after every request, read again on
    the next). Then the shared copy is named by a name that still maps to it ("one" unloaded or
    reused: its labels, /lora-adapters and the errors said "one")."""

    async def go() -> None:
        reg = _registry(svc, tiny_files)
        path = tmp_path / "same.gguf"
        path.write_bytes(tiny_files["alpha"].read_bytes())
        one = await reg.load("one", str(path))
        reg.evict("one")
        assert not one.resident
        gate = _gated_reads(svc, monkeypatch)
        loading = asyncio.ensure_future(reg.load("two", str(path)))
        await await_until(lambda: one.loading is not None, 30, "the read of two")
        await reg.unload("one")
        gate.set()
        two = await asyncio.wait_for(loading, 60)
        assert two is one and not two.retired and two.resident and two.name == "two"
        lease = await reg.lease("two", None, BASE)
        assert lease.labels == ["two"]
        reg.release(lease)
        assert two.resident  # (kept: not read again on the next request)
        three = await reg.load("three", str(path))
        assert three is two
        await reg.load("two", str(tiny_files["beta"]))  # the name reused for another file
        assert three.name == "three" and reg.names["two"] is not three
        assert {row["name"] for row in reg.adapter_list()} == {"two", "three"}
        await reg.unload("two")
        await reg.unload("three")

    asyncio.run(go())


def test_an_adapter_unloaded_while_it_was_read_is_not_left_attached(
    svc: EngineService, tiny_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router's warm of alpha, alpha unloaded while it is read: it landed and stayed attached,
    nameless, held by nobody, until the server stopped."""

    async def go() -> None:
        reg = _registry(svc, tiny_files)
        alpha = reg.names["alpha"]
        gate = _gated_reads(svc, monkeypatch)
        warming = asyncio.ensure_future(reg.warm("alpha"))
        await await_until(lambda: alpha.loading is not None, 30, "alpha's read")
        await reg.unload("alpha")
        gate.set()
        await asyncio.wait_for(warming, 60)
        assert alpha.retired and not alpha.resident and not reg.by_id

    asyncio.run(go())


def test_adapters_at_a_global_scale_count_as_kept_when_a_request_cannot_fit(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """--max-loras 2, alpha at a nonzero global scale (never evicted): a request for beta and
    gamma together can never fit, a 400 at once naming why, where it waited for its 503."""

    async def go() -> None:
        reg = _registry(svc, tiny_files, max_loras=2)
        reg.room_wait_s = 600.0
        alpha = reg.names["alpha"]
        reg.release(await reg.lease("alpha", None, BASE))
        assert alpha.id is not None
        await reg.set_scales({alpha.id: 0.5})
        with pytest.raises(RequestError, match="never evicted") as exc:
            await asyncio.wait_for(reg.lease(None, None, BASE, {"beta": 1.0, "gamma": 1.0}), 60)
        assert exc.value.code == "too_many_adapters"
        assert all(e.refs == 0 and e.loading is None for e in reg.names.values())
        await reg.set_scales({})
        lease = await reg.lease(None, None, BASE, {"beta": 1.0, "gamma": 1.0})  # now it fits
        reg.release(lease)

    asyncio.run(go())


def test_a_read_whose_request_went_is_not_kept(
    svc: EngineService, tiny_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request cancelled while its adapter is read (a client gone): the read ends in its
    thread and is not kept, since a prepared adapter that has not landed is in no budget."""
    real = svc.prepare_adapter
    monkeypatch.setattr(svc, "prepare_adapter", lambda p: time.sleep(0.3) or real(p))

    async def go() -> None:
        reg = _registry(svc, tiny_files)
        gone = asyncio.ensure_future(reg.lease("alpha", None, BASE))
        await asyncio.sleep(0.1)
        gone.cancel()
        entry = reg.names["alpha"]
        assert entry.loading is not None
        await await_until(lambda: entry.loading is None, 30, "the read to be let go")
        assert not entry.resident
        reg.release(await reg.lease("alpha", None, BASE))  # read again, served

    asyncio.run(go())


def test_replacing_an_adapter_leaves_running_requests_alone(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """A request running on adapter X keeps X's weights when X is replaced mid-generation; new
    requests get the new weights under a new id; the old adapter goes when its request ends."""
    prompt, n = [9, 40, 120, 7], 300
    ref = graftlm.load(tiny_files["model"], ctx_size=SPEC.n_ctx)
    old_ref, new_ref = ref.add_lora(tiny_files["alpha"], 0.0), ref.add_lora(tiny_files["beta"], 0.0)

    def ref_run(i: int) -> list[int]:
        return [t for t in _greedy(ref, prompt, n, i)]

    async def go() -> None:
        reg = AdapterRegistry(svc)
        reg.add_module("x", str(tiny_files["alpha"]))
        lease = await reg.lease("x", None, BASE)
        (old_id,) = lease.lora
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        tokens: list[int] = []
        async with aclosing(svc.stream([Job(prompt, params, lease.lora)])) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    tokens.append(ev.token)
                if len(tokens) == 3:
                    # hold the engine until the new adapter is in (at scale 0 it goes in beside
                    # a busy engine): the request is mid-way however long the read takes
                    gate = threading.Event()
                    svc.call(lambda gate=gate: gate.wait(300))
                    try:
                        await reg.load("x", str(tiny_files["beta"]))
                        assert reg.by_id[old_id].retired and old_id in _attached(svc)
                        assert reg.names["x"].id != old_id
                        assert svc.engine.running  # the new adapter arrived mid-generation
                    finally:
                        gate.set()
                if isinstance(ev, FinishEvent):
                    assert ev.n_generated == n
        reg.release(lease)
        await await_until(lambda: old_id not in _attached(svc), 60, f"adapter {old_id}'s detach")
        assert old_id not in _attached(svc) and old_id not in reg.by_id
        assert tokens == ref_run(old_ref)
        lease2 = await reg.lease("x", None, BASE)
        (new_id,) = lease2.lora
        async with aclosing(svc.stream([Job(prompt, params, lease2.lora)])) as events:
            again = [ev.token async for ev in events if isinstance(ev, TokenEvent)]
        reg.release(lease2)
        assert again == ref_run(new_ref)

    asyncio.run(go())


def _greedy(model: graftlm.Model, prompt: list[int], n: int, adapter: int) -> list[int]:
    from graftlm.lora.settings import AdapterSettings
    from graftlm.runtime.scheduler import Request

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    req = model.engine.submit(Request(prompt, params, AdapterSettings({adapter: 1.0})))
    model.engine.run(req)
    return req.generated


def test_runtime_load_and_unload_over_http(server: TinyServer) -> None:
    http = httpx.Client(base_url=server.url, timeout=60)
    prompt = [4, 50, 99]

    def complete(model: str) -> httpx.Response:
        return http.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
        )

    r = http.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "gamma", "lora_path": str(server.adapters["gamma"])},
    )
    assert r.status_code == 200, r.text
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["gamma"]["parent"] == "tiny"
    assert complete("gamma").json()["choices"][0]["text"] == server.ref.detokenize(
        server.ref_tokens(prompt, 8, {"gamma": 1.0})
    )
    r = http.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "gamma", "lora_path": str(server.adapters["delta"])},
    )
    assert r.status_code == 200, r.text
    assert complete("gamma").json()["choices"][0]["text"] == server.ref.detokenize(
        server.ref_tokens(prompt, 8, {"delta": 1.0})
    )
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200
    # an unloaded adapter's name is a 404 naming it (as vLLM's), not the base's answer that a
    # name never registered gets without --strict-model-names (as llama-server's)
    error_of(complete("gamma"), 404, "'gamma' was unloaded")
    by_name = {"prompt": prompt, "max_tokens": 2, "lora": [{"name": "gamma", "scale": 1.0}]}
    error_of(http.post("/v1/completions", json=by_name), 404, "'gamma' (it was unloaded)")
    # a name unloaded elsewhere (another replica told this one), never held here: a 404 too
    server.state.registry.forget("elsewhere")
    error_of(complete("elsewhere"), 404, "'elsewhere' was unloaded")
    assert complete("tiny").status_code == 200
    registry, service = server.state.registry, server.state.service

    def settled() -> bool:  # (the registry lets it go at once; the engine detaches it later)
        gone = not any(e.name == "gamma" for e in registry.by_id.values())
        return gone and set(service.adapters.attached) == set(registry.by_id)

    wait_until(settled, 60, "gamma let go and detached", every=0.01)
    assert not any(e.name == "gamma" for e in registry.by_id.values())
    assert set(service.adapters.attached) == set(registry.by_id)
    r = http.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "gamma", "lora_path": str(server.adapters["gamma"])},
    )
    assert r.status_code == 200, r.text  # loaded again: served again
    assert complete("gamma").json()["choices"][0]["text"] == server.ref.detokenize(
        server.ref_tokens(prompt, 8, {"gamma": 1.0})
    )
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200


def test_errors_list_a_few_of_many_adapters(svc: EngineService, tmp_path: Path) -> None:
    """With hundreds of adapters registered, an unknown name's 404 names it and the first 20
    (each cut to 64 characters) and says how many more, where it listed every one."""
    one = write_tiny_adapter(tmp_path / "one.gguf", SPEC)

    async def go() -> None:
        reg = AdapterRegistry(svc)
        for i in range(300):
            reg.add_module(f"tenant-{i:03d}-" + "x" * (100 if i == 0 else 8), str(one))
        for call in (
            lambda: reg.lease("nope", None, BASE),  # (the base's name listed first: 281 more)
            lambda: reg.lease(None, None, BASE, {"nope": 1.0}),
            lambda: reg.unload("nope"),
            lambda: reg.warm("nope"),
        ):
            with pytest.raises(RequestError) as exc:
                await call()
            msg = str(exc.value)
            assert "'nope'" in msg and re.search(r"\(and 28[01] more: GET /v1/models\)$", msg)
            assert "tenant-018-" in msg and "tenant-020-" not in msg, msg
            assert "tenant-000-" + "x" * 50 + "..." in msg and len(msg) < 1000, msg
        assert not reg.by_id

    asyncio.run(go())


def test_a_slow_adapter_read_ends_its_request_with_a_503(
    svc: EngineService, tiny_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading runs in a worker thread under a deadline: a read that hangs (a network mount,
    say) ends the request that waits for it, and the registry goes on serving."""

    release = threading.Event()
    real = svc.prepare_adapter

    def hanging(path: str) -> object:
        release.wait(10)
        return real(path)

    async def go() -> None:
        reg = _registry(svc, tiny_files)
        reg.load_timeout_s = 0.3
        monkeypatch.setattr(svc, "prepare_adapter", hanging)
        with pytest.raises(RequestError) as exc:
            await reg.lease("alpha", None, BASE)
        assert exc.value.code == "adapter_load_timeout" and not reg.names["alpha"].resident
        release.set()
        monkeypatch.setattr(svc, "prepare_adapter", real)
        lease = await reg.lease("alpha", None, BASE)
        assert reg.names["alpha"].resident
        reg.release(lease)

    asyncio.run(go())


def test_reads_take_turns_but_a_hung_one_lets_the_next_start(
    svc: EngineService, tiny_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads run one at a time (side by side they only take turns at the interpreter's lock),
    the time one queues counted as its wait, not its load; a read that hangs past read_alone_s
    lets the next one start beside it, so one slow file does not hold up every other adapter."""

    release = threading.Event()
    real = svc.prepare_adapter
    running: list[str] = []
    most = [0]
    loads: list[tuple[str, float, float]] = []

    def watched(path: str) -> object:
        running.append(path)
        most[0] = max(most[0], len(running))
        try:
            if path == str(tiny_files["alpha"]):
                release.wait(120)
            return real(path)
        finally:
            running.remove(path)

    async def go() -> None:
        reg = _registry(svc, tiny_files)
        reg.on_attach.append(lambda name, load, wait: loads.append((name, load, wait)))
        monkeypatch.setattr(svc, "prepare_adapter", watched)
        reg.read_alone_s = 1.0
        hung = asyncio.ensure_future(reg.lease("alpha", None, BASE))
        # (alpha's read has begun: beta queues behind it)
        await await_until(lambda: running, 60, "the first read to start", every=0.001)
        lease = await asyncio.wait_for(reg.lease("beta", None, BASE), 120)  # past the hung read
        assert reg.names["beta"].resident and not reg.names["alpha"].resident
        assert most[0] == 2  # (beside the hung one, after read_alone_s)
        release.set()
        reg.release(await hung)
        reg.release(lease)
        # two reads asked together run one after the other
        reg.add_module("delta", str(tiny_files["delta"]))
        reg.read_alone_s, most[0] = 30.0, 0
        for x in await asyncio.gather(
            reg.lease("gamma", None, BASE), reg.lease("delta", None, BASE)
        ):
            reg.release(x)
        assert most[0] == 1

    asyncio.run(go())
    beta = [w for name, _, w in loads if name == "beta"]
    # it waited for the reader (read_alone_s from that read's start, which it saw begin), and
    # that is wait, not load
    assert beta and beta[0] >= 0.1


def test_an_adapter_for_another_base_is_a_short_answer(
    server: TinyServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One problem a tensor would be kilobytes: the answer names a few and counts the rest."""
    from dataclasses import replace

    other = replace(SPEC, n_embd=SPEC.n_embd * 2, n_layer=12)
    path = write_tiny_adapter(tmp_path_factory.mktemp("other") / "other.gguf", other, seed=9)
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "other", "lora_path": str(path)}, timeout=60)  # fmt: skip
    msg = error_of(r, 400)["message"]
    assert "other.gguf" in msg and re.search(r"  - and \d+ more$", msg), msg
    assert len(msg.splitlines()) <= 1 + 5 and len(msg) < 2000
