"""The chat path every chatting dialect shares: an OpenAI chat body becomes the pipeline's
request through the model's chat template (messages, tools, the grammar `tool_choice` imposes),
and OpenAI's chat answer is framed as llama-server frames it (the first chunk's content null,
the finish in a chunk of its own, usage with timings). OpenAI's /v1/chat/completions and
Vertex's /predict answer with it; Anthropic's Messages and OpenAI's Responses translate their
bodies into a chat body and frame `start_chat`'s pieces themselves."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from graftlm.runtime.constraints import Constraint
from graftlm.runtime.reasoning import (
    AnswerParser,
    Parts,
    answer_syntax,
    parse_answer,
    thinking_forced_open,
)
from graftlm.runtime.service import FinishEvent
from graftlm.runtime.tools import tool_constraint
from graftlm.server.chat_schemas import ApplyTemplateRequest, ChatCompletionRequest
from graftlm.server.framing import (
    EventStream,
    StreamClock,
    chat_logprobs,
    finish_reason,
    generated_and_cached,
    progress_fields,
    served_name,
    sse,
    system_fingerprint,
    timings,
    usage,
)
from graftlm.server.pipeline import (
    Choice,
    Delta,
    Generation,
    collect,
    request_constraint,
    start,
)
from graftlm.server.state import ApiError, ServerState


# -- the chat body -> the pipeline's request --
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
    end that chats, OpenAI's, Anthropic's and the Responses API, frames these), and how its
    answers are split into reasoning, content and calls (`parser`, `parse`)."""

    ids: list[int]
    text: str  # the rendered chat
    tools: list[dict[str, Any]] | None
    pieces: AsyncGenerator[Delta, None]
    top: int | None  # top log-probabilities asked for (None: none)
    syntax: str | None = None  # how the model writes reasoning (reasoning.answer_syntax)
    reasoning_format: str = "auto"
    tool_format: str = "hermes"

    @property
    def forced_open(self) -> bool:
        return self.syntax == "think" and thinking_forced_open(self.text)

    def parser(self, stream: bool) -> AnswerParser:
        """A choice's parser, for its streamed pieces."""
        tools = self.tool_format if self.tools else None
        return AnswerParser(
            self.syntax, self.reasoning_format, tools, self.forced_open, stream=stream
        )

    def parse(self, text: str) -> Parts:
        """A whole choice's text split."""
        tools = self.tool_format if self.tools else None
        return parse_answer(text, self.syntax, self.reasoning_format, tools, self.forced_open)


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
    if body.reasoning_effort is not None:  # (as llama-server: the template's variable)
        kwargs = {"reasoning_effort": body.reasoning_effort} | (kwargs or {})
    if answer_syntax(state.prompter.chat_template) == "harmony":
        messages = harmony_messages(messages)
        # gpt-oss's template writes every tool's description unguarded: one left out (as
        # clients often leave it) would fail the render
        tools = [_described(t) for t in tools] if tools else tools
    if cont:
        return str(
            apply(messages[:-1], add_generation_prompt=True, tools=tools, kwargs=kwargs)
        ) + str(messages[-1].get("content") or "")
    gen = body.add_generation_prompt is not False
    text = str(apply(messages, add_generation_prompt=gen, tools=tools, kwargs=kwargs))
    if not gen and answer_syntax(state.prompter.chat_template) == "harmony":
        # as llama.cpp: a chat that the model goes on from ends its last message with <|end|>,
        # not the <|return|> that ends a generation (its training form)
        at = text.rfind("<|return|>")
        if at >= 0:
            text = text[:at] + "<|end|>" + text[at + len("<|return|>") :]
    return text


def _described(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function")
    if isinstance(fn, dict) and fn.get("description") is None:
        return tool | {"function": fn | {"description": ""}}
    return tool


def harmony_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat as gpt-oss's template reads it (llama.cpp's adjustment): an assistant message's
    reasoning as `thinking`, and a message with calls and reasoning without its content (the
    template refuses both)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and isinstance(m.get("reasoning_content"), str):
            m = dict(m, thinking=m["reasoning_content"])
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out


def template_tools(
    body: ChatCompletionRequest | ApplyTemplateRequest,
) -> list[dict[str, Any]] | None:
    """The tools as the template receives them, whatever `tool_choice` says (None: none)."""
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


async def start_chat(state: ServerState, body: ChatCompletionRequest) -> ChatRun:
    """The chat rendered and tokenized (off the event loop), and its run started."""
    limit = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    max_tokens = state.config.n_predict if limit is None else limit
    messages = chat_messages(body)
    tools, tool_grammar = _tool_setup(state, body)
    _one_constraint(state, body, tool_grammar)
    text = await asyncio.to_thread(chat_text, state, body, messages, tools)  # off the loop
    ids = await asyncio.to_thread(state.prompter.chat_ids, text)
    top = (body.top_logprobs or 0) if body.logprobs else None
    gen = Generation(
        body, [ids], max_tokens, "chat", body.model, body.n, body.stream, top, imposed=tool_grammar
    )
    run = await start(state, gen)
    p = state.prompter
    fmt = body.reasoning_format or state.config.reasoning_format
    syntax = answer_syntax(p.chat_template)
    return ChatRun(ids, text, tools, run.pieces, top, syntax, fmt, p.tool_format)


def _one_constraint(
    state: ServerState, body: ChatCompletionRequest, tool_grammar: Constraint | None
) -> None:
    """A 400 where the body's own constraint meets the one its tools impose."""
    constraint = request_constraint(body)
    if tool_grammar is None or constraint is None:
        return
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


