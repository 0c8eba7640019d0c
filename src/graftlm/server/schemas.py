"""Request bodies of every endpoint, as pydantic models (the chat's messages, tools and their
bodies are in `chat_schemas.py`).

Strict: a string where a number belongs is an error (400), not a coercion. No field is silently
ignored: a field no body declares is a 400 naming it. The few fields that are declared and then
not used are listed in `IGNORED` (and in docs/server.md): each is one that changes nothing here
(`user`, `id_slot`), or a sampler setting accepted only at the value that turns it off.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from graftlm.runtime.constraints import Constraint, ConstraintError
from graftlm.runtime.speculative import SpecParams
from graftlm.server.names import name_problem

NonNegInt = Annotated[int, Field(ge=0)]
MAX_N_PROBS = 100  # /completion's n_probs (2**70 made a 187 MB answer of the whole vocabulary)
MAX_TOKENIZE_CHARS = 1 << 20  # /tokenize's text (a model's context is far shorter)
PositiveInt = Annotated[int, Field(ge=1)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Temperature = Annotated[float, Field(ge=0.0)]


def _stray_items(value: Any) -> Any:
    """Texts and token ids (a list, or a list of lists): the first null, boolean or float in them
    (never a token id in these strict fields) is one error, named. Pydantic would make an error for
    every such item and every shape of the union: 32,743 floats made 130,974 errors and held the
    event loop for a second."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            inner = isinstance(item, list)
            for j, x in enumerate(item if inner else (item,)):
                if x is None or isinstance(x, bool | float):
                    where = f"[{i}][{j}]" if inner else f"[{i}]"
                    raise ValueError(f"item {where} is {x!r}, not a text or a token id")
    return value


# a prompt as texts and token ids: OpenAI's shapes, and llama-server's (texts and ids mixed,
# {"prompt_string"} / {"content"} objects)
OpenAIPromptField = Annotated[
    str | list[str] | list[int] | list[list[int]], BeforeValidator(_stray_items)
]
LlamaPromptField = Annotated[
    str | dict[str, Any] | list[int | str | list[int | str] | dict[str, Any]],
    BeforeValidator(_stray_items),
]
TokenIds = Annotated[list[int], BeforeValidator(_stray_items)]


class Body(BaseModel):
    """The base of every request body: strict types, no field it does not declare."""

    model_config = ConfigDict(strict=True, extra="forbid")


# Accepted and not used. Each changes nothing in this server's answers: metadata for the
# client's own bookkeeping, or llama-server sampler settings at the values that turn them off
# (any other value is a 400: it would change the output and this server does not do it).
IGNORED: dict[str, str] = {
    "user": "an end-user id (OpenAI's abuse monitoring)",
    "metadata": "OpenAI's stored-completion tags",
    "store": "OpenAI's stored completions (nothing is stored)",
    "service_tier": "OpenAI's billing tier",
    "parallel_tool_calls": "with auto every call the model writes is returned; required and a named function give one",
    "id_slot": "llama-server's slot choice (the scheduler picks)",
    "n_keep": "llama-server's context shift (a prompt must fit the context)",
    "t_max_predict_ms": "llama-server's time limit",
    "backend_sampling": "llama-server's sampling on the compute device (the same draws here)",
    "post_sampling_probs": "on /completion, n_probs after the sampler chain; on the OpenAI endpoints the logprobs stay those of the raw logits",
    "samplers": "llama-server's sampler order (the order is llama.cpp's default)",
    "typical_p": "accepted at 1.0 only (off)",
    "tfs_z": "accepted at 1.0 only (off)",
    "mirostat": "accepted at 0 only (off)",
    "mirostat_tau": "unused while mirostat is 0",
    "mirostat_eta": "unused while mirostat is 0",
    "penalize_nl": "accepted at false only",
    "dynatemp_range": "accepted at 0 only (off)",
    "dynatemp_exponent": "unused while dynatemp_range is 0",
    "dry_multiplier": "accepted at 0 only (off)",
    "dry_base": "unused while dry_multiplier is 0",
    "dry_allowed_length": "unused while dry_multiplier is 0",
    "dry_penalty_last_n": "unused while dry_multiplier is 0",
    "dry_sequence_breakers": "unused while dry_multiplier is 0",
    "xtc_probability": "accepted at 0 only (off)",
    "xtc_threshold": "unused while xtc_probability is 0",
    "top_n_sigma": "accepted at -1 only (off)",
    "guided_decoding_backend": "vLLM's constraint backend (always llguidance)",
}

# the values at which an ignored sampler setting is off
_OFF: dict[str, tuple[Any, ...]] = {
    "typical_p": (1, 1.0),
    "tfs_z": (1, 1.0),
    "mirostat": (0,),
    "penalize_nl": (False,),
    "dynatemp_range": (0, 0.0),
    "dry_multiplier": (0, 0.0),
    "xtc_probability": (0, 0.0),
    "top_n_sigma": (-1, -1.0),
}


