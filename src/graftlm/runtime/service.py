"""The engine thread: one owner of the model, serving requests that arrive from other threads.

A server (or any multi-threaded client) does not call `Engine.step()` itself. It hands jobs to an
`EngineService`, whose single thread admits them between steps (continuous batching), drives the
engine, and hands each job's events back to the asyncio loop the job came from, a step's at once
(`runtime.tracking.Outbox`; `runtime.tracking` also turns tokens into text and events).

Everything that touches the model runs on that thread, in the order it was asked for: requests,
cancellations, scoring passes, attaching and detaching adapters (but an adapter attached while
a step is in flight goes in beside it: `attach`). A caller that leaves (a client that
disconnects) cancels its requests and their cache slots are free at the next step.

One cache slot is kept back from generation (when the engine has more than one) so that a scoring
pass (`prompt_logprobs`) never waits for a generation to end.

The queue of requests waiting to start is the engine's scheduler's; this object keeps only the
thread and its inbox of calls and submissions; which submission each request's events go to is
its `runtime.tracking.Tracker`'s.
It knows the model through three narrow objects: the engine, the prompter (text) and the
adapter set. With `sleep_idle_s` it lets the engine go when idle (`runtime.idle` says when) and
loads it again through `reload` for the next work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from graftlm.errors import GraftError, RequestError
from graftlm.lora.prepare import PreparedAdapter, prepare_adapter
from graftlm.lora.settings import AdapterSettings
from graftlm.native import release_threads
from graftlm.runtime.engine import Engine
from graftlm.runtime.events import (
    CacheFacts,
    ErrorEvent,
    Event,
    FinishEvent,
    Job,
    ProgressEvent,
    ServiceObserver,
    StepWork,
    TokenEvent,
)
from graftlm.runtime.idle import IdleClock, settle_heap, unsettle_heap
from graftlm.runtime.prompting import Prompter
from graftlm.runtime.scoring import Scorer
from graftlm.runtime.tracking import Outbox, Submission, Tracker

if TYPE_CHECKING:
    from graftlm.lora.adapter_set import AdapterSet

# what a caller of the service meets: the service and what goes through it
__all__ = [
    "CacheFacts",
    "EngineService",
    "ErrorEvent",
    "Event",
    "FinishEvent",
    "Job",
    "ProgressEvent",
    "ServiceObserver",
    "StepWork",
    "TokenEvent",
]

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]
    needs_slot: bool


_STOP = object()
_ASLEEP_ERROR = GraftError("the engine is asleep (its model was released); wake it first")


class EngineService:
    """Runs an engine on one thread; every other thread talks to it through this object.

    prompter: the model's text rules (stop strings, end tokens, the routes' tokenizing).
    adapters: the model's adapter set, changed on the engine thread (or beside a step: `attach`).
    max_running: how many requests generate at once (default: the engine's slots, less the one
    kept for scoring); the engine's scheduler admits under it while the service runs."""

    def __init__(
        self,
        engine: Engine,
        prompter: Prompter,
        adapters: AdapterSet,
        max_running: int | None = None,
        observer: ServiceObserver | None = None,
        reload: Callable[[], Engine] | None = None,
        sleep_idle_s: float | None = None,
    ) -> None:
        if sleep_idle_s is not None and (reload is None or sleep_idle_s <= 0):
            raise GraftError(f"sleep after {sleep_idle_s} s idle needs a reload and a time > 0")
        self.prompter = prompter
        self.adapters = adapters
        n_slots = engine.n_slots
        default = n_slots - 1 if n_slots > 1 else n_slots
        self.max_running = max(1, min(max_running or default, n_slots))
        self._cap_before = engine.scheduler.max_running
        self._engine: Engine | None = None
        self._scorer: Scorer | None = None
        self._bind(engine)
        self.observer = observer
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tracker = Tracker(prompter)  # the requests given to the engine, their events
        self._deferred: list[_Call] = []  # calls waiting for a free cache slot
        self._outbox = Outbox()  # the events of a step, handed over when it ends
        self._thread: threading.Thread | None = None
        self._at_rest = False  # the thread waits on an empty inbox (no step in flight)
        self.n_running = 0
        self.n_waiting = 0
        self._reload = reload
        self.idle = IdleClock(sleep_idle_s)

    def _bind(self, engine: Engine) -> None:
        self._engine = engine
        self._scorer = Scorer(engine, self.prompter)
        self.n_ctx: int = engine.n_ctx
        engine.scheduler.max_running = self.max_running

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise _ASLEEP_ERROR
        return self._engine

    @property
    def scorer(self) -> Scorer:
        if self._scorer is None:
            raise _ASLEEP_ERROR
        return self._scorer

    @property
    def sleeping(self) -> bool:
        return self._engine is None

    @property
    def sleep_idle_s(self) -> float | None:
        return self.idle.sleep_idle_s

    @property
    def n_sleeps(self) -> int:
        return self.idle.n_sleeps

    @property
    def n_wakes(self) -> int:
        return self.idle.n_wakes

    # -- lifecycle --
    def start(self) -> EngineService:
        if self._thread is None:
            # the steps run on the engine thread from now on: this thread's OpenMP workers, idle
            # from here, would count against the CPUs and make the engine's team sleep between
            # regions instead of spinning (a decode step at half speed: gl_release_threads)
            release_threads()
            self._thread = threading.Thread(target=self._loop, name="graftlm-engine", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after the step in progress; requests still running are cancelled."""
        stopped = True
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            stopped = not self._thread.is_alive()
            self._thread = None
        if self._engine is not None:
            self._engine.scheduler.max_running = self._cap_before
        if stopped:  # (not under a wake still loading: it would freeze again after this)
            unsettle_heap()  # (a model let go after this is collectable whole)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- calls on the engine thread --
    def call(self, fn: Callable[[], T], needs_slot: bool = False) -> concurrent.futures.Future[T]:
        """Run fn on the engine thread between two steps; its result or exception in the future.
        needs_slot: wait until a cache slot is free (a scoring pass borrows one)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._thread is None or threading.current_thread() is self._thread:
            # not started (setup) or already on the engine thread: run in place
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            return fut
        self._inbox.put(_Call(fn, fut, needs_slot))
        return fut

    async def acall(self, fn: Callable[[], T], needs_slot: bool = False) -> T:
        return await asyncio.wrap_future(self.call(fn, needs_slot))

    def prompt_logprobs(
        self, ids: list[int], top: int, lora: AdapterSettings
    ) -> concurrent.futures.Future[list[dict[str, Any]]]:
        """`Model.logprobs(ids, top, lora)` on the engine thread: for i >= 1, the log-probability
        of ids[i] after ids[:i], and the top alternatives."""
        return self.call(lambda: self.scorer.logprobs(ids, top, lora), needs_slot=True)

    async def aprompt_logprobs(
        self, ids: list[int], top: int, lora: AdapterSettings
    ) -> list[dict[str, Any]]:
        """`prompt_logprobs`, awaited from the event loop."""
        return await asyncio.wrap_future(self.prompt_logprobs(ids, top, lora))

    async def aembedding(
        self, ids: list[int], lora: AdapterSettings, pooling: str = "mean"
    ) -> list[float] | list[list[float]]:
        """`Scorer.embedding` on the engine thread, awaited from the event loop; pooling "none":
        `Scorer.token_embeddings`, one vector a token."""
        if pooling == "none":
            return await self.acall(lambda: self.scorer.token_embeddings(ids, lora), True)
        return await self.acall(lambda: self.scorer.embedding(ids, lora, pooling), True)

    async def arank_score(self, ids: list[int], lora: AdapterSettings) -> float:
        """`Scorer.rank_score` on the engine thread, awaited from the event loop."""
        return await self.acall(lambda: self.scorer.rank_score(ids, lora), needs_slot=True)

    # -- adapters --
    def prepare_adapter(self, path: str | Path) -> PreparedAdapter:
        """`lora.prepare.prepare_adapter` against this service's adapter set (blocking, and on
        the caller's thread: call it off the event loop). Nothing is attached."""
        return prepare_adapter(self.adapters, path)

    def attach(
        self, prepared: PreparedAdapter, scale: float = 0.0
    ) -> concurrent.futures.Future[int]:
        """Attach a prepared adapter at this global scale; its id in the future. While the
        engine's thread is at work (a step in flight), one at scale 0 goes in at once beside the
        step (`AdapterSet.attach_beside`; the future done on return), the steps' tables taking
        it before the thread runs anything asked after this call; else between two steps."""
        if scale == 0.0 and self._thread is not None and not self._at_rest:
            slot = self.adapters.attach_beside(prepared.resolved)
            if slot is not None:
                self.call(self.adapters.publish)  # (the inbox is first in, first out)
                done: concurrent.futures.Future[int] = concurrent.futures.Future()
                done.set_result(slot)
                return done
        return self._locked(lambda: self.adapters.attach(prepared.resolved, scale))

    def detach(self, adapter_id: int) -> concurrent.futures.Future[None]:
        return self._locked(lambda: self.adapters.detach(adapter_id))

    def set_scales(self, scales: AdapterSettings) -> concurrent.futures.Future[None]:
        """The adapter set's global scales (checked settings; adapters not listed go to 0)."""
        return self._locked(lambda: self.adapters.set_scales(scales))

    def _locked(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        def locked() -> T:  # (between two steps, under the engine's lock)
            with self.engine.lock:
                return fn()

        return self.call(locked)

    # -- sleep --
    def hold(self) -> None:
        """A caller's work begins (an HTTP request): the engine does not sleep until `unhold`."""
        self.idle.hold()

    def unhold(self) -> None:
        self.idle.unhold()

    async def awake(self) -> None:
        """Wait until the engine is loaded (at once when it is awake). Raises the reload's error
        (RequestError model_unavailable) when the model cannot be loaded again."""
        if self.sleeping:
            await self.acall(lambda: None)

    def _wake(self) -> None:
        """On the engine thread: load the engine again and give it every adapter back."""
        assert self._reload is not None  # (sleep_idle_s needs one: __init__)
        t0 = time.perf_counter()
        try:
            engine = self._reload()
            self.adapters.rebind(engine.model)
        except Exception as exc:  # noqa: BLE001 - the requests waiting get it, the thread lives
            log.exception("waking from sleep failed")
            raise RequestError(
                f"the model could not be loaded again after sleep: {exc}", "model_unavailable"
            ) from exc
        engine.invocations = self.adapters.invocations
        self._bind(engine)
        settle_heap()
        self.idle.n_wakes += 1
        self.idle.touch()
        log.info("awake: model loaded again in %.2f s", time.perf_counter() - t0)

    def _maybe_sleep(self) -> None:
        """Let the engine go when nothing ran, waited or was held for sleep_idle_s seconds."""
        if self._engine is None:
            return
        with self.idle.lock:
            if self._tracker.active or self._deferred or self._engine.busy or not self.idle.due():
                return
            # nothing but this thread may reach the engine now: callers hold, work goes through
            # the inbox, and the inbox wakes it
            self._engine.scheduler.max_running = self._cap_before
            unsettle_heap()  # (the model's cycles are collectable again)
            self._engine = self._scorer = None
            self.adapters.release()
        settle_heap()
        self.idle.n_sleeps += 1
        log.info("sleeping after %g s idle: model and KV cache released", self.sleep_idle_s)

    # -- generation --
    async def stream(self, jobs: Sequence[Job], whole: bool = False) -> AsyncGenerator[Event, None]:
        """Run jobs (event index = position in `jobs`) and yield their events as they come
        (whole: a job's events come together when it ends; for a caller that folds whole
        answers). Leaving the iteration early (a client that disconnected) cancels what is
        still running; use `contextlib.aclosing` so that happens at once."""
        loop = asyncio.get_running_loop()
        sub = Submission(list(jobs), loop, asyncio.Queue(), self._outbox, whole=whole)
        remaining = len(sub.jobs)
        if not remaining:
            return
        self._require_thread()
        self._inbox.put(sub)
        try:
            while remaining:
                ev = await sub.events.get()
                if isinstance(ev, FinishEvent | ErrorEvent):
                    remaining -= 1
                yield ev
        finally:
            if remaining:
                self._inbox.put(("cancel", sub))

    def _require_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the engine service is not running (call start())")

    # -- the thread --
    def _loop(self) -> None:
        while True:
            self._outbox.flush()  # what the last turn posted, before this one may wait
            # sleep only when there is nothing to step
            idle = self._engine is None or not self._engine.busy
            self._at_rest = idle
            try:
                if not idle:
                    item = self._inbox.get_nowait()
                else:
                    wait = None if self._engine is None else self.idle.wait_s()
                    item = self._inbox.get(timeout=wait)
            except queue.Empty:
                if idle:
                    self._maybe_sleep()
                    continue
                item = None
            finally:
                self._at_rest = False
            while item is not None:
                if item is _STOP:
                    self._shutdown()
                    return
                self._handle(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self._engine is None:
                continue
            try:
                self._run_deferred()
                if self._engine.busy:
                    self._step()
                    self._outbox.flush()  # (before calls put aside run: a scoring pass may be long)
                    self.idle.touch()
                    # a step that ended sequences freed slots that calls put aside wait for: run
                    # them now, before the loop, the engine perhaps idle, sleeps on the inbox
                    self._run_deferred()
                self._publish_counts()
            except Exception:  # a bug of ours: log it, keep the thread (and the server) alive
                log.exception("engine service: unexpected error")

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Call | Submission):
            self.idle.touch()
            if self._engine is None:
                try:
                    self._wake()
                except RequestError as exc:
                    _refuse(item, exc)
                    return
        elif self._engine is None:  # a cancellation: nothing runs while asleep
            return
        try:
            if isinstance(item, _Call):
                if item.needs_slot and not self.engine.slots.n_free:
                    self._deferred.append(item)
                else:
                    self._run_call(item)
            elif isinstance(item, Submission):
                self._tracker.accept(self.engine, item)
            elif isinstance(item, tuple) and item[0] == "cancel":
                self._tracker.cancel(self.engine, item[1])
        except Exception as exc:
            log.exception("engine service: unexpected error")
            if isinstance(item, Submission):
                self._tracker.cancel(self.engine, item)
                _refuse(item, exc)

    @staticmethod
    def _run_call(call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        try:
            call.future.set_result(call.fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            call.future.set_exception(exc)

    def _run_deferred(self) -> None:
        while self._deferred and self.engine.slots.n_free:
            self._run_call(self._deferred.pop(0))

    def _step(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            plan = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests of this step, keep serving
            self._tracker.fail(self.engine, exc)
            return
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        self._tracker.post_ends()
        if self.observer is not None:
            # sequences in this step: those running, the ones admitted now included
            self.observer.on_step(plan.n_running, len(self.engine.running), self._n_waiting())
            real = sum(c.length for c in plan.prefill)
            work = StepWork(len(plan.prefill), real, plan.computed, len(plan.decode), cpu, wall)
            self.observer.on_work(work)
            self.observer.on_cache(self.cache_facts())

    def cache_facts(self) -> CacheFacts:
        pool, cache = self.engine.slots.pool, self.engine.cache
        st = pool.stats
        return CacheFacts(
            pool.n_usable,
            pool.n_used,
            pool.n_cached,
            cache.block,
            cache.nbytes,
            st.query_tokens,
            st.hit_tokens,
            st.evicted,
        )

    @property
    def n_cancelled(self) -> int:
        """Requests ended early because their caller left."""
        return self._tracker.n_cancelled

    def _n_waiting(self) -> int:
        return len(self.engine.waiting)

    def _publish_counts(self) -> None:
        self.n_running = len(self.engine.running)
        self.n_waiting = self._n_waiting()
        if self.observer is not None and not self.engine.busy:
            self.observer.on_step(0, self.n_running, self.n_waiting)  # idle: counts only

    def _shutdown(self) -> None:
        if self._engine is not None:
            why = RequestError("the server is shutting down", "server_shutdown")
            self._tracker.fail(self._engine, why, "cancelled")
        for call in self._deferred:
            call.future.cancel()
        self._deferred.clear()
        self._outbox.flush()


def _refuse(item: _Call | Submission, exc: Exception) -> None:
    """A call or submission that will not run: its caller gets `exc`."""
    if isinstance(item, _Call):
        if item.future.set_running_or_notify_cancel():
            item.future.set_exception(exc)
    else:
        for index in range(len(item.jobs)):
            item.post(ErrorEvent(index, exc))
