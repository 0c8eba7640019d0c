"""Tool calls in chat completions: the grammar that enforces `tool_choice`, and the parser that
finds calls in the model's text (as it streams, or whole).

Four formats, chosen by the chat template (`Prompter.tool_format`):

- "hermes" (Hermes, Qwen 2.5, the built-in `chatml`): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; text around calls is content.
- "llama3" (Llama 3.1's JSON form): the whole answer is one `{"name": ..., "parameters": {...}}`
  object, possibly after `<|python_tag|>`.
- "generic" (llama.cpp's, for a template that renders no tools): the whole answer is one JSON
  object, `{"tool_call": {"name": ..., "arguments": {...}}}` (or `"tool_calls": [...]`) or
  `{"response": "..."}`; a grammar holds every answer to that, whatever `tool_choice` says.
- "harmony" (gpt-oss): a call is a message to the function,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`; its answers are
  parsed by `runtime/reasoning.py`, which keeps their reasoning apart too.

`tool_choice` "required" or a named function becomes a grammar (exactly one call, to one of the
tools or to the named one, its arguments following the tool's JSON schema); "auto" leaves the
model free and parses what it writes. Pure Python: no tensors.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from graftlm.runtime.constraints import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out = {"index": index} | out
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_constraint(
    tools: list[dict[str, Any]],
    only: str | None,
    fmt: str,
    field: str = "tool_choice",
    answer: bool = False,
) -> Constraint:
    """The grammar of exactly one call: to the function `only`, or (None) to any of `tools`;
    `answer` (the generic format's tool_choice auto): or a `{"response": text}` instead."""
    args_key = "parameters" if fmt == "llama3" else "arguments"
    options = []
    harmony_options: list[tuple[str, dict[str, Any]]] = []  # (name, its arguments' schema)
    for t in tools:
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        params = closed(fn.get("parameters") or {"type": "object"})
        harmony_options.append((fn["name"], params))
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt == "generic":
        # closed: once its one key is written the object must end (open, a model went on adding
        # keys until max_tokens)
        call = {"type": "object", "properties": {"tool_call": schema}, "required": ["tool_call"],
                "additionalProperties": False}  # fmt: skip
        reply = {"type": "object", "properties": {"response": {"type": "string"}},
                 "required": ["response"], "additionalProperties": False}  # fmt: skip
        schema = {"anyOf": [call, reply]} if answer else call
    # no free whitespace (as for response_format): a sampled call cannot wander into newlines
    schema = schema | {"x-guidance": {"whitespace_flexible": False, "lenient": True}}
    if fmt == "harmony":  # gpt-oss: a message to the function on the commentary channel
        guidance = schema["x-guidance"]
        calls = [
            f'"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>" '
            f"%json {json.dumps(args | {'x-guidance': guidance})}"
            for name, args in harmony_options
        ]
        lark = "start: " + " | ".join(f"call{k}" for k in range(len(calls))) + "\n"
        lark += "".join(f"call{k}: {c}\n" for k, c in enumerate(calls))
    elif fmt in ("llama3", "generic"):
        lark = f"start: call\ncall: %json {json.dumps(schema)}"
    else:
        lark = f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}'
    return Constraint("lark", lark, field)


_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed(schema: Any) -> Any:
    """A tool's JSON schema with every object that lists its properties and says nothing of
    others closed to them (`additionalProperties: false`), as llama.cpp's grammar reads a tool's
    schema: JSON Schema's default (open) let a model append keys of its own to the arguments.
    Whatever the schema says itself stands; the caller's dict is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _MAPS:
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed(sub) for name, sub in schema[k].items()}
    for k in _ONE:
        if isinstance(schema.get(k), dict):
            out[k] = closed(schema[k])
    for k in _MANY:
        if isinstance(schema.get(k), list):
            out[k] = [closed(sub) for sub in schema[k]]
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _parse_call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return _call_of(obj)


def _call_of(obj: Any) -> ToolCall | None:
    """A call from its JSON object ({"name", "arguments" or "parameters"}), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


class ToolCallParser:
    """Splits a generation into content and tool calls, piece by piece. `feed` returns the
    content that can be released now and the calls completed; text that may still become a call
    is held back until it is known."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._buf = ""
        self._in_call = False
        self._decided = fmt != "llama3"  # llama3: is the answer a call? known at its first char
        self._json_answer = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self.fmt == "llama3":
            return self._feed_llama3()
        if self.fmt == "generic":  # one JSON object: known when it is whole
            return "", []
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
                self._in_call = False
                call = _parse_call(body.strip())
                if call is None:  # not a call after all: give the text back as it was
                    content += OPEN + body + CLOSE
                else:
                    calls.append(call)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                content += self._buf[:start]
                self._buf = self._buf[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = partial_suffix(self._buf, OPEN)  # may be the start of a tag
            content += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            break
        if calls and not self.calls:
            content = content.rstrip()  # the newline before a call is not an answer
        self.calls += calls
        return content, calls

    def _feed_llama3(self) -> tuple[str, list[ToolCall]]:
        if not self._decided:
            head = self._buf.lstrip()
            if not head:
                return "", []
            self._decided = True
            self._json_answer = head.startswith("{") or head.startswith(PYTHON_TAG[: len(head)])
        if self._json_answer:
            return "", []
        out, self._buf = self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest, at the end of the generation: held text is content unless it is a call."""
        rest, self._buf = self._buf, ""
        if self.fmt == "generic":
            return self._finish_generic(rest)
        if self.fmt == "llama3" and self._json_answer:
            body = rest.strip().removeprefix(PYTHON_TAG).strip()
            call = _parse_call(body)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return rest, []
        if self._in_call:  # a call cut off (max_tokens): it stays text
            self._in_call = False
            return OPEN + rest, []
        return rest, []

    def _finish_generic(self, text: str) -> tuple[str, list[ToolCall]]:
        """`{"response": text}` is content, `{"tool_call": ...}` / `{"tool_calls": [...]}`
        calls; anything else (an answer cut off by max_tokens) stays text."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if isinstance(obj, dict) and isinstance(obj.get("response"), str):
            return obj["response"], []
        raw = obj.get("tool_calls") if isinstance(obj, dict) else None
        if raw is None and isinstance(obj, dict) and "tool_call" in obj:
            raw = [obj["tool_call"]]
        calls = [_call_of(c) for c in raw or []]
        if not raw or any(c is None for c in calls):
            return text, []
        self.calls += [c for c in calls if c is not None]
        return "", [c for c in calls if c is not None]


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """A whole answer: its content (None-worthy when empty) and its calls."""
    p = ToolCallParser(fmt)
    content, calls = p.feed(text)
    tail, more = p.finish()
    return content + tail, calls + more
