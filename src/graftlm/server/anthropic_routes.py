"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), as llama-server serves it:
a translation onto the same chat path as /v1/chat/completions. `model` selects an adapter there
too. Text, tool use and tool results are translated; images are refused (no vision here);
A model's reasoning comes back as `thinking` blocks (split as for the chat answer's
`reasoning_content`, `runtime/reasoning.py`), and thinking blocks of the history go back to the
template as the assistant message's reasoning; the `thinking` field (a budget), `metadata` and
other fields with no counterpart here are accepted and change nothing.
Unlike llama-server, an empty `messages` list is a 400 (as Anthropic's own API answers it).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from graftlm.runtime.reasoning import Parts
from graftlm.runtime.service import FinishEvent
from graftlm.runtime.tools import ToolCall
from graftlm.server.chat import (
    ChatRun,
    chat_messages,
    chat_text,
    start_chat,
    template_tools,
)
from graftlm.server.chat_schemas import ChatCompletionRequest
from graftlm.server.framing import EventStream, served_name
from graftlm.server.inputs import ANTHROPIC_PARTS, block_text, content_text, problems
from graftlm.server.pipeline import collect
from graftlm.server.state import ApiError, json_body, state_of

router = APIRouter()


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's system + messages as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        out.append(
            {"role": "system", "content": content_text(body["system"], "system", ANTHROPIC_PARTS)}
        )
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "messages: field required (a list of messages)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}]: expected a user or assistant message")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"messages[{i}].content: expected a string or content blocks")
        text, calls, results, thoughts = [], [], [], []
        for k, block in enumerate(content):
            where = f"messages[{i}].content[{k}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(block_text(block, where))
            elif kind == "thinking":
                if role == "assistant":  # earlier reasoning: the template's to render or drop
                    thoughts.append(str(block.get("thinking", "")))
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use" and role == "assistant":
                args = block.get("input", {})
                fn = {"name": str(block.get("name", "")), "arguments": json.dumps(args)}
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": fn})
            elif kind == "tool_result" and role == "user":
                result = content_text(block.get("content", ""), f"{where}.content", ANTHROPIC_PARTS)
                if block.get("is_error"):
                    result = f"Error: {result}"
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": result,
                    }
                )
            elif kind == "image":
                raise ApiError(400, f"{where}: image input is not supported by this model")
            else:
                raise ApiError(400, f"{where}: content blocks of type {kind!r} are not supported")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
            if calls:
                msg["tool_calls"] = calls
            if thoughts:
                msg["reasoning_content"] = "".join(thoughts)
            out.append(msg)
        else:
            if text:
                out.append({"role": "user", "content": "".join(text)})
            out += results
    return out


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    tools = body.get("tools")
    out: dict[str, Any] = {}
    if tools:
        if not isinstance(tools, list):
            raise ApiError(400, "tools: expected a list")
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in {
                        "name": t.get("name"),
                        "description": t.get("description"),
                        "parameters": t.get("input_schema"),
                    }.items()
                    if v is not None
                },
            }
            for t in tools
            if isinstance(t, dict)
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "none"):
            out["tool_choice"] = kind
        elif kind == "any":
            out["tool_choice"] = "required"
    return out


def chat_request(body: Any, count_only: bool = False) -> ChatCompletionRequest:
    """The Anthropic request as the chat request it is served by (a 400 for what is malformed)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if not count_only and "max_tokens" not in body:
        raise ApiError(400, "max_tokens: field required")
    messages = _messages(body)
    if not messages:
        raise ApiError(400, "messages: at least one message is required")
    chat: dict[str, Any] = {"messages": messages, **_tools(body)}
    for ours, theirs in (
        ("model", "model"),
        ("max_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop", "stop_sequences"),
        ("lora", "lora"),
        ("seed", "seed"),
        ("stream", "stream"),  # (pieces come as they are made only to a stream)
    ):
        if body.get(theirs) is not None and not (count_only and ours == "max_tokens"):
            chat[ours] = body[theirs]
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise ApiError(400, f"invalid request: {problems(exc)}") from None


def _stop_reason(f: FinishEvent | None, n_calls: int) -> str:
    if n_calls:
        return "tool_use"
    if f is not None and f.reason == "length":
        return "max_tokens"
    if f is not None and f.stop_word is not None:
        return "stop_sequence"
    return "end_turn"


def _usage(n_prompt: int, f: FinishEvent | None) -> dict[str, int]:
    cached = f.n_cached if f else 0
    return {
        "input_tokens": n_prompt - cached,
        "output_tokens": f.n_generated if f else 0,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_block(c: ToolCall) -> dict[str, Any]:
    try:
        args = json.loads(c.arguments)
    except json.JSONDecodeError:
        args = {}
    return {"type": "tool_use", "id": c.id, "name": c.name, "input": args}


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """The prompt tokens the messages (with system and tools) come to."""
    state = state_of(request)
    body = chat_request(await json_body(request), count_only=True)
    tools = template_tools(body)
    text = await asyncio.to_thread(chat_text, state, body, chat_messages(body), tools)
    return {"input_tokens": len(await asyncio.to_thread(state.prompter.chat_ids, text))}


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    """Anthropic's Messages API over the chat path."""
    state = state_of(request)
    raw = await json_body(request)
    body = chat_request(raw)
    run = await start_chat(state, body)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    model = served_name(state, body.model)
    if not raw.get("stream"):
        (c,) = await collect(request, run.pieces, 1)
        parts = run.parse(c.text)
        answer, calls = parts.content, parts.calls
        blocks: list[dict[str, Any]] = []
        if parts.reasoning:
            blocks.append({"type": "thinking", "thinking": parts.reasoning, "signature": ""})
        if answer or not calls:
            blocks.append({"type": "text", "text": answer})
        blocks += [_tool_block(x) for x in calls]
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": blocks,
            "stop_reason": _stop_reason(c.finish, len(calls)),
            "stop_sequence": c.finish.stop_word if c.finish else None,
            "usage": _usage(len(run.ids), c.finish),
        }
    return EventStream(state, _stream(run, mid, model))


