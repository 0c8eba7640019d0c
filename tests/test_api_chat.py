"""`Model.chat` and `graftlm run -cnv` on a model that reasons apart from its answer, as llama-cli
shows it: the answer is the content (a str) with the reasoning in `.reasoning`, streamed or
whole, under each reasoning format; the chat session shows the reasoning between [Start
thinking] and [End thinking] and keeps the answer alone. On the tiny gpt-oss reference with its
own chat template, its output forced by a grammar to hand-written harmony text, and on
hand-written `<think>` and harmony texts cut into pieces at every place."""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from made_families import made_dir

import graftlm
from graftlm.api import ChatReply, Model
from graftlm.commands.chat import ChatSession
from graftlm.errors import GraftError
from graftlm.runtime.reasoning import AnswerParser, split_pieces

TEMPLATE = (Path(__file__).parent / "server" / "gpt_oss_chat_template.jinja").read_text()
CHAT = [{"role": "user", "content": "hi"}]
THOUGHT, ANSWER = "Greet.", "Hi!"  # (short: each character is a token of the tiny vocabulary)
HARMONY = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"
)


def forced(text: str) -> dict[str, Any]:
    """Sampling that makes the model write exactly `text` (a GBNF literal)."""
    return {"grammar": f"root ::= {json.dumps(text)}", "temperature": 0.0, "max_tokens": 400}


@pytest.fixture(scope="module")
def gpt_oss() -> Model:
    folder = made_dir("gpt-oss")
    if folder is None:
        pytest.skip("the tiny gpt-oss reference cannot be made here (transformers, converter)")
    return graftlm.load(folder / "model-f32.gguf", ctx_size=2048, chat_template=TEMPLATE)


# -- Model.chat ------------------------------------------------------------------------------------
def test_chat_answer_is_the_content_with_the_reasoning_apart(gpt_oss: Model) -> None:
    reply = gpt_oss.chat(CHAT, **forced(HARMONY))
    assert isinstance(reply, ChatReply) and isinstance(reply, str)
    assert reply == ANSWER and reply.reasoning == THOUGHT
    assert str(reply) + "" == ANSWER  # a plain string wherever one is used
    back = pickle.loads(pickle.dumps(reply))
    assert back == ANSWER and back.reasoning == THOUGHT


def test_chat_streams_reasoning_then_content(gpt_oss: Model) -> None:
    pieces = list(gpt_oss.chat(CHAT, stream=True, **forced(HARMONY)))
    assert all(isinstance(p, ChatReply) for p in pieces)
    assert "".join(pieces) == ANSWER
    assert "".join(p.reasoning for p in pieces) == THOUGHT
    first_content = next(i for i, p in enumerate(pieces) if p)
    assert not any(p.reasoning for p in pieces[first_content:])  # reasoning comes first
    assert not any(p.reasoning and p for p in pieces)  # (harmony: one or the other a piece)


@pytest.mark.parametrize(
    ("fmt", "stream", "content", "reasoning"),
    [
        ("deepseek", False, ANSWER, THOUGHT),
        ("deepseek-legacy", False, f"<think>{THOUGHT}</think>{ANSWER}", THOUGHT),
        ("deepseek-legacy", True, f"<think>{THOUGHT}</think>{ANSWER}", ""),  # (as llama-server)
        # none: the analysis in the content with its own tags (llama-server's output)
        ("none", False, f"<|channel|>analysis<|message|>{THOUGHT}<|end|>{ANSWER}", ""),
        ("none", True, f"<|channel|>analysis<|message|>{THOUGHT}<|end|>{ANSWER}", ""),
    ],
)
def test_chat_reasoning_formats(
    gpt_oss: Model, fmt: str, stream: bool, content: str, reasoning: str
) -> None:
    out = gpt_oss.chat(CHAT, reasoning_format=fmt, stream=stream, **forced(HARMONY))
    pieces = list(out) if stream else [out]
    assert "".join(pieces) == content
    assert "".join(getattr(p, "reasoning", "") for p in pieces) == reasoning


