"""Tool calls on /v1/chat/completions: the template receives the tools (the built-in chatml here,
Hermes form), `required` and a named function are enforced by grammar, calls come back as
`tool_calls` (streamed as deltas that reassemble into the same call), a template without tools
gets llama.cpp's generic JSON format; and the parser on its own, for each format, split at every
point."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_fixtures import PARALLEL, SPEC, TinyServer, error_of, serving
from tiny_models import write_tiny_model

import graftlm
from graftlm.runtime.tools import ToolCallParser, parse_tool_calls
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "adds two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
CHAT: list[dict[str, Any]] = [{"role": "user", "content": "weather in Oslo for 3 days?"}]
PROMPT = [5, 70, 33, 200, 41, 9]


@pytest.fixture(scope="module")
def chatml_url(
    tiny_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    # the tiny byte-level vocabulary spends a token a character: the tools' prompt needs room
    # (same weights as the session's tiny model: only the context length differs)
    long = write_tiny_model(
        tmp_path_factory.mktemp("tools") / "tiny4k.gguf", replace(SPEC, n_ctx=4096)
    )
    model = graftlm.load(long, ctx_size=4096, n_seq=PARALLEL + 1, chat_template="chatml")
    state = build_state(
        model,
        ServerConfig(model_name="tiny"),
        parallel=PARALLEL,
        lora_modules=[(n, str(tiny_files[n])) for n in ("alpha", "beta", "gamma")],
    )
    with serving(state) as url:
        yield url


@pytest.fixture(scope="module")
def client(chatml_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=chatml_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _check_call(call: Any) -> dict[str, Any]:
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    return dict(args)


def _required_calls(client: openai.OpenAI, seeds: int) -> None:
    """tool_choice required, sampled: exactly one valid call, and no content, every time."""
    for seed in range(seeds):
        out = client.chat.completions.create(
            model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
            temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        c = out.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert not c.message.content and len(c.message.tool_calls or []) == 1
        _check_call((c.message.tool_calls or [])[0])


def test_required_gives_a_valid_call_every_time(client: openai.OpenAI) -> None:
    _required_calls(client, 8)


def test_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for seed in range(3):
        out = client.chat.completions.create(
            model="alpha", messages=CHAT, tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "add"}},
            temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        (call,) = out.choices[0].message.tool_calls or []
        assert call.function.name == "add"
        _check_call(call)


def test_streamed_call_reassembles_into_the_same_call(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required", temperature=1.0,
        seed=5, max_tokens=200,
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for ch in client.chat.completions.create(stream=True, **kwargs):
        if not ch.choices:
            continue
        d = ch.choices[0]
        finish = d.finish_reason or finish
        for tc in d.delta.tool_calls or []:
            cur = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function and tc.function.name:
                cur["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                cur["arguments"] += tc.function.arguments
    assert finish == "tool_calls"
    (w,) = whole.message.tool_calls or []
    assert calls == {0: {"name": w.function.name, "arguments": w.function.arguments}}


def test_history_with_calls_and_results_is_accepted(client: openai.OpenAI) -> None:
    history: list[dict[str, Any]] = CHAT + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "c", "days": 3}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 4}'},
    ]
    out = client.chat.completions.create(
        model="tiny",
        messages=history,
        tools=TOOLS,
        max_tokens=5,
        temperature=0,  # type: ignore[arg-type]
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_and_auto(client: openai.OpenAI) -> None:
    """none: the tools are not rendered, the answer is text; auto: the same prompt as a plain
    chat with tools (the random model writes no call)."""
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    none = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert none.choices[0].message.content == plain.choices[0].message.content
    auto = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        tools=TOOLS,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert auto.usage is not None and none.usage is not None
    assert auto.usage.prompt_tokens > none.usage.prompt_tokens  # the tools were in the prompt


def test_tool_refusals(chatml_url: str, server: TinyServer) -> None:
    http = httpx.Client(base_url=chatml_url, timeout=60)
    body: dict[str, Any] = {"messages": CHAT, "tools": TOOLS, "max_tokens": 4}
    named = {"type": "function", "function": {"name": "nope"}}
    error_of(http.post("/v1/chat/completions", json=body | {"tool_choice": named}), 400, "nope")
    error_of(
        http.post(
            "/v1/chat/completions",
            json=body | {"tool_choice": "required", "guided_regex": "a"},
        ),
        400,
        "guided_regex",
    )
    bad_tool = {"type": "function", "function": {"name": "has space"}}
    error_of(http.post("/v1/chat/completions", json=body | {"tools": [bad_tool]}), 400, "name")
    # a template without tools (the tiny server's ChatML fallback) answers as JSON: a grammar of
    # its own, which another constraint would contradict
    plain = httpx.Client(base_url=server.url, timeout=60)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    error_of(
        plain.post("/v1/chat/completions", json=body | {"response_format": schema}),
        400,
        "renders none",
        "response_format",
    )


def test_generic_tools_on_a_template_without_tools(server: TinyServer) -> None:
    """llama.cpp's generic format where the template renders no tools: the tools and the JSON
    instruction in a system message, the answer held to a call or a reply by a grammar."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    _required_calls(client, 4)
    kinds = set()
    for seed in range(6):  # auto: a call, or a reply given as text (never the JSON around it)
        out = client.chat.completions.create(
            model="tiny", messages=CHAT, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=300,
        )  # fmt: skip
        c = out.choices[0]
        if c.finish_reason == "length":
            continue  # a reply cut off stays the raw text
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            _check_call(c.message.tool_calls[0])
            kinds.add("call")
        else:
            assert c.finish_reason == "stop"  # content None: an empty reply
            assert not (c.message.content or "").startswith('{"response"')
            kinds.add("reply")
    assert kinds  # at least one answer ended within max_tokens
    # the prompt the model saw: the tools and the instruction in a system turn, and a history
    # with a call and its result as JSON text
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]  # fmt: skip
    text = server.ref.prompter.apply_chat_template(history, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou can call these tools:\n")
    assert '"name": "get_weather"' in text and "Respond in JSON format" in text
    assert '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}' in text
    assert '<|im_start|>user\n{"tool_response": {"tool_call_id": "c1", "content": "3"}}' in text


def test_mixed_batch_with_tool_calls_over_adapters(
    server: TinyServer, client: openai.OpenAI
) -> None:
    """16 concurrent requests over four adapters: a quarter JSON schema, a quarter regex, a
    quarter free (greedy, compared with the reference model run alone), a quarter tool calls."""
    models = ["tiny", "alpha", "beta", "gamma"]
    regex = r"[a-z]{3}-[0-9]{3}"

    def run(i: int) -> tuple[int, Any]:
        kind, model = i % 4, models[(i // 4) % 4]
        if kind == 0:
            fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
            return i, client.chat.completions.create(
                model=model,
                messages=CHAT,
                response_format=fmt,
                temperature=1.0,
                seed=i,
                max_tokens=200,  # type: ignore[arg-type]
            )
        if kind == 1:
            return i, client.completions.create(
                model=model,
                prompt=PROMPT,
                temperature=1.0,
                seed=i,
                max_tokens=40,
                extra_body={"guided_regex": regex},
            )
        if kind == 2:
            return i, client.completions.create(
                model=model,
                prompt=PROMPT,
                temperature=0,
                max_tokens=12,
                extra_body={"ignore_eos": True},
            )
        return i, client.chat.completions.create(
            model=model,
            messages=CHAT,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=i,
            max_tokens=200,  # type: ignore[arg-type]
        )

    with ThreadPoolExecutor(16) as pool:
        results = dict(pool.map(run, range(16)))
    for i, out in results.items():
        kind, model = i % 4, models[(i // 4) % 4]
        if kind == 0:
            jsonschema.validate(json.loads(out.choices[0].message.content), WEATHER)
        elif kind == 1:
            assert re.fullmatch(regex, out.choices[0].text)
        elif kind == 2:
            lora = {} if model == "tiny" else {model: 1.0}
            ref = server.ref.detokenize(server.ref_tokens(PROMPT, 12, lora))
            assert out.choices[0].text == ref, model
        else:
            (call,) = out.choices[0].message.tool_calls
            _check_call(call)


# -- the parser alone --
HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", HERMES, "Let me check.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]),
    ("hermes", "no calls, a < b and <tool", "no calls, a < b and <tool", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("hermes", "cut <tool_call>\n{\"name\": \"add\"", "cut <tool_call>\n{\"name\": \"add\"", []),
    ("llama3", '{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "", [("add", {"a": 1})]),
    ("llama3", "It is sunny {maybe}.", "It is sunny {maybe}.", []),
    ("generic", '{"response": "It is sunny."}', "It is sunny.", []),
    ("generic", '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}', "", [("add", {"a": 1, "b": 2})]),
    ("generic", '{"tool_calls": [{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"b": 2}}]}', "", [("add", {"a": 1}), ("add", {"b": 2})]),
    ("generic", '{"tool_call": {"name": "add", "argu', '{"tool_call": {"name": "add", "argu', []),
    ("generic", "plain words", "plain words", []),
])  # fmt: skip
def test_parser_whole_and_split_anywhere(
    fmt: str, text: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    got_content, got = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    for cut in range(1, len(text)):  # streamed in two pieces, split at every character
        p = ToolCallParser(fmt)
        c1, k1 = p.feed(text[:cut])
        c2, k2 = p.feed(text[cut:])
        c3, k3 = p.finish()
        assert (c1 + c2 + c3).strip() == content.strip(), cut
        assert [(c.name, json.loads(c.arguments)) for c in k1 + k2 + k3] == calls, cut


def _grammar_takes(server: TinyServer, constraint: Any, text: str) -> bool:
    """Whether the grammar takes the whole of text (one byte token a character) and may end."""
    from graftlm.runtime.constraints import ConstraintError

    matcher = server.ref.prompter.compile(constraint).matcher()
    try:
        for tok in server.ref.prompter.tokenizer.encode(text):
            matcher.advance(tok)
    except ConstraintError:
        return False
    return matcher.accepting


def test_a_forced_call_ends_with_its_object_and_closes_the_tools_objects(
    server: TinyServer,
) -> None:
    """After a forced call the generic format's object must end (it was open: SmolLM2 went on
    writing keys until max_tokens), and a tool schema's objects take no keys of their own
    unless the schema says so (llama.cpp's reading)."""
    from graftlm.runtime.tools import closed, tool_constraint

    c = tool_constraint(TOOLS, None, "generic")
    call = '{"tool_call":{"name":"add","arguments":{"a":1,"b":2}}}'
    assert _grammar_takes(server, c, call)
    assert not _grammar_takes(server, c, call[:-1] + ',"description":"x"}')
    plain_args = {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}
    loose = [{"type": "function", "function": {"name": "f", "parameters": plain_args}}]
    f = tool_constraint(loose, None, "generic")
    assert _grammar_takes(server, f, '{"tool_call":{"name":"f","arguments":{"a":2}}}')
    assert not _grammar_takes(server, f, '{"tool_call":{"name":"f","arguments":{"a":2,"t":3}}}')
    reply = tool_constraint(TOOLS, None, "generic", answer=True)
    assert _grammar_takes(server, reply, '{"response":"hi"}')
    assert not _grammar_takes(server, reply, '{"response":"hi","more":1}')
    # what a schema says of other keys stands, nested objects are closed too, the input is kept
    open_args = {"type": "object", "properties": {"a": {"type": "number"}},
                 "additionalProperties": True}  # fmt: skip
    nested = {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "properties": {"type": "string"}}}}}  # fmt: skip
    got = closed(nested)
    assert got["additionalProperties"] is False
    assert got["properties"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]["p"]["properties"]  # a key's name
    assert "additionalProperties" not in nested and closed(open_args) == open_args
    tools = [{"type": "function", "function": {"name": "f", "parameters": open_args}}]
    assert _grammar_takes(
        server, tool_constraint(tools, "f", "generic"),
        '{"tool_call":{"name":"f","arguments":{"a":1,"z":2}}}',
    )  # fmt: skip
