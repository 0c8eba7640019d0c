"""llama-server's own endpoints: /completion, tokens, templates, health, props, the LoRA API, and
the Prometheus /metrics."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from graftlm.runtime.service import FinishEvent
from graftlm.server.chat import chat_messages, chat_text, template_tools
from graftlm.server.chat_schemas import ApplyTemplateRequest
from graftlm.server.framing import (
    EventStream,
    StreamClock,
    progress_fields,
    served_name,
    sse,
    timings,
    token_logprobs,
)
from graftlm.server.inputs import (
    LlamaPrompt,
    check_prompt_count,
    llama_prompt_ids,
    llama_prompts,
)
from graftlm.server.pipeline import Choice, Delta, Generation, Run, collect, score_each, start
from graftlm.server.schemas import (
    DetokenizeRequest,
    LlamaCompletionRequest,
    LoraItem,
    RerankRequest,
    TokenizeRequest,
)
from graftlm.server.state import ApiError, ServerState, json_body, state_of

router = APIRouter()
public = APIRouter()  # no API key needed (llama-server's public endpoints)


# -- /completion --
def _stop_type(f: FinishEvent | None) -> str:
    if f is None:
        return "none"
    if f.stop_word is not None or (f.reason == "stop" and not f.stopped_eos):
        return "word"
    return "eos" if f.stopped_eos else "limit"


def _fields(out: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama-server's response_fields: only those fields ("a/b" reaches into an object)."""
    picked: dict[str, Any] = {}
    for f in fields:
        value: Any = out
        for key in f.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            picked[f] = value
    return picked


@router.post("/completion")
@router.post("/completions", include_in_schema=False)
@router.post("/v1/completion", include_in_schema=False)
async def completion(body: LlamaCompletionRequest, request: Request) -> Any:
    """llama-server's /completion: content, tokens_predicted, timings (and n_probs alternatives);
    several prompts give a list of answers."""
    state = state_of(request)
    prompts = llama_prompts(body.prompt)
    if len(prompts) == 1:
        return await _complete(state, body, request, prompts[0])
    if body.stream:
        raise ApiError(400, "stream: give one prompt to stream (several were given)")
    answers = await asyncio.gather(*(_complete(state, body, request, p) for p in prompts))
    return [a | {"index": i} for i, a in enumerate(answers)]


async def _complete(
    state: ServerState, body: LlamaCompletionRequest, request: Request, prompt: LlamaPrompt
) -> Any:
    n_predict = state.config.n_predict if body.n_predict is None else max(body.n_predict, -1)
    ids = await asyncio.to_thread(llama_prompt_ids, state, prompt)  # off the event loop
    top = body.n_probs if body.n_probs > 0 else None
    gen = Generation(
        body,
        [ids],
        n_predict,
        "completion",
        body.model,
        stream=body.stream,
        logprobs=top,
        post_sampling=body.post_sampling_probs,
    )
    run = await start(state, gen)
    prompt_text = prompt if isinstance(prompt, str) else state.prompter.detokenize(ids)
    answer = _Answer(state, body, run, n_predict, prompt_text)
    if body.stream:
        return EventStream(state, sse(run.pieces, answer.frame, done_marker=False))
    (choice,) = await collect(request, run.pieces, 1)
    out = answer.final(choice, stream=False)
    return _fields(out, body.response_fields) if body.response_fields else out


