"""The one way a generating request runs, whatever its dialect.

A route translates its dialect's body into a `Generation` (the prompt ids, the length, the
constraint the dialect imposes, how many choices) and `start` does the rest in one order for
every dialect: the context check, the constraint compiled, the sampling settings, the adapters'
lease, the engine jobs, and `deltas()`, one generator of per-choice pieces (text, tokens,
log-probabilities, and at the end the finish). A streaming answer frames each piece as it comes
(`server/framing.py` holds what the dialects' frames share); a non-streaming answer folds the
same pieces (`collect`). Nothing here touches tensors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from graftlm.errors import RequestError
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.constraints import CompiledGrammar, Constraint
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.service import ErrorEvent, FinishEvent, Job, ProgressEvent, TokenEvent
from graftlm.server.registry import Lease, UnknownModelError
from graftlm.server.schemas import RequestLoraItem, SamplingFields
from graftlm.server.state import ApiError, ServerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability (None: the first prompt token has none) and the top few."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Delta:
    """A piece of one choice: text released, tokens it came from, their log-probabilities;
    `finish` is set on the last piece of the choice."""

    index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishEvent | None = None
    echo: bool = False  # the prompt, given back (completions with echo)
    progress: ProgressEvent | None = None  # the prompt's computation (return_progress): no text


@dataclass
class Choice:
    """A whole choice, folded from its deltas."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishEvent | None = None
    n_echo_tokens: int = 0
    # the text's pieces, joined when read: `text += piece` copied the whole answer a piece
    _pieces: list[str] = field(default_factory=list, repr=False)

    @property
    def text(self) -> str:
        """The text of the pieces so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, d: Delta) -> None:
        if d.text:
            self._pieces.append(d.text)
        if d.echo:
            self.n_echo_tokens += len(d.tokens)
        else:
            self.tokens += d.tokens
        self.logprobs += d.logprobs
        if d.finish is not None:
            self.finish = d.finish


# -- the common request --
@dataclass
class Generation:
    """A generating request in no dialect's words: what every route translates its body into."""

    body: SamplingFields  # sampling settings, adapters, prefix cache, speculative bounds
    prompts: list[list[int]]  # prompt ids; each prompt is answered `n` times
    max_tokens: int
    endpoint: str  # the route's name in the metrics
    model: str | None = None
    n: int = 1
    stream: bool = False
    logprobs: int | None = None  # top log-probabilities each token carries (None: none)
    post_sampling: bool = False  # llama-server's n_probs after the sampler chain
    # a constraint the dialect imposes (chat's tool_choice); None: the body's own, if any
    imposed: Constraint | None = None
    echo: Sequence[str] | None = None  # the prompts' texts, given back first (completions' echo)


@dataclass
class Run:
    """A request on its way through the engine: its choices' pieces, and what an answer tells
    of how it ran (choice i of prompt p is piece index p * n + i)."""

    prompts: list[list[int]]
    params: list[SamplingParams]  # choice i's settings (seed + i)
    lease: Lease
    pieces: AsyncGenerator[Delta, None]
    n_choices: int


async def start(state: ServerState, gen: Generation) -> Run:
    """Check, compile, admit and submit a request: the one place a request becomes jobs. The
    lease is released when the pieces end (or here, if what follows admission fails)."""
    for x in gen.prompts:
        check_context(state, x, gen.max_tokens)
    constraint = gen.imposed if gen.imposed is not None else request_constraint(gen.body)
    grammar = await compile_constraint(state, constraint)
    params = [sampling_params(state, gen.body, gen.max_tokens, j, grammar) for j in range(gen.n)]
    lease = await admit(state, gen.model, gen.body.lora)
    try:
        jobs = [_job(gen, x, p, lease.lora) for x in gen.prompts for p in params]
        before = [] if gen.echo is None else await _echoed(state, gen, gen.echo, lease.lora)
    except BaseException:
        state.registry.release(lease)
        raise
    pieces = deltas(state, jobs, lease, gen.endpoint, before, whole=not gen.stream)
    return Run(gen.prompts, params, lease, pieces, len(jobs))


