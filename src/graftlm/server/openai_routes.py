"""OpenAI's endpoints (completions, chat completions, models) and vLLM's runtime adapter API."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
import uuid
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from graftlm.lora.peft import peft_files
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.service import Job
from graftlm.server.generation import (
    Choice,
    Delta,
    LlamaPrompt,
    TokenLogprob,
    admit,
    check_context,
    collect,
    compile_constraint,
    deltas,
    finish_reason,
    generated_and_cached,
    llama_prompt_ids,
    llama_prompts,
    progress_fields,
    prompt_ids,
    request_constraint,
    sampling_params,
    score_each,
    served_name,
    sse,
    usage,
)
from graftlm.server.registry import UnknownModelError
from graftlm.server.schemas import (
    CompletionRequest,
    EmbeddingRequest,
    LlamaEmbeddingRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
)
from graftlm.server.state import ApiError, ServerState

router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.graft
    return state


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


# -- /v1/completions --
def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise ApiError(400, "the prompt is empty", "invalid_prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    """Continue prompts (text or token ids); echo + logprobs + max_tokens 0 scores a prompt."""
    state = state_of(request)
    svc = state.service
    max_tokens = body.length if body.length is not None else state.config.n_predict
    prompts = _prompts(body)
    ids = [await asyncio.to_thread(prompt_ids, state, p) for p in prompts]  # off the loop
    for x in ids:
        check_context(state, x, max_tokens)
    grammar = await compile_constraint(state, request_constraint(body))
    params = [sampling_params(state, body, max_tokens, j, grammar) for j in range(body.n)]
    lease = await admit(state, body.model, body.lora)
    try:
        jobs = [
            Job(
                x,
                params[j],
                lease.lora,
                body.logprobs,
                body.cache_prompt,
                progress=body.stream and body.return_progress,
                spec=body.spec(),
            )
            for x in ids
            for j in range(body.n)
        ]
        before: list[Delta] = []
        if body.echo:
            scored = None
            if body.logprobs is not None:
                scored = [await svc.aprompt_logprobs(x, body.logprobs, lease.lora) for x in ids]
            for pi, (p, x) in enumerate(zip(prompts, ids, strict=True)):
                text = p if isinstance(p, str) else state.prompter.detokenize(x)
                lps: list[TokenLogprob] = []
                if scored is not None:
                    lps = [TokenLogprob(x[0], None)] + [
                        TokenLogprob(s["id"], s["logprob"], tuple((t, v) for t, v in s["top"]))
                        for s in scored[pi]
                    ]
                before += [
                    Delta(pi * body.n + j, text, list(x), lps, echo=True) for j in range(body.n)
                ]
    except BaseException:
        state.registry.release(lease)
        raise
    pieces = deltas(state, jobs, lease, "completions", before)
    rid, created, model = (
        f"cmpl-{uuid.uuid4().hex}",
        int(time.time()),
        served_name(state, body.model),
    )
    n_prompt = [len(x) for x in ids]

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }

    if body.stream:
        offsets = [0] * len(jobs)
        n_gen = [0, 0]  # tokens generated, prompt tokens the cache served

        def frame(d: Delta) -> list[dict[str, Any]]:
            if d.progress is not None:  # as llama-server: on an empty piece
                c = {"index": d.index, "text": "", "logprobs": None, "finish_reason": None}
                return [chunk([c]) | progress_fields(d.progress, body.timings_per_token)]
            if d.finish is not None:
                n_gen[0] += d.finish.n_generated
                n_gen[1] += d.finish.n_cached
            if not d.text and d.finish is None and not d.logprobs:
                return []
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(state, d.logprobs, offsets[d.index])
            offsets[d.index] += len(d.text)
            c = {
                "index": d.index,
                "text": d.text,
                "logprobs": lp,
                "finish_reason": finish_reason(d.finish),
            }
            return [chunk([c])]

        def tail() -> list[dict[str, Any]]:
            if body.stream_options is None or not body.stream_options.include_usage:
                return []
            return [chunk([]) | {"usage": usage(n_prompt, n_gen[0], n_gen[1])}]

        return StreamingResponse(
            sse(pieces, frame, tail), media_type="text/event-stream", headers=SSE_HEADERS
        )

    choices = await collect(request, pieces, len(jobs))
    return chunk([_completion_choice(state, c, body.logprobs is not None) for c in choices]) | {
        "usage": usage(n_prompt, *generated_and_cached(choices))
    }


def _completion_choice(state: ServerState, c: Choice, logprobs: bool) -> dict[str, Any]:
    return {
        "index": c.index,
        "text": c.text,
        "logprobs": completion_logprobs(state, c.logprobs, 0) if logprobs else None,
        "finish_reason": finish_reason(c.finish),
    }


# -- embeddings --
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


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's /tokenizer_info: what a remote-tokenizer client needs to tokenize as we do."""
    state = state_of(request)
    p = state.prompter
    tok = p.tokenizer

    def text(i: int | None) -> str | None:
        return None if i is None else tok.token_text(i)

    return {
        "tokenizer_class": "GGUFTokenizer",
        "tokenizer_model": tok.model,
        "vocab_size": p.n_vocab,
        "model_max_length": state.service.n_ctx,
        "bos_token": text(tok.bos_id),
        "eos_token": text(tok.eos_id),
        "add_bos_token": tok.add_bos,
        "add_eos_token": tok.add_eos,
        "eog_token_ids": sorted(p.eog),
        "chat_template": p.chat_template,
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


# -- vLLM's runtime adapter API --
def _runtime_lora(state: ServerState) -> None:
    if not state.config.allow_runtime_lora:
        raise ApiError(
            404,
            "runtime LoRA loading is off: start the server with --allow-runtime-lora",
            "not_enabled",
        )


def _confined(state: ServerState, path: str) -> str:
    """The path, resolved (symlinks followed), when it lies under one of the server's --lora-dir
    folders; else a 403 that says nothing of whether it exists. What exists there must be a
    regular file or a directory (not a FIFO or a device, whose reads block)."""
    try:
        real = Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # too long, a symlink loop, a NUL byte
        raise ApiError(400, f"lora_path cannot be used: {exc}"[:300], "invalid_value") from None
    dirs = state.config.lora_dirs

    def inside(p: Path) -> bool:
        return any(p.is_relative_to(d) for d in dirs)

    if not inside(real):
        allowed = ", ".join(str(d) for d in dirs) or "none (start the server with --lora-dir)"
        raise ApiError(
            403,
            f"lora_path {path[:200]!r} is outside the folders runtime loads may read: {allowed}",
            "permission_denied",
        )
    try:
        is_other = real.exists() and not (real.is_file() or real.is_dir())
        # a PEFT directory's files are read too: a link in it to elsewhere is outside as well
        files = peft_files(real) if real.is_dir() else ()
        inner = [(f.name, f.resolve()) for f in files if f.is_symlink()]
    except (OSError, RuntimeError) as exc:
        raise ApiError(400, f"lora_path cannot be used: {exc}"[:300], "invalid_value") from None
    if is_other:
        raise ApiError(400, f"{path[:200]}: not a regular file or a directory", "invalid_value")
    for name, target in inner:
        if not inside(target):
            raise ApiError(
                403,
                f"lora_path {path[:200]!r}: {name} links outside the folders runtime loads may "
                "read",
                "permission_denied",
            )
    return str(real)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> PlainTextResponse:
    """Attach an adapter (GGUF file or PEFT directory) under a name; a name in use is replaced."""
    state = state_of(request)
    _runtime_lora(state)
    if body.lora_name in state.base_names:
        raise ApiError(400, f"{body.lora_name!r} is the base model's name", "invalid_value")
    await state.registry.load(body.lora_name, _confined(state, body.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> PlainTextResponse:
    """Forget a named adapter; requests using it finish with it first."""
    state = state_of(request)
    _runtime_lora(state)
    try:
        await state.registry.unload(body.lora_name)
    except UnknownModelError as exc:
        raise ApiError(404, str(exc), exc.code) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
