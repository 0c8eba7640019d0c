"""An adapter attached while a step is in flight goes in beside the step (EngineService.attach,
AdapterSet.attach_beside): the running requests' answers do not change, the new adapter's
requests answer as on a model that had it from the start, and no step runs a row on an adapter
whose slots are not in every table it reads."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

import graftlm
from graftlm.lora.adapter import EMBEDDING
from graftlm.lora.adapter_set import AdapterSet
from graftlm.lora.settings import AdapterSettings
from graftlm.lora.site import LoraSite
from graftlm.native import library
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.service import EngineService, FinishEvent, Job, TokenEvent

SPEC = TinySpec(n_ctx=512)
PROMPTS = [[1, 5, 9, 13], [2, 6, 10], [3, 7, 11, 15, 19], [4, 8]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("beside")
    out = {"model": write_tiny_model(d / "m.gguf", SPEC)}
    for k in range(6):
        out[f"a{k}"] = write_tiny_adapter(d / f"a{k}.gguf", SPEC, seed=40 + k)
    return out


def _alone(files: dict[str, Path], name: str | None, prompt: list[int], n: int) -> list[int]:
    """The greedy answer of one request alone, on a model with only its adapter attached."""
    model = graftlm.load(files["model"], ctx_size=SPEC.n_ctx, n_seq=1)
    lora = {} if name is None else {model.add_lora(files[name], scale=0.0): 1.0}
    service = EngineService(model.engine, model.prompter, model.adapters).start()
    try:
        return asyncio.run(_tokens(service, _job(prompt, n, lora)))
    finally:
        service.close()


def _job(prompt: list[int], n: int, lora: dict[int, float]) -> Job:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return Job(prompt, params, AdapterSettings(lora))


async def _tokens(service: EngineService, job: Job) -> list[int]:
    out: list[int] = []
    async for ev in service.stream([job]):
        if isinstance(ev, TokenEvent):
            out.append(ev.token)
        assert not isinstance(ev, Exception)
        if isinstance(ev, FinishEvent):
            break
    return out


def _checked_steps(service: EngineService, seen: list[str]) -> None:
    """Before each step (on the engine's thread), every adapter a queued or running request
    names must be attached with its slot in the table of every projection it names."""
    engine, adapters = service.engine, service.adapters
    step = engine.step

    def checked() -> Any:
        for req in [*engine.running, *engine.waiting]:
            for i in req.lora:
                attached = adapters.attached.get(i)
                if attached is None:
                    seen.append(f"adapter {i} runs but is not attached")
                    continue
                for name in attached.adapter.deltas:
                    site = adapters.model.seams.projections[name].lora
                    table = None if site is None else site.native()
                    if table is None or i not in table.ids:
                        seen.append(f"adapter {i} runs without its slot in {name}'s table")
        return step()

    engine.step = checked  # type: ignore[method-assign]


@pytest.mark.skipif(library() is None, reason="the native delta's tables need the library")
def test_adapters_attached_and_detached_beside_running_steps(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    n_long, n_short = 24, 6
    long_names: list[str | None] = [None, "a0", "a1"]
    want_long = [_alone(files, nm, PROMPTS[k], n_long) for k, nm in enumerate(long_names)]
    churned = ["a2", "a3", "a4", "a5"]
    want_short = {nm: _alone(files, nm, PROMPTS[3], n_short) for nm in churned}

    # each slot goes in with a pause after it: the steps run while an attach is half done
    stage = LoraSite.stage_packed

    def slow_stage(self: LoraSite, slot: int, packed: Any) -> None:
        stage(self, slot, packed)
        time.sleep(0.0005)

    monkeypatch.setattr(LoraSite, "stage_packed", slow_stage)
    beside = AdapterSet.attach_beside
    went_beside: list[int | None] = []

    def counted(self: AdapterSet, adapter: Any) -> int | None:
        out = beside(self, adapter)
        went_beside.append(out)
        return out

    monkeypatch.setattr(AdapterSet, "attach_beside", counted)

    model = graftlm.load(files["model"], ctx_size=SPEC.n_ctx, n_seq=5)
    resident = {nm: model.add_lora(files[nm], scale=0.0) for nm in ("a0", "a1")}
    service = EngineService(model.engine, model.prompter, model.adapters).start()
    problems: list[str] = []
    _checked_steps(service, problems)
    try:

        async def churn() -> list[tuple[str, list[int]]]:
            got = []
            for rnd in range(3):
                for nm in churned:
                    prepared = await asyncio.to_thread(service.prepare_adapter, files[nm])
                    i = await asyncio.wrap_future(service.attach(prepared))
                    got.append((nm, await _tokens(service, _job(PROMPTS[3], n_short, {i: 1.0}))))
                    await asyncio.wrap_future(service.detach(i))
                    assert i not in service.adapters.attached, (rnd, nm)
            return got

        async def go() -> tuple[list[list[list[int]]], list[tuple[str, list[int]]]]:
            done = asyncio.Event()

            async def client(k: int, nm: str | None) -> list[list[int]]:
                # the same request again and again while the adapters churn: steps always run
                lora = {} if nm is None else {resident[nm]: 1.0}
                got = []
                while not done.is_set():
                    got.append(await _tokens(service, _job(PROMPTS[k], n_long, lora)))
                return got

            async def churning() -> list[tuple[str, list[int]]]:
                try:
                    return await churn()
                finally:
                    done.set()

            clients = [client(k, nm) for k, nm in enumerate(long_names)]
            *long_got, short_got = await asyncio.gather(*clients, churning())
            return long_got, short_got

        long_got, short_got = asyncio.run(go())
    finally:
        service.close()
    assert not problems, problems[:5]
    for k, answers in enumerate(long_got):
        assert answers and all(a == want_long[k] for a in answers), long_names[k]
    for nm, got in short_got:
        assert got == want_short[nm], nm
    # the path under test ran: some attach went in beside a step (those that found the
    # engine's thread at rest, or its set's lock held, went between two steps)
    assert any(i is not None for i in went_beside), went_beside
    assert set(model.adapters.attached) == set(resident.values())


def test_attach_beside_places_whole_and_publishes_between_steps(files: dict[str, Path]) -> None:
    """A projection with no slots yet (its site would be made under the step), the slots
    changing on another thread or the model asleep: None, nothing changed. Otherwise the slot
    is in every projection the adapter names, the tables made before stay as they were and the model's adapters' generation unchanged
    until `publish`."""
    if library() is None:
        pytest.skip("packed slots need the library")
    model = graftlm.load(files["model"], ctx_size=SPEC.n_ctx, n_seq=1)
    adapters, seams = model.adapters, model.model.seams
    a0, a1, a2 = (adapters.load(files[f"a{k}"]) for k in range(3))  # read, not attached
    assert EMBEDDING not in a0.deltas
    assert adapters.attach_beside(a0) is None and not adapters.attached  # no site yet
    first = adapters.attach(a1, 0.0)
    sites = {name: seams.projections[name].lora for name in a0.deltas}
    tables = {name: site.native() for name, site in sites.items() if site is not None}
    generation = seams.generation.value
    i = adapters.attach_beside(a0)
    assert i == first + 1 and adapters.attached[i].scale == 0.0
    for name, site in sites.items():
        assert site is not None and i in site.slot_ids, name
        assert site.native() is tables[name] and i not in tables[name].ids, name
    assert seams.generation.value == generation
    adapters.publish()
    assert seams.generation.value > generation
    for name, site in sites.items():
        assert site is not None
        table = site.native()
        assert table is not None and table.ids == [first, i], name
    with adapters._lock:  # the slots changing on the engine's thread: no wait, None
        assert adapters.attach_beside(a2) is None
    adapters.release()  # asleep
    assert adapters.attach_beside(a2) is None and set(adapters.attached) == {first, i}
