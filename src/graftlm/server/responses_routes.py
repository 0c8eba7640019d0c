"""OpenAI's Responses API (/v1/responses), as llama-server serves it: a translation onto the same
chat path as /v1/chat/completions, without stored state (`previous_response_id` is refused).
Text input and output; `model` selects an adapter there too; `timings_per_token` adds llama-server's
timings to the text deltas and the completed event. A model's reasoning (split as for the chat
answer's `reasoning_content`, `runtime/reasoning.py`) is a `reasoning` output item before the
message, streamed as `response.reasoning_text.delta` events; `reasoning.effort` is the
template's `reasoning_effort`, as the chat body's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from graftlm.runtime.reasoning import Parts
from graftlm.runtime.service import FinishEvent, ProgressEvent
from graftlm.server.chat import ChatRun, count_chat_tokens, start_chat
from graftlm.server.chat_schemas import ChatCompletionRequest
from graftlm.server.framing import EventStream, StreamClock, progress_fields, served_name, timings
from graftlm.server.inputs import RESPONSES_PARTS, content_text, problems
from graftlm.server.pipeline import collect
from graftlm.server.state import ApiError, json_body, state_of

router = APIRouter()


def chat_request(body: Any) -> tuple[ChatCompletionRequest, bool]:
    """The Responses request as a chat request, and whether it streams."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise ApiError(400, "previous_response_id: this server stores no responses")
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        messages.append(
            {
                "role": "system",
                "content": content_text(body["instructions"], "instructions", RESPONSES_PARTS),
            }
        )
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for i, item in enumerate(given):
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise ApiError(400, f"input[{i}]: only message items are supported")
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, f"input[{i}].role: {role!r} is not a message role")
            messages.append(
                {
                    "role": role,
                    "content": content_text(
                        item.get("content"), f"input[{i}].content", RESPONSES_PARTS
                    ),
                }
            )
    else:
        raise ApiError(400, "input: field required (a string or a list of messages)")
    chat: dict[str, Any] = {"messages": messages}
    for ours, theirs in (
        ("model", "model"),
        ("max_tokens", "max_output_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("seed", "seed"),
        ("lora", "lora"),
        ("timings_per_token", "timings_per_token"),
        ("return_progress", "return_progress"),
        ("stream", "stream"),
        ("reasoning_format", "reasoning_format"),
    ):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    try:
        return ChatCompletionRequest.model_validate(chat), bool(body.get("stream"))
    except ValidationError as exc:
        raise ApiError(400, f"invalid request: {problems(exc)}") from None


def _usage(n_prompt: int, f: FinishEvent | None) -> dict[str, Any]:
    out = f.n_generated if f else 0
    return {
        "input_tokens": n_prompt,
        "input_tokens_details": {"cached_tokens": f.n_cached if f else 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n_prompt + out,
    }


def _response(
    rid: str, model: str, created: int, status: str, output: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": None,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
    }


def _reasoning(rid: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "reasoning_text", "text": text}
    return {
        "type": "reasoning",
        "id": rid,
        "status": status,
        "summary": [],
        "content": [part] if status == "completed" else [],
    }


def _message(mid: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": mid,
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


@router.post("/v1/responses")
@router.post("/responses", include_in_schema=False)
async def responses(request: Request) -> Any:
    state = state_of(request)
    raw = await json_body(request)
    body, stream = chat_request(raw)
    run = await start_chat(state, body)
    rid, mid, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())
    model = served_name(state, body.model)
    if not stream:
        (c,) = await collect(request, run.pieces, 1)
        parts = run.parse(c.text)
        items = [_reasoning(_rs_id(), parts.reasoning, "completed")] if parts.reasoning else []
        items.append(_message(mid, parts.content, "completed"))
        out = _response(rid, model, created, "completed", items)
        return out | {"usage": _usage(len(run.ids), c.finish)}
    clock = StreamClock(len(run.ids)) if body.timings_per_token else None
    return EventStream(state, _stream(run, rid, mid, model, created, clock))


def _rs_id() -> str:
    return f"rs_{uuid.uuid4().hex}"


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens", include_in_schema=False)
async def input_tokens(request: Request) -> dict[str, Any]:
    """The prompt tokens a Responses request comes to, without generating (OpenAI's count)."""
    raw = await json_body(request)
    body, _ = chat_request(raw)
    n = await count_chat_tokens(state_of(request), body)
    return {"object": "response.input_tokens", "input_tokens": n}


class _ResponseStream:
    """The state of one streamed response and its events, one method per kind: the event
    sequence number, the output items done, the open reasoning item's text and the message's,
    and the run's finish."""

    def __init__(
        self, rid: str, mid: str, model: str, created: int, clock: StreamClock | None
    ) -> None:
        self.rid, self.mid, self.model, self.created, self.clock = rid, mid, model, created, clock
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output items done
        # the open reasoning item's text and the message's, as pieces joined when done (an
        # attribute's `+=` copied the whole text a piece); None: that item not yet opened
        self.thought: list[str] | None = None
        self.rsid = _rs_id()
        self.text: list[str] | None = None
        self.finish: FinishEvent | None = None

    def event(self, kind: str, data: dict[str, Any]) -> bytes:
        self.seq += 1
        payload = json.dumps(
            {"type": kind, "sequence_number": self.seq, **data}, ensure_ascii=False
        )
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    def busy(self) -> dict[str, Any]:
        """The `response` field of the events before completion."""
        return {"response": _response(self.rid, self.model, self.created, "in_progress", [])}

    def opening(self) -> Iterator[bytes]:
        yield self.event("response.created", self.busy())
        yield self.event("response.in_progress", self.busy())

    def progress(self, p: ProgressEvent) -> bytes:
        """As llama-server: an in_progress event carries the prompt's progress."""
        fields = progress_fields(p, self.clock is not None)
        return self.event("response.in_progress", self.busy() | fields)

    def piece(self, parts: Parts, n_tokens: int) -> Iterator[bytes]:
        """A piece's reasoning and text, as their items' deltas."""
        if parts.reasoning and self.text is None:
            yield from self.think(parts.reasoning)
        elif parts.reasoning:  # (reasoning after the message's text: kept with it)
            parts.content = parts.reasoning + parts.content
        if parts.content:
            yield from self.answer(parts.content, n_tokens)

    def think(self, delta: str) -> list[bytes]:
        out = []
        if self.thought is None:
            self.thought = []
            item = _reasoning(self.rsid, "", "in_progress")
            out.append(self.event("response.output_item.added", {"output_index": 0, "item": item}))
        self.thought.append(delta)
        at = {"item_id": self.rsid, "output_index": 0, "content_index": 0}
        out.append(self.event("response.reasoning_text.delta", at | {"delta": delta}))
        return out

    def end_thinking(self) -> list[bytes]:
        if self.thought is None or self.items:
            return []
        at = {"item_id": self.rsid, "output_index": 0, "content_index": 0}
        thought = "".join(self.thought)
        item = _reasoning(self.rsid, thought, "completed")
        self.items.append(item)
        return [
            self.event("response.reasoning_text.done", at | {"text": thought}),
            self.event("response.output_item.done", {"output_index": 0, "item": item}),
        ]

    def open_message(self) -> list[bytes]:
        if self.text is not None:
            return []
        self.text = []
        out = self.end_thinking()
        k = len(self.items)
        item = _message(self.mid, "", "in_progress")
        out.append(self.event("response.output_item.added", {"output_index": k, "item": item}))
        empty = {"type": "output_text", "text": "", "annotations": []}
        at = {"item_id": self.mid, "output_index": k, "content_index": 0}
        out.append(self.event("response.content_part.added", at | {"part": empty}))
        return out

    def answer(self, delta: str, n_tokens: int) -> Iterator[bytes]:
        yield from self.open_message()
        assert self.text is not None  # (opened above)
        self.text.append(delta)
        at = {"item_id": self.mid, "output_index": len(self.items), "content_index": 0}
        ev: dict[str, Any] = at | {"delta": delta}
        if self.clock is not None:
            ev["timings"] = self.clock.tick(n_tokens)
        yield self.event("response.output_text.delta", ev)

    def error(self, exc: Exception) -> bytes:
        err = ApiError.of(exc)
        return self.event("error", {"code": err.code, "message": err.message})

    def closing(self, n_prompt: int) -> Iterator[bytes]:
        """The message item closed (an empty answer is still a message), then the response."""
        yield from self.open_message()
        text, items = "".join(self.text or ()), self.items
        at = {"item_id": self.mid, "output_index": len(items), "content_index": 0}
        yield self.event("response.output_text.done", at | {"text": text})
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        yield self.event("response.content_part.done", at | {"part": part})
        item = _message(self.mid, text or "", "completed")
        yield self.event("response.output_item.done", {"output_index": len(items), "item": item})
        items.append(item)
        done = _response(self.rid, self.model, self.created, "completed", items)
        done |= {"usage": _usage(n_prompt, self.finish)}
        finish = self.finish
        extra = {"timings": timings(finish)} if finish is not None else {}
        yield self.event("response.completed", {"response": done} | extra)


async def _stream(
    run: ChatRun, rid: str, mid: str, model: str, created: int, clock: StreamClock | None
) -> AsyncGenerator[bytes, None]:
    parser = run.parser(stream=True)
    s = _ResponseStream(rid, mid, model, created, clock)
    for ev in s.opening():
        yield ev
    async with aclosing(run.pieces) as it:
        try:
            async for d in it:
                if d.progress is not None:
                    yield s.progress(d.progress)
                parts = parser.feed(d.text, last=d.finish is not None)
                if d.finish is not None:
                    s.finish = d.finish
                for ev in s.piece(parts, len(d.tokens)):
                    yield ev
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in-band
            yield s.error(exc)
            return
    for ev in s.closing(len(run.ids)):
        yield ev
