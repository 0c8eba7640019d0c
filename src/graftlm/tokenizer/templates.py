"""Built-in chat templates, chosen by name (llama-server's `--chat-template NAME`).

Each is a Jinja template in Hugging Face's conventions (`messages`, `add_generation_prompt`,
`bos_token`, `tools`), written from the model families' published formats. `chatml` and `llama3`
render `tools` and tool-call history: `chatml` in the Hermes / Qwen 2.5 form (tools listed in the
system turn, calls as `<tool_call>{json}</tool_call>`, results as `<tool_response>` in a user
turn), `llama3` in Llama 3.1's JSON form (a call is `{"name": ..., "parameters": ...}`, results
come back in an `ipython` turn). `gemma`, `phi3` and `mistral` take no tools, nor do the other
names of llama.cpp's (`command-r`, `llama2`, `llama2-sys`, `mistral-v7`, `phi4`, `zephyr`,
`falcon3`, `granite`, `llama4`, `vicuna`, `deepseek3`), which follow llama.cpp's own rules.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from graftlm.errors import GraftError
from graftlm.gguf import GGUFFile

CHATML = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}
{%- if tools %}
{%- set system = (system + '\\n\\n' if system else '') + 'Environment: ipython\\n\\nYou have access to the following functions. To call a function, respond with a JSON object of the form {"name": function name, "parameters": dictionary of argument name and its value}, and nothing else.\\n\\n' %}
{%- for tool in tools %}{%- set system = system + (tool | tojson(indent=4)) + '\\n\\n' %}{%- endfor %}
{%- endif %}
{%- if system %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system | trim + '<|eot_id|>' }}{%- endif %}
{%- for message in rest %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + fn.name + '", "parameters": ' + (fn.arguments | tojson) + '}<|eot_id|>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content or '') | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

GEMMA = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'system' %}{%- continue %}{%- endif %}
{%- set role = 'model' if message.role == 'assistant' else message.role %}
{%- set content = message.content or '' %}
{%- if loop.index0 == 1 and messages[0].role == 'system' %}{%- set content = messages[0].content + '\\n\\n' + content %}{%- endif %}
{{- '<start_of_turn>' + role + '\\n' + content | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}
"""

PHI3 = """\
{%- for message in messages %}
{{- '<|' + message.role + '|>\\n' + (message.content or '') + '<|end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}
"""

MISTRAL = """\
{{- bos_token }}
{%- set system = messages[0].content if messages[0].role == 'system' else '' %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- set text = (system + '\\n\\n' + message.content) if system and loop.index0 <= 1 else message.content %}
{{- '[INST] ' + text + ' [/INST]' }}
{%- elif message.role == 'assistant' %}
{{- ' ' + (message.content or '') + eos_token }}
{%- endif %}
{%- endfor %}
"""

# llama.cpp's other named formats (llama-chat.cpp's rules, as Jinja): no tools
COMMAND_R = """\
{%- set marks = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>'} %}
{%- for message in messages %}
{%- if message.role in marks %}
{{- '<|START_OF_TURN_TOKEN|>' + marks[message.role] + (message.content or '') | trim + '<|END_OF_TURN_TOKEN|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}
"""


def _llama2(system: str) -> str:
    return (
        """\
{%- set ns = namespace(inside=true) %}
{{- '[INST] ' }}
{%- for message in messages %}
{%- if not ns.inside %}{%- set ns.inside = true %}{{- '[INST] ' }}{%- endif %}
{%- if message.role == 'system' %}"""
        + system
        + """
{%- elif message.role == 'user' %}{{- (message.content or '') + ' [/INST]' }}
{%- else %}{{- (message.content or '') + '</s>' }}{%- set ns.inside = false %}
{%- endif %}
{%- endfor %}
"""
    )


LLAMA2 = _llama2("{{- (message.content or '') + '\\n' }}")
LLAMA2_SYS = _llama2("{{- '<<SYS>>\\n' + (message.content or '') + '\\n<</SYS>>\\n\\n' }}")

MISTRAL_V7 = """\
{%- for message in messages %}
{%- if message.role == 'system' %}{{- '[SYSTEM_PROMPT] ' + (message.content or '') + '[/SYSTEM_PROMPT]' }}
{%- elif message.role == 'user' %}{{- '[INST] ' + (message.content or '') + '[/INST]' }}
{%- else %}{{- ' ' + (message.content or '') + '</s>' }}
{%- endif %}
{%- endfor %}
"""


def _turns(head: str, tail: str, prompt: str, trim: bool = False) -> str:
    """Each message as head + role marker + content + tail; the generation prompt after."""
    content = "(message.content or '')" + (" | trim" if trim else "")
    return (
        "{%- for message in messages %}{{- " + head + " + " + content + " + " + tail + " }}"
        "{%- endfor %}\n{%- if add_generation_prompt %}{{- " + prompt + " }}{%- endif %}\n"
    )


PHI4 = _turns(
    "'<|im_start|>' + message.role + '<|im_sep|>'",
    "'<|im_end|>'",
    "'<|im_start|>assistant<|im_sep|>'",
)
ZEPHYR = _turns("'<|' + message.role + '|>\\n'", "'<|endoftext|>\\n'", "'<|assistant|>\\n'")
FALCON3 = _turns("'<|' + message.role + '|>\\n'", "'\\n'", "'<|assistant|>\\n'")
GRANITE = _turns(
    "'<|start_of_role|>' + message.role + '<|end_of_role|>'",
    "'<|end_of_text|>\\n'",
    "'<|start_of_role|>assistant<|end_of_role|>\\n'",
)
LLAMA4 = _turns(
    "'<|header_start|>' + message.role + '<|header_end|>\\n\\n'",
    "'<|eot|>'",
    "'<|header_start|>assistant<|header_end|>\\n\\n'",
    trim=True,
)

