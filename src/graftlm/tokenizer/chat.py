"""Chat templates: a GGUF's Jinja `tokenizer.chat_template`, rendered the way HF transformers
does, or llama.cpp's ChatML fallback when the file has none."""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from graftlm.errors import GraftError
from graftlm.tokenizer import template_bounds as bounds


class ChatTemplateError(GraftError, ValueError):
    """The template failed to compile, or raised while rendering (e.g. `raise_exception`)."""


class TemplateLimitError(ChatTemplateError):
    """The template ran past the renderer's limits (time, output, a string or list's size)."""


# the variables render_chat sets itself, which a caller's extra variables (a request's
# chat_template_kwargs, the server's --chat-template-kwargs) may not replace
TEMPLATE_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """`value` (extra template variables) when it names none of TEMPLATE_RESERVED; else a
    ValueError naming them."""
    bad = sorted(set(value or ()) & set(TEMPLATE_RESERVED))
    if bad:
        raise ValueError(f"{', '.join(bad)}: set by the request itself, not a template variable")
    return value


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) into prompt text.

    `template` is a Jinja chat template (HF conventions: `messages`, `add_generation_prompt`,
    `bos_token`, `eos_token` and any `extra` variables such as `tools`); None selects the ChatML
    text llama.cpp uses for a model without a template. The result is meant to be tokenized with
    `parse_special=True`. Raises ChatTemplateError when the template cannot be rendered."""
    if template is None:
        return chatml(messages, add_generation_prompt)
    compiled = _compile(template)
    variables = dict(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **(context(extra.get("tools")) | extra),
    )
    # A template comes with the model file: untrusted. It renders in Jinja's sandbox (ranges
    # up to MAX_RANGE), with `*` and `**` bounded (_Bounded), its output gathered piece by piece
    # under MAX_OUTPUT characters, and anything it raises a ChatTemplateError: a 400, not a
    # 500, and never gigabytes.
    limit = MAX_OUTPUT + sum(len(str(m.get("content") or "")) for m in messages)
    out: list[str] = []
    size = 0
    deadline = time.monotonic() + MAX_SECONDS
    memory, every = bounds.MemoryWatch(), [time.monotonic()]

    def clock(frame: Any, event: str, arg: Any) -> Any:  # a loop that never ends, ended
        now = time.monotonic()
        if now > deadline:
            raise TemplateLimitError(f"chat template ran past {MAX_SECONDS:g} s: refused")
        if now > every[0]:  # (and one that grows memory step by step)
            every[0] = now + 0.004
            memory.check()
        return clock

    before = sys.gettrace()
    _render.limit = limit
    sys.settrace(clock)
    try:
        for piece in compiled.generate(**variables):
            size += len(piece)
            if size > limit:
                raise TemplateLimitError(
                    f"chat template output passed {limit} characters (the messages' length "
                    f"and {MAX_OUTPUT} more): refused"
                )
            out.append(piece)
    except ChatTemplateError:
        raise
    except bounds.Bounded as exc:
        raise TemplateLimitError(f"chat template: {exc}: refused") from None
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except (OverflowError, MemoryError, RecursionError, TypeError, ValueError) as exc:
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # (an untrusted program: whatever its filters and methods raise)
        # Python's own words name its internals ('float' object has no attribute 'items')
        raise ChatTemplateError(
            f"chat template failed on this chat: {type(exc).__name__} in the template's code"
        ) from None
    finally:
        sys.settrace(before)
    return "".join(out)


def chatml(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """llama.cpp's LLM_CHAT_TEMPLATE_CHATML (`llm_chat_apply_template`), byte for byte."""
    parts = [
        f"<|im_start|>{m.get('role', '')}\n{_content_text(m.get('content'))}<|im_end|>\n"
        for m in messages
    ]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _content_text(content: Any) -> str:
    # llama.cpp receives plain strings; OpenAI-style lists of parts are joined by their text.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _raise_exception(message: str) -> NoReturn:
    if not isinstance(message, str):  # (a repr would show an address: `<... at 0x7f...>`)
        message = f"the chat template raised an error (with a {type(message).__name__})"
    raise ChatTemplateError(message)


def context(tools: Any = None) -> dict[str, Any]:
    """The variables llama.cpp gives every template beside the messages, which templates it
    ships read without a default: `enable_thinking` (true unless reasoning is off),
    `date_string` (Llama 3.x's "Today Date"), and FireFunction's `datetime` and `functions`
    (the tools as JSON). A caller's own values (chat_template_kwargs) replace them."""
    now = datetime.now()
    return {
        "enable_thinking": True,
        "date_string": now.strftime("%d %b %Y"),
        "datetime": now.strftime("%b %d %Y %H:%M:%S GMT"),
        "functions": json.dumps(tools, indent=2, ensure_ascii=False) if tools else "",
    }


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF overrides Jinja's tojson: no HTML escaping, unicode kept, same keyword arguments.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


MAX_OUTPUT = 1 << 20  # characters a template may add to the messages' own
MAX_SECONDS = 2.0  # a render's time (a chat template renders in milliseconds)
MAX_PRODUCT = 1 << 20  # items a `*` (string or list repetition) or `**` may make
_render = threading.local()  # .limit: the render's bound on a text (its output's)


def _text_limit() -> int:
    return int(getattr(_render, "limit", MAX_OUTPUT))


class _BoundedCode(CodeGenerator):
    """Jinja's code generator with `~` (concatenation) through the environment's
    `bounded_join`: a template that doubles a string in a loop is stopped at MAX_PRODUCT."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Bounded(ImmutableSandboxedEnvironment):
    """The sandbox with `*`, `**`, `+` and `~` checked before they run: `'x' * 1500000000`
    took a server past 4 GiB in seconds."""

    code_generator_class = _BoundedCode
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=self._finalize, **options)
        self.filters["tojson"] = _tojson
        bounds.bounded_filters(self.filters, _text_limit)

    @staticmethod
    def _finalize(value: Any) -> Any:  # every {{ value }}, before it becomes text
        bounds.check_text(value, _text_limit(), "a {{ value }}")
        return value

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        bounds.check_call(__obj, args, _text_limit())
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        inner = super().wrap_str_format(value)
        if inner is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            if is_map and len(args) == 1 and isinstance(args[0], dict):
                bounds.check_format(fmt, (), args[0], _text_limit())
            else:
                bounds.check_format(fmt, args, kwargs, _text_limit())
            return str(inner(*args, **kwargs))

        return checked

    @staticmethod
    def bounded_join(parts: tuple[Any, ...]) -> str:
        for p in parts:
            bounds.check_text(p, MAX_PRODUCT, "~")
        texts = [str(p) for p in parts]
        if sum(map(len, texts)) > MAX_PRODUCT:
            raise TemplateLimitError(f"chat template: a string of more than {MAX_PRODUCT}: refused")
        return "".join(texts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "%" and isinstance(left, str):
            bounds.check_printf(left, right, _text_limit())
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > MAX_PRODUCT:
                    raise TemplateLimitError(
                        f"chat template: a sum of more than {MAX_PRODUCT} items: refused"
                    )
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                if len(seq) * max(n, 0) > MAX_PRODUCT:
                    raise TemplateLimitError(
                        f"chat template: a repetition of {len(seq)} x {n} items passes "
                        f"{MAX_PRODUCT}: refused"
                    )
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 64:
                raise TemplateLimitError(f"chat template: {left} ** {right} is too large: refused")
        if operator in ("*", "**"):
            bounds.check_ints(operator, left, right)
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
