"""vLLM's own endpoints: the runtime adapter API (/v1/load_lora_adapter, /v1/unload_lora_adapter,
paths confined to --lora-dir) and /tokenizer_info."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from graftlm.lora.peft import peft_files
from graftlm.server.registry import UnknownModelError
from graftlm.server.schemas import LoadLoraRequest, UnloadLoraRequest
from graftlm.server.state import ApiError, ServerState, state_of

router = APIRouter()


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
