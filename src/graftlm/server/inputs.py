"""What the dialects share on the way in: prompts as text or token ids (and llama-server's
mixed shapes), message content given as parts flattened to text, a body's validation problems
in one line. Each turns a malformed input into a 400 that names where it is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from graftlm.server.state import ApiError, ServerState


# -- prompts --
def prompt_ids(state: ServerState, prompt: str | Sequence[int]) -> list[int]:
    """A prompt as text (tokenized with the model's special tokens) or as token ids (checked)."""
    ids = state.prompter.prompt_ids(prompt)
    if not ids:
        raise ApiError(400, "the prompt is empty", "invalid_prompt")
    return ids


LlamaPrompt = str | list[int | str] | dict[str, Any]
# prompts in one request, each its own answer (OpenAI's limit on an embeddings input array):
# 14,563 two-letter prompts held one slot past 30 s, and a body limit allows a million
MAX_PROMPTS = 2048


def check_prompt_count(n: int, what: str = "prompts") -> None:
    if n > MAX_PROMPTS:
        raise ApiError(
            400, f"{n} {what} in one request, past the limit of {MAX_PROMPTS}", "invalid_prompt"
        )


def llama_prompts(prompt: Any) -> list[LlamaPrompt]:
    """llama-server's prompt shapes: one text, token ids, ids and texts mixed in one sequence,
    {"prompt_string": text}; or a list of these (several prompts, one answer each)."""
    if isinstance(prompt, str | dict):
        return [prompt]
    if not prompt:
        raise ApiError(400, "the prompt is empty", "invalid_prompt")
    if any(isinstance(x, int) for x in prompt):
        return [prompt]  # one sequence of ids (and texts)
    check_prompt_count(len(prompt))
    return list(prompt)


def _object_text(prompt: dict[str, Any]) -> str:
    """{"prompt_string": text} or {"content": [text parts]} (an embedding input; as
    llama-server, content is a list of parts, never a bare string)."""
    if isinstance(prompt.get("prompt_string"), str):
        return str(prompt["prompt_string"])
    content = prompt.get("content")
    if isinstance(content, list) and content:
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"content[{k}]: {kind!r} parts are not supported by this model")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(
        400, "prompt: an object prompt needs prompt_string, or content as a list of text parts"
    )


def llama_prompt_ids(state: ServerState, prompt: LlamaPrompt) -> list[int]:
    if isinstance(prompt, dict):
        if prompt.get("multimodal_data"):
            raise ApiError(400, "multimodal_data: this model takes no images or audio")
        return prompt_ids(state, _object_text(prompt))
    if isinstance(prompt, str) or all(isinstance(x, int) for x in prompt):
        return prompt_ids(state, prompt)  # type: ignore[arg-type]
    ids: list[int] = []  # as llama.cpp's tokenize_mixed: specials for a leading text only
    for k, x in enumerate(prompt):
        if isinstance(x, str):
            ids += state.prompter.tokenize(x, add_special=k == 0, parse_special=True)
        else:
            ids.append(x)
    return prompt_ids(state, ids)


# -- content parts --
@dataclass(frozen=True)
class TextParts:
    """How a dialect spells content as a list of parts: the kinds that are text, the kinds it
    refuses by name (what the message calls them), and its word for a part."""

    noun: str  # "block" (Anthropic), "part" (Responses)
    text_kinds: frozenset[str]
    refused: Mapping[str, str]  # kind -> how the refusal names it
    # a text part whose text is not a string: its own 400 (else: "expected a text part")
    checked_text: bool = False


ANTHROPIC_PARTS = TextParts("block", frozenset({"text"}), {"image": "image input"}, True)
RESPONSES_PARTS = TextParts(
    "part",
    frozenset({"input_text", "output_text", "text"}),
    {"input_image": "input_image", "input_file": "input_file"},
)


def block_text(block: dict[str, Any], where: str) -> str:
    """A text block's text (the block at `where`)."""
    text = block.get("text")
    if not isinstance(text, str):
        raise ApiError(
            400, f"{where}.text: expected a string, got {type(text).__name__} {text!r}"[:300]
        )
    return text


def content_text(content: Any, where: str, parts: TextParts) -> str:
    """A content that must be text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected a string or a list of content {parts.noun}s")
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in parts.text_kinds and parts.checked_text:
            out.append(block_text(part, f"{where}[{k}]"))
        elif kind in parts.text_kinds and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif isinstance(kind, str) and kind in parts.refused:
            raise ApiError(
                400, f"{where}[{k}]: {parts.refused[kind]} is not supported by this model"
            )
        else:
            raise ApiError(400, f"{where}[{k}]: expected a text {parts.noun}, got {kind!r}")
    return "".join(out)


def problems(exc: ValidationError, shown: int = 3) -> str:
    """The first few problems pydantic found in a translated body, each as `where: what`."""
    return "; ".join(
        f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()[:shown]
    )
