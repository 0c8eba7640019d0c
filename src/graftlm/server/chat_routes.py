"""OpenAI's chat completions: the model's chat template, tools, streaming as llama-server frames
it (the first chunk's content null, the finish in a chunk of its own, usage with timings)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from graftlm.runtime.constraints import Constraint
from graftlm.runtime.service import FinishEvent, Job
from graftlm.server.generation import (
    Choice,
    Delta,
    StreamClock,
    admit,
    check_context,
    collect,
    compile_constraint,
    deltas,
    finish_reason,
    generated_and_cached,
    progress_fields,
    request_constraint,
    sampling_params,
    served_name,
    sse,
    system_fingerprint,
    timings,
    usage,
)
from graftlm.server.openai_routes import SSE_HEADERS, chat_logprobs, state_of
from graftlm.server.schemas import ApplyTemplateRequest, ChatCompletionRequest
from graftlm.server.state import ApiError, ServerState
from graftlm.server.tools import ToolCall, ToolCallParser, parse_tool_calls, tool_constraint

router = APIRouter()


# -- /v1/chat/completions --
def _tool_setup(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[list[dict[str, Any]] | None, Constraint | None]:
    """The tools the template receives (None: no tools in play) and the grammar that
    `tool_choice` "required" or a named function imposes."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none" and choice != "auto":
            raise ApiError(400, "tool_choice names a tool but no tools are given", "invalid_value")
        return None, None
    if choice == "none":
        return None, None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"tools: function names must be unique, got {names}", "invalid_value")
    fmt = state.prompter.tool_format
    if choice is None or choice == "auto":  # generic: the answer is JSON, a call or a reply
        return tools, tool_constraint(tools, None, fmt, answer=True) if fmt == "generic" else None
    only = None
    if not isinstance(choice, str):
        only = choice.function.name
        if only not in names:
            raise ApiError(
                400,
                f"tool_choice names the function {only!r}, which is not among tools: {names}",
                "invalid_value",
            )
    return tools, tool_constraint(tools, only, fmt)


@dataclass
class ChatRun:
    """A chat request on its way through the engine: its prompt, tools and pieces (every front
    end that chats, OpenAI's, Anthropic's and the Responses API, frames these)."""

    ids: list[int]
    text: str  # the rendered chat
    tools: list[dict[str, Any]] | None
    pieces: AsyncGenerator[Delta, None]
    top: int | None  # top log-probabilities asked for (None: none)


def chat_messages(body: ChatCompletionRequest | ApplyTemplateRequest) -> list[dict[str, Any]]:
    """The messages as the template receives them; a 400 where llama-server refuses them (two
    assistant messages at the end, or a generation prompt after a continued final message)."""
    messages = [m.as_template_input() for m in body.messages]
    if len(messages) >= 2 and all(m["role"] == "assistant" for m in messages[-2:]):
        raise ApiError(
            400, "the chat ends with two assistant messages; give at most one to continue"
        )
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true")
    return messages


