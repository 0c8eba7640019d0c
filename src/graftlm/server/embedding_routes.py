"""Embeddings: OpenAI's /v1/embeddings and llama-server's /embedding, each input scored under
the request's adapters (`pipeline.score_each`)."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request

from graftlm.lora.settings import AdapterSettings
from graftlm.server.framing import served_name
from graftlm.server.inputs import LlamaPrompt, llama_prompt_ids, llama_prompts
from graftlm.server.pipeline import score_each
from graftlm.server.schemas import EmbeddingRequest, LlamaEmbeddingRequest
from graftlm.server.state import ApiError, ServerState, state_of

router = APIRouter()


async def embed_all(
    state: ServerState, inputs: list[LlamaPrompt], model: str | None, lora: Any
) -> tuple[list[Any], int]:
    """Each input's embedding (pooled as --pooling says, normalized, the request's adapter
    applied; pooling none: one vector a token, not normalized) and the tokens read."""
    ids = [await asyncio.to_thread(llama_prompt_ids, state, x) for x in inputs]

    def embed(x: list[int], settings: AdapterSettings) -> Awaitable[Any]:
        return state.service.aembedding(x, settings, state.config.pooling)

    return await score_each(state, ids, model, lora, embed), sum(len(x) for x in ids)


def _inputs(value: Any) -> list[LlamaPrompt]:
    """OpenAI's input shapes, and llama-server's (texts and ids mixed, {"content": ...})."""
    if isinstance(value, list) and not value:
        raise ApiError(400, "input is empty", "invalid_value")
    return llama_prompts(value)


@router.post("/v1/embeddings")
@router.post("/embeddings", include_in_schema=False)
async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """OpenAI's embeddings: the mean of the last hidden state (after the final norm) over the
    input's tokens, L2-normalized (--pooling cls / last: the first / last token's)."""
    state = state_of(request)
    if state.config.pooling == "none":  # as llama-server
        raise ApiError(
            400,
            "pooling type 'none' is not OpenAI-compatible (one vector a token): use /embedding, "
            "or start the server with another --pooling",
            "unsupported_pooling",
        )
    vecs, n = await embed_all(state, _inputs(body.input), body.model, body.lora)
    data = []
    for i, v in enumerate(vecs):
        emb: Any = v
        if body.encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {
        "object": "list",
        "data": data,
        "model": served_name(state, body.model),
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }


@router.post("/embedding")
async def llama_embedding(body: LlamaEmbeddingRequest, request: Request) -> list[dict[str, Any]]:
    """llama-server's /embedding: [{"index", "embedding": [vector]}]; with --pooling none, one
    vector a token: [{"index", "embedding": [vector, ...]}]."""
    state = state_of(request)
    vecs, _ = await embed_all(state, _inputs(body.content), body.model, body.lora)
    per_token = state.config.pooling == "none"
    return [{"index": i, "embedding": v if per_token else [v]} for i, v in enumerate(vecs)]
