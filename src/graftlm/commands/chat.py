"""`graftlm run -cnv`: an interactive chat as llama-cli's, over `Model.chat`.

The conversation is a list of chat messages, rendered through the model's template on every turn
(so a prefix cache sees each turn as the previous one plus the new tokens). Input comes from
prompt_toolkit where stdin is a terminal (line editing, Up/Down history, Alt-Enter for a new line)
and from plain lines otherwise; in both, a line ending in `\\` continues on the next one.

Ctrl-C during a reply stops the reply (what was generated stays in the conversation); Ctrl-C at an
empty prompt, Ctrl-D, `/exit` or `/quit` leave. Commands: see HELP.

A model that reasons apart from its answer (gpt-oss's analysis channel, Qwen3's or R1's `<think>`
block) is shown as llama-cli shows it: the reasoning between `[Start thinking]` and
`[End thinking]` (grey on a terminal), then the answer; the conversation keeps the answer alone.
`--reasoning-format none` shows the reply unparsed (llama-server's `none`: a `<think>` block as
written, gpt-oss's analysis with its own tags), and keeps it so; `deepseek-legacy` shows the
reasoning inside the answer between `<think>` tags.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

_COMMAND = re.compile(r"^/[A-Za-z]+(\s|$)")  # "/lora ..."; "/usr/bin is ..." is a message
# llama-cli's frame around a reply's reasoning, and its grey (on a terminal)
START_THINKING, END_THINKING = "[Start thinking]\n", "\n[End thinking]\n\n"
GREY, RESET = "\033[90m", "\033[0m"

HELP = """\
commands:
  /help                 this list
  /exit, /quit          leave (also Ctrl-D, or Ctrl-C at an empty prompt)
  /clear                start the conversation over (the system prompt stays)
  /history              the messages so far
  /lora                 list the adapters and their scales
  /lora NAME SCALE      set one adapter's scale (NAME: its id or file name; 0 turns it off)
  /lora off             every adapter to scale 0
input:
  Enter sends; a line ending in \\ continues on the next line; Alt-Enter (or Esc, Enter) inserts
  a new line; Up/Down walk the history; Ctrl-C during a reply stops it and keeps the conversation"""


class ChatSession:
    """The conversation and its commands, independent of the terminal."""

    def __init__(
        self,
        model: Any,
        sampling: dict[str, Any],
        system_prompt: str | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
        reasoning_format: str = "auto",
    ) -> None:
        self.model = model
        self.sampling = sampling
        self.reasoning_format = reasoning_format
        self.system_prompt = system_prompt
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.messages: list[dict[str, str]] = []
        self.stop_requested = False
        self.clear()

    def clear(self) -> None:
        self.messages = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )

    # -- commands --------------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False when the session should end. Unknown commands are refused."""
        words = line.split()
        name, rest = words[0].lower(), words[1:]
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/help":
            self._note(HELP)
        elif name == "/clear":
            self.clear()
            self._note("conversation cleared")
        elif name == "/history":
            self._history()
        elif name == "/lora":
            self._lora(rest)
        else:
            self._note(f"unknown command {words[0]}: /help lists the commands")
        return True

    def _note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def _history(self) -> None:
        if not self.messages:
            self._note("(no messages)")
        for m in self.messages:
            text = m["content"].replace("\n", " ")
            self._note(f"{m['role']}: {text[:70] + '...' if len(text) > 70 else text}")

    def _adapter_name(self, a: dict[str, Any]) -> str:
        return Path(str(a["path"])).name

    def _lora(self, args: list[str]) -> None:
        loras = self.model.loras
        if not args:
            if not loras:
                self._note("no adapters: start with --lora FILE or --lora-scaled FILE:SCALE")
            for a in loras:
                self._note(f"  {a['id']}: {self._adapter_name(a)}  scale {a['scale']:g}")
            return
        scales = {int(a["id"]): float(a["scale"]) for a in loras}
        if args == ["off"]:
            self.model.set_lora_scales({})
            self._note("every adapter at scale 0")
            return
        if len(args) != 2:
            self._note("usage: /lora NAME SCALE (or /lora to list, /lora off)")
            return
        key, value = args
        try:
            scale = float(value)
        except ValueError:
            self._note(f"/lora: the scale {value!r} is not a number")
            return
        found = [
            a
            for a in loras
            if key == str(a["id"])
            or key in (self._adapter_name(a), Path(str(a["path"])).stem, str(a["path"]))
        ]
        if not found:
            names = ", ".join(f"{a['id']} ({self._adapter_name(a)})" for a in loras) or "none"
            self._note(f"/lora: no adapter {key!r}; attached: {names}")
            return
        scales[int(found[0]["id"])] = scale
        self.model.set_lora_scales(scales)
        self._note(f"lora {found[0]['id']} ({self._adapter_name(found[0])}) at scale {scale:g}")

    # -- turns -----------------------------------------------------------------------------------
    def reply(self, text: str) -> str:
        """One turn: the user's `text`, the reply streamed to `out` and kept in the conversation
        (its content: reasoning shown apart is not kept, as llama-cli keeps it).
        `stop_requested` (set by Ctrl-C) ends the reply early; what came before stays."""
        self.messages.append({"role": "user", "content": text})
        self.stop_requested = False
        pieces: list[str] = []
        stream: Iterator[str] = self.model.chat(
            self.messages, stream=True, reasoning_format=self.reasoning_format, **self.sampling
        )
        grey, reset = (GREY, RESET) if self.out.isatty() else ("", "")
        thinking = False
        try:
            for piece in stream:
                reasoning = getattr(piece, "reasoning", "")  # (Model.chat's ChatReply)
                if reasoning:
                    self.out.write(reasoning if thinking else grey + START_THINKING + reasoning)
                    thinking = True
                if piece:
                    if thinking:
                        self.out.write(END_THINKING + reset)
                        thinking = False
                    pieces.append(str(piece))
                    self.out.write(str(piece))
                self.out.flush()
                if self.stop_requested:
                    break
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # a generator stopped early releases its sequence
        self.out.write(reset + "\n" if thinking else "\n")
        self.out.flush()
        if self.stop_requested:
            self._note("[reply stopped; the conversation keeps it]")
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        return "".join(pieces)


