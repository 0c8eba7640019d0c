"""gpt-oss's answers through the HTTP API, as a llama-server client reads them: the tiny gpt-oss
reference (made_families.py) served with gpt-oss's own chat template, its output forced by a
grammar to hand-written harmony text, so that each route shows its reasoning, content and tool
calls: the chat answer whole and streamed (read by the openai client), `reasoning_format` per
request, `tool_choice` required held to a harmony call by its grammar, the Responses API's
reasoning item, Anthropic's thinking blocks; and the prompt side (reasoning and calls of the
history, `reasoning_effort`) through /apply-template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from made_families import made_dir
from server_fixtures import serving

import graftlm
from graftlm.runtime.constraints import Constraint
from graftlm.server import pipeline
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

TEMPLATE = (Path(__file__).parent / "gpt_oss_chat_template.jinja").read_text()
CHAT = [{"role": "user", "content": "hi"}]
THOUGHT = "Greet."  # (short: each character is a token of the tiny vocabulary)
ANSWER = "Hi!"
HARMONY = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
            },
        },
    }
]
CALL = (
    "<|channel|>analysis<|message|>Tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}'
)
SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")


def forced(text: str) -> dict[str, Any]:
    """Request fields that make the model write exactly `text` (a GBNF literal)."""
    return {"grammar": f"root ::= {json.dumps(text)}", "temperature": 0.0, "max_tokens": 400}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    folder = made_dir("gpt-oss")
    if folder is None:
        pytest.skip("the tiny gpt-oss reference cannot be made here (transformers, converter)")
    model = graftlm.load(folder / "model-f32.gguf", ctx_size=2048, n_seq=3, chat_template=TEMPLATE)
    state = build_state(model, ServerConfig(model_name="gpt-oss"), parallel=2)
    with serving(state) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str, dict[int, dict], str]:
    """A streamed chat answer reassembled: reasoning, content, calls by index, finish reason."""
    reasoning, content, calls, finish = "", "", {}, ""
    for ch in client.chat.completions.create(stream=True, **kwargs):
        if not ch.choices:
            continue
        d = ch.choices[0]
        finish = d.finish_reason or finish
        piece = getattr(d.delta, "reasoning_content", None)
        assert piece is None or not d.delta.content  # (a delta of its own, as llama-server's)
        reasoning += piece or ""
        content += d.delta.content or ""
        for tc in d.delta.tool_calls or []:
            cur = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            cur["name"] += (tc.function and tc.function.name) or ""
            cur["arguments"] += (tc.function and tc.function.arguments) or ""
    return reasoning, content, calls, finish


def test_chat_answer_keeps_reasoning_apart(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="gpt-oss",
        messages=CHAT,  # type: ignore[arg-type]
        extra_body=forced(HARMONY),
    )
    msg = out.choices[0].message
    assert getattr(msg, "reasoning_content", None) == THOUGHT
    assert msg.content == ANSWER and out.choices[0].finish_reason == "stop"
    kwargs: dict[str, Any] = dict(model="gpt-oss", messages=CHAT, extra_body=forced(HARMONY))
    assert _streamed(client, **kwargs) == (THOUGHT, ANSWER, {}, "stop")


@pytest.mark.parametrize(
    "fmt,reasoning,content",
    [
        ("deepseek", THOUGHT, ANSWER),
        ("deepseek-legacy", THOUGHT, f"<think>{THOUGHT}</think>{ANSWER}"),
        ("none", None, f"<|channel|>analysis<|message|>{THOUGHT}<|end|>{ANSWER}"),
    ],
)
def test_reasoning_format_per_request(
    url: str, fmt: str, reasoning: str | None, content: str
) -> None:
    body = {"messages": CHAT, "reasoning_format": fmt} | forced(HARMONY)
    msg = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    msg = msg["choices"][0]["message"]
    assert msg.get("reasoning_content") == reasoning and msg["content"] == content
    bad = httpx.post(url + "/v1/chat/completions", json=body | {"reasoning_format": "x"})
    assert bad.status_code == 400


def test_harmony_calls_are_tool_calls(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="gpt-oss", messages=CHAT, tools=TOOLS, extra_body=forced(CALL)
    )
    c = client.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    assert getattr(c.message, "reasoning_content", None) == "Tool."
    (call,) = c.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Oslo"
    }
    reasoning, content, calls, finish = _streamed(client, **kwargs)
    assert (reasoning, content, finish) == ("Tool.", "", "tool_calls")
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}


def test_required_is_held_to_a_harmony_call(client: openai.OpenAI) -> None:
    """tool_choice required, sampled from the random model: its grammar writes a harmony
    call every time, which comes back as a valid call."""
    for seed in range(2):
        c = client.chat.completions.create(
            model="gpt-oss", messages=CHAT, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
            temperature=1.0, seed=seed, max_tokens=200,
        ).choices[0]  # fmt: skip
        (call,) = c.message.tool_calls or []
        assert c.finish_reason == "tool_calls" and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        assert set(args) == {"city"} and len(args["city"]) <= 10


def test_sampled_answers_never_fail(client: openai.OpenAI) -> None:
    """Whatever the random model writes (no harmony at all), an answer comes back, streamed
    or not, with no special token leaking from the parser."""
    kwargs: dict[str, Any] = dict(
        model="gpt-oss", messages=CHAT, tools=TOOLS, temperature=1.0, seed=3, max_tokens=30
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    reasoning, content, _, finish = _streamed(client, **kwargs)
    assert finish == whole.finish_reason
    assert content == (whole.message.content or "")


@pytest.fixture
def force(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`force(text)`: from then on every request's answer is `text`, through a grammar set in
    place of the request's own (the Responses and Anthropic bodies carry none)."""

    def set_text(text: str) -> None:
        grammar = Constraint("gbnf", f"root ::= {json.dumps(text)}")
        monkeypatch.setattr(pipeline, "request_constraint", lambda body: grammar)

    return set_text


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
    return [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]


