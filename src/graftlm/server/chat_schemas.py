"""The chat bodies (/v1/chat/completions and /apply-template): messages, tools and the choice
among them, the template's variables; their sampling fields are `schemas.SamplingFields`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from graftlm.runtime.reasoning import ReasoningFormat
from graftlm.server.schemas import Body, NonNegInt, SamplingFields, StreamOptions
from graftlm.tokenizer.chat import check_template_kwargs


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text


class ToolCallItem(Body):
    """An assistant message's tool call, in a chat's history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    # an assistant message's reasoning, given back (as llama-server reads it; templates that
    # render it read `reasoning_content`, gpt-oss's `thinking`: server/chat.py gives both)
    reasoning_content: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string, tool-call arguments
        as objects (templates write them with `tojson`), the reasoning where it is given."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None and self.role == "assistant":
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                args: Any = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass  # kept as text: the template writes it as a string
                fn = {"name": c.function.name, "arguments": args}
                calls.append({"id": c.id, "type": "function", "function": fn})
            out["tool_calls"] = calls
        return out


class FunctionDef(Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


# more variables for the chat template (llama-server's and vLLM's; e.g. enable_thinking), not
# the template's own (tokenizer/chat.py's rule)
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(check_template_kwargs)]


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
    tools: list[Tool] | None = None
    chat_template_kwargs: TemplateKwargs = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # see IGNORED
    # the template's generation prompt (False: none); continue_final_message: the final
    # assistant message is continued rather than closed (the default where it is last, as
    # llama-server's prefill); both true is a 400
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # llama-server's: where the answer's reasoning goes (None: the server's --reasoning-format),
    # and the effort a template reads (gpt-oss's "low", "medium", "high")
    reasoning_format: ReasoningFormat | None = None
    reasoning_effort: Annotated[str, Field(max_length=64)] | None = None


class ApplyTemplateRequest(Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: TemplateKwargs = None
    reasoning_effort: Annotated[str, Field(max_length=64)] | None = None