class _Answer:
    """A /completion answer: the final object (whole, or closing a stream) and the stream's
    partial pieces before it."""

    def __init__(
        self,
        state: ServerState,
        body: LlamaCompletionRequest,
        run: Run,
        n_predict: int,
        prompt_text: str,
    ) -> None:
        self.state, self.body, self.run = state, body, run
        self.n_predict, self.prompt_text = n_predict, prompt_text
        self.model = served_name(state, body.model)
        self.n_prompt = len(run.prompts[0])
        self.whole = Choice(0)  # a stream's pieces so far
        self.clock = StreamClock(self.n_prompt) if body.timings_per_token else None

    def final(self, c: Choice, stream: bool) -> dict[str, Any]:
        f, body, n_prompt = c.finish, self.body, self.n_prompt
        out: dict[str, Any] = {
            "index": 0,
            "content": "" if stream else c.text,
            "tokens": [] if stream or not body.return_tokens else c.tokens,
            "id_slot": -1,
            "stop": True,
            "model": self.model,
            "tokens_predicted": f.n_generated if f else 0,
            "tokens_evaluated": n_prompt,
            "generation_settings": self._settings(),
            "prompt": self.prompt_text,
            "has_new_line": "\n" in c.text,
            "truncated": bool(f and f.truncated),  # as llama-server: a context shift happened
            "stop_type": _stop_type(f),
            "stopped_eos": bool(f and f.stopped_eos),
            "stopped_word": _stop_type(f) == "word",
            "stopped_limit": _stop_type(f) == "limit",
            "stopping_word": (f.stop_word or "") if f else "",
            # as llama-server: the sequence's tokens in the cache when it ended (the reuse is
            # timings.cache_n)
            "tokens_cached": n_prompt + max(0, f.n_generated - 1) if f else 0,
            "timings": timings(f) if f else {},
        }
        if f and f.alora_inactive:  # as llama-server: an aLoRA without its invocation is off
            out["alora_inactive"] = list(f.alora_inactive)
        if body.n_probs > 0 and not stream:
            out["completion_probabilities"] = token_logprobs(
                self.state, c.logprobs, with_id=True, post=body.post_sampling_probs
            )
        return out

    def _settings(self) -> dict[str, Any]:
        """llama-server's generation_settings: the sampling settings the request ran with."""
        p, body = self.run.params[0], self.body
        eog = sorted(self.state.prompter.eog) if p.ignore_eos else []
        return {
            "n_predict": self.n_predict,
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "seed": -1 if p.seed is None else p.seed,
            "stop": list(p.stop),
            "ignore_eos": p.ignore_eos,
            "repeat_penalty": p.repeat_penalty,
            "repeat_last_n": p.repeat_last_n,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "stream": body.stream,
            "n_probs": body.n_probs,
            # as llama-server: ignore_eos is the end tokens' bias of -inf (JSON null)
            "logit_bias": [
                {"token": t, "bias": None if b == float("-inf") else b}
                for t, b in (*p.logit_bias, *((e, float("-inf")) for e in eog))
            ],
            "lora": [{"id": i, "scale": s} for i, s in sorted(self.run.lease.lora.items())],
        }

    def _partial(self, text: str, tokens: list[int]) -> dict[str, Any]:
        return {
            "index": 0,
            "content": text,
            "tokens": tokens,
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": len(self.whole.tokens),
            "tokens_evaluated": self.n_prompt,
        }

    def frame(self, d: Delta) -> list[dict[str, Any]]:
        clock, body = self.clock, self.body
        if d.progress is not None:  # as llama-server: on an empty piece
            return [self._partial("", []) | progress_fields(d.progress, clock is not None)]
        self.whole.add(d)
        out = []
        if d.text or d.tokens:
            ev = self._partial(d.text, d.tokens)
            if clock is not None:
                ev["timings"] = clock.tick(len(d.tokens))
            if body.n_probs > 0:
                ev["completion_probabilities"] = token_logprobs(
                    self.state, d.logprobs, with_id=True, post=body.post_sampling_probs
                )
            out.append(ev)
        if d.finish is not None:
            out.append(self.final(self.whole, stream=True))
        return out


# -- tokens and templates --
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    svc, n_ctx = state_of(request).prompter, state_of(request).service.n_ctx

    def work() -> bytes:  # tokens and their JSON off the event loop: a large body takes seconds
        ids = svc.tokenize(body.text, add_special=body.specials, parse_special=body.parse_special)
        if body.prompt is not None:  # vLLM's body, vLLM's answer
            strs = [svc.token_bytes(i).decode("utf-8", "replace") for i in ids]
            answer = {"count": len(ids), "max_model_len": n_ctx, "tokens": ids,
                      "token_strs": strs if body.return_token_strs else None}  # fmt: skip
            return json.dumps(answer, ensure_ascii=False).encode()
        if not body.with_pieces:
            return json.dumps({"tokens": ids}).encode()
        out = []
        for i in ids:
            raw = svc.token_bytes(i)
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            out.append({"id": i, "piece": piece})
        return json.dumps({"tokens": out}, ensure_ascii=False).encode()

    return Response(await asyncio.to_thread(work), media_type="application/json")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    """The text under llama-server's name (`content`) and vLLM's (`prompt`): both send the same
    body, so both names answer it."""
    text = state_of(request).prompter.detokenize(body.tokens)
    return {"content": text, "prompt": text}


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateRequest, request: Request) -> dict[str, str]:
    """The prompt a chat would be given (the same rules as /v1/chat/completions)."""
    state = state_of(request)
    tools = template_tools(body)
    messages = chat_messages(body)
    return {"prompt": await asyncio.to_thread(chat_text, state, body, messages, tools)}


# -- health and properties --
@public.get("/health")
@public.get("/v1/health", include_in_schema=False)
async def health(request: Request) -> JSONResponse:
    if not state_of(request).service.alive:
        return JSONResponse(
            ApiError(503, "the engine thread is not running").body(), status_code=503
        )
    return JSONResponse({"status": "ok"})


@router.get("/props")
async def props(request: Request) -> dict[str, Any]:
    state = state_of(request)
    cfg, svc = state.config, state.service
    from graftlm import __version__

    return {
        "default_generation_settings": {
            "n_ctx": slot_ctx(state),
            "n_ctx_seq": svc.n_ctx,
            "params": {
                "temperature": cfg.temperature,
                "top_k": cfg.top_k,
                "top_p": cfg.top_p,
                "min_p": cfg.min_p,
                "seed": cfg.seed,
                "n_predict": cfg.n_predict,
            },
        },
        "total_slots": svc.max_running,
        "model_path": str(state.model_path),
        "model_alias": cfg.model_name,
        "chat_template": state.prompter.chat_template or "",
        "modalities": {"vision": False, "audio": False},
        "is_sleeping": svc.sleeping,  # --sleep-idle-seconds
        "build_info": f"graftlm {__version__}",
    }