class LoraItem(Body):
    """One adapter's scale for one request (llama-server's `lora` field, POST /lora-adapters)."""

    id: int
    scale: float  # its range is checked with the id, by the adapter set (AdapterSet.settings)


class RequestLoraItem(Body):
    """One adapter's scale for one request: by `id` (llama-server's) or by `name` (a
    `--lora-modules` or runtime-loaded adapter, attached on first use)."""

    id: int | None = None
    name: Annotated[str, Field(min_length=1)] | None = None
    scale: float

    @model_validator(mode="after")
    def _one_of(self) -> RequestLoraItem:
        if (self.id is None) == (self.name is None):
            raise ValueError("each lora entry names its adapter by 'id' or by 'name' (one of them)")
        return self


def _json_constraint(schema: dict[str, Any] | str, field: str) -> Constraint:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"{field}: not valid JSON ({exc})") from None
    return Constraint.json_schema(schema, field)


def _vllm_constraints(
    json_: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
    field: str,
) -> list[Constraint]:
    """vLLM's four constraints, spelled both as structured_outputs.{json,regex,choice,grammar}
    and as guided_{json,regex,choice,grammar}: `field` names them with "{}" for the kind."""
    out = []
    if json_ is not None:
        out.append(_json_constraint(json_, field.format("json")))
    if regex is not None:
        out.append(Constraint("regex", regex, field.format("regex")))
    if choice is not None:
        out.append(Constraint.choice(choice, field.format("choice")))
    if grammar is not None:
        out.append(Constraint("gbnf", grammar, field.format("grammar")))
    return out


class JsonSchemaFormat(Body):
    """OpenAI's response_format.json_schema."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's response_format (llama-server also takes a `schema` beside json_object)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    def constraint(self) -> Constraint:
        if self.type == "json_schema":
            js = self.json_schema
            schema = js.schema_ if js is not None else self.schema_
            if schema is None:
                raise ConstraintError("response_format.json_schema.schema is required")
            strict = bool(js is not None and js.strict)
            return Constraint.json_schema(schema, "response_format.json_schema", strict)
        if self.schema_ is not None:
            return Constraint.json_schema(self.schema_, "response_format.schema")
        return Constraint("json_object", "", "response_format")


class StructuredOutputs(Body):
    """vLLM's structured_outputs: one of json, regex, choice, grammar (or json_object)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraints(self) -> list[Constraint]:
        out = _vllm_constraints(
            self.json_, self.regex, self.choice, self.grammar, "structured_outputs.{}"
        )
        if self.json_object:
            out.append(Constraint("json_object", "", "structured_outputs.json_object"))
        return out


class SamplingFields(Body):
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
    lora: list[RequestLoraItem] | None = None
    # OpenAI's {"token id": bias}; llama-server's [[id or text, bias or false]]
    logit_bias: dict[str, Any] | list[Any] | None = None
    # constraints: OpenAI's, llama-server's and vLLM's names for the same few things
    response_format: ResponseFormat | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_prompt: bool = True  # reuse the prefix cache (unless the server turned it off)
    # /completion's n_probs after the sampler chain, as probabilities (`prob`, `top_probs`)
    post_sampling_probs: bool = False
    # llama-server's stream extras: `timings` on every chunk, and `prompt_progress` chunks while
    # the prompt is computed (before each prefill chunk and after the last)
    timings_per_token: bool = False
    return_progress: bool = False
    # accepted, not used: see IGNORED
    backend_sampling: bool | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    id_slot: int | None = None
    n_keep: int | None = None
    t_max_predict_ms: int | None = None
    samplers: list[str] | str | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_nl: bool | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    top_n_sigma: float | None = None
    guided_decoding_backend: str | None = None
    # llama-server's per-request draft bounds (speculative decoding, when the server drafts;
    # n_max 0 turns it off for the request; p_min bounds a draft model's, unused by n-grams)
    speculative_n_max: int | None = Field(default=None, alias="speculative.n_max", ge=0, le=1024)
    speculative_n_min: int | None = Field(default=None, alias="speculative.n_min", ge=0, le=1024)
    speculative_p_min: float | None = Field(default=None, alias="speculative.p_min", ge=0.0, le=1.0)
    verbose: bool = False  # llama-server's __verbose: the rendered prompt beside the answer

    @field_validator(*_OFF, mode="after")
    @classmethod
    def _off_only(cls, v: Any, info: Any) -> Any:
        if v is not None and v not in _OFF[info.field_name]:
            raise ValueError(
                f"{info.field_name} is not supported; only its off value "
                f"{_OFF[info.field_name][-1]!r} is accepted"
            )
        return v

    def spec(self) -> SpecParams | None:
        """The request's own speculative bounds, None when it names none."""
        n_max, n_min, p_min = self.speculative_n_max, self.speculative_n_min, self.speculative_p_min
        if n_max is None and n_min is None and p_min is None:
            return None
        return SpecParams(n_max, n_min, p_min)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def constraint(self) -> Constraint | None:
        """The one output constraint the request asks for (None: free text); ConstraintError
        when it names several or one is malformed."""
        found: list[Constraint] = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            found.append(rf.constraint())
        if self.grammar is not None:
            found.append(Constraint("gbnf", self.grammar, "grammar"))
        if self.json_schema is not None:
            found.append(Constraint.json_schema(self.json_schema, "json_schema"))
        if self.structured_outputs is not None:
            found += self.structured_outputs.constraints()
        found += _vllm_constraints(
            self.guided_json,
            self.guided_regex,
            self.guided_choice,
            self.guided_grammar,
            "guided_{}",
        )
        if len(found) > 1:
            names = ", ".join(c.field for c in found)
            raise ConstraintError(f"give at most one output constraint; got {names}")
        return found[0] if found else None


