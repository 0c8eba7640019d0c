"""Vertex AI's custom-container prediction API, as llama-server serves it when started with
AIP_MODE=PREDICTION: POST /predict with {"instances": [...]}, each instance a chat completion
request (`"@requestFormat": "chatCompletions"`), answered as {"predictions": [...]}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from graftlm.server.chat import chat_completion
from graftlm.server.chat_schemas import ChatCompletionRequest
from graftlm.server.inputs import problems
from graftlm.server.state import ApiError, json_body, state_of

router = APIRouter()


@router.post("/predict")
async def predict(request: Request) -> dict[str, Any]:
    body = await json_body(request)
    instances = body.get("instances") if isinstance(body, dict) else None
    if not isinstance(instances, list) or not instances:
        raise ApiError(400, "instances: a non-empty list of requests is required")
    out = []
    for k, inst in enumerate(instances):
        if not isinstance(inst, dict):
            raise ApiError(400, f"instances[{k}]: expected an object")
        fmt = inst.get("@requestFormat", "chatCompletions")
        if fmt != "chatCompletions":
            raise ApiError(400, f"instances[{k}]: @requestFormat {fmt!r} is not supported")
        fields = {key: v for key, v in inst.items() if key != "@requestFormat"}
        if fields.get("stream"):
            raise ApiError(400, f"instances[{k}]: predictions do not stream")
        try:
            chat = ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:
            raise ApiError(400, f"instances[{k}]: {problems(exc)}") from None
        out.append(await chat_completion(state_of(request), chat, request))
    return {"predictions": out}
