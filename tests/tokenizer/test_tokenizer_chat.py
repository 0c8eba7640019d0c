"""Chat template rendering: SmolLM2's own template and llama.cpp's ChatML fallback against the
golden prompts, and the HF-compatible Jinja environment."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from graftlm.tokenizer import ChatTemplateError, Tokenizer, chatml, render_chat

GOLDEN = Path(__file__).resolve().parents[2] / ".." / "shared" / "golden"
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", re.DOTALL)
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _chat_cases(model: str) -> list[dict[str, Any]]:
    path = GOLDEN / f"{model}_generate.json"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    cases = [c for c in json.loads(path.read_text(encoding="utf-8"))["cases"] if c["chat"]]
    assert cases, f"{path} has no chat case"
    return cases


def _messages(prompt_text: str) -> list[dict[str, str]]:
    """The conversation a ChatML-shaped golden prompt was rendered from."""
    return [{"role": r, "content": c} for r, c in _TURN.findall(prompt_text)]


@pytest.mark.real
def test_smollm2_template_reproduces_golden_prompts(
    smollm2_meta: dict[str, Any], smollm2_tok: Tokenizer
) -> None:
    template = smollm2_meta["tokenizer.chat_template"]
    for case in _chat_cases("smollm2"):
        messages = _messages(case["prompt_text"])
        # The golden prompts carry the template's default system turn: the request had none.
        assert messages[0] == {"role": "system", "content": SMOLLM2_DEFAULT_SYSTEM}
        user_only = messages[1:]
        text = render_chat(template, user_only, add_generation_prompt=True)
        assert text == case["prompt_text"], case["name"]
        # An explicit system message renders the same text.
        assert render_chat(template, messages) == case["prompt_text"]
        ids = smollm2_tok.encode(text, add_special=True, parse_special=True)
        assert ids == case["prompt_ids"], case["name"]


@pytest.mark.real
def test_gemma3_chatml_fallback_reproduces_golden_prompts(
    gemma3_meta: dict[str, Any], gemma3_tok: Tokenizer
) -> None:
    template = gemma3_meta.get("tokenizer.chat_template")
    assert template is None  # why llama.cpp falls back to ChatML for this file
    for case in _chat_cases("gemma3"):
        text = render_chat(template, _messages(case["prompt_text"]), add_generation_prompt=True)
        assert text == case["prompt_text"], case["name"]
        ids = gemma3_tok.encode(text, add_special=True, parse_special=True)
        assert ids == case["prompt_ids"], case["name"]


def test_chatml_fallback_text() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nab<|im_end|>\n"
    )
    assert render_chat(None, messages, add_generation_prompt=False) == expected
    assert chatml(messages) == expected + "<|im_start|>assistant\n"


def test_hf_environment_conventions() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m.role == 'tool' %}{% continue %}{% endif %}\n"
        "  [{{ m.role }}] {{ m.content | tojson }}\n"
        "{% endfor %}{% if add_generation_prompt %}{{ greeting }}{% endif %}{{ eos_token }}"
    )
    messages = [
        {"role": "user", "content": "héllo"},
        {"role": "tool", "content": "x"},
        {"role": "assistant", "content": "ok"},
    ]
    out = render_chat(template, messages, True, bos_token="<s>", eos_token="</s>", greeting="go")
    # trim_blocks + lstrip_blocks remove the block lines' own whitespace, as in HF.
    assert out == '<s>  [user] "héllo"\n  [assistant] "ok"\ngo</s>'


def test_strftime_now_and_raise_exception() -> None:
    assert re.fullmatch(r"\d{4}", render_chat("{{ strftime_now('%Y') }}", []))
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        render_chat(template, [{"role": "assistant", "content": "x"}])


def test_sandbox_refuses_unsafe_templates() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat("{{ ''.__class__.__mro__ }}", [])
    with pytest.raises(ChatTemplateError):
        render_chat("{% set xs = [] %}{{ xs.append(1) }}", [])
    with pytest.raises(ChatTemplateError, match="compile"):
        render_chat("{% for %}", [])