def test_chat_refuses_an_unknown_reasoning_format(gpt_oss: Model) -> None:
    with pytest.raises(GraftError, match="reasoning_format must be one of"):
        gpt_oss.chat(CHAT, reasoning_format="hidden")


def test_chat_stopped_early_releases_its_sequence(gpt_oss: Model) -> None:
    stream = gpt_oss.chat(CHAT, stream=True, **forced(HARMONY))
    assert isinstance(stream, Iterator)
    next(stream)
    stream.close()
    assert not gpt_oss.engine.busy  # (the generation was cancelled, not left running)
    assert gpt_oss.chat(CHAT, **forced(HARMONY)) == ANSWER  # the one sequence is free again


# -- graftlm run -cnv ------------------------------------------------------------------------------
def test_chat_session_shows_reasoning_as_llama_cli_and_keeps_the_answer(gpt_oss: Model) -> None:
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(gpt_oss, forced(HARMONY), out=out, err=err)
    assert session.reply("hi") == ANSWER
    assert out.getvalue() == f"[Start thinking]\n{THOUGHT}\n[End thinking]\n\n{ANSWER}\n"
    assert session.messages[-1] == {"role": "assistant", "content": ANSWER}
    assert session.reply("again") == ANSWER  # the history (the answer alone) renders again
    assert "<|" not in out.getvalue()


def test_chat_session_reasoning_format_none_shows_the_text_as_written(gpt_oss: Model) -> None:
    out = io.StringIO()
    session = ChatSession(gpt_oss, forced(HARMONY), out=out, err=io.StringIO(),
                          reasoning_format="none")  # fmt: skip
    raw = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>{ANSWER}"
    assert session.reply("hi") == raw
    assert out.getvalue() == raw + "\n"
    assert "[Start thinking]" not in out.getvalue()


# -- hand-written texts, cut at every place --------------------------------------------------------
def _cuts(text: str) -> Iterator[list[str]]:
    yield [text]
    yield list(text)
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]


def _closing(pieces: list[str], closed: list[bool]) -> Iterator[str]:
    try:
        yield from pieces
    finally:
        closed.append(True)


THINK = "<think>\nThe user greets.\n</think>\n\nHello there."
CASES = [
    # (syntax, forced_open, fmt, text, content, reasoning)
    ("think", False, "auto", THINK, "Hello there.", "The user greets."),
    ("think", True, "auto", "The user greets.</think>Hello.", "Hello.", "The user greets."),
    ("think", False, "auto", "No thinking here.", "No thinking here.", ""),
    ("think", False, "none", THINK, THINK, ""),
    ("think", False, "deepseek-legacy", THINK, "<think>The user greets.</think>Hello there.", ""),
    ("think", False, "auto", "<think>cut off", "", "cut off"),  # max_tokens inside the block
    ("harmony", False, "auto", HARMONY, ANSWER, THOUGHT),
    ("harmony", False, "auto", "<|channel|>final<|message|>Only.", "Only.", ""),
    (None, False, "auto", "<think>a</think>b", "<think>a</think>b", ""),  # a model that does not
]


@pytest.mark.parametrize(("syntax", "forced_open", "fmt", "text", "content", "reasoning"), CASES)
def test_split_on_hand_written_texts(
    syntax: str | None, forced_open: bool, fmt: str, text: str, content: str, reasoning: str
) -> None:
    """What Model.chat streams: the same content and reasoning wherever the text is cut."""
    for pieces in _cuts(text):
        closed: list[bool] = []
        parser = AnswerParser(syntax, fmt, None, forced_open, stream=True)
        replies = list(split_pieces(_closing(pieces, closed), parser))
        assert all(isinstance(r, ChatReply) and (r or r.reasoning) for r in replies)
        assert "".join(replies) == content, pieces
        assert "".join(r.reasoning for r in replies) == reasoning, pieces
        assert closed == [True]


def test_split_closed_early_closes_the_generation() -> None:
    closed: list[bool] = []
    replies = split_pieces(_closing(list(THINK), closed), AnswerParser("think", stream=True))
    assert next(replies).reasoning
    replies.close()
    assert closed == [True]
