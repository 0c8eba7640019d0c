"""OpenAI's chat completions: /v1/chat/completions over the chat path (`server/chat.py`: the
model's chat template, tools, and the answer as llama-server frames it), and its token count."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from graftlm.server.chat import chat_completion, count_chat_tokens
from graftlm.server.chat_schemas import ChatCompletionRequest
from graftlm.server.state import state_of

router = APIRouter()


@router.post("/v1/chat/completions")
@router.post("/chat/completions", include_in_schema=False)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """Chat through the model's template; streaming as server-sent events. With `tools`, the
    template receives them and the answer's calls come back as `tool_calls`."""
    return await chat_completion(state_of(request), body, request)


@router.post("/chat/completions/input_tokens")
@router.post("/v1/chat/completions/input_tokens", include_in_schema=False)
async def input_tokens(body: ChatCompletionRequest, request: Request) -> dict[str, int]:
    """The prompt tokens a chat comes to (llama-server's count, without generating)."""
    return {"input_tokens": await count_chat_tokens(state_of(request), body)}