def _end_thinking(index: int) -> list[bytes]:
    """A thinking block closed, with the signature delta Anthropic's clients wait for (empty:
    this server signs nothing)."""
    delta = {"type": "signature_delta", "signature": ""}
    return [
        _event("content_block_delta", {"index": index, "delta": delta}),
        _event("content_block_stop", {"index": index}),
    ]


def _event(kind: str, data: dict[str, Any]) -> bytes:
    payload = json.dumps({"type": kind, **data}, ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode()


class _Blocks:
    """The content blocks of one streamed message, one method per kind: the index of the open
    (or next) block, whether a text or a thinking block is open, and the tool uses sent."""

    def __init__(self) -> None:
        self.index = 0
        self.text_open = False
        self.thinking_open = False
        self.n_calls = 0

    def piece(self, parts: Parts, last: bool) -> Iterator[bytes]:
        """A piece's reasoning, text and tool calls (`last`: the run's final piece)."""
        text, calls = parts.content, parts.calls
        if parts.reasoning:
            yield from self.thinking(parts.reasoning)
        if self.thinking_open and (text or calls or last):
            yield from _end_thinking(self.index)
            self.index, self.thinking_open = self.index + 1, False
        if text:
            yield from self.text(text)
        for c in calls:
            yield from self.tool_use(c)

    def start(self, block: dict[str, Any]) -> bytes:
        return _event("content_block_start", {"index": self.index, "content_block": block})

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def close_text(self) -> Iterator[bytes]:
        if self.text_open:
            yield _event("content_block_stop", {"index": self.index})
            self.index, self.text_open = self.index + 1, False

    def thinking(self, reasoning: str) -> Iterator[bytes]:
        yield from self.close_text()  # (reasoning after text: a block of its own)
        if not self.thinking_open:
            yield self.start({"type": "thinking", "thinking": ""})
            self.thinking_open = True
        yield self.delta({"type": "thinking_delta", "thinking": reasoning})

    def text(self, text: str) -> Iterator[bytes]:
        if not self.text_open:
            yield self.start({"type": "text", "text": ""})
            self.text_open = True
        yield self.delta({"type": "text_delta", "text": text})

    def tool_use(self, c: ToolCall) -> Iterator[bytes]:
        yield from self.close_text()
        yield self.start(_tool_block(c) | {"input": {}})
        yield self.delta({"type": "input_json_delta", "partial_json": c.arguments})
        yield _event("content_block_stop", {"index": self.index})
        self.index += 1
        self.n_calls += 1

    def closing(self) -> Iterator[bytes]:
        """The open text block closed; an empty answer is still one (empty) text block."""
        if not self.text_open and self.n_calls == 0:
            yield self.start({"type": "text", "text": ""})
            self.text_open = True
        if self.text_open:
            yield _event("content_block_stop", {"index": self.index})


async def _stream(run: ChatRun, mid: str, model: str) -> AsyncGenerator[bytes, None]:
    """Anthropic's event stream: message_start, content blocks (thinking, text, then each tool
    use), message_delta with the stop reason and usage, message_stop."""
    pieces, ids = run.pieces, run.ids
    message: dict[str, Any] = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(ids), "output_tokens": 0},
    }
    yield _event("message_start", {"message": message})
    parser = run.parser(stream=True)
    blocks = _Blocks()
    finish: FinishEvent | None = None
    async with aclosing(pieces) as it:
        try:
            async for d in it:
                parts = parser.feed(d.text, last=d.finish is not None)
                for ev in blocks.piece(parts, d.finish is not None):
                    yield ev
                if d.finish is not None:
                    finish = d.finish
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in-band
            err = ApiError.of(exc)
            yield _event("error", {"error": {"type": err.type, "message": err.message}})
            return
    for ev in blocks.closing():
        yield ev
    end = {
        "stop_reason": _stop_reason(finish, blocks.n_calls),
        "stop_sequence": finish.stop_word if finish else None,
    }
    yield _event("message_delta", {"delta": end, "usage": _usage(len(ids), finish)})
    yield _event("message_stop", {})
