"""The engine thread: one owner of the model, serving requests that arrive from other threads.

A server (or any multi-threaded client) does not call `Engine.step()` itself. It hands jobs to an
`EngineService`, whose single thread admits them between steps (continuous batching), drives the
engine, turns each new token into text (stop strings included) and hands the events back to the
asyncio loop the job came from (`loop.call_soon_threadsafe` into a per-submission queue).

Everything that touches the model runs on that thread, in the order it was asked for: requests,
cancellations, scoring passes, attaching and detaching adapters. A caller that leaves (a client
that disconnects) cancels its requests and their cache slots are free at the next step.

One cache slot is kept back from generation (when the engine has more than one) so that a scoring
pass (`prompt_logprobs`) never waits for a generation to end.

The queue of requests waiting to start is the engine's scheduler's; this object keeps only the
thread, its inbox of calls and submissions, and which submission each request's events go to.
It knows the model through three narrow objects: the engine, the prompter (text) and the
adapter set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from graftlm.errors import AdapterError, GraftError, RequestError
from graftlm.lora.settings import NO_ADAPTERS, AdapterSettings
from graftlm.native import release_threads
from graftlm.runtime.engine import Engine
from graftlm.runtime.prompting import Prompter
from graftlm.runtime.sampling import Sampler, SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.runtime.scoring import Scorer
from graftlm.runtime.speculative import SpecParams
from graftlm.runtime.textstream import TextStream

if TYPE_CHECKING:
    from graftlm.lora.adapter import ResolvedAdapter
    from graftlm.lora.registry import AdapterSet

T = TypeVar("T")
log = logging.getLogger(__name__)


# -- what goes in and what comes out --
@dataclass(frozen=True)
class Job:
    """One sequence to generate. `lora`: the adapter settings, fixed for the job's whole life.
    `logprobs`: None for none, k >= 0 for the chosen token's log-probability plus the top k."""

    prompt: list[int]
    params: SamplingParams
    lora: AdapterSettings = NO_ADAPTERS
    logprobs: int | None = None
    cache: bool = True  # may reuse what the prefix cache holds (llama-server's cache_prompt)
    # logprobs after the sampler chain (llama-server's post_sampling_probs): over the tokens the
    # draw chose among, with their probabilities after top-k, top-p, min-p and temperature
    post_sampling: bool = False
    # ProgressEvents while the prompt is computed (llama-server's return_progress)
    progress: bool = False
    # the request's own speculative bounds (llama-server's speculative.n_max / n_min / p_min)
    spec: SpecParams | None = None


@dataclass(frozen=True)
class TokenEvent:
    """A generated token and the text it released ("" while held back or for an end token).
    logprob and top come from the raw logits (before penalties and temperature)."""

    index: int
    token: int
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    """The end of a job. reason: "stop" (end token or stop string), "length" or "cancelled".
    `text` is whatever the detokenizer still held; `stop_word` the stop string that matched."""

    index: int
    reason: str
    text: str
    n_prompt: int
    n_generated: int
    stopped_eos: bool = False
    n_cached: int = 0  # prompt tokens the prefix cache served (not computed)
    # activated-LoRA adapters the request named whose invocation its prompt lacks (not applied)
    alora_inactive: tuple[int, ...] = ()
    stop_word: str | None = None
    t_submit: float = 0.0
    t_first: float | None = None
    t_prompt_done: float | None = None
    t_end: float | None = None
    n_drafts: int = 0  # speculative decoding: drafts verified, tokens drafted, tokens kept
    n_drafted: int = 0
    n_draft_accepted: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first token."""
        return None if self.t_first is None else self.t_first - self.t_submit

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.t_first is None or self.t_end is None or self.n_generated < 2:
            return None
        return (self.t_end - self.t_first) / (self.n_generated - 1)


@dataclass(frozen=True)
class ProgressEvent:
    """The prompt's computation so far: of `total` tokens, `cache` came from the prefix cache
    and `processed` (the cached ones included) are in the KV cache; `ms` since the first of
    these events, which comes before any token is computed (processed == cache)."""

    index: int
    total: int
    cache: int
    processed: int
    ms: float


@dataclass(frozen=True)
class ErrorEvent:
    index: int
    error: BaseException


Event = TokenEvent | FinishEvent | ProgressEvent | ErrorEvent


@dataclass(frozen=True)
class CacheFacts:
    """The paged KV cache after a step: its blocks and the prefix cache's counts so far."""

    blocks_total: int
    blocks_used: int
    blocks_cached: int
    block_tokens: int
    nbytes: int
    query_tokens: int
    hit_tokens: int
    evicted: int


