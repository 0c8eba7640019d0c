"""Request bodies of every endpoint, as pydantic models.

Strict: a string where a number belongs is an error (400), not a coercion. Unknown fields are
accepted and ignored, as OpenAI clients send many this server does not use.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NonNegInt = Annotated[int, Field(ge=0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Temperature = Annotated[float, Field(ge=0.0)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class LoraItem(_Body):
    """One adapter's scale for one request (llama-server's `lora` field, POST /lora-adapters)."""

    id: int
    scale: float  # its range is checked with the id, by the adapter set (AdapterSet.settings)


class SamplingFields(_Body):
    """Sampling fields shared by every generating endpoint (None: the server's default)."""

    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: int | None = None
    min_p: Probability | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    ignore_eos: bool = False
    lora: list[LoraItem] | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class StreamOptions(_Body):
    include_usage: bool = False


class CompletionRequest(SamplingFields):
    """POST /v1/completions (OpenAI's legacy completions)."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: NonNegInt | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    user: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    user: str | None = None


class LlamaCompletionRequest(SamplingFields):
    """POST /completion (llama-server's native endpoint)."""

    prompt: str | list[int]
    n_predict: int | None = None
    stream: bool = False
    n_probs: NonNegInt = 0
    cache_prompt: bool = True  # reuse the prefix cache (unless the server turned it off)
    return_tokens: bool = False
    model: str | None = None


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int]


class ApplyTemplateRequest(_Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


class LoadLoraRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoraRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: int | None = None