def chat_text(
    state: ServerState,
    body: ChatCompletionRequest | ApplyTemplateRequest,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> str:
    """The rendered chat. A final assistant message is continued (as llama-server's prefill):
    the chat before it with the generation prompt, then its text; add_generation_prompt false
    renders the chat as it is, with no generation prompt."""
    last_assistant = bool(messages) and messages[-1]["role"] == "assistant"
    cont = body.continue_final_message
    if cont is None:
        cont = last_assistant and body.add_generation_prompt is not False
    if cont and not last_assistant:
        raise ApiError(400, "continue_final_message: the last message is not the assistant's")
    apply = state.prompter.apply_chat_template
    kwargs = body.chat_template_kwargs
    if cont:
        return str(
            apply(messages[:-1], add_generation_prompt=True, tools=tools, kwargs=kwargs)
        ) + str(messages[-1]["content"])
    gen = body.add_generation_prompt is not False
    return str(apply(messages, add_generation_prompt=gen, tools=tools, kwargs=kwargs))


def chat_ids(state: ServerState, text: str) -> list[int]:
    """The prompt ids of a rendered chat: a BOS only where the template has none of its own."""
    p = state.prompter
    tok = p.tokenizer
    bos = tok.decode([tok.bos_id]) if tok.bos_id is not None and tok.add_bos else None
    return p.tokenize(text, add_special=bos is None or not text.startswith(bos), parse_special=True)


async def start_chat(state: ServerState, body: ChatCompletionRequest) -> ChatRun:
    limit = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    max_tokens = state.config.n_predict if limit is None else limit
    messages = chat_messages(body)
    tools, tool_grammar = _tool_setup(state, body)
    constraint = request_constraint(body)
    if tool_grammar is not None:
        if constraint is not None:
            choice = body.tool_choice or "auto"
            what = (
                f"tool_choice {choice if isinstance(choice, str) else 'naming a function'}"
                if state.prompter.tool_format != "generic"
                else "tools on a chat template that renders none (answered as JSON)"
            )
            raise ApiError(
                400,
                f"{what} and {constraint.field} both constrain the answer; give one",
                "invalid_value",
            )
        constraint = tool_grammar
    text = await asyncio.to_thread(chat_text, state, body, messages, tools)  # off the loop
    ids = await asyncio.to_thread(chat_ids, state, text)
    check_context(state, ids, max_tokens)
    top = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await compile_constraint(state, constraint)
    params = [sampling_params(state, body, max_tokens, j, grammar) for j in range(body.n)]
    lease = await admit(state, body.model, body.lora)
    progress = body.stream and body.return_progress
    jobs = [
        Job(ids, params[j], lease.lora, top, body.cache_prompt, progress=progress, spec=body.spec())
        for j in range(body.n)
    ]
    return ChatRun(ids, text, tools, deltas(state, jobs, lease, "chat"), top)


@router.post("/v1/chat/completions")
@router.post("/chat/completions", include_in_schema=False)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """Chat through the model's template; streaming as server-sent events. With `tools`, the
    template receives them and the answer's calls come back as `tool_calls`."""
    state = state_of(request)
    run = await start_chat(state, body)
    ids, tools, pieces, top = run.ids, run.tools, run.pieces, run.top
    rid, created, model = (
        f"chatcmpl-{uuid.uuid4().hex}",
        int(time.time()),
        served_name(state, body.model),
    )
    fingerprint = system_fingerprint()
    fmt = state.prompter.tool_format

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
            "choices": choices,
        }

    def reason(finish: FinishEvent | None, n_calls: int) -> str | None:
        r = finish_reason(finish)
        return "tool_calls" if r == "stop" and n_calls else r

    if body.stream:
        started = [False] * body.n
        parsers = [ToolCallParser(fmt) if tools else None for _ in range(body.n)]
        n_gen = [0, 0]  # tokens generated, prompt tokens the cache served
        finished: list[FinishEvent] = []
        clock = StreamClock(len(ids)) if body.timings_per_token else None

        def piece(i: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
            return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None} | extra

        def frame(d: Delta) -> list[dict[str, Any]]:
            out = []
            i = d.index
            if d.progress is not None:  # as llama-server: on a role chunk of its own
                role = chunk([piece(i, {"role": "assistant", "content": None})])
                return [role | progress_fields(d.progress, clock is not None)]
            if not started[i]:  # as llama-server: the role first, with content null
                started[i] = True
                out.append(chunk([piece(i, {"role": "assistant", "content": None})]))
            parser = parsers[i]
            text, calls = d.text, list[ToolCall]()
            if parser is not None:
                text, calls = parser.feed(d.text)
                if d.finish is not None:
                    tail, more = parser.finish()
                    text, calls = text + tail, calls + more
            if d.finish is not None:
                n_gen[0] += d.finish.n_generated
                n_gen[1] += d.finish.n_cached
                finished.append(d.finish)
            lps = chat_logprobs(state, d.logprobs) if top is not None and d.logprobs else None
            if text or lps is not None:
                out.append(chunk([piece(i, {"content": text or None}, logprobs=lps)]))
            if calls:
                k0 = len(parser.calls) - len(calls) if parser is not None else 0
                out.append(
                    chunk(
                        [
                            piece(
                                i,
                                {"tool_calls": [c.as_openai(k0 + k) for k, c in enumerate(calls)]},
                            )
                        ]
                    )
                )
            if clock is not None and d.tokens:  # on the pieces, not on the role chunk
                tick = clock.tick(len(d.tokens))
                for ev in out:
                    if "role" not in ev["choices"][0]["delta"]:
                        ev["timings"] = tick
            if d.finish is not None:  # the finish in a chunk of its own, its delta empty
                n_calls = len(parser.calls) if parser is not None else 0
                out.append(chunk([piece(i, {}, finish_reason=reason(d.finish, n_calls))]))
            return out

        def tail() -> list[dict[str, Any]]:
            # as llama-server: the usage chunk (with timings) unless include_usage is false
            if body.stream_options is not None and not body.stream_options.include_usage:
                return []
            last = {"timings": timings(finished[-1])} if finished else {}
            return [chunk([]) | {"usage": usage([len(ids)], n_gen[0], n_gen[1])} | last]

        return StreamingResponse(
            sse(pieces, frame, tail), media_type="text/event-stream", headers=SSE_HEADERS
        )

    choices = await collect(request, pieces, body.n)

    def message(c: Choice) -> tuple[dict[str, Any], int]:
        if not tools:
            return {"role": "assistant", "content": c.text}, 0
        content, calls = parse_tool_calls(c.text, fmt)
        msg: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            msg["tool_calls"] = [call.as_openai() for call in calls]
        return msg, len(calls)

    out = []
    for c in choices:
        msg, n_calls = message(c)
        out.append(
            {
                "index": c.index,
                "message": msg,
                "logprobs": chat_logprobs(state, c.logprobs) if top is not None else None,
                "finish_reason": reason(c.finish, n_calls),
            }
        )
    return (
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
            "choices": out,
            "usage": usage([len(ids)], *generated_and_cached(choices)),
        }
        | ({"timings": timings(choices[-1].finish)} if choices[-1].finish else {})
        | (
            {"__verbose": {"prompt": run.text, "content": choices[0].text}}
            if body.verbose or state.config.verbose
            else {}
        )
    )


@router.post("/chat/completions/input_tokens")
@router.post("/v1/chat/completions/input_tokens", include_in_schema=False)
async def input_tokens(body: ChatCompletionRequest, request: Request) -> dict[str, int]:
    """The prompt tokens a chat comes to (llama-server's count, without generating)."""
    return {"input_tokens": await count_chat_tokens(state_of(request), body)}


async def count_chat_tokens(state: ServerState, body: ChatCompletionRequest) -> int:
    """How many prompt tokens the chat `body` comes to, its tools included."""
    tools, _ = _tool_setup(state, body)
    text = await asyncio.to_thread(chat_text, state, body, chat_messages(body), tools)
    return len(await asyncio.to_thread(chat_ids, state, text))
