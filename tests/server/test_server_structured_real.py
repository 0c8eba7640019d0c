"""Structured output and tool calls end to end on SmolLM2-135M, with the official `openai` client
and with `langchain-openai` (with_structured_output, bind_tools), sampling on, on the base and on
the pirate adapter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_fixtures import FIXTURES, serving

import graftlm
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

pytestmark = pytest.mark.real

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "country": {"type": "string", "maxLength": 40},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Make up a person and describe them as JSON."}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    try:
        model = graftlm.load(None, ctx_size=2048, n_seq=5, chat_template="chatml")
    except graftlm.ModelFileError as exc:
        pytest.skip(str(exc))
    pirate = str(FIXTURES / "smollm2" / "pirate-f32.gguf")
    state = build_state(
        model,
        ServerConfig(model_name="smollm2"),
        parallel=4,
        lora_modules=[("pirate", pirate)],
    )
    with serving(state) as url:
        yield url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.mark.parametrize("model", ["smollm2", "pirate"])
def test_json_schema_20_of_20_sampled(client: openai.OpenAI, model: str) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }

    def one(seed: int) -> Any:
        return client.chat.completions.create(
            model=model, messages=ASK, response_format=fmt,  # type: ignore[arg-type]
            temperature=0.9, seed=seed, max_tokens=300,
        )  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(20)))
    for out in outs:
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    size: Literal["small", "medium", "large"]


def test_langchain_with_structured_output_and_bind_tools(url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=url + "/v1", api_key="x", model="smollm2", temperature=0.7, max_tokens=200,  # type: ignore[arg-type]
        seed=1, max_retries=0,
    )  # fmt: skip
    city = llm.with_structured_output(City, method="json_schema").invoke("Name a city.")
    assert isinstance(city, City)

    def get_weather(city: str, days: int) -> str:
        """The weather forecast for a city, for a number of days."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris for the next 3 days?"
    )
    (call,) = msg.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather"
    assert isinstance(call["args"]["city"], str) and isinstance(call["args"]["days"], int)
