"""A chat answer split into reasoning, content and tool calls, as llama-server's chat parser
splits it (its `--reasoning-format` and a request's `reasoning_format`), piece by piece as it
streams, or whole.

Two ways models keep their reasoning apart, chosen by the chat template (`answer_syntax`):

- "think" (Qwen3, QwQ, DeepSeek-R1, ...): the answer starts with `<think>...</think>`; a template
  whose generation prompt ends in `<think>` (R1's) leaves the answer inside it from the start.
  What follows is content, split into content and calls by `runtime/tools.py`'s parser.
- "harmony" (gpt-oss): messages `<|channel|>NAME<|message|>TEXT<|end|>`, each after
  `<|start|>assistant` but the first. The `analysis` channel is reasoning; `final`, and
  `commentary` without a recipient (a preamble), are content; a message to
  `to=functions.NAME` (in the header, before or after its channel) is a call whose arguments are
  its text; its end, `<|call|>`, ends the generation. An unknown channel's text is content, text
  outside any message is content (an answer a grammar held to plain JSON comes through whole), a
  header cut off is dropped; a call's arguments that are not JSON stay as the model wrote them
  (OpenAI's own rule: a client checks them), so no answer is ever refused here.

The reasoning formats (llama-server's names): "auto" and "deepseek" put the reasoning in
`reasoning_content`; "deepseek-legacy" keeps it in the content too, between `<think>` tags (in a
stream only there, as llama-server streams it); "none" parses nothing: a `<think>` answer is
content as written, and a harmony answer's analysis stays in the content with its own tags
(llama-server's output). Pure Python: no tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, get_args

from graftlm.runtime.tools import ToolCall, ToolCallParser, new_call_id, partial_suffix

ReasoningFormat = Literal["none", "deepseek", "deepseek-legacy", "auto"]
REASONING_FORMATS: tuple[str, ...] = get_args(ReasoningFormat)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
# a message's text ends at its end marker, or where the next message's header begins
_STOPS = (END, CALL, RETURN, START, CHANNEL)
_HEADS = (START, CHANNEL, "to=", " to=")  # how a harmony header may begin
MAX_HEADER = 1024  # characters of a header without its <|message|>: not a header after all
_RECIPIENT = re.compile(r"(?:^|\s)to=(?:functions\.)?([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z0-9_-]*)")


def answer_syntax(template: str | None) -> str | None:
    """How a chat template's model writes its reasoning: "harmony", "think", or None (it does
    not: the answer is content as it is)."""
    if template is None:
        return None
    if CHANNEL in template and MESSAGE in template:
        return "harmony"
    if THINK_OPEN in template or THINK_CLOSE in template:
        return "think"
    return None


def thinking_forced_open(prompt: str) -> bool:
    """Whether the rendered prompt leaves the answer inside a `<think>` block (R1's templates
    end the generation prompt with it)."""
    return prompt.rstrip().endswith(THINK_OPEN)


@dataclass
class Parts:
    """What a piece (or a whole answer) comes to."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: Parts) -> Parts:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class _Sink:
    """The reasoning format applied: where reasoning text goes, and its tags in the content."""

    def __init__(self, fmt: str, stream: bool) -> None:
        self.to_field = fmt in ("auto", "deepseek") or (fmt == "deepseek-legacy" and not stream)
        self.legacy = fmt == "deepseek-legacy"
        self.raw = fmt == "none"  # (harmony only: "none" on a <think> answer parses nothing)
        self.out = Parts()

    def open(self, tag: str) -> None:
        if self.legacy:
            self.out.content += THINK_OPEN
        elif self.raw:
            self.out.content += tag

    def reasoning(self, text: str) -> None:
        if self.to_field:
            self.out.reasoning += text
        if self.legacy or self.raw:
            self.out.content += text

    def close(self, tag: str) -> None:
        if self.legacy:
            self.out.content += THINK_CLOSE
        elif self.raw:
            self.out.content += tag

    def take(self) -> Parts:
        out, self.out = self.out, Parts()
        return out


