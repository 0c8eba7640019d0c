"""What the dialects' answers share, from the pipeline's pieces to their frames: server-sent
events, llama-server's timings and progress fields, OpenAI's usage and finish reasons, the
log-probability shapes, the model name an answer shows. Nothing here touches tensors."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from graftlm.runtime.service import FinishEvent, ProgressEvent
from graftlm.server.pipeline import Choice, Delta, TokenLogprob
from graftlm.server.state import ApiError, ServerState

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


class _NotReading(Exception):
    pass


class EventStream(StreamingResponse):
    """A server-sent event stream that a client must keep reading: a write that waits longer
    than the server's write timeout (the client accepts nothing while its socket's buffers are
    full) ends the stream, cancels its sequences, so their slots go to the requests waiting, and
    closes the connection. Without it, a client that never reads holds its slot for as long as
    its answer runs."""

    def __init__(self, state: ServerState, frames: AsyncGenerator[bytes, None]) -> None:
        super().__init__(frames, media_type="text/event-stream", headers=SSE_HEADERS)
        self.frames = frames
        self.state = state

    async def stream_response(self, send: Send) -> None:
        limit = self.state.config.write_timeout

        async def timed(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), limit)
            except TimeoutError:
                raise _NotReading from None

        try:
            await super().stream_response(timed)
        except _NotReading:
            await self.frames.aclose()  # its sequences are cancelled on the engine's thread
            self.state.metrics.slow_clients.inc()
            logging.getLogger("graftlm.server").warning(
                "a client read nothing of its stream for %g s (-to): its sequences were "
                "cancelled and the connection is closed",
                limit,
            )  # (the server then notes the answer as incomplete, and closes the connection)


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


# -- log-probabilities in OpenAI's two shapes --
def completion_logprobs(
    state: ServerState, lps: Sequence[TokenLogprob], offset: int
) -> dict[str, Any]:
    """The legacy completions shape; `offset`: text offset of the first token. The chosen token
    is always among its top_logprobs (lm-evaluation-harness compares it with the best one)."""
    svc = state.prompter
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for lp in lps:
        s = svc.token_str(lp.token)
        tokens.append(s)
        token_logprobs.append(lp.logprob)
        if lp.logprob is None:
            top_logprobs.append(None)
        else:
            top: dict[str, float] = {}
            for t, v in lp.top:  # best first; tokens that render alike keep the best value
                top.setdefault(svc.token_str(t), v)
            top.setdefault(s, lp.logprob)
            top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def token_logprobs(
    state: ServerState, lps: Sequence[TokenLogprob], with_id: bool = False, post: bool = False
) -> list[dict[str, Any]]:
    """Chosen tokens with their top alternatives, in the shape both OpenAI's chat `logprobs`
    and llama-server's `completion_probabilities` use (the latter also carries `id`); `post`:
    llama-server's post-sampling shape, `prob` and `top_probs` (probabilities, not logs)."""
    svc = state.prompter
    name, top_name = ("prob", "top_probs") if post else ("logprob", "top_logprobs")

    def entry(token: int, logprob: float) -> dict[str, Any]:
        e: dict[str, Any] = {"id": token} if with_id else {}
        value = math.exp(logprob) if post else logprob
        e.update({"token": svc.token_str(token), name: value})
        e["bytes"] = list(svc.token_bytes(token))
        return e

    out = []
    for lp in lps:
        e = entry(lp.token, lp.logprob if lp.logprob is not None else 0.0)
        e[top_name] = [entry(t, v) for t, v in lp.top]
        out.append(e)
    return out


def chat_logprobs(state: ServerState, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": token_logprobs(state, lps), "refusal": None}
