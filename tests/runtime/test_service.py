"""The engine service's thread: a call that needs a cache slot (a scoring pass) waits while every
slot is held, and runs as soon as one is free, even when nothing else comes after it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tiny_models import TinySpec, write_tiny_model

import graftlm
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.service import EngineService, FinishEvent, Job


def test_a_deferred_scoring_call_runs_when_the_last_step_frees_its_slot(tmp_path: Path) -> None:
    """Found by the memory test and the fuzzers (a request unanswered for minutes): the call was
    put aside while the only slot generated, and the loop then slept on its inbox, the engine idle
    and the slot free, until some other request happened to arrive."""
    spec = TinySpec(n_ctx=256)
    model = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=256, n_seq=1)
    service = EngineService(model.engine, model.prompter, model.adapters).start()
    try:

        async def go() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            job = Job([1, 2, 3], params, AdapterSettings({}))
            stream = service.stream([job])
            first = await anext(stream)  # the generation holds the one slot now
            assert not model.engine.slots.n_free
            scored = service.prompt_logprobs([1, 2, 3, 4], 2, AdapterSettings({}))
            events = [first] + [ev async for ev in stream]
            assert isinstance(events[-1], FinishEvent)
            out = await asyncio.wait_for(asyncio.wrap_future(scored), 10)
            assert [e["id"] for e in out] == [2, 3, 4]

        asyncio.run(go())
    finally:
        service.close()