class AnswerParser:
    """One choice's text split into reasoning, content and calls. `feed` returns what a piece
    releases; text that may still turn out to be a tag or a call is held back until it is
    known; `finish` releases the rest. `tools`: the tool format when calls are parsed (None:
    none are); `forced_open`: the answer starts inside a <think> block."""

    def __init__(
        self,
        syntax: str | None,
        reasoning_format: str = "auto",
        tools: str | None = None,
        forced_open: bool = False,
        stream: bool = False,
    ) -> None:
        if syntax == "think" and reasoning_format == "none":
            syntax = None  # nothing parsed: the <think> block is content as written
        self.syntax = syntax
        self.sink = _Sink(reasoning_format, stream)
        # calls in the content (every syntax but harmony's, which writes calls as messages)
        self.tool_parser = ToolCallParser(tools) if tools and syntax != "harmony" else None
        self.parse_calls = tools is not None
        self.calls: list[ToolCall] = []
        self._buf = ""
        if syntax == "think":
            self._state = "think" if forced_open else "start"
            self._started = False  # (the think block's leading whitespace dropped)
            if forced_open:
                self.sink.open(THINK_OPEN)
        else:
            self._state = "header"
            self._channel = ""
            self._recipient: str | None = None
            self._seen_message = False

    # -- the one interface --
    def feed(self, text: str, last: bool = False) -> Parts:
        """What `text` releases; `last`: the answer's final piece, then `finish`'s rest too."""
        self._buf += text
        if self.syntax == "think":
            self._think(final=False)
        elif self.syntax == "harmony":
            self._harmony(final=False)
        else:
            self._content(self._buf)
            self._buf = ""
        out = self._take()
        if last:
            out += self.finish()
        return out

    def finish(self) -> Parts:
        if self.syntax == "think":
            self._think(final=True)
        elif self.syntax == "harmony":
            self._harmony(final=True)
        else:
            self._content(self._buf)
            self._buf = ""
        if self.tool_parser is not None:
            content, calls = self.tool_parser.finish()
            self.sink.out.content += content
            self.sink.out.calls += calls
        return self._take()

    def _take(self) -> Parts:
        out = self.sink.take()
        self.calls += out.calls
        return out

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.tool_parser is None:
            self.sink.out.content += text
            return
        content, calls = self.tool_parser.feed(text)
        self.sink.out.content += content
        self.sink.out.calls += calls

    # -- <think>...</think> --
    def _think(self, final: bool) -> None:
        if self._state == "start":
            head = self._buf.lstrip()
            if not head:
                if final:
                    self._state = "content"
                else:
                    return
            elif head.startswith(THINK_OPEN):
                self._buf = head[len(THINK_OPEN) :]
                self._state = "think"
                self.sink.open(THINK_OPEN)
            elif THINK_OPEN.startswith(head) and not final:
                return  # may still be the tag
            else:
                self._state = "content"
        if self._state == "think":
            if not self._started:  # the reasoning's leading whitespace dropped
                self._buf = self._buf.lstrip()
                self._started = bool(self._buf)
            end = self._buf.find(THINK_CLOSE)
            if end >= 0:
                self.sink.reasoning(self._buf[:end].rstrip())
                self.sink.close(THINK_CLOSE)
                self._buf = self._buf[end + len(THINK_CLOSE) :].lstrip()
                self._state = "after"
            elif final:  # cut off inside the block (max_tokens): reasoning all the same
                self.sink.reasoning(self._buf.rstrip())
                self.sink.close(THINK_CLOSE)
                self._buf = ""
                return
            else:
                # held: a partial closing tag, and trailing whitespace (dropped at the tag)
                keep = partial_suffix(self._buf, THINK_CLOSE)
                body = self._buf[: len(self._buf) - keep]
                ready = body.rstrip()
                self.sink.reasoning(ready)
                self._buf = self._buf[len(ready) :]
                return
        if self._state == "after":  # the content's leading whitespace dropped
            self._buf = self._buf.lstrip()
            if not self._buf:
                return
            self._state = "content"
        self._content(self._buf)
        self._buf = ""

    # -- harmony --
    def _harmony(self, final: bool) -> None:
        while True:
            if self._state == "header":
                if not self._harmony_header(final):
                    return
            elif not self._harmony_body(final):
                return

    def _harmony_header(self, final: bool) -> bool:
        """Reads a header up to its <|message|>; False when it needs more text."""
        buf = self._buf
        head = buf.lstrip()
        if not head:
            if final:
                self._buf = ""
            return False
        if not any(head.startswith(h) for h in _HEADS):
            if any(h.startswith(head) for h in _HEADS) and not final:
                return False  # may still begin a header
            self._buf = head if self._seen_message else buf
            self._begin_body("", "text", None)  # text outside any message: content
            return True
        at = head.find(MESSAGE)
        # a message's end, or a second start, before the <|message|>: a malformed header,
        # dropped up to there
        bad = [(i, m) for m in (END, CALL, RETURN) if (i := head.find(m)) >= 0]
        if (i := head.find(START, 1)) >= 0:
            bad.append((i, ""))
        if bad and (at < 0 or min(bad)[0] < at):
            cut, marker = min(bad)
            self._buf = head[cut + len(marker) :]
            return True
        if at < 0:
            if final or len(head) > MAX_HEADER:  # cut off, or not a header: dropped
                self._buf = ""
            return False
        header = head[:at]
        self._buf = head[at + len(MESSAGE) :]
        m = _CHANNEL_NAME.search(header)
        channel = m.group(1) if m else ""
        r = _RECIPIENT.search(header.replace(CONSTRAIN, " "))
        recipient = r.group(1) if r else None
        self._begin_body(header, channel, recipient)
        return True

    def _begin_body(self, header: str, channel: str, recipient: str | None) -> None:
        self._state = "body"
        self._channel, self._recipient = channel, recipient
        self._seen_message = True
        self._args = ""  # a call's arguments, gathered to its end
        if channel == "analysis" and recipient is None:
            self.sink.open(header.lstrip().removeprefix(START).removeprefix("assistant") + MESSAGE)

    def _harmony_body(self, final: bool) -> bool:
        """Reads a message's text up to its end; False when it needs more text."""
        buf = self._buf
        ends = [(buf.find(s), s) for s in _STOPS]
        hits = [(i, s) for i, s in ends if i >= 0]
        if hits:
            cut, stop = min(hits)
            text, closed = buf[:cut], True
            self._buf = buf[cut + len(stop) :] if stop in (END, CALL, RETURN) else buf[cut:]
        elif final:
            text, closed, stop = buf, False, ""
            self._buf = ""
        else:  # all but a possible start of a marker
            keep = max(partial_suffix(buf, s) for s in _STOPS)
            text = buf[: len(buf) - keep]
            self._buf = buf[len(buf) - keep :]
            self._body_text(text)
            return False
        self._body_text(text)
        self._end_body(stop if closed else "")
        return True

    def _body_text(self, text: str) -> None:
        if not text:
            return
        if self._recipient is not None:
            self._args += text
        elif self._channel == "analysis":
            self.sink.reasoning(text)
        else:  # final, a commentary preamble, an unknown channel, text outside messages
            self._content(text)

    def _end_body(self, stop: str) -> None:
        if self._recipient is not None:
            if self.parse_calls:
                args = self._args.strip() or "{}"
                self.sink.out.calls.append(ToolCall(self._recipient, args, new_call_id()))
        elif self._channel == "analysis":
            self.sink.close(stop if stop in (END, CALL, RETURN) else "")
        self._state = "header"


