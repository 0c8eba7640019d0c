"""The built-in chat templates (`--chat-template NAME`) and the tools they render."""

from __future__ import annotations

from pathlib import Path

import pytest

import graftlm
from graftlm.errors import GraftError
from graftlm.tokenizer import render_chat
from graftlm.tokenizer.templates import BUILTIN, resolve_chat_template, supports_tools

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Weather?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
EXPECTED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    "Hello.<end_of_turn>\n<start_of_turn>user\nWeather?<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n"
    "<|user|>\nWeather?<|end|>\n<|assistant|>\n",
    "mistral": "<s>[INST] Be brief.\n\nHi [/INST] Hello.</s>[INST] Weather? [/INST]",
    # llama.cpp's named formats, as llama-chat.cpp writes them
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello.<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Weather?<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "llama2": "[INST] Be brief.\nHi [/INST]Hello.</s>[INST] Weather? [/INST]",
    "llama2-sys": "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello.</s>[INST] Weather? [/INST]",
    "mistral-v7": "[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST] Hi[/INST] Hello.</s>"
    "[INST] Weather?[/INST]",
    "phi4": "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>Hi<|im_end|>"
    "<|im_start|>assistant<|im_sep|>Hello.<|im_end|><|im_start|>user<|im_sep|>Weather?<|im_end|>"
    "<|im_start|>assistant<|im_sep|>",
    "zephyr": "<|system|>\nBe brief.<|endoftext|>\n<|user|>\nHi<|endoftext|>\n<|assistant|>\n"
    "Hello.<|endoftext|>\n<|user|>\nWeather?<|endoftext|>\n<|assistant|>\n",
    "falcon3": "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.\n<|user|>\nWeather?\n"
    "<|assistant|>\n",
    "granite": "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
    "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
    "<|start_of_role|>assistant<|end_of_role|>Hello.<|end_of_text|>\n"
    "<|start_of_role|>user<|end_of_role|>Weather?<|end_of_text|>\n"
    "<|start_of_role|>assistant<|end_of_role|>\n",
    "llama4": "<|header_start|>system<|header_end|>\n\nBe brief.<|eot|>"
    "<|header_start|>user<|header_end|>\n\nHi<|eot|>"
    "<|header_start|>assistant<|header_end|>\n\nHello.<|eot|>"
    "<|header_start|>user<|header_end|>\n\nWeather?<|eot|>"
    "<|header_start|>assistant<|header_end|>\n\n",
    "vicuna": "Be brief.\n\nUSER: Hi\nASSISTANT: Hello.</s>\nUSER: Weather?\nASSISTANT:",
    "deepseek3": "Be brief.\n\n<\uff5cUser\uff5c>Hi<\uff5cAssistant\uff5c>Hello."
    "<\uff5cend\u2581of\u2581sentence\uff5c><\uff5cUser\uff5c>Weather?<\uff5cAssistant\uff5c>",
}


@pytest.mark.parametrize("name", list(BUILTIN))
def test_builtin_templates_render_the_families_formats(name: str) -> None:
    text = render_chat(BUILTIN[name], CHAT, bos_token="<s>", eos_token="</s>")
    assert text == EXPECTED[name]


def test_chatml_renders_tools_calls_and_results_hermes_style() -> None:
    history = CHAT + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = render_chat(BUILTIN["chatml"], history, tools=TOOLS)
    assert "<tools>\n" + '{"type": "function"' in text and "get_weather" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    llama = render_chat(BUILTIN["llama3"], history, tools=TOOLS)
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in llama
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny" in llama
    assert supports_tools(BUILTIN["chatml"]) and not supports_tools(BUILTIN["gemma"])


def test_resolve_names_text_and_files(tmp_path: Path) -> None:
    assert resolve_chat_template("phi3") == BUILTIN["phi3"]
    assert resolve_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    f = tmp_path / "t.jinja"
    f.write_text("{{ 'x' }}")
    assert resolve_chat_template(file=f) == "{{ 'x' }}"
    with pytest.raises(GraftError, match="chatml, llama3, gemma, phi3, mistral, command-r"):
        resolve_chat_template("alpaca")
    with pytest.raises(GraftError, match="cannot be read"):
        resolve_chat_template(file=tmp_path / "missing")


