"""The adapter registry's room (src/graftlm/server/adapter_room.py): LRU eviction, never an
adapter in use; a request waits for room instead of failing, all of its adapters at once or
none; requests for resident adapters are not queued behind one waiting for room, until that
one has waited past its share of --lora-wait (the hold-back rule: no starvation)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from registry_helpers import BASE, settled, tiny_registry
from server_fixtures import await_until

from graftlm.errors import AdapterError, RequestError
from graftlm.runtime.service import EngineService
from graftlm.server.registry import AdapterRegistry, Lease


def test_lru_eviction_never_takes_an_adapter_in_use(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    async def go() -> None:
        reg = tiny_registry(svc, tiny_files, max_loras=2)
        a, b, c = (reg.names[n] for n in ("alpha", "beta", "gamma"))
        reg.release(await reg.lease("alpha", None, BASE))
        reg.release(await reg.lease("beta", None, BASE))
        held_c = await reg.lease("gamma", None, BASE)  # evicts alpha, the least recently used
        assert not a.resident and b.resident and c.resident
        assert len(reg.by_id) == 2
        await settled(svc, reg)
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
        await settled(svc, reg)

    asyncio.run(go())


def test_a_request_waits_for_room_instead_of_failing(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """Both resident adapters in use: a third request waits in the queue (it used to get a 503
    at once) and is served as soon as one of them is released."""

    async def go() -> None:
        reg = tiny_registry(svc, tiny_files, max_loras=2)
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
        reg = tiny_registry(svc, tiny_files, max_loras=2)
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
        await settled(svc, reg)

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
        reg = tiny_registry(svc, tiny_files, max_loras=1)
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
        reg = tiny_registry(svc, tiny_files, max_loras=2)
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
    # (read, and queued for the admission behind beta's, which is in it)
    in_line = 1 + len(behind)
    await await_until(lambda: reg.admitting == in_line, 60, "the requests behind beta's")
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
        reg = tiny_registry(svc, tiny_files, max_loras=3)
        for name in ("delta", "a0"):
            reg.add_module(name, str(tiny_files[name]))
        reg.room_wait_s = 600.0  # (before: held until a0's 503, past await_until's bound)
        spare = await reg.lease("delta", None, BASE)
        prev, waiter, (for_a0,), held = await _held_behind_beta(reg, ("a0",))
        # a wait for room begun from here (a0's) is not past its share at once, as served
        reg.starve_share = 0.25
        reg.release(spare)  # beta's room: delta evicted
        lease_b = await asyncio.wait_for(waiter, 120)
        assert lease_b.labels == ["beta"] and not reg.names["delta"].resident
        await await_until(lambda: held.done() or for_a0.done(), 120, "alpha's or a0's request")
        assert held.done() and not for_a0.done()  # (before: it waited for a0's too)
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
        reg = tiny_registry(svc, tiny_files, max_loras=2)
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
        reg = tiny_registry(svc, tiny_files, max_loras=2)
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
        reg = tiny_registry(svc, tiny_files)
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
        reg = tiny_registry(svc, tiny_files, max_loras=2)
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
        reg = tiny_registry(svc, tiny_files, max_loras=1)
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
            await settled(svc, reg)

    asyncio.run(go())