def parse_answer(
    text: str,
    syntax: str | None,
    reasoning_format: str = "auto",
    tools: str | None = None,
    forced_open: bool = False,
) -> Parts:
    """A whole answer split (not streamed)."""
    return AnswerParser(syntax, reasoning_format, tools, forced_open).feed(text, last=True)


class ChatReply(str):
    """A chat answer: the string is its content; `reasoning` what the model reasoned apart from it
    (gpt-oss's analysis channel, a `<think>` block; "" where it wrote none, or where the
    reasoning format keeps it in the content). Streamed, each piece is one of these: its content
    and its reasoning since the last piece, either of them possibly empty."""

    reasoning: str

    def __new__(cls, content: str = "", reasoning: str = "") -> ChatReply:
        reply = super().__new__(cls, content)
        reply.reasoning = reasoning
        return reply

    def __reduce__(self) -> tuple[type[ChatReply], tuple[str, str]]:
        return ChatReply, (str(self), self.reasoning)


def split_pieces(pieces: Iterator[str], parser: AnswerParser) -> Iterator[ChatReply]:
    """A generation's text pieces as the parser splits them; closed early, it closes the
    generation (which releases its sequence)."""
    try:
        for piece in pieces:
            parts = parser.feed(piece)
            if parts.content or parts.reasoning:
                yield ChatReply(parts.content, parts.reasoning)
        parts = parser.finish()
        if parts.content or parts.reasoning:
            yield ChatReply(parts.content, parts.reasoning)
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