def _job(gen: Generation, ids: list[int], params: SamplingParams, lora: AdapterSettings) -> Job:
    body = gen.body
    return Job(
        ids,
        params,
        lora,
        gen.logprobs,
        body.cache_prompt,
        post_sampling=gen.post_sampling,
        progress=gen.stream and body.return_progress,
        spec=body.spec(),
    )


async def _echoed(
    state: ServerState, gen: Generation, texts: Sequence[str], lora: AdapterSettings
) -> list[Delta]:
    """The prompts given back before their answers, each choice's copy; with log-probabilities
    asked for, the prompt's own (its first token has none)."""
    scored = None
    if gen.logprobs is not None:
        scored = [await state.service.aprompt_logprobs(x, gen.logprobs, lora) for x in gen.prompts]
    out: list[Delta] = []
    for pi, (text, x) in enumerate(zip(texts, gen.prompts, strict=True)):
        lps: list[TokenLogprob] = []
        if scored is not None:
            lps = [TokenLogprob(x[0], None)] + [
                TokenLogprob(s["id"], s["logprob"], tuple((t, v) for t, v in s["top"]))
                for s in scored[pi]
            ]
        out += [Delta(pi * gen.n + j, text, list(x), lps, echo=True) for j in range(gen.n)]
    return out


# -- its steps --
def request_constraint(body: SamplingFields) -> Constraint | None:
    """The request's output constraint; a 400 when it names several or one is malformed."""
    try:
        return body.constraint()
    except RequestError as exc:
        raise ApiError(400, str(exc), "invalid_grammar") from None


async def compile_constraint(
    state: ServerState, constraint: Constraint | None
) -> CompiledGrammar | None:
    """The compiled grammar of a request's constraint, compiled off the event loop (cached);
    a 400 naming the field and the problem when it does not compile."""
    if constraint is None:
        return None
    try:
        return await asyncio.to_thread(state.prompter.compile, constraint)
    except RequestError as exc:
        raise ApiError(400, str(exc), "invalid_grammar") from None


