"""The requests given to the engine on the engine thread, and the events they post back.

A `Submission` is the jobs one caller handed the service at once, with the asyncio loop and
queue their events go to. Each job becomes a `Tracked` request: the engine's `Request`, its
text stream (stop strings held back) and, when log-probabilities are asked for, the sampler
that records them. The request's callbacks turn each token (and the prompt's progress) into
events; `finish_event` says how it ended. The `Tracker` holds the requests given to the engine
(queued there or running) and posts each one's end after the step that ended it; an `Outbox`
hands a step's events to their loops at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graftlm.errors import GraftError
from graftlm.runtime.events import (
    ErrorEvent,
    Event,
    FinishEvent,
    Job,
    ProgressEvent,
    TokenEvent,
)
from graftlm.runtime.prompting import Prompter
from graftlm.runtime.sampling import Sampler, SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.runtime.textstream import TextStream

if TYPE_CHECKING:
    from graftlm.runtime.engine import Engine

Stop = Callable[[Request, str], None]  # ends a request in the engine, with its reason


class RecordingSampler(Sampler):
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


class Outbox:
    """The events the engine thread posted since it last flushed, handed to their loops
    together: one wake-up of each asyncio loop a step, not one a token (16 rows woke the
    server's loop 16 times a step, each a write to its self-pipe and a turn for the GIL).
    The engine thread alone posts and flushes; it flushes before it waits for work."""

    def __init__(self) -> None:
        self._held: list[Submission] = []  # submissions with events not yet handed over

    def hold(self, sub: Submission) -> None:
        self._held.append(sub)

    def flush(self) -> None:
        if not self._held:
            return
        held, self._held = self._held, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], list[Event]]]]
        by_loop = {}
        for sub in held:
            events, sub.pending, sub._handed = sub.pending, [], False
            by_loop.setdefault(sub.loop, []).append((sub.events, events))
        for loop, batches in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batches)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _deliver(batches: list[tuple[asyncio.Queue[Event], list[Event]]]) -> None:
    """On the loop: each submission's events into its queue, in the order posted."""
    for queue, events in batches:
        for ev in events:
            queue.put_nowait(ev)


@dataclass
class Submission:
    """outbox: where posted events wait for the engine thread's next flush (the engine thread
    alone posts). whole: the caller folds whole answers (not a stream), so a job's events are
    handed over when it ends, with whatever else is pending then, not every step: the loop
    wakes once a job, not once a step (16 rows woke it 32 times for 32 tokens each)."""

    jobs: Sequence[Job]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event]
    outbox: Outbox
    tracked: list[Tracked] = field(default_factory=list)
    pending: list[Event] = field(default_factory=list)
    whole: bool = False
    _handed: bool = field(default=False, init=False)  # in the outbox's hands until it flushes

    def post(self, ev: Event) -> None:
        self.pending.append(ev)
        if self._handed or (self.whole and not isinstance(ev, FinishEvent | ErrorEvent)):
            return
        self._handed = True
        self.outbox.hold(self)