@pytest.mark.real
def test_gemma3_chats_with_the_gemma_template(gemma3_file: Path) -> None:
    """The packaged gemma-3 file has no template: its family's (gemma) with no flag, another
    by name."""
    m = graftlm.load(gemma3_file, ctx_size=256)
    prompt = m.apply_chat_template([{"role": "user", "content": "Say hi"}])
    assert prompt.startswith("<bos><start_of_turn>user\n") and "<|im_" not in prompt
    assert prompt.endswith("<start_of_turn>model\n")
    named = graftlm.load(gemma3_file, ctx_size=256, chat_template="chatml")
    assert named.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|im_start|>")
    out = m.chat([{"role": "user", "content": "Say hi"}], max_tokens=12, temperature=0)
    assert "<|im_" not in str(out) and "<start_of_turn>" not in str(out)


def test_a_file_without_a_template_gets_its_familys(tiny_gemma3: Path, tiny_llama: Path) -> None:
    """gemma files chat in gemma's turns, phi3 in phi3's, llama files with Llama 3's header tokens
    in Llama 3's; the rest in llama.cpp's ChatML default."""
    from graftlm.gguf import GGUFFile
    from graftlm.tokenizer.templates import BUILTIN, family_template

    assert family_template(GGUFFile(tiny_gemma3)) == BUILTIN["gemma"]
    assert family_template(GGUFFile(tiny_llama)) is None
    m = graftlm.load(tiny_gemma3, ctx_size=64)
    assert m.apply_chat_template([{"role": "user", "content": "x"}]).endswith(
        "<start_of_turn>model\n"
    )


def test_templates_get_llama_cpps_context_variables() -> None:
    """llama.cpp's own templates read enable_thinking, date_string, datetime and functions
    without defaults: they are given (today's date), and a caller's values replace them."""
    import datetime as dt

    from graftlm.tokenizer.chat import render_chat

    t = (
        "{{ date_string }}|{{ datetime[:6] }}|{{ functions }}|"
        "{% if not enable_thinking %}</think>{% endif %}"
    )
    msgs = [{"role": "user", "content": "x"}]
    today = dt.date.today()
    out = render_chat(t, msgs)
    assert out == f"{today.strftime('%d %b %Y')}|{today.strftime('%b %d')}||"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert '"name": "f"' in render_chat(t, msgs, tools=tools)
    assert render_chat(t, msgs, enable_thinking=False).endswith("</think>")
    assert render_chat(t, msgs, date_string="1 Jan 2000").startswith("1 Jan 2000|")


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{{ 'x' * 1500000000 }}", "repetition"),
        ("{{ [0] * 10**9 }}", "repetition"),
        ("{{ 2 ** 100000 }}", "too large"),
        ("{{ range(10**12)|list }}", "Range too big"),
        ("{% for i in range(100000) %}{{ 'y' * 20 }}{% endfor %}", "output passed"),
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "2 s"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "a string of more than",
        ),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
            "a sum of more than",
        ),
    ],
)
def test_an_untrusted_template_is_bounded(template: str, words: str) -> None:
    """A template comes with the model file: a loop, a repetition or a doubling stops at the
    renderer's limits with a ChatTemplateError (a 400 in the server), never a hang or gigabytes."""
    from graftlm.tokenizer.chat import ChatTemplateError, render_chat

    with pytest.raises(ChatTemplateError, match=words):
        render_chat(template, [{"role": "user", "content": "hi"}])


def test_a_model_whose_template_runs_past_the_limits_is_refused_at_load(tiny_llama: Path) -> None:
    loop = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    with pytest.raises(graftlm.ModelFileError, match="chat template is refused.*2 s"):
        graftlm.load(tiny_llama, ctx_size=64, chat_template=loop)
    # a template that only rejects the load's conversation is left to the requests
    strict = "{{ raise_exception('system messages only') }}"
    m = graftlm.load(tiny_llama, ctx_size=64, chat_template=strict)
    with pytest.raises(GraftError, match="system messages only"):
        m.apply_chat_template([{"role": "user", "content": "x"}])