def slot_ctx(state: ServerState) -> int:
    """llama-server's n_ctx of a slot: the KV pool (-c) over the slots. A graftlm sequence is
    not held to its share (it may use up to n_ctx_seq tokens of the pool)."""
    pool = state.config.n_ctx_pool or state.service.n_ctx * state.service.max_running
    return pool // state.service.max_running


@router.get("/slots")
async def slots(request: Request) -> list[dict[str, Any]]:
    """llama-server's slot monitor. graftlm has no fixed slots: its `max_running` sequences are
    shown as slots, the first `n_running` of them busy."""
    state = state_of(request)
    if not state.config.slots:
        raise ApiError(501, "this server does not expose /slots (started with --no-slots)")
    svc = state.service
    busy = svc.n_running
    return [
        {"id": i, "id_task": -1, "n_ctx": slot_ctx(state), "is_processing": i < busy}
        for i in range(svc.max_running)
    ]


# -- llama-server's LoRA API --
@router.get("/lora-adapters")
async def get_lora_adapters(request: Request) -> list[dict[str, Any]]:
    """[{id, path, scale, task_name, prompt_prefix}] of every attached adapter."""
    return state_of(request).registry.adapter_list()


@router.post("/lora-adapters")
async def post_lora_adapters(request: Request) -> list[dict[str, Any]]:
    """Set the global scales: [{id, scale}]; adapters not listed go to 0."""
    state = state_of(request)
    payload = await json_body(request)
    if not isinstance(payload, list):
        raise ApiError(
            400,
            'POST /lora-adapters expects a JSON array of {"id", "scale"} objects, '
            f"got {type(payload).__name__}",
            "invalid_value",
        )
    items: dict[int, float] = {}
    for k, raw in enumerate(payload):
        try:
            item = LoraItem.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in e['loc']) or 'item'}: {e['msg']}" for e in exc.errors()
            )
            raise ApiError(
                400, f"POST /lora-adapters item {k}: {problems}", "invalid_value"
            ) from None
        items[item.id] = item.scale
    await state.registry.set_scales(items)
    return state.registry.adapter_list()


# -- metrics --
@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = state_of(request)
    if not state.config.metrics:
        raise ApiError(501, "this server does not expose /metrics (started with --no-metrics)")
    state.metrics.adapters(len(state.registry.by_id), state.registry.resident_bytes)
    data, content_type = state.metrics.render()
    started = {"Process-Start-Time-Unix": str(int(state.metrics.started))}  # as llama-server
    return Response(data, media_type=content_type, headers=started)


@router.post("/rerank")
@router.post("/reranking", include_in_schema=False)
@router.post("/v1/rerank", include_in_schema=False)
@router.post("/v1/reranking", include_in_schema=False)
async def rerank(body: RerankRequest, request: Request) -> Any:
    """llama-server's reranking: each document's score as llama.cpp's rank pooling computes it
    for a model without a classification head (the first component of the last token's
    final-norm hidden state over `query` then the document, with the model's BOS, EOS and
    separator rules), best first; `top_n` keeps the best n. `texts` (TEI's request) gets TEI's
    answer: a list of {index, score[, text]}."""
    state = state_of(request)
    docs = body.documents if body.documents is not None else body.texts
    if not docs:
        raise ApiError(400, '"documents" must be a non-empty string array', "invalid_value")
    check_prompt_count(len(docs), "documents")  # (14,563 held the slot past 30 s)
    ids = [await asyncio.to_thread(_rerank_ids, state, body.query, d) for d in docs]
    scores = await score_each(state, ids, body.model, body.lora, state.service.arank_score)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[: body.top_n]
    if body.documents is None:  # TEI
        return [
            {"index": i, "score": scores[i], **({"text": docs[i]} if body.return_text else {})}
            for i in order
        ]
    n = sum(len(x) for x in ids)
    return {
        "model": served_name(state, body.model),
        "object": "list",
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "results": [{"index": i, "relevance_score": scores[i]} for i in order],
    }


def _rerank_ids(state: ServerState, query: str, doc: str) -> list[int]:
    """llama.cpp's pair format without a rerank template: [BOS] query [EOS] doc [EOS], each
    special where the vocabulary adds it."""
    tok = state.prompter.tokenizer
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.add_eos and tok.eos_id is not None else []
    q = state.prompter.tokenize(query, add_special=False, parse_special=False)
    d = state.prompter.tokenize(doc, add_special=False, parse_special=False)
    return [*bos, *q, *eos, *d, *eos]


@router.post("/infill")
async def infill() -> Response:
    raise ApiError(501, "this server has no fill-in-the-middle endpoint")
