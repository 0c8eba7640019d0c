"""`graftlm run -cnv` as a person uses it: on a terminal (a pty, through pexpect) and on a pipe."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

from graftlm.api import ChatReply
from graftlm.commands.chat import GREY, RESET, ChatSession, chat_loop, join_continued

SPEC = TinySpec(n_ctx=16384)  # replies long enough to be stopped part way on any CPU
PROMPT = r"\x1b\[\?2004h"  # prompt_toolkit turns bracketed paste on as each prompt starts
PROMPT_END = r"\x1b\[\?2004l"  # and off as it ends (the line accepted)
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("chat")
    return {
        "model": write_tiny_model(d / "tiny.gguf", SPEC),
        "a": write_tiny_adapter(d / "a.gguf", SPEC, seed=11),
        "b": write_tiny_adapter(d / "b.gguf", SPEC, seed=12),
    }


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env["PROMPT_TOOLKIT_NO_CPR"] = "1"  # pexpect's pty answers no cursor-position requests
    env["TERM"] = "xterm"
    env["COLUMNS"], env["LINES"] = "200", "50"
    return env


def _chat_cmd(files: dict[str, Path], *extra: str) -> list[str]:
    return [
        "-m", "graftlm", "run", "-m", str(files["model"]), "-cnv", "-c", "16384", "--temp", "0",
        "--lora", str(files["a"]), "--lora-scaled", f"{files['b']}:0", *extra,
    ]  # fmt: skip


def _expect_text(child: Any) -> str:
    """Read past escape sequences to the first character outside one; return it.

    prompt_toolkit (3.0.53) ends a prompt inside raw mode: its last render, then
    Renderer.reset() turns bracketed paste off and may show the cursor (`\\x1b[?12l\\x1b[?25h`)
    or reset its shape after that, all escape sequences; the chat writes nothing before the
    reply's first piece, which it writes with its Ctrl-C handler in place."""
    state = "text"
    while True:
        child.expect(r"[\s\S]")  # the next character, the buffer's first
        c = child.after
        if state == "text":
            if c != "\x1b":
                return str(c)
            state = "esc"
        elif state == "esc":
            state = "csi" if c == "[" else "text"  # ESC [ ... a CSI; ESC x two characters
        elif "@" <= c <= "~":  # a CSI's final byte
            state = "text"


def test_terminal_two_turns_ctrl_c_keeps_history_and_exit(chat_files: dict[str, Path]) -> None:
    pexpect = pytest.importorskip("pexpect")
    pytest.importorskip("prompt_toolkit")
    child = pexpect.spawn(
        sys.executable,
        _chat_cmd(chat_files, "--ignore-eos", "-n", "12000"),
        env=_env(),
        encoding="utf-8",
        timeout=60,
        dimensions=(50, 200),
    )
    try:
        child.expect("/help for commands")
        child.expect(PROMPT)
        for turn in ("tell me a long story", "and then?"):
            child.sendline(turn)
            # stop it part way once it streams (a reply of 12000 tokens takes seconds), once the
            # reply's first character has come: only then has the line editor left raw mode (a
            # Ctrl-C before is a key for the next prompt) and the chat put in its handler
            child.expect(PROMPT_END)
            _expect_text(child)
            child.sendintr()
            child.expect(r"\[reply stopped; the conversation keeps it\]")
            child.expect(PROMPT)
        child.sendline("/history")
        child.expect("user: tell me a long story")
        child.expect("assistant: ")
        child.expect("user: and then\\?")
        child.expect("assistant: ")
        child.expect(PROMPT)
        child.sendline("/lora b 0.5")
        child.expect(r"lora 1 \(b\.gguf\) at scale 0\.5")
        child.expect(PROMPT)
        child.sendline("/lora")
        child.expect(r"1: b\.gguf\s+scale 0\.5")
        child.expect(PROMPT)
        child.sendline("/clear")
        child.expect("conversation cleared")
        child.expect(PROMPT)
        child.sendline("/history")
        child.expect(r"\(no messages\)")
        child.expect(PROMPT)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_terminal_history_multiline_and_ctrl_c_at_prompt(chat_files: dict[str, Path]) -> None:
    pexpect = pytest.importorskip("pexpect")
    pytest.importorskip("prompt_toolkit")
    child = pexpect.spawn(
        sys.executable,
        _chat_cmd(chat_files, "-n", "4"),
        env=_env(),
        encoding="utf-8",
        timeout=60,
        dimensions=(50, 200),
    )
    try:
        child.expect(PROMPT)
        child.send("first line \\\r")  # a trailing backslash continues the message
        child.expect(PROMPT)  # the continuation line
        child.send("second line\r")
        child.expect(PROMPT)
        child.sendline("/history")
        child.expect("user: first line  second line")
        child.expect(PROMPT)
        child.send("\x1b[A")  # Up: the last line entered comes back, editable
        child.expect("/history")
        child.send("\x15")  # Ctrl-U clears it
        child.sendintr()  # Ctrl-C at an empty prompt leaves
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    assert "^[[A" not in (child.before or "")