def test_responses_api_reasoning_item(url: str, force: Any) -> None:
    force(HARMONY)
    body: dict[str, Any] = {"input": "hi", "model": "gpt-oss", "temperature": 0.0,
                            "max_output_tokens": 400, "reasoning": {"effort": "low"}}  # fmt: skip
    out = httpx.post(url + "/v1/responses", json=body, timeout=120).json()
    reasoning, message = out["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert message["type"] == "message" and message["content"][0]["text"] == ANSWER
    events = _events(httpx.post(url + "/v1/responses", json=body | {"stream": True}, timeout=120))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, text) == (THOUGHT, ANSWER)
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    done = events[-1]["response"]["output"]
    assert [o["type"] for o in done] == ["reasoning", "message"]
    assert done[1]["content"][0]["text"] == ANSWER
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")


def test_anthropic_thinking_and_tool_use(url: str, force: Any) -> None:
    force(HARMONY)
    body: dict[str, Any] = {"model": "gpt-oss", "max_tokens": 400, "messages": CHAT,
                            "temperature": 0.0}  # fmt: skip
    out = httpx.post(url + "/v1/messages", json=body, timeout=120).json()
    assert out["content"] == [
        {"type": "thinking", "thinking": THOUGHT, "signature": ""},
        {"type": "text", "text": ANSWER},
    ]
    events = _events(httpx.post(url + "/v1/messages", json=body | {"stream": True}, timeout=120))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == THOUGHT
    assert "".join(d.get("text", "") for d in deltas) == ANSWER
    assert any(d["type"] == "signature_delta" for d in deltas)
    # a call: its analysis a thinking block, the call a tool_use block
    force(CALL)
    fn = TOOLS[0]["function"]  # (gpt-oss's template reads every tool's description)
    tools = [
        {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
    ]
    r = httpx.post(url + "/v1/messages", json=body | {"tools": tools}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    kinds = [b["type"] for b in out["content"]]
    assert kinds == ["thinking", "tool_use"] and out["stop_reason"] == "tool_use"
    assert out["content"][1]["input"] == {"city": "Oslo"}


def test_history_reasoning_and_effort_reach_the_template(url: str) -> None:
    """An assistant turn's reasoning_content (and an Anthropic thinking block) reaches gpt-oss's
    template as its `thinking`; reasoning_effort its system message."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = CHAT + [
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    body = {"messages": messages, "tools": TOOLS, "reasoning_effort": "low"}
    r = httpx.post(url + "/apply-template", json=body, timeout=60)
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "Reasoning: low" in prompt
    assert "<|channel|>analysis<|message|>Use the tool.<|end|>" in prompt
    assert '<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>' in prompt
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    r = httpx.post(url + "/apply-template", json=body | kwargs, timeout=60)
    assert "Reasoning: high" in r.json()["prompt"]  # (the kwargs go over the field)
    bare = [{"type": "function", "function": {"name": "f"}}]  # no description, no parameters
    r = httpx.post(url + "/apply-template", json=body | {"tools": bare}, timeout=60)
    assert r.status_code == 200, r.text
    assert "type f = () => any;" in r.json()["prompt"]
    thinking = [{"type": "thinking", "thinking": "Think first.", "signature": ""},
                {"type": "text", "text": "Hi."}]  # fmt: skip
    anthropic = {"messages": [*CHAT, {"role": "assistant", "content": thinking}, *CHAT]}
    n = httpx.post(url + "/v1/messages/count_tokens", json=anthropic, timeout=60)
    assert n.status_code == 200, n.text
