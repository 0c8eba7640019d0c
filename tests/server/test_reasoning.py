"""The answer parser of runtime/reasoning.py on hand-written answers: gpt-oss's harmony messages
(analysis to reasoning, final to content, messages to functions to calls), `<think>` blocks,
each reasoning format, every split of a streamed answer (tags cut across pieces), and malformed
answers (missing ends, unknown channels, arguments that are not JSON, plain text), which all
come to an answer, never an error. And the template side: which templates write reasoning,
gpt-oss's template rendering reasoning and calls back, the harmony tool grammar compiling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graftlm.runtime.reasoning import (
    AnswerParser,
    Parts,
    answer_syntax,
    parse_answer,
    thinking_forced_open,
)
from graftlm.runtime.tools import tool_constraint
from graftlm.server.chat import harmony_messages
from graftlm.tokenizer.chat import render_chat
from graftlm.tokenizer.templates import BUILTIN, tool_format

GPT_OSS = (Path(__file__).parent / "gpt_oss_chat_template.jinja").read_text()
QWEN3_LIKE = "{% for m in messages %}{{ m.content }}{% endfor %}<think>\n\n</think>"

ANALYSIS = "<|channel|>analysis<|message|>The user greets. Reply.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello there!"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo", "days": 3}'
)
CALL_IN_ROLE = (
    '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}'
)
SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>")


def _streamed(text: str, cuts: list[int], *args: object, **kwargs: object) -> Parts:
    p = AnswerParser(*args, stream=True, **kwargs)  # type: ignore[arg-type]
    out = Parts()
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        out += p.feed(text[a:b])
    out += p.finish()
    assert len(p.calls) == len(out.calls)
    return out


def _same(a: Parts, b: Parts) -> None:
    assert (a.reasoning, a.content) == (b.reasoning, b.content)
    assert [(c.name, c.arguments) for c in a.calls] == [(c.name, c.arguments) for c in b.calls]


# -- harmony --
def test_analysis_is_reasoning_and_final_is_content() -> None:
    out = parse_answer(ANALYSIS + FINAL, "harmony")
    assert (out.reasoning, out.content, out.calls) == (
        "The user greets. Reply.",
        "Hello there!",
        [],
    )
    # the ends a generation stops on (rendered where end tokens are not hidden) end it too
    _same(parse_answer(ANALYSIS + FINAL + "<|return|>", "harmony"), out)
    _same(parse_answer(ANALYSIS + FINAL + "<|end|>", "harmony"), out)


@pytest.mark.parametrize(
    "fmt,stream,reasoning,content",
    [
        ("auto", False, "R.", "Hi"),
        ("deepseek", True, "R.", "Hi"),
        ("deepseek-legacy", False, "R.", "<think>R.</think>Hi"),
        ("deepseek-legacy", True, "", "<think>R.</think>Hi"),  # as llama-server streams it
        ("none", False, "", "<|channel|>analysis<|message|>R.<|end|>Hi"),  # (its own output)
    ],
)
def test_reasoning_formats(fmt: str, stream: bool, reasoning: str, content: str) -> None:
    text = "<|channel|>analysis<|message|>R.<|end|><|start|>assistant<|channel|>final<|message|>Hi"
    if stream:
        out = _streamed(text, [5, 40], "harmony", fmt)
    else:
        out = parse_answer(text, "harmony", fmt)
    assert (out.reasoning, out.content) == (reasoning, content)


@pytest.mark.parametrize("text", [ANALYSIS + FINAL, ANALYSIS + CALL, CALL_IN_ROLE, ANALYSIS])
def test_every_split_gives_the_whole_answer(text: str) -> None:
    """Streamed in two pieces cut at every point (a tag cut anywhere) and a character at a
    time: the same reasoning, content and calls as whole, and never a tag in them."""
    whole = parse_answer(text, "harmony", tools="harmony")
    for cut in range(len(text) + 1):
        _same(_streamed(text, [cut], "harmony", tools="harmony"), whole)
    _same(_streamed(text, list(range(1, len(text))), "harmony", tools="harmony"), whole)
    for s in SPECIALS:
        assert s not in whole.reasoning + whole.content


def test_calls_in_both_header_orders() -> None:
    out = parse_answer(ANALYSIS + CALL, "harmony", tools="harmony")
    (call,) = out.calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo", "days": 3})
    assert out.reasoning == "The user greets. Reply." and out.content == ""
    assert call.id.startswith("call_")
    (call,) = parse_answer(CALL_IN_ROLE + "<|call|>", "harmony", tools="harmony").calls
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})
    # a preamble on the commentary channel is content, the call after it a call
    pre = "<|channel|>commentary<|message|>Checking.<|end|>" + CALL
    out = parse_answer(pre, "harmony", tools="harmony")
    assert out.content == "Checking." and [c.name for c in out.calls] == ["get_weather"]
    # two calls, each its own message
    out = parse_answer(CALL + "<|call|>" + CALL_IN_ROLE, "harmony", tools="harmony")
    assert [c.name for c in out.calls] == ["get_weather", "add"]


def test_no_tools_no_calls() -> None:
    """Without tools (or with tool_choice none) a message to a function is no call, and its
    arguments are not content either (llama-server drops them too)."""
    out = parse_answer(ANALYSIS + CALL, "harmony")
    assert out.calls == [] and out.content == "" and out.reasoning


def test_arguments_that_are_not_json_stay_as_written() -> None:
    """OpenAI's rule: arguments are the model's text, which the client checks."""
    text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{city: Oslo"
    (call,) = parse_answer(text, "harmony", tools="harmony").calls
    assert (call.name, call.arguments) == ("f", "{city: Oslo")
    (call,) = parse_answer(
        text.split("<|message|>")[0] + "<|message|>", "harmony", tools="harmony"
    ).calls
    assert call.arguments == "{}"  # cut off before any argument


@pytest.mark.parametrize(
    "text,reasoning,content",
    [
        ("<|channel|>analysis<|message|>cut off", "cut off", ""),  # max_tokens in the analysis
        ("<|channel|>final<|message|>no end", "", "no end"),
        (
            "<|channel|>final<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b",
            "",
            "ab",
        ),
        ("<|channel|>weird<|message|>odd channel<|end|>", "", "odd channel"),  # unknown: content
        ('{"answer": 42}', "", '{"answer": 42}'),  # a grammar held it to plain JSON
        ("  plain text <b>bold</b> a<|b", "", "  plain text <b>bold</b> a<|b"),
        ("<|channel|>analysis<|end|>" + FINAL, "", "Hello there!"),  # a broken header: dropped
        ("<|channel|>analys", "", ""),  # a header cut off: nothing to show
        ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b", "a", "b"),  # no <|end|>
        (ANALYSIS + "\n" + FINAL, "The user greets. Reply.", "Hello there!"),
        ("", "", ""),
    ],
)
def test_malformed_answers_come_to_an_answer(text: str, reasoning: str, content: str) -> None:
    out = parse_answer(text, "harmony", tools="harmony")
    assert (out.reasoning, out.content, out.calls) == (reasoning, content, [])
    for cut in range(len(text) + 1):
        _same(_streamed(text, [cut], "harmony", tools="harmony"), out)


# -- <think> --
@pytest.mark.parametrize(
    "text,fmt,forced,reasoning,content",
    [
        ("<think>\nhmm\n</think>\n\nThe answer.", "auto", False, "hmm", "The answer."),
        ("\n<think>hmm</think>ok", "deepseek", False, "hmm", "ok"),
        ("hmm\n</think>\n\nok", "auto", True, "hmm", "ok"),  # R1: the prompt opened it
        ("<think>\nhmm still", "auto", False, "hmm still", ""),  # cut off inside
        ("No thinking here.", "auto", False, "", "No thinking here."),
        ("<thinking>x", "auto", False, "", "<thinking>x"),
        ("<think>\nhmm\n</think>\n\nok", "none", False, "", "<think>\nhmm\n</think>\n\nok"),
        ("<think>\nhmm\n</think>\n\nok", "deepseek-legacy", False, "hmm", "<think>hmm</think>ok"),
    ],
)
def test_think_blocks(text: str, fmt: str, forced: bool, reasoning: str, content: str) -> None:
    out = parse_answer(text, "think", fmt, forced_open=forced)
    assert (out.reasoning, out.content) == (reasoning, content)
    for cut in range(len(text) + 1):
        streamed = _streamed(text, [cut], "think", fmt, forced_open=forced)
        if fmt != "deepseek-legacy":  # (legacy streams its reasoning in the content only)
            _same(streamed, out)


def test_think_then_hermes_calls() -> None:
    text = '<think>call it</think>\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    out = parse_answer(text, "think", tools="hermes")
    assert out.reasoning == "call it" and out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", {"x": 1})]


def test_no_syntax_is_the_text_as_it_is() -> None:
    text = "<think>not parsed</think><|channel|>x"
    assert parse_answer(text, None) == Parts(content=text)


# -- the template side --
def test_which_templates_write_reasoning() -> None:
    assert answer_syntax(GPT_OSS) == "harmony" and tool_format(GPT_OSS) == "harmony"
    assert answer_syntax(QWEN3_LIKE) == "think"
    assert answer_syntax(BUILTIN["chatml"]) is None and answer_syntax(None) is None
    assert thinking_forced_open("<|im_start|>assistant\n<think>\n")
    assert not thinking_forced_open("<think>\n\n</think>\n\n")


def test_gpt_oss_template_renders_reasoning_and_calls_back() -> None:
    """An assistant turn's reasoning_content is the template's `thinking` (llama.cpp's
    adjustment): kept before a call that no final answer follows; the call and its result
    rendered as harmony messages; reasoning_effort read."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "w",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    text = render_chat(GPT_OSS, harmony_messages(messages), tools=tools, reasoning_effort="high")
    assert "Reasoning: high" in text
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>" in text
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
        in text
    )
    assert (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        in text
    )
    assert text.endswith("<|start|>assistant")
    # reasoning and content on a call: the template refuses both, so the content goes
    both = harmony_messages([dict(messages[1], content="also this")])
    assert "content" not in both[0] and both[0]["thinking"] == "Need the tool."


def test_harmony_tool_grammar_compiles() -> None:
    llguidance = pytest.importorskip("llguidance")
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
         "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "g"}},
    ]  # fmt: skip
    for only in (None, "g"):
        c = tool_constraint(tools, only, "harmony")
        assert "to=functions.g <|constrain|>json<|message|>" in c.text
        assert ("to=functions.f" in c.text) == (only is None)
        err = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", c.text))
        assert not err, err


def test_serve_flags() -> None:
    """llama-server's --reasoning-format and --reasoning-effort are taken (no "no effect"
    note), the effort a template variable every chat gets."""
    from graftlm.cli import build_parser
    from graftlm.commands.llama_server_flags import llama_server_notes
    from graftlm.commands.serve import chat_template_kwargs

    p = build_parser()
    a = p.parse_args(["serve"])
    assert a.reasoning_format == "auto" and chat_template_kwargs(a) == {}
    a = p.parse_args("serve --reasoning-format none --reasoning-effort high -rea off".split())
    assert a.reasoning_format == "none" and llama_server_notes(a) == []
    assert chat_template_kwargs(a) == {"enable_thinking": False, "reasoning_effort": "high"}
    with pytest.raises(SystemExit):
        p.parse_args("serve --reasoning-format think".split())
