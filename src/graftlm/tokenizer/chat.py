"""Chat templates: a GGUF's Jinja `tokenizer.chat_template`, rendered the way HF transformers
does, or llama.cpp's ChatML fallback when the file has none."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from graftlm.errors import GraftError


class ChatTemplateError(GraftError, ValueError):
    """The template failed to compile, or raised while rendering (e.g. `raise_exception`)."""


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
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **(context(extra.get("tools")) | extra),
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


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


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
