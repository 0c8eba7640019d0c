"""Text in and out of one model: tokenizing, checking ids, chat prompts, and the text stream of a
generation. The Python API and the engine service both use this one object, so a prompt is built
and a generation is turned into text the same way wherever a request comes from. Pure Python."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

from graftlm.errors import RequestError
from graftlm.runtime.constraints import CompiledGrammar, Constraint, ConstraintCompiler
from graftlm.runtime.textstream import TextStream
from graftlm.tokenizer import Tokenizer, render_chat
from graftlm.tokenizer.templates import generic_tool_messages, supports_tools, tool_format


class Prompter:
    """A model's tokenizer, chat template and vocabulary size, and every rule built on them."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, n_vocab: int) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # variables every rendering gives the template (`--chat-template-kwargs`, `--reasoning`)
        self.template_kwargs: dict[str, Any] = {}
        self.n_vocab = n_vocab
        self._compiler: ConstraintCompiler | None = None
        self._compiler_lock = threading.Lock()

    @property
    def eog(self) -> frozenset[int]:
        """The end-of-generation tokens."""
        return self.tokenizer.eog_ids

    # -- ids --
    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"tokenize takes a str, got {type(text).__name__}")
        unicode_problem(text, "the text")
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def check_ids(self, ids: Sequence[int]) -> None:
        """RequestError naming the ids that are not tokens of this vocabulary (up to ten)."""
        n = self.n_vocab
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise RequestError(f"token ids out of range [0, {n}): {bad[:10]}")

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt as text (tokenized with the model's special tokens) or as ids (checked)."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special=True, parse_special=True)
        ids = list(prompt)
        self.check_ids(ids)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        self.check_ids(ids)
        return self.tokenizer.decode(list(ids))

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token renders as (may be part of a UTF-8 character)."""
        return self.tokenizer.token_to_piece(token)

    def token_str(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def logit_bias(self, raw: Any, field: str = "logit_bias") -> tuple[tuple[int, float], ...]:
        """A request's logit bias as (token id, bias) pairs, in any of the shapes clients send:
        OpenAI's {"token id": bias}, llama-server's [[id, bias]] and [["text", bias]] (every
        token of the text gets the bias; so does a key that is not a number), with `false` for
        a ban. RequestError naming the field for ids outside the vocabulary, biases that are
        not finite or outside [-100, 100]."""
        if raw is None:
            return ()
        if isinstance(raw, dict):
            items = list(raw.items())
        elif isinstance(raw, list):
            items = []
            for k, item in enumerate(raw):
                if not isinstance(item, (list, tuple)) or len(item) != 2:
                    raise RequestError(
                        f"{field}[{k}] must be a [token, bias] pair, got {item!r:.80}"
                    )
                items.append((item[0], item[1]))
        else:
            raise RequestError(f"{field} must be an object or a list of [token, bias] pairs")
        out: dict[int, float] = {}
        for key, value in items:
            if value is False:
                bias = -math.inf
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"{field}[{key!r}] must be a number or false, got {value!r:.80}")
            elif not math.isfinite(value) or not -100 <= value <= 100:
                raise RequestError(
                    f"{field}[{key!r}] must be a finite number in [-100, 100], got {value}"
                )
            else:
                bias = float(value)
            for tok in self._bias_tokens(key, field):
                out[tok] = bias
        return tuple(out.items())

    def _bias_tokens(self, key: Any, field: str) -> list[int]:
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                return self.tokenize(key, add_special=False, parse_special=False)
        if isinstance(key, bool) or not isinstance(key, int):
            raise RequestError(f"{field}: {key!r:.80} is neither a token id nor a text")
        if not 0 <= key < self.n_vocab:
            raise RequestError(
                f"{field}: token id {key} is outside the vocabulary [0, {self.n_vocab})"
            )
        return [key]

    # -- constraints --
    @property
    def constraints(self) -> ConstraintCompiler:
        """This vocabulary's grammar compiler and its cache (built on first use)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = ConstraintCompiler(self.tokenizer, self.n_vocab, self.eog)
            return self._compiler

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of a constraint (cached); ConstraintError when it does not
        compile. Blocking: a server calls it off its event loop."""
        return self.constraints.compile(constraint)

    # -- chats --
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat rendered through the template; `tools` (OpenAI's function definitions) are
        passed to it as Hugging Face's `apply_chat_template` passes them, or, for a template that
        never reads them, described in a system message with calls and results as JSON text
        (`generic_tool_messages`). `kwargs`: more variables for the template (a request's
        `chat_template_kwargs`), over the prompter's own `template_kwargs` (the server's)."""
        tok = self.tokenizer
        bos = tok.decode([tok.bos_id]) if tok.bos_id is not None else ""
        eos = tok.decode([tok.eos_id]) if tok.eos_id is not None else ""
        extra: dict[str, Any] = {**self.template_kwargs, **(kwargs or {})}
        if tools:
            if supports_tools(self.chat_template):
                extra["tools"] = tools
            else:  # llama.cpp's generic format: the template sees plain messages
                messages = generic_tool_messages(messages, tools)
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            **extra,
        )

    @property
    def tool_format(self) -> str:
        """How this template's model writes a tool call ("hermes" or "llama3")."""
        return tool_format(self.chat_template)

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt ids of a chat: the rendered template, with a BOS only where the template
        has none of its own."""
        return self.chat_ids(self.apply_chat_template(messages, True, tools=tools))

    def chat_ids(self, text: str) -> list[int]:
        """The prompt ids of a rendered chat: a BOS only where the template has none of its own."""
        tok = self.tokenizer
        bos = tok.decode([tok.bos_id]) if tok.bos_id is not None and tok.add_bos else None
        add_special = bos is None or not text.startswith(bos)
        return self.tokenize(text, add_special=add_special, parse_special=True)

    # -- generations --
    def text_stream(self, stop: tuple[str, ...] = (), ignore_eos: bool = False) -> TextStream:
        """The text of one generation, cut at the first of `stop`; end tokens render as nothing
        unless they are ignored (then they are text like any other token)."""
        return TextStream(self.tokenizer, stop, frozenset() if ignore_eos else self.eog)


def unicode_problem(text: str, what: str) -> None:
    """RequestError when `text` holds a lone surrogate (JSON's "\\ud800" decodes to one): it has
    no UTF-8 form, so it can be neither tokenized nor sent back."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{what} holds an unpaired surrogate (U+{ord(text[exc.start]):04X}) at character "
            f"{exc.start}: not valid Unicode"
        ) from None
