"""From a parsed request to engine jobs, and from the engine's events back to answer pieces.

Every generating endpoint runs `deltas()`: one generator of per-choice pieces (text, tokens,
log-probabilities, and at the end the finish). A streaming answer frames each piece as it comes;
a non-streaming answer folds the same pieces (`collect`). Nothing here touches tensors.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from graftlm.errors import RequestError
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.constraints import CompiledGrammar, Constraint
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.service import ErrorEvent, FinishEvent, Job, ProgressEvent, TokenEvent
from graftlm.server.registry import Lease, UnknownModelError
from graftlm.server.schemas import RequestLoraItem, SamplingFields
from graftlm.server.state import ApiError, ServerState


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
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishEvent | None = None
    n_echo_tokens: int = 0

    def add(self, d: Delta) -> None:
        self.text += d.text
        if d.echo:
            self.n_echo_tokens += len(d.tokens)
        else:
            self.tokens += d.tokens
        self.logprobs += d.logprobs
        if d.finish is not None:
            self.finish = d.finish


# -- requests -> jobs --
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


def prompt_ids(state: ServerState, prompt: str | Sequence[int]) -> list[int]:
    """A prompt as text (tokenized with the model's special tokens) or as token ids (checked)."""
    ids = state.prompter.prompt_ids(prompt)
    if not ids:
        raise ApiError(400, "the prompt is empty", "invalid_prompt")
    return ids


LlamaPrompt = str | list[int | str] | dict[str, Any]


def llama_prompts(prompt: Any) -> list[LlamaPrompt]:
    """llama-server's prompt shapes: one text, token ids, ids and texts mixed in one sequence,
    {"prompt_string": text}; or a list of these (several prompts, one answer each)."""
    if isinstance(prompt, str | dict):
        return [prompt]
    if not prompt:
        raise ApiError(400, "the prompt is empty", "invalid_prompt")
    if any(isinstance(x, int) for x in prompt):
        return [prompt]  # one sequence of ids (and texts)
    return list(prompt)


def _object_text(prompt: dict[str, Any]) -> str:
    """{"prompt_string": text} or {"content": [text parts]} (an embedding input; as
    llama-server, content is a list of parts, never a bare string)."""
    if isinstance(prompt.get("prompt_string"), str):
        return str(prompt["prompt_string"])
    content = prompt.get("content")
    if isinstance(content, list) and content:
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"content[{k}]: {kind!r} parts are not supported by this model")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(
        400, "prompt: an object prompt needs prompt_string, or content as a list of text parts"
    )


def llama_prompt_ids(state: ServerState, prompt: LlamaPrompt) -> list[int]:
    if isinstance(prompt, dict):
        if prompt.get("multimodal_data"):
            raise ApiError(400, "multimodal_data: this model takes no images or audio")
        return prompt_ids(state, _object_text(prompt))
    if isinstance(prompt, str) or all(isinstance(x, int) for x in prompt):
        return prompt_ids(state, prompt)  # type: ignore[arg-type]
    ids: list[int] = []  # as llama.cpp's tokenize_mixed: specials for a leading text only
    for k, x in enumerate(prompt):
        if isinstance(x, str):
            ids += state.prompter.tokenize(x, add_special=k == 0, parse_special=True)
        else:
            ids.append(x)
    return prompt_ids(state, ids)


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


async def admit(state: ServerState, model: str | None, lora: list[RequestLoraItem] | None) -> Lease:
    """The adapter settings a request runs with, held until its deltas end."""
    items = None if lora is None else {x.id: x.scale for x in lora if x.id is not None}
    names = {x.name: x.scale for x in lora or [] if x.name is not None}
    if (
        model is not None
        and not state.config.strict_model_names
        and model not in state.base_names
        and model not in state.registry.names
    ):
        model = None  # as llama-server: a name it does not know is served by the base model
    try:
        lease = await state.registry.lease(model, items, state.base_names, names)
    except UnknownModelError as exc:
        raise ApiError(404, str(exc), exc.code) from None
    return lease


# -- events -> deltas --
async def deltas(
    state: ServerState,
    jobs: list[Job],
    lease: Lease,
    endpoint: str,
    before: Sequence[Delta] = (),
) -> AsyncGenerator[Delta, None]:
    """The pieces of every choice as the engine produces them (`before` first: echoed prompts).
    Releases the lease when it ends, however it ends; records each finished choice's metrics."""
    try:
        for d in before:
            yield d
        async with aclosing(state.service.stream(jobs)) as events:
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
    """Fold pieces into whole choices; cancel the generation if the client goes away meanwhile."""
    choices = [Choice(i) for i in range(n)]

    async def fold() -> None:
        async with aclosing(pieces) as it:
            async for d in it:
                choices[d.index].add(d)

    task = asyncio.ensure_future(fold())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "the client closed the connection", "client_closed")
    finally:
        if not task.done():
            task.cancel()
    task.result()
    return choices