class ServiceObserver(Protocol):
    """Told after every engine step (from the engine thread): sequences in the step, requests
    running and waiting, and the cache's facts. rows == 0: no step was run, only the counts
    changed (the engine idles)."""

    def on_step(self, rows: int, running: int, waiting: int) -> None: ...
    def on_cache(self, facts: CacheFacts) -> None: ...


@dataclass(frozen=True)
class AdapterFacts:
    path: str
    nbytes: int
    rank: int
    alpha: float
    task_name: str
    prompt_prefix: str
    n_tensors: int
    invocation_tokens: tuple[int, ...] = ()  # activated LoRA's; () for a plain LoRA


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read and checked against the base, not attached yet (`EngineService.attach`)."""

    facts: AdapterFacts
    resolved: ResolvedAdapter


class _RecordingSampler(Sampler):
    """The job's sampler, plus the log-probabilities of the raw logits at each step (or, with
    `post`, of the candidates the draw chose among)."""

    def __init__(self, params: SamplingParams, top: int, post: bool = False) -> None:
        super().__init__(params)
        self.top = top
        self.post = post
        self.last: tuple[float, tuple[tuple[int, float], ...]] = (0.0, ())

    def draw(self, logits: torch.Tensor) -> int:
        if not self.post:
            return super().draw(logits)
        probs, idx = self.candidates(logits)
        tok = self.pick(probs, idx)
        lp = torch.log(probs)
        n = min(self.top, int((probs > 0).sum()))  # never a token of probability 0
        top = tuple(zip(idx[:n].tolist(), lp[:n].tolist(), strict=True))
        self.last = (float(lp[(idx == tok).nonzero()[0, 0]]), top)
        return tok

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        tok = super().__call__(logits, history)
        if self.post:
            return tok
        lp = torch.log_softmax(logits.float(), dim=-1)  # (V,)
        top: tuple[tuple[int, float], ...] = ()
        if self.top > 0:
            v, i = lp.topk(min(self.top, lp.shape[-1]))  # at most the vocabulary
            top = tuple(zip(i.tolist(), v.tolist(), strict=True))
        self.last = (float(lp[tok]), top)
        return tok


@dataclass
class _Tracked:
    sub: _Submission
    index: int
    job: Job
    req: Request
    text: TextStream
    recorder: _RecordingSampler | None = None


@dataclass
class _Submission:
    jobs: Sequence[Job]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event]
    tracked: list[_Tracked] = field(default_factory=list)

    def post(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


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
    adapters: the model's adapter set, changed only on the engine thread.
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
        self._active: list[_Tracked] = []  # given to the engine: queued there or running
        self._deferred: list[_Call] = []  # calls waiting for a free cache slot
        self._thread: threading.Thread | None = None
        self.n_running = 0
        self.n_waiting = 0
        self.n_cancelled = 0  # requests ended early because their caller left
        # sleep (llama-server's --sleep-idle-seconds): after this long with nothing to do the
        # engine (weights, KV cache) is let go; the next work loads it again through `reload`
        self._reload = reload
        self.sleep_idle_s = sleep_idle_s
        self._last_active = time.monotonic()
        self._holds = 0  # callers (HTTP requests) that keep the engine awake while they run
        self._holds_lock = threading.Lock()
        self.n_sleeps = 0
        self.n_wakes = 0

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
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None
        if self._engine is not None:
            self._engine.scheduler.max_running = self._cap_before

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
            fut: Any = self.call(lambda: self.scorer.token_embeddings(ids, lora), needs_slot=True)
        else:
            fut = self.call(lambda: self.scorer.embedding(ids, lora, pooling), needs_slot=True)
        return await asyncio.wrap_future(fut)

    async def arank_score(self, ids: list[int], lora: AdapterSettings) -> float:
        """`Scorer.rank_score` on the engine thread, awaited from the event loop."""
        fut = self.call(lambda: self.scorer.rank_score(ids, lora), needs_slot=True)
        return await asyncio.wrap_future(fut)

    # -- adapters --
    def prepare_adapter(self, path: str | Path) -> PreparedAdapter:
        """Read and check an adapter against the base (blocking; call it off the event loop).
        Nothing is attached; raises AdapterError when the file cannot be used."""
        p = Path(path)
        try:
            found = p.exists()
        except OSError as exc:  # a name too long, a path through a file
            raise AdapterError(f"{str(p)[:200]}: cannot be read ({exc.strerror})") from None
        if not found:
            raise AdapterError(f"{p}: no such file or directory")
        try:
            resolved = self.adapters.load(p)
        except ImportError as exc:
            raise AdapterError(f"{p}: this kind of adapter is not supported yet ({exc})") from None
        except GraftError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            raise AdapterError(f"{p}: cannot read the adapter ({exc})") from None
        rank = max((d.rank for d in resolved.deltas.values()), default=0)
        facts = AdapterFacts(
            path=str(resolved.path),
            nbytes=int(resolved.nbytes),
            rank=rank,
            alpha=float(resolved.alpha),
            task_name=resolved.task_name,
            prompt_prefix=resolved.prompt_prefix,
            n_tensors=resolved.n_tensors,
            invocation_tokens=tuple(resolved.invocation_tokens),
        )
        return PreparedAdapter(facts, resolved)

    def attach(
        self, prepared: PreparedAdapter, scale: float = 0.0
    ) -> concurrent.futures.Future[int]:
        """Attach a prepared adapter at this global scale; its id in the future."""

        def attach() -> int:
            with self.engine.lock:
                return self.adapters.attach(prepared.resolved, scale)

        return self.call(attach)

    def detach(self, adapter_id: int) -> concurrent.futures.Future[None]:
        def detach() -> None:
            with self.engine.lock:
                self.adapters.detach(adapter_id)

        return self.call(detach)

    def set_scales(self, scales: AdapterSettings) -> concurrent.futures.Future[None]:
        """The adapter set's global scales (checked settings; adapters not listed go to 0)."""

        def set_scales() -> None:
            with self.engine.lock:
                self.adapters.set_scales(scales)

        return self.call(set_scales)

    # -- sleep --
    def hold(self) -> None:
        """A caller's work begins (an HTTP request): the engine does not sleep until `unhold`."""
        with self._holds_lock:
            self._holds += 1
            self._last_active = time.monotonic()

    def unhold(self) -> None:
        with self._holds_lock:
            self._holds -= 1
            self._last_active = time.monotonic()

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
        self.n_wakes += 1
        self._last_active = time.monotonic()
        log.info("awake: model loaded again in %.2f s", time.perf_counter() - t0)

    def _sleep_timeout(self) -> float | None:
        """How long the idle thread may wait for work before it checks whether to sleep."""
        if self.sleep_idle_s is None or self._engine is None:
            return None
        left = self.sleep_idle_s - (time.monotonic() - self._last_active)
        return min(max(left, 0.01), 0.5)

    def _maybe_sleep(self) -> None:
        """Let the engine go when nothing ran, waited or was held for sleep_idle_s seconds."""
        if self.sleep_idle_s is None or self._engine is None:
            return
        with self._holds_lock:
            if (
                self._holds
                or self._active
                or self._deferred
                or self._engine.busy
                or time.monotonic() - self._last_active < self.sleep_idle_s
            ):
                return
            # nothing but this thread may reach the engine now: callers hold, work goes through
            # the inbox, and the inbox wakes it
            self._engine.scheduler.max_running = self._cap_before
            self._engine = self._scorer = None
            self.adapters.release()
        gc.collect()
        self.n_sleeps += 1
        log.info("sleeping after %g s idle: model and KV cache released", self.sleep_idle_s)

    # -- generation --
    async def stream(self, jobs: Sequence[Job]) -> AsyncGenerator[Event, None]:
        """Run jobs (event index = position in `jobs`) and yield their events as they come.
        Leaving the iteration early (a client that disconnected) cancels what is still running;
        use `contextlib.aclosing` so that happens at once."""
        sub = _Submission(list(jobs), asyncio.get_running_loop(), asyncio.Queue())
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
            # sleep only when there is nothing to step
            idle = self._engine is None or not self._engine.busy
            try:
                if not idle:
                    item = self._inbox.get_nowait()
                else:
                    item = self._inbox.get(timeout=self._sleep_timeout())
            except queue.Empty:
                if idle:
                    self._maybe_sleep()
                    continue
                item = None
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
                    self._last_active = time.monotonic()
                self._publish_counts()
            except Exception:  # a bug of ours: log it, keep the thread (and the server) alive
                log.exception("engine service: unexpected error")

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Call | _Submission):
            self._last_active = time.monotonic()
            if self._engine is None:
                try:
                    self._wake()
                except RequestError as exc:
                    if isinstance(item, _Call):
                        if item.future.set_running_or_notify_cancel():
                            item.future.set_exception(exc)
                    else:
                        for index in range(len(item.jobs)):
                            item.post(ErrorEvent(index, exc))
                    return
        elif self._engine is None:  # a cancellation: nothing runs while asleep
            return
        try:
            if isinstance(item, _Call):
                if item.needs_slot and not self.engine.slots.n_free:
                    self._deferred.append(item)
                else:
                    self._run_call(item)
            elif isinstance(item, _Submission):
                self._accept(item)
            elif isinstance(item, tuple) and item[0] == "cancel":
                self._cancel(item[1])
        except Exception as exc:
            log.exception("engine service: unexpected error")
            if isinstance(item, _Submission):
                self._cancel(item)
                for index in range(len(item.jobs)):
                    item.post(ErrorEvent(index, exc))

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

    def _accept(self, sub: _Submission) -> None:
        """Each job becomes a request in the engine's queue (its scheduler admits it)."""
        for index, job in enumerate(sub.jobs):
            p = job.params
            req = Request(
                list(job.prompt), p, job.lora, eog=self.prompter.eog, use_cache=job.cache,
                spec=job.spec,
            )  # fmt: skip
            t = _Tracked(sub, index, job, req, self.prompter.text_stream(p.stop, p.ignore_eos))
            req.on_token = self._on_token_for(t)
            if job.progress:
                req.on_progress = self._on_progress_for(t)
            sub.tracked.append(t)
            if p.max_tokens == 0:
                req.t_end = time.perf_counter()
                sub.post(self._finish_event(t, "length"))
                continue
            if job.logprobs is not None:
                t.recorder = _RecordingSampler(p, job.logprobs, job.post_sampling)
                req.sampler = t.recorder
            try:
                self.engine.submit(req)
            except GraftError as exc:
                req.finish_reason = "error"
                sub.post(ErrorEvent(index, exc))
                continue
            self._active.append(t)

    def _on_token_for(self, t: _Tracked) -> Callable[[Request, int], None]:
        def on_token(req: Request, token: int) -> None:
            piece = t.text.push(token)
            if t.text.stopped:
                self.engine.stop(req, "stop")
            if t.recorder is not None:
                lp, top = t.recorder.last
                t.sub.post(TokenEvent(t.index, token, piece, lp, top))
            else:
                t.sub.post(TokenEvent(t.index, token, piece))

        return on_token

    @staticmethod
    def _on_progress_for(t: _Tracked) -> Callable[[Request, int], None]:
        started: float | None = None

        def on_progress(req: Request, processed: int) -> None:
            nonlocal started
            now = time.perf_counter()
            started = now if started is None else started
            ms = (now - started) * 1e3
            t.sub.post(ProgressEvent(t.index, len(req.prompt), req.n_cached, processed, ms))

        return on_progress

    def _step(self) -> None:
        try:
            plan = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests of this step, keep serving
            for t in list(self._active):
                if not t.req.done:
                    self.engine.stop(t.req, "error")
                t.sub.post(ErrorEvent(t.index, exc))
            self._active.clear()
            return
        finished = [t for t in self._active if t.req.done]
        if finished:
            self._active = [t for t in self._active if not t.req.done]
            for t in finished:
                if t.req.finish_reason == "error" and t.req.error is not None:
                    t.sub.post(ErrorEvent(t.index, t.req.error))  # this request's alone
                elif t.req.finish_reason != "cancelled":
                    t.sub.post(self._finish_event(t, t.req.finish_reason or "stop"))
        if self.observer is not None:
            # sequences in this step: those running, the ones admitted now included
            self.observer.on_step(plan.n_running, len(self.engine.running), self._n_waiting())
            self.observer.on_cache(self.cache_facts())

    def cache_facts(self) -> CacheFacts:
        pool, cache = self.engine.slots.pool, self.engine.cache
        st = pool.stats
        return CacheFacts(pool.n_usable, pool.n_used, pool.n_cached, cache.block, cache.nbytes,
                          st.query_tokens, st.hit_tokens, st.evicted)  # fmt: skip

    def _finish_event(self, t: _Tracked, reason: str) -> FinishEvent:
        req = t.req
        tail = t.text.flush()
        eos = bool(req.generated) and req.generated[-1] in req.eog and not req.params.ignore_eos
        return FinishEvent(
            index=t.index,
            reason="stop" if reason == "stop" else reason,
            text=tail,
            n_prompt=len(req.prompt),
            n_generated=len(req.generated),
            n_cached=req.n_cached,
            alora_inactive=req.inactive,
            stopped_eos=eos and not t.text.stopped,
            stop_word=t.text.matched if t.text.stopped else None,
            t_submit=req.t_submit,
            t_first=req.t_first,
            t_prompt_done=req.t_prompt_done,
            t_end=req.t_end,
            n_drafts=req.n_drafts,
            n_drafted=req.n_drafted,
            n_draft_accepted=req.n_draft_accepted,
        )

    def _cancel(self, sub: _Submission) -> None:
        for t in sub.tracked:
            if not t.req.done:
                self.engine.stop(t.req, "cancelled")
                self.n_cancelled += 1
        self._active = [t for t in self._active if t.sub is not sub]

    def _n_waiting(self) -> int:
        return len(self.engine.waiting)

    def _publish_counts(self) -> None:
        self.n_running = len(self.engine.running)
        self.n_waiting = self._n_waiting()
        if self.observer is not None and not self.engine.busy:
            self.observer.on_step(0, self.n_running, self.n_waiting)  # idle: counts only

    def _shutdown(self) -> None:
        for t in self._active:
            if not t.req.done:
                self.engine.stop(t.req, "cancelled")
            t.sub.post(
                ErrorEvent(t.index, RequestError("the server is shutting down", "server_shutdown"))
            )
        self._active.clear()
        for call in self._deferred:
            call.future.cancel()
        self._deferred.clear()