VICUNA = """\
{%- for message in messages %}
{%- if message.role == 'system' %}{{- (message.content or '') + '\\n\\n' }}
{%- elif message.role == 'user' %}{{- 'USER: ' + (message.content or '') + '\\n' }}
{%- elif message.role == 'assistant' %}{{- 'ASSISTANT: ' + (message.content or '') + '</s>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}
"""

DEEPSEEK3 = """\
{%- for message in messages %}
{%- if message.role == 'system' %}{{- (message.content or '') + '\\n\\n' }}
{%- elif message.role == 'user' %}{{- '<\uff5cUser\uff5c>' + (message.content or '') }}
{%- elif message.role == 'assistant' %}{{- '<\uff5cAssistant\uff5c>' + (message.content or '') + '<\uff5cend\u2581of\u2581sentence\uff5c>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<\uff5cAssistant\uff5c>' }}{%- endif %}
"""

BUILTIN: dict[str, str] = {
    "chatml": CHATML,
    "llama3": LLAMA3,
    "gemma": GEMMA,
    "phi3": PHI3,
    "mistral": MISTRAL,
    "command-r": COMMAND_R,
    "llama2": LLAMA2,
    "llama2-sys": LLAMA2_SYS,
    "mistral-v7": MISTRAL_V7,
    "phi4": PHI4,
    "zephyr": ZEPHYR,
    "falcon3": FALCON3,
    "granite": GRANITE,
    "llama4": LLAMA4,
    "vicuna": VICUNA,
    "deepseek3": DEEPSEEK3,
}


def resolve_chat_template(
    name: str | None = None, file: str | os.PathLike[str] | None = None
) -> str | None:
    """The template text for `--chat-template NAME` (a built-in name, or Jinja text itself) or
    `--chat-template-file FILE`; None when neither is given (the model's own). GraftError for an
    unknown name or a file that cannot be read."""
    if name is not None and file is not None:
        raise GraftError("give --chat-template or --chat-template-file, not both")
    if file is not None:
        try:
            return Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise GraftError(f"chat template file {file}: cannot be read ({exc})") from None
    if name is None:
        return None
    if name in BUILTIN:
        return BUILTIN[name]
    if "{{" in name or "{%" in name:
        return name  # the template itself
    raise GraftError(
        f"unknown chat template {name!r}: the built-in ones are {', '.join(BUILTIN)} "
        "(or pass the Jinja text itself, or --chat-template-file)"
    )


def supports_tools(template: str | None) -> bool:
    """Whether a template renders `tools` (a template that never reads it would drop them)."""
    return template is not None and "tools" in template


def tool_format(template: str | None) -> str:
    """How the model writes a call: "hermes" (`<tool_call>{...}</tool_call>`), "llama3" (a bare
    JSON object with "name" and "parameters"), "harmony" (gpt-oss's message to a function), or
    "generic" for a template that renders no tools
    (llama.cpp's generic format: the tools in a system message, and the answer one JSON object,
    `{"tool_call": {...}}` or `{"response": "..."}`, held to that by a grammar)."""
    if not supports_tools(template):
        return "generic"
    assert template is not None
    if "<|channel|>" in template and "<|message|>" in template:
        return "harmony"  # gpt-oss: a call is a message to `functions.NAME` (runtime/reasoning.py)
    if "<tool_call>" not in template and "ipython" in template:
        return "llama3"
    return "hermes"


# llama.cpp's generic tool format (common/chat.cpp), for templates that render no tools
GENERIC_INSTRUCTION = (
    "Respond in JSON format, either with `tool_call` (a request to call tools) or with "
    "`response` reply to the user's request"
)


def generic_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The chat for a template that renders no tools: the tools (their JSON definitions) and
    llama.cpp's instruction in the system message, past calls as the JSON answer the model gave
    (`{"tool_call": {"name", "arguments"}}`, or `{"tool_calls": [...]}` for several) and tool
    results as user turns of `{"tool_response": {"tool_call_id", "content"}}`."""
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    note = f"You can call these tools:\n{listing}\n\n{GENERIC_INSTRUCTION}"
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if calls:
            written = [_generic_call(c) for c in calls]
            answer = {"tool_call": written[0]} if len(written) == 1 else {"tool_calls": written}
            out.append({"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)})
        elif m.get("role") == "tool":
            result = {"tool_call_id": m.get("tool_call_id", ""), "content": m.get("content") or ""}
            body = json.dumps({"tool_response": result}, ensure_ascii=False)
            out.append({"role": "user", "content": body})
        else:
            out.append(dict(m))
    if out and out[0].get("role") == "system":
        first = out[0].get("content") or ""
        out[0] = {**out[0], "content": f"{first}\n\n{note}" if first else note}
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


def _generic_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # kept as the text it was
    return {"name": fn.get("name", ""), "arguments": args}


def family_template(file: GGUFFile) -> str | None:
    """The built-in template of a file's model family where the file carries none (a gemma
    model chats in its own turns, not in ChatML); None leaves llama.cpp's ChatML default."""
    arch = file.architecture or ""
    if arch.startswith("gemma"):
        return BUILTIN["gemma"]
    if arch == "phi3":
        return BUILTIN["phi3"]
    tokens = file.get("tokenizer.ggml.tokens") or []
    if arch == "llama" and "<|start_header_id|>" in tokens and "<|eot_id|>" in tokens:
        return BUILTIN["llama3"]
    return None