@dataclass
class Tracked:
    sub: Submission
    index: int
    job: Job
    req: Request
    text: TextStream
    recorder: RecordingSampler | None = None

    @classmethod
    def of(cls, sub: Submission, index: int, prompter: Prompter, stop: Stop) -> Tracked:
        """Job `index` of `sub` as a request whose tokens become events; `stop` ends it when
        its text meets a stop string."""
        job = sub.jobs[index]
        p = job.params
        req = Request(
            list(job.prompt), p, job.lora, eog=prompter.eog, use_cache=job.cache, spec=job.spec
        )
        t = cls(sub, index, job, req, prompter.text_stream(p.stop, p.ignore_eos))
        if job.logprobs is not None:
            t.recorder = RecordingSampler(p, job.logprobs, job.post_sampling)
            req.sampler = t.recorder
        req.on_token = t._on_token(stop)
        if job.progress:
            req.on_progress = t._on_progress()
        sub.tracked.append(t)
        return t

    def _on_token(self, stop: Stop) -> Callable[[Request, int], None]:
        def on_token(req: Request, token: int) -> None:
            piece = self.text.push(token)
            if self.text.stopped:
                stop(req, "stop")
            if self.recorder is not None:
                lp, top = self.recorder.last
                self.sub.post(TokenEvent(self.index, token, piece, lp, top))
            else:
                self.sub.post(TokenEvent(self.index, token, piece))

        return on_token

    def _on_progress(self) -> Callable[[Request, int], None]:
        started: float | None = None

        def on_progress(req: Request, processed: int) -> None:
            nonlocal started
            now = time.perf_counter()
            started = now if started is None else started
            ms = (now - started) * 1e3
            self.sub.post(ProgressEvent(self.index, len(req.prompt), req.n_cached, processed, ms))

        return on_progress

    def finish_event(self, reason: str) -> FinishEvent:
        req = self.req
        tail = self.text.flush()
        eos = bool(req.generated) and req.generated[-1] in req.eog and not req.params.ignore_eos
        return FinishEvent(
            index=self.index,
            reason="stop" if reason == "stop" else reason,
            text=tail,
            n_prompt=len(req.prompt),
            n_generated=len(req.generated),
            n_cached=req.n_cached,
            alora_inactive=req.inactive,
            stopped_eos=eos and not self.text.stopped,
            stop_word=self.text.matched if self.text.stopped else None,
            t_submit=req.t_submit,
            t_first=req.t_first,
            t_prompt_done=req.t_prompt_done,
            t_end=req.t_end,
            n_drafts=req.n_drafts,
            n_drafted=req.n_drafted,
            n_draft_accepted=req.n_draft_accepted,
            truncated=req.dropped > 0,
        )


class Tracker:
    """The requests the service gave the engine (queued there or running), each with the
    submission its events go to; engine-thread only."""

    def __init__(self, prompter: Prompter) -> None:
        self.prompter = prompter
        self.active: list[Tracked] = []
        self.n_cancelled = 0  # requests ended early because their caller left

    def accept(self, engine: Engine, sub: Submission) -> None:
        """Each job becomes a request in the engine's queue (its scheduler admits it)."""
        for index in range(len(sub.jobs)):
            t = Tracked.of(sub, index, self.prompter, lambda req, why: engine.stop(req, why))
            if t.job.params.max_tokens == 0:
                t.req.t_end = time.perf_counter()
                sub.post(t.finish_event("length"))
                continue
            try:
                engine.submit(t.req)
            except GraftError as exc:
                t.req.finish_reason = "error"
                sub.post(ErrorEvent(index, exc))
                continue
            self.active.append(t)

    def post_ends(self) -> None:
        """After a step: each request it ended posts its end (an error its own)."""
        finished = [t for t in self.active if t.req.done]
        if not finished:
            return
        self.active = [t for t in self.active if not t.req.done]
        for t in finished:
            if t.req.finish_reason == "error" and t.req.error is not None:
                t.sub.post(ErrorEvent(t.index, t.req.error))  # this request's alone
            elif t.req.finish_reason != "cancelled":
                t.sub.post(t.finish_event(t.req.finish_reason or "stop"))

    def fail(self, engine: Engine, exc: Exception, reason: str = "error") -> None:
        """Every request ends with `exc` (a step that failed; the service shutting down, its
        requests cancelled)."""
        for t in self.active:
            if not t.req.done:
                engine.stop(t.req, reason)
            t.sub.post(ErrorEvent(t.index, exc))
        self.active.clear()

    def cancel(self, engine: Engine, sub: Submission) -> None:
        """The submission's caller left: what it still runs ends, posting nothing."""
        for t in sub.tracked:
            if not t.req.done:
                engine.stop(t.req, "cancelled")
                self.n_cancelled += 1
        self.active = [t for t in self.active if t.sub is not sub]