async def sse(
    pieces: AsyncGenerator[Delta, None],
    frame: Callable[[Delta], list[dict[str, Any]]],
    tail: Callable[[], list[dict[str, Any]]] = list,
    done_marker: bool = True,
) -> AsyncGenerator[bytes, None]:
    """Server-sent events: `frame` turns each piece into zero or more JSON events; `tail` adds the
    last ones (usage). An error after the answer started is sent as an error event."""
    async with aclosing(pieces) as it:
        try:
            async for d in it:
                for ev in frame(d):
                    yield _event(ev)
            for ev in tail():
                yield _event(ev)
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in-band
            yield _event(ApiError.of(exc).body())
    if done_marker:
        yield b"data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


def timings(f: FinishEvent) -> dict[str, float]:
    """llama-server's `timings` of one finished sequence (prompt_n: the prompt tokens computed,
    cache_n: those the prefix cache served). As llama-server counts them, the prompt's time runs
    to the first token (which comes from the prompt's last logits) and the generation rate is
    over the tokens after it; a rate over nothing is 0."""
    first = f.t_first or f.t_prompt_done or f.t_end or f.t_submit
    end = f.t_end or first
    prompt_ms = (first - f.t_submit) * 1000.0
    predicted_ms = (end - first) * 1000.0
    n = f.n_prompt - f.n_cached
    steps = max(0, f.n_generated - 1)  # decode steps after the first token
    out: dict[str, float] = {
        "cache_n": f.n_cached,
        "prompt_n": n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / n if n else 0.0,
        "prompt_per_second": n / prompt_ms * 1000.0 if prompt_ms > 0 else 0.0,
        "predicted_n": f.n_generated,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": steps / predicted_ms * 1000.0
        if predicted_ms > 0 and steps
        else 0.0,
    }
    if f.n_drafted:  # as llama-server: only where speculative decoding drafted
        out["draft_n"] = f.n_drafted
        out["draft_n_accepted"] = f.n_draft_accepted
    return out


def progress_fields(p: ProgressEvent, with_timings: bool) -> dict[str, Any]:
    """What a progress report adds to the chunk that carries it: llama-server's
    `prompt_progress` (the prompt's tokens, those the cache served, those in the KV cache now,
    the served ones included, and the milliseconds since the first report), and with
    timings_per_token its `timings` so far."""
    out: dict[str, Any] = {
        "prompt_progress": {
            "total": p.total,
            "cache": p.cache,
            "processed": p.processed,
            "time_ms": int(p.ms),
        }
    }
    if with_timings:
        out["timings"] = _progress_timings(p)
    return out


def _progress_timings(p: ProgressEvent) -> dict[str, float]:
    """`timings` on a progress report: the prompt's tokens computed so far and their time;
    nothing generated yet."""
    n = p.processed - p.cache
    return {
        "cache_n": p.cache,
        "prompt_n": n,
        "prompt_ms": p.ms,
        "prompt_per_token_ms": p.ms / n if n else 0.0,
        "prompt_per_second": n / p.ms * 1000.0 if p.ms > 0 else 0.0,
        "predicted_n": 0,
        "predicted_ms": 0.0,
        "predicted_per_token_ms": 0.0,
        "predicted_per_second": 0.0,
    }


def system_fingerprint() -> str:
    """llama-server's form ("b" and its build) for graftlm's version."""
    from graftlm import __version__

    return f"b{__version__}-graftlm"


def served_name(state: ServerState, model: str | None) -> str:
    """The `model` an answer shows: the adapter or base name asked for, else the base's name (as
    llama-server, which serves any other name with its model)."""
    if model is not None and (model in state.base_names or model in state.registry.names):
        return model
    return state.config.model_name


class StreamClock:
    """llama-server's per-token `timings` (timings_per_token), measured as the stream is framed:
    the prompt's time is until the first token, the rest is generation."""

    def __init__(self, n_prompt: int) -> None:
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.n_prompt = n_prompt
        self.n = 0

    def tick(self, n_tokens: int) -> dict[str, float]:
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.n += n_tokens
        prompt_ms = (self.t_first - self.t0) * 1000.0
        predicted_ms = (now - self.t_first) * 1000.0
        return {
            "prompt_n": self.n_prompt,
            "prompt_ms": prompt_ms,
            "prompt_per_second": self.n_prompt / prompt_ms * 1000.0 if prompt_ms > 0 else 0.0,
            "predicted_n": self.n,
            "predicted_ms": predicted_ms,
            "predicted_per_second": self.n / predicted_ms * 1000.0
            if predicted_ms > 0 and self.n > 1
            else 0.0,
        }


def usage(
    choices_prompt_tokens: Sequence[int], n_generated: int, n_cached: int = 0
) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens: prompt tokens the prefix cache served (not computed)."""
    prompt = sum(choices_prompt_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": n_generated,
        "total_tokens": prompt + n_generated,
        "prompt_tokens_details": {"cached_tokens": n_cached},
    }


def generated_and_cached(choices: Sequence[Choice]) -> tuple[int, int]:
    """Tokens the choices generated, and prompt tokens the prefix cache served them."""
    done = [c.finish for c in choices if c.finish]
    return sum(f.n_generated for f in done), sum(f.n_cached for f in done)


def finish_reason(finish: FinishEvent | None) -> str | None:
    if finish is None:
        return None
    return "length" if finish.reason == "length" else "stop"