def sampling_params(
    state: ServerState,
    body: SamplingFields,
    max_tokens: int,
    choice: int = 0,
    grammar: CompiledGrammar | None = None,
) -> SamplingParams:
    """The request's sampling settings over the server's defaults. Choice i of n gets seed + i, so
    n > 1 with a seed gives n different, repeatable answers. `grammar`: the compiled constraint
    (`compile_constraint`), one matcher per choice."""
    cfg = state.config
    seed = body.seed if body.seed is not None else cfg.seed
    try:
        bias = state.prompter.logit_bias(body.logit_bias)
    except RequestError as exc:
        raise ApiError(400, str(exc), "invalid_value") from None
    try:
        return SamplingParams(
            temperature=cfg.temperature if body.temperature is None else body.temperature,
            top_k=cfg.top_k if body.top_k is None else body.top_k,
            top_p=cfg.top_p if body.top_p is None else body.top_p,
            min_p=cfg.min_p if body.min_p is None else body.min_p,
            repeat_penalty=1.0 if body.repeat_penalty is None else body.repeat_penalty,
            repeat_last_n=64 if body.repeat_last_n is None else body.repeat_last_n,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            seed=None if seed is None or seed < 0 else seed + choice,
            max_tokens=max_tokens,
            stop=body.stop_list(),
            ignore_eos=body.ignore_eos,
            logit_bias=bias,
            grammar=grammar,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_value") from None


def check_context(state: ServerState, ids: list[int], max_tokens: int) -> None:
    """A prompt must leave room for one generated token (or fit whole, when only scored)."""
    n_ctx = state.service.n_ctx
    if len(ids) > n_ctx or (max_tokens != 0 and len(ids) >= n_ctx):
        raise ApiError(
            400,
            f"this model's maximum context length is {n_ctx} tokens; "
            f"the prompt has {len(ids)} tokens"
            + (" and is too large" if max_tokens == 0 else " and needs room for at least one more"),
            "context_length_exceeded",
            # llama-server's type and figures (OpenAI's code above)
            "exceed_context_size_error",
            {"n_prompt_tokens": len(ids), "n_ctx": n_ctx},
        )


async def admit(state: ServerState, model: str | None, lora: list[RequestLoraItem] | None) -> Lease:
    """The adapter settings a request runs with, held until its deltas end."""
    items = None if lora is None else {x.id: x.scale for x in lora if x.id is not None}
    names = {x.name: x.scale for x in lora or [] if x.name is not None}
    if (
        model is not None
        and not state.config.strict_model_names
        and model not in state.base_names
        and model not in state.registry.names
        and model not in state.registry.unloaded  # (an adapter's name: never the base's answer)
    ):
        model = None  # as llama-server: a name it does not know is served by the base model
    try:
        lease = await state.registry.lease(model, items, state.base_names, names)
    except UnknownModelError as exc:
        raise ApiError(404, str(exc), exc.code) from None
    return lease


# -- scoring (embeddings, reranking): no jobs, the same context check and lease --
T = TypeVar("T")


async def score_each(
    state: ServerState,
    ids: list[list[int]],
    model: str | None,
    lora: list[RequestLoraItem] | None,
    score: Callable[[list[int], AdapterSettings], Awaitable[T]],
) -> list[T]:
    """Each prompt scored in turn under the request's adapters (embeddings, reranking): all
    checked against the context first, each counted in llama-server's prompt metrics."""
    for x in ids:
        check_context(state, x, 0)
    lease = await admit(state, model, lora)
    try:
        out = []
        for x in ids:
            t0 = time.perf_counter()
            out.append(await score(x, lease.lora))
            state.metrics.llama.prompt_only(len(x), time.perf_counter() - t0)
    finally:
        state.registry.release(lease)
    return out


# -- events -> deltas --
async def deltas(
    state: ServerState,
    jobs: list[Job],
    lease: Lease,
    endpoint: str,
    before: Sequence[Delta] = (),
    whole: bool = False,
) -> AsyncGenerator[Delta, None]:
    """The pieces of every choice as the engine produces them (`before` first: echoed prompts;
    whole: an answer not streamed, its pieces handed over when its choice ends). Releases the
    lease when it ends, however it ends; records each finished choice's metrics."""
    try:
        for d in before:
            yield d
        async with aclosing(state.service.stream(jobs, whole)) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    lp = (
                        [TokenLogprob(ev.token, ev.logprob, ev.top)]
                        if ev.logprob is not None
                        else []
                    )
                    yield Delta(ev.index, ev.text, [ev.token], lp)
                elif isinstance(ev, FinishEvent):
                    state.metrics.finished(
                        lease.labels, endpoint, ev.n_prompt, ev.n_generated, ev.ttft, ev.tpot
                    )
                    state.metrics.llama.finished(ev)
                    yield Delta(ev.index, ev.text, finish=ev)
                elif isinstance(ev, ProgressEvent):
                    yield Delta(ev.index, progress=ev)
                elif isinstance(ev, ErrorEvent):
                    raise ev.error
    finally:
        state.registry.release(lease)


async def collect(request: Request, pieces: AsyncGenerator[Delta, None], n: int) -> list[Choice]:
    """Fold pieces into whole choices; cancel the generation if the client goes away meanwhile
    (told by the server's receive channel: no polling while the answer is made)."""
    choices = [Choice(i) for i in range(n)]

    async def fold() -> None:
        async with aclosing(pieces) as it:
            async for d in it:
                choices[d.index].add(d)

    task = asyncio.ensure_future(fold())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():  # (cancelled below)
            raise ApiError(499, "the client closed the connection", "client_closed")
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
    task.result()
    return choices


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone: the ASGI receive channel, its body read, next says
    `http.disconnect` (starlette's `is_disconnected` asks the same channel without waiting,
    which a loop must then poll). A channel that fails is not a client gone: the watch ends and
    the answer goes on (its sending tells)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - any failure of the channel: stop watching it
        log.debug("the receive channel failed; no longer watching it", exc_info=True)
        await asyncio.Event().wait()  # (cancelled with the answer)