async def count_chat_tokens(state: ServerState, body: ChatCompletionRequest) -> int:
    """How many prompt tokens the chat `body` comes to, its tools included."""
    tools, _ = _tool_setup(state, body)
    text = await asyncio.to_thread(chat_text, state, body, chat_messages(body), tools)
    return len(await asyncio.to_thread(state.prompter.chat_ids, text))


# -- the pieces -> OpenAI's chat answer --
async def chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Any:
    """OpenAI's chat answer to `body`: one JSON body, or its stream of chunks."""
    run = await start_chat(state, body)
    head = _Head(
        f"chatcmpl-{uuid.uuid4().hex}",
        int(time.time()),
        served_name(state, body.model),
        system_fingerprint(),
    )
    if body.stream:
        frames = _ChatStream(state, body, run, head)
        return EventStream(state, sse(run.pieces, frames.frame, frames.tail))
    return await _whole(state, body, run, head, request)


@dataclass(frozen=True)
class _Head:
    """What every chunk of one answer repeats."""

    id: str
    created: int
    model: str
    fingerprint: str

    def chunk(
        self, choices: list[dict[str, Any]], kind: str = "chat.completion.chunk"
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }


def _reason(finish: FinishEvent | None, n_calls: int) -> str | None:
    r = finish_reason(finish)
    return "tool_calls" if r == "stop" and n_calls else r


def _piece(i: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None} | extra


class _ChatStream:
    """The chunks of a streamed chat answer, framed piece by piece, then usage."""

    def __init__(
        self, state: ServerState, body: ChatCompletionRequest, run: ChatRun, head: _Head
    ) -> None:
        self.state, self.body, self.run, self.head = state, body, run, head
        self.started = [False] * body.n
        self.parsers = [run.parser(stream=True) for _ in range(body.n)]
        self.finished: list[FinishEvent] = []
        self.clock = StreamClock(len(run.ids)) if body.timings_per_token else None

    def frame(self, d: Delta) -> list[dict[str, Any]]:
        chunk, clock = self.head.chunk, self.clock
        out = []
        i = d.index
        if d.progress is not None:  # as llama-server: on a role chunk of its own
            role = chunk([_piece(i, {"role": "assistant", "content": None})])
            return [role | progress_fields(d.progress, clock is not None)]
        if not self.started[i]:  # as llama-server: the role first, with content null
            self.started[i] = True
            out.append(chunk([_piece(i, {"role": "assistant", "content": None})]))
        parser = self.parsers[i]
        parts = parser.feed(d.text, last=d.finish is not None)
        if d.finish is not None:
            self.finished.append(d.finish)
        text, calls = parts.content, parts.calls
        lps = None
        if self.run.top is not None and d.logprobs:
            lps = chat_logprobs(self.state, d.logprobs)
        if parts.reasoning:  # as llama-server: a delta of its own
            out.append(chunk([_piece(i, {"reasoning_content": parts.reasoning})]))
        if text or lps is not None:
            out.append(chunk([_piece(i, {"content": text or None}, logprobs=lps)]))
        if calls:
            k0 = len(parser.calls) - len(calls)
            delta = {"tool_calls": [c.as_openai(k0 + k) for k, c in enumerate(calls)]}
            out.append(chunk([_piece(i, delta)]))
        if clock is not None and d.tokens:  # on the pieces, not on the role chunk
            tick = clock.tick(len(d.tokens))
            for ev in out:
                if "role" not in ev["choices"][0]["delta"]:
                    ev["timings"] = tick
        if d.finish is not None:  # the finish in a chunk of its own, its delta empty
            n_calls = len(parser.calls)
            out.append(chunk([_piece(i, {}, finish_reason=_reason(d.finish, n_calls))]))
        return out

    def tail(self) -> list[dict[str, Any]]:
        # as llama-server: the usage chunk (with timings) unless include_usage is false
        options = self.body.stream_options
        if options is not None and not options.include_usage:
            return []
        last = {"timings": timings(self.finished[-1])} if self.finished else {}
        n_gen = sum(f.n_generated for f in self.finished)
        n_cached = sum(f.n_cached for f in self.finished)
        usage_ = usage([len(self.run.ids)], n_gen, n_cached)
        return [self.head.chunk([]) | {"usage": usage_} | last]


def _message(c: Choice, run: ChatRun) -> tuple[dict[str, Any], int]:
    """A whole choice's message: its text split into reasoning, content and calls (where tools
    are given); `reasoning_content` only where there is reasoning, as llama-server answers."""
    parts = run.parse(c.text)
    content: str | None = parts.content
    if run.tools:
        content = content or None
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if parts.reasoning:
        msg["reasoning_content"] = parts.reasoning
    if parts.calls:
        msg["tool_calls"] = [call.as_openai() for call in parts.calls]
    return msg, len(parts.calls)


async def _whole(
    state: ServerState, body: ChatCompletionRequest, run: ChatRun, head: _Head, request: Request
) -> dict[str, Any]:
    choices = await collect(request, run.pieces, body.n)
    out = []
    for c in choices:
        msg, n_calls = _message(c, run)
        out.append(
            {
                "index": c.index,
                "message": msg,
                "logprobs": chat_logprobs(state, c.logprobs) if run.top is not None else None,
                "finish_reason": _reason(c.finish, n_calls),
            }
        )
    last = choices[-1].finish
    verbose = body.verbose or state.config.verbose
    return (
        head.chunk(out, "chat.completion")
        | {"usage": usage([len(run.ids)], *generated_and_cached(choices))}
        | ({"timings": timings(last)} if last else {})
        | ({"__verbose": {"prompt": run.text, "content": choices[0].text}} if verbose else {})
    )