def test_pipe_turns_commands_and_continuation(chat_files: dict[str, Path]) -> None:
    """Without a terminal, lines are read as they come: messages, commands, `\\` joins lines."""
    script = "hello\n/lora a 0\n/lora\nline one \\\nline two\n/history\n/exit\nnever sent\n"
    done = subprocess.run(
        [sys.executable, *_chat_cmd(chat_files, "-n", "3")],
        input=script,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "lora 0 (a.gguf) at scale 0" in err
    assert "0: a.gguf  scale 0" in err
    assert "user: hello" in err and "user: line one  line two" in err
    assert "never sent" not in err
    assert err.count("assistant: ") == 2


class _FakeModel:
    """Model.chat and the adapter table, recorded."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.seen: list[list[dict[str, str]]] = []
        self.kwargs: list[dict[str, Any]] = []
        self.scales = {0: 1.0, 1: 0.0}
        self.closed = False

    @property
    def loras(self) -> list[dict[str, Any]]:
        return [{"id": i, "path": f"/x/{'ab'[i]}.gguf", "scale": s} for i, s in self.scales.items()]

    def set_lora_scales(self, scales: dict[int, float]) -> None:
        self.scales = {i: scales.get(i, 0.0) for i in self.scales}

    def chat(self, messages: list[dict[str, str]], stream: bool, **kw: Any) -> Iterator[str]:
        self.seen.append([dict(m) for m in messages])
        self.kwargs.append(kw)

        def gen() -> Iterator[str]:
            try:
                yield from self.pieces
            finally:
                self.closed = True

        return gen()


def test_session_keeps_history_and_stops_early() -> None:
    model = _FakeModel(["Hel", "lo", "!", " more"])
    out, err = io.StringIO(), io.StringIO()
    s = ChatSession(model, {}, system_prompt="be brief", out=out, err=err)
    assert s.reply("hi") == "Hello! more"
    assert model.seen[0] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]

    class Stop(io.StringIO):
        def write(self, text: str) -> int:
            if text == "lo":
                s.stop_requested = True  # as the Ctrl-C handler does
            return super().write(text)

    s.out = Stop()
    assert s.reply("again") == "Hello"  # stopped after the piece that was being written
    assert model.closed  # the generator was closed: its sequence is released
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert "reply stopped" in err.getvalue()
    s.command("/clear")
    assert s.messages == [{"role": "system", "content": "be brief"}]


def test_session_lora_commands() -> None:
    model = _FakeModel([])
    err = io.StringIO()
    s = ChatSession(model, {}, out=io.StringIO(), err=err)
    s.command("/lora b 0.25")
    assert model.scales == {0: 1.0, 1: 0.25}  # the others keep their scales
    s.command("/lora 0 0")
    assert model.scales == {0: 0.0, 1: 0.25}
    s.command("/lora off")
    assert model.scales == {0: 0.0, 1: 0.0}
    s.command("/lora nope 1")
    assert "no adapter 'nope'; attached: 0 (a.gguf), 1 (b.gguf)" in err.getvalue()
    s.command("/lora a lots")
    assert "the scale 'lots' is not a number" in err.getvalue()
    assert s.command("/frobnicate") is True
    assert "unknown command /frobnicate" in err.getvalue()
    assert s.command("/exit") is False and s.command("/quit") is False


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_session_shows_reasoning_apart_as_llama_cli() -> None:
    """Model.chat's pieces with reasoning: between [Start thinking] and [End thinking], grey on a
    terminal; the conversation keeps the answer alone."""
    model = _FakeModel([ChatReply("", "Let"), ChatReply("", " me."), ChatReply("Hi", ""),
                        ChatReply("!", "")])  # fmt: skip
    out = io.StringIO()
    s = ChatSession(model, {}, out=out, err=io.StringIO())
    assert s.reply("hi") == "Hi!"
    assert out.getvalue() == "[Start thinking]\nLet me.\n[End thinking]\n\nHi!\n"
    assert s.messages[-1] == {"role": "assistant", "content": "Hi!"}
    assert model.kwargs[-1]["reasoning_format"] == "auto"
    s.out = _Terminal()
    s.reply("again")
    assert s.out.getvalue() == f"{GREY}[Start thinking]\nLet me.\n[End thinking]\n\n{RESET}Hi!\n"
    model.pieces = [ChatReply("", "cut off")]  # max_tokens while thinking: the grey ends
    s.out = _Terminal()
    assert s.reply("more") == ""
    assert s.out.getvalue() == f"{GREY}[Start thinking]\ncut off{RESET}\n"


def test_reasoning_format_reaches_model_chat() -> None:
    from graftlm.cli import build_parser

    assert build_parser().parse_args(["run", "-cnv"]).reasoning_format == "auto"
    args = build_parser().parse_args(["run", "-cnv", "--reasoning-format", "none"])
    assert args.reasoning_format == "none"
    model = _FakeModel(["raw"])
    chat_loop(model, {}, stdin=io.StringIO("hi\n"), reasoning_format=args.reasoning_format)
    assert model.kwargs == [{"reasoning_format": "none"}]


def test_join_continued() -> None:
    lines = iter(["a \\", "b\\", "c", "d"])
    prompts: list[str] = []

    def read(prompt: str) -> str | None:
        prompts.append(prompt)
        return next(lines, None)

    assert join_continued(read) == "a \nb\nc"
    assert prompts == ["> ", ". ", ". "]
    assert join_continued(read) == "d"
    assert join_continued(read) is None


def test_a_second_turn_reuses_the_first_from_the_prefix_cache(
    chat_files: dict[str, Path],
) -> None:
    """The chat keeps messages, so the next turn's prompt starts with the last one's tokens."""
    done = subprocess.run(
        [sys.executable, "-m", "graftlm", "run", "-m", str(chat_files["model"]), "-cnv"]
        + ["-n", "4", "--temp", "0"],
        input="hello there, how are you today?\nand what about tomorrow?\n",
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    last = [ln for ln in done.stderr.splitlines() if ln.startswith("prompt: ")][-1]
    assert "from the prefix cache" in last, last