class _Interrupts:
    """While a reply streams, the first Ctrl-C asks it to stop; a second one interrupts outright
    (a long prompt yields nothing to check the flag between)."""

    def __init__(self, session: ChatSession) -> None:
        self.session = session
        self.old: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.session.stop_requested:
            raise KeyboardInterrupt
        self.session.stop_requested = True

    def __enter__(self) -> _Interrupts:
        self.old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.old)


def join_continued(read_line: Callable[[str], str | None]) -> str | None:
    """Lines ending in a backslash continue on the next (the backslash becomes a new line);
    None at the end of input."""
    parts: list[str] = []
    prompt = "> "
    while True:
        line = read_line(prompt)
        if line is None:
            return "\n".join(parts) if parts else None
        if line.endswith("\\"):
            parts.append(line[:-1])
            prompt = ". "
            continue
        parts.append(line)
        return "\n".join(parts)


def _terminal_reader() -> Callable[[str], str | None] | None:
    """prompt_toolkit's line editor, or None where it is not installed."""
    try:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings
    except ImportError:
        return None
    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    @keys.add("c-c")
    def _interrupt(event: Any) -> None:
        buf = event.current_buffer
        if buf.text:
            buf.reset()  # Ctrl-C on a typed line discards it, as in a shell
        else:
            event.app.exit(exception=KeyboardInterrupt)

    session: PromptSession[str] = PromptSession(history=InMemoryHistory(), key_bindings=keys)

    def read(prompt: str) -> str | None:
        try:
            return session.prompt(prompt)
        except (EOFError, KeyboardInterrupt):
            return None

    return read


def _plain_reader(stream: TextIO, echo_prompt: bool) -> Callable[[str], str | None]:
    def read(prompt: str) -> str | None:
        if echo_prompt:
            sys.stdout.write(prompt)
            sys.stdout.flush()
        try:
            line = stream.readline()
        except KeyboardInterrupt:
            return None
        return line.rstrip("\n") if line else None

    return read


def chat_loop(
    model: Any,
    sampling: dict[str, Any],
    system_prompt: str | None = None,
    first: str | None = None,
    stdin: TextIO | None = None,
    reasoning_format: str = "auto",
) -> int:
    """Run the interactive chat until the user leaves; 0."""
    stdin = stdin or sys.stdin
    session = ChatSession(model, sampling, system_prompt, reasoning_format=reasoning_format)
    tty = stdin.isatty() and sys.stdout.isatty()
    read = (_terminal_reader() if tty else None) or _plain_reader(stdin, echo_prompt=tty)
    if tty:
        print(
            "chat: /help for commands, Ctrl-C stops a reply, /exit or Ctrl-D leaves",
            file=sys.stderr,
        )
    pending = first
    while True:
        if pending is None:
            pending = join_continued(read)
            if pending is None:
                break
        text, pending = pending, None
        if not text.strip():
            continue
        if _COMMAND.match(text):
            if not session.command(text.strip()):
                break
            continue
        try:
            with _Interrupts(session):
                session.reply(text)
        except KeyboardInterrupt:  # a second Ctrl-C before the reply had a first piece
            sys.stdout.write("\n")
            print("[reply stopped]", file=sys.stderr)
            if session.messages and session.messages[-1]["role"] == "user":
                session.messages.append({"role": "assistant", "content": ""})
    return 0