class StreamOptions(Body):
    include_usage: bool = False


class CompletionRequest(SamplingFields):
    """POST /v1/completions (OpenAI's legacy completions)."""

    model: str | None = None
    prompt: OpenAIPromptField
    max_tokens: NonNegInt | None = None
    # llama-server's name for max_tokens, which its OpenAI endpoint takes too (-1: no limit)
    n_predict: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _one_length(self) -> CompletionRequest:
        if self.max_tokens is not None and self.n_predict is not None:
            raise ValueError("give max_tokens or n_predict (llama-server's name), not both")
        return self

    @property
    def length(self) -> int | None:
        """max_tokens, or n_predict (None: neither given)."""
        return self.max_tokens if self.max_tokens is not None else self.n_predict


class LlamaCompletionRequest(SamplingFields):
    """POST /completion (llama-server's native endpoint)."""

    # one text, token ids (texts may be mixed in), {"prompt_string": ...}, or a list of these
    prompt: LlamaPromptField
    n_predict: int | None = None
    response_fields: list[str] | None = None  # only these fields in the answer
    stream: bool = False
    # the alternatives a token lists (each is a row of the answer: bounded, as OpenAI's 20)
    n_probs: Annotated[int, Field(ge=0, le=MAX_N_PROBS)] = 0
    return_tokens: bool = False
    model: str | None = None


class EmbeddingRequest(Body):
    """POST /v1/embeddings (OpenAI): one text or token list, or several."""

    # also llama-server's shapes: texts and ids mixed, {"prompt_string"} / {"content"} objects
    input: LlamaPromptField
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None  # see IGNORED
    lora: list[RequestLoraItem] | None = None


class RerankRequest(Body):
    """POST /rerank (llama-server; Jina/Cohere's `documents`, or TEI's `texts`)."""

    query: str
    documents: list[str] | None = None
    texts: list[str] | None = None  # TEI's name: the answer is TEI's list then
    top_n: PositiveInt | None = None
    return_text: bool = False  # TEI: each result carries its text
    model: str | None = None
    lora: list[RequestLoraItem] | None = None


class LlamaEmbeddingRequest(Body):
    """POST /embedding (llama-server)."""

    content: LlamaPromptField
    model: str | None = None
    lora: list[RequestLoraItem] | None = None


class TokenizeRequest(Body):
    """llama-server's body (`content`, `add_special`, ...) or vLLM's (`prompt`,
    `add_special_tokens`, `model`, `return_token_strs`): the text in exactly one of the two."""

    content: str | None = None
    prompt: str | None = None  # vLLM's name for the text; its answer has vLLM's fields
    add_special: bool | None = None
    add_special_tokens: bool | None = None  # vLLM's name for add_special (default True there)
    parse_special: bool = True
    with_pieces: bool = False
    return_token_strs: bool = False
    model: str | None = None  # vLLM's; any value (one model is served)

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        if (self.content is None) == (self.prompt is None):
            raise ValueError(
                "give the text to tokenize in 'content' (llama-server) or 'prompt' (vLLM), "
                "one of them"
            )
        if self.add_special is not None and self.add_special_tokens is not None:
            raise ValueError(
                "give 'add_special' (llama-server) or 'add_special_tokens' (vLLM), not both"
            )
        if len(self.text) > MAX_TOKENIZE_CHARS:
            name = "content" if self.content is not None else "prompt"
            raise ValueError(
                f"{name}: {len(self.text)} characters, more than the {MAX_TOKENIZE_CHARS} one "
                "request may tokenize"
            )
        return self

    @property
    def text(self) -> str:
        return self.content if self.content is not None else self.prompt or ""

    @property
    def specials(self) -> bool:
        """Whether to add the BOS and other special tokens: llama-server's default is no, vLLM's
        yes."""
        given = self.add_special if self.add_special is not None else self.add_special_tokens
        return given if given is not None else self.prompt is not None


class DetokenizeRequest(Body):
    tokens: TokenIds
    model: str | None = None  # vLLM's; any value


def _adapter_name(name: str) -> str:
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


class LoadLoraRequest(Body):
    """POST /v1/load_lora_adapter (vLLM)."""

    lora_name: Annotated[
        str, Field(min_length=1), AfterValidator(_adapter_name)
    ]  # (its length too)
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoraRequest(Body):
    """POST /v1/unload_lora_adapter (vLLM)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: int | None = None
