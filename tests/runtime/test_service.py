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
            out = await asyncio.wait_for(asyncio.wrap_future(scored), 120)
            assert [e["id"] for e in out] == [2, 3, 4]

        asyncio.run(go())
    finally:
        service.close()


def test_a_steps_events_reach_their_loop_in_one_hand_off_in_order() -> None:
    """Events posted through an outbox wait for its flush, then arrive in the order posted,
    with one call into each loop for all its submissions."""
    from graftlm.runtime.events import TokenEvent
    from graftlm.runtime.tracking import Outbox, Submission

    async def go() -> None:
        loop = asyncio.get_running_loop()
        calls = 0
        wrapped = loop.call_soon_threadsafe

        def counting(*args: object) -> object:
            nonlocal calls
            calls += 1
            return wrapped(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        box = Outbox()
        subs = [Submission([], loop, asyncio.Queue(), outbox=box) for _ in range(2)]
        for i in range(3):
            for s, sub in enumerate(subs):
                sub.post(TokenEvent(s, i, str(i)))
        await asyncio.sleep(0)
        assert calls == 0 and all(sub.events.empty() for sub in subs)
        box.flush()
        await asyncio.sleep(0)
        assert calls == 1
        for s, sub in enumerate(subs):
            got = [sub.events.get_nowait() for _ in range(3)]
            assert [(e.index, e.token) for e in got] == [(s, 0), (s, 1), (s, 2)]
        box.flush()  # nothing held: no call
        assert calls == 1

    asyncio.run(go())


def test_a_whole_answers_events_wait_for_its_end() -> None:
    """A submission folded whole (not streamed) hands its events over when a job ends, with
    every event it holds then, in order; a streamed one at every flush."""
    from graftlm.runtime.events import ErrorEvent, TokenEvent
    from graftlm.runtime.tracking import Outbox, Submission

    def finish(index: int) -> FinishEvent:
        return FinishEvent(index, "length", "", n_prompt=1, n_generated=2)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        box = Outbox()
        whole = Submission([], loop, asyncio.Queue(), outbox=box, whole=True)
        streamed = Submission([], loop, asyncio.Queue(), outbox=box)
        for sub in (whole, streamed):
            sub.post(TokenEvent(0, 7, "a"))
            sub.post(TokenEvent(1, 8, "b"))
        box.flush()
        await asyncio.sleep(0)
        assert whole.events.empty() and streamed.events.qsize() == 2
        whole.post(TokenEvent(0, 9, "c"))
        whole.post(finish(0))  # job 0 ends: everything held goes
        box.flush()
        await asyncio.sleep(0)
        got = [whole.events.get_nowait() for _ in range(whole.events.qsize())]
        assert [(e.index, type(e).__name__) for e in got] == [
            (0, "TokenEvent"), (1, "TokenEvent"), (0, "TokenEvent"), (0, "FinishEvent")
        ]  # fmt: skip
        whole.post(TokenEvent(1, 10, "d"))
        box.flush()
        await asyncio.sleep(0)
        assert whole.events.empty()
        whole.post(ErrorEvent(1, RuntimeError("x")))  # an error ends a job too
        box.flush()
        await asyncio.sleep(0)
        assert [type(whole.events.get_nowait()).__name__ for _ in range(2)] == [
            "TokenEvent", "ErrorEvent"
        ]  # fmt: skip

    asyncio.run(go())


def test_the_observer_is_told_what_each_step_computed(tmp_path: Path) -> None:
    """Every prompt token is prefilled once (padding counted apart), every token after a
    request's first is one decode row, and each step's time is reported."""
    from graftlm.runtime.events import CacheFacts, StepWork

    class Seen:
        def __init__(self) -> None:
            self.work: list[StepWork] = []

        def on_step(self, rows: int, running: int, waiting: int) -> None:
            pass

        def on_work(self, work: StepWork) -> None:
            self.work.append(work)

        def on_cache(self, facts: CacheFacts) -> None:
            pass

    spec = TinySpec(n_ctx=256)
    model = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=256, n_seq=4)
    seen = Seen()
    service = EngineService(model.engine, model.prompter, model.adapters, observer=seen).start()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    try:

        async def go() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            jobs = [Job(p, params, AdapterSettings({}), cache=False) for p in prompts]
            events = [ev async for ev in service.stream(jobs, whole=True)]
            assert sum(isinstance(ev, FinishEvent) for ev in events) == 3

        asyncio.run(go())
    finally:
        service.close()
    w = seen.work
    assert sum(x.prefill_tokens for x in w) == sum(len(p) for p in prompts)
    assert all(x.prefill_padded >= x.prefill_tokens for x in w)
    assert sum(x.decode_rows for x in w) == 3 * (6 - 1)
    assert all(x.cpu_s >= 0 and x.wall_s > 0 for x in w)
