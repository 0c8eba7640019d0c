"""The adapter registry: one file under two names, replacement under a running request, reads
that fail, hang or take turns, and vLLM's runtime load/unload API over HTTP. Refusals of what can
never fit: test_adapter_entries.py; of scales past float16's range: test_adapter_scales.py;
waiting for room and eviction: test_adapter_room.py."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest
from registry_helpers import BASE, attached_ids, settled, tiny_registry
from server_fixtures import SPEC, TinyServer, await_until, error_of, wait_until
from tiny_models import write_tiny_adapter

import graftlm
from graftlm.errors import RequestError
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.service import EngineService, FinishEvent, Job, TokenEvent
from graftlm.server.registry import AdapterRegistry


def test_one_file_loaded_under_two_names_is_one_resident_copy(
    svc: EngineService, tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    """load_lora_adapter of the same file (path, size, mtime) under two names attached two
    copies (1000 names: 1000 copies, unbounded without --max-loras). The names now share one:
    unloading one leaves the other served; a file changed on disk is a copy of its own."""

    async def go() -> None:
        reg = tiny_registry(svc, tiny_files)
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
        await settled(svc, reg)
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
        reg = tiny_registry(svc, tiny_files)
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
        reg = tiny_registry(svc, tiny_files)
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
        reg = tiny_registry(svc, tiny_files, max_loras=2)
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
        reg = tiny_registry(svc, tiny_files)
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
                        assert reg.by_id[old_id].retired and old_id in attached_ids(svc)
                        assert reg.names["x"].id != old_id
                        assert svc.engine.running  # the new adapter arrived mid-generation
                    finally:
                        gate.set()
                if isinstance(ev, FinishEvent):
                    assert ev.n_generated == n
        reg.release(lease)
        await await_until(lambda: old_id not in attached_ids(svc), 60, f"adapter {old_id}'s detach")
        assert old_id not in attached_ids(svc) and old_id not in reg.by_id
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
        reg = tiny_registry(svc, tiny_files)
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
        reg = tiny_registry(svc, tiny_files)
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
