"""OpenAI's legacy completions (/v1/completions) and the model list (/v1/models)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from graftlm.server.framing import (
    EventStream,
    completion_logprobs,
    finish_reason,
    generated_and_cached,
    progress_fields,
    served_name,
    sse,
    usage,
)
from graftlm.server.inputs import check_prompt_count, prompt_ids
from graftlm.server.pipeline import Choice, Delta, Generation, Run, collect, start
from graftlm.server.schemas import CompletionRequest
from graftlm.server.state import ApiError, ServerState, state_of

router = APIRouter()


# -- /v1/completions --
def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise ApiError(400, "the prompt is empty", "invalid_prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    check_prompt_count(len(p))
    return list(p)  # type: ignore[arg-type]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    """Continue prompts (text or token ids); echo + logprobs + max_tokens 0 scores a prompt."""
    state = state_of(request)
    max_tokens = body.length if body.length is not None else state.config.n_predict
    prompts = _prompts(body)
    ids = [await asyncio.to_thread(prompt_ids, state, p) for p in prompts]  # off the loop
    echo = None
    if body.echo:
        echo = [
            p if isinstance(p, str) else state.prompter.detokenize(x)
            for p, x in zip(prompts, ids, strict=True)
        ]
    gen = Generation(
        body,
        ids,
        max_tokens,
        "completions",
        body.model,
        body.n,
        body.stream,
        body.logprobs,
        echo=echo,
    )
    run = await start(state, gen)
    answer = _Answer(state, body, run)
    if body.stream:
        return EventStream(state, sse(run.pieces, answer.frame, answer.tail))
    choices = await collect(request, run.pieces, run.n_choices)
    return answer.chunk(
        [_completion_choice(state, c, body.logprobs is not None) for c in choices]
    ) | {"usage": usage(answer.n_prompt, *generated_and_cached(choices))}


class _Answer:
    """A completions answer: its chunks (each streamed piece framed, then usage) or one body."""

    def __init__(self, state: ServerState, body: CompletionRequest, run: Run) -> None:
        self.state, self.body = state, body
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.model = served_name(state, body.model)
        self.n_prompt = [len(x) for x in run.prompts]
        self.offsets = [0] * run.n_choices
        self.n_gen = [0, 0]  # tokens generated, prompt tokens the cache served

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def frame(self, d: Delta) -> list[dict[str, Any]]:
        body = self.body
        if d.progress is not None:  # as llama-server: on an empty piece
            c = {"index": d.index, "text": "", "logprobs": None, "finish_reason": None}
            return [self.chunk([c]) | progress_fields(d.progress, body.timings_per_token)]
        if d.finish is not None:
            self.n_gen[0] += d.finish.n_generated
            self.n_gen[1] += d.finish.n_cached
        if not d.text and d.finish is None and not d.logprobs:
            return []
        lp = None
        if body.logprobs is not None:
            lp = completion_logprobs(self.state, d.logprobs, self.offsets[d.index])
        self.offsets[d.index] += len(d.text)
        c = {
            "index": d.index,
            "text": d.text,
            "logprobs": lp,
            "finish_reason": finish_reason(d.finish),
        }
        return [self.chunk([c])]

    def tail(self) -> list[dict[str, Any]]:
        options = self.body.stream_options
        if options is None or not options.include_usage:
            return []
        return [self.chunk([]) | {"usage": usage(self.n_prompt, *self.n_gen)}]


def _completion_choice(state: ServerState, c: Choice, logprobs: bool) -> dict[str, Any]:
    return {
        "index": c.index,
        "text": c.text,
        "logprobs": completion_logprobs(state, c.logprobs, 0) if logprobs else None,
        "finish_reason": finish_reason(c.finish),
    }


# -- /v1/models --
@router.get("/v1/models")
@router.get("/models", include_in_schema=False)
async def models(request: Request) -> dict[str, Any]:
    """The base model and every adapter (`parent`: the base), loaded or loadable."""
    state = state_of(request)
    base = state.config.model_name
    created = int(state.model_path.stat().st_mtime) if state.model_path.exists() else 0
    data = [
        {
            "id": base,
            "object": "model",
            "created": created,
            "owned_by": "graftlm",
            "root": str(state.model_path),
            "parent": None,
            "max_model_len": state.service.n_ctx,
            "aliases": sorted(state.config.aliases or (base,)),
            "tags": list(state.config.tags),
        }
    ]
    for name, e in sorted(state.registry.names.items()):
        data.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "graftlm",
                "root": e.path,
                "parent": base,
                "lora_id": e.id,
            }
        )
    return {"object": "list", "data": data}
