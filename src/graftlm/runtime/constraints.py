"""Constrained decoding: a request's grammar becomes a token mask for each of its rows' steps.

The constraint engine is llguidance (see docs/design-notes.md for why not xgrammar). Three pieces:

- `Constraint`: what a request asked for (a JSON schema, any JSON object, a regex, a choice of
  strings, a GBNF or Lark grammar), as plain text: hashable, the key of the compile cache.
- `ConstraintCompiler`: one per vocabulary. It builds llguidance's tokenizer description from
  graftlm's own vocabulary (token id -> the bytes it renders as, control tokens marked with a
  0xFF prefix so no grammar emits them as text, the end-of-generation ids as its end tokens) and
  keeps an LRU of compiled grammars keyed by the constraint.
- `Matcher`: one request's state in its grammar. `apply(logits)` sets every token the grammar
  forbids to -inf (end tokens are allowed only where the grammar accepts); `advance(token)`
  moves the state on by the token that was sampled.

Rows are independent: each request has its own matcher (or none), so a batch mixes constrained
and free rows and different grammars. Pure CPU work, no model access.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from graftlm.errors import RequestError

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

    from graftlm.tokenizer import Tokenizer

Kind = Literal["json_schema", "json_object", "regex", "choice", "gbnf", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "gbnf", "lark")


def _json_options(strict: bool) -> JsonCompileOptions:
    # JSON without free whitespace: a sampled row cannot wander off into spaces and newlines,
    # and the output is what `json.dumps(separators=(",", ":"))` writes.
    return {"whitespace_flexible": False, "lenient": not strict}


MAX_CHOICES = 10_000  # of a `choice` constraint (100,000 made the grammar compiler panic)


class ConstraintError(RequestError, ValueError):
    """A schema, regex or grammar that does not compile: the request's fault (a 400)."""


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint. `text`: the JSON schema (as JSON text), the regex, the
    choices (a JSON list of strings) or the grammar; `field`: the request field it came from,
    named in errors. `strict` False lets a JSON schema use keywords llguidance does not
    implement (they are ignored, as OpenAI's non-strict mode does)."""

    kind: Kind
    text: str = ""
    field: str = "grammar"
    strict: bool = True

    @classmethod
    def json_schema(
        cls, schema: object, field: str = "json_schema", strict: bool = True
    ) -> Constraint:
        if not isinstance(schema, dict) and not isinstance(schema, bool):
            raise ConstraintError(f"{field}: a JSON schema must be an object, got {schema!r:.80}")
        # key order kept: properties are written in the order the schema lists them
        return cls("json_schema", json.dumps(schema), field, strict)

    @classmethod
    def choice(cls, choices: Sequence[str], field: str = "choice") -> Constraint:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ConstraintError(f"{field}: a choice must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise ConstraintError(
                f"{field}: {len(choices)} choices, more than the {MAX_CHOICES} a request may give"
            )
        return cls("choice", json.dumps(list(choices)), field)

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint (not yet checked)."""
        from llguidance import LLMatcher, grammar_from

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_json_options(True)
            )
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(
                self.text, defaults=_json_options(self.strict)
            )
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            # each choice as a literal (a regex would read "." as any character)
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in json.loads(self.text))
            )
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.text)
        try:
            return grammar_from("gbnf", self.text)
        except ValueError as exc:
            raise ConstraintError(f"{self.field}: {exc}"[:500]) from None


class _Vocabulary:
    """graftlm's tokenizer in the shape llguidance's `TokenizerWrapper` reads."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, eog: Iterable[int]) -> None:
        tokens: list[bytes] = []
        special: list[int] = []
        for i in range(tokenizer.n_vocab):
            piece = tokenizer.token_to_piece(i)
            if tokenizer.is_special(i):
                piece = b"\xff" + piece  # llguidance's mark of a control token
                special.append(i)
            tokens.append(piece)
        tokens += [b""] * (n_vocab - len(tokens))  # output rows past the tokenizer's table
        self.tokens = tokens
        self.special_token_ids = special
        eog = sorted(eog)
        self.eos_token_id = eog[0] if eog else tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        # the grammar forces text in the middle of an answer: no SentencePiece space prefix
        return self._tokenizer.encode(
            text.decode("utf-8", errors="replace"),
            add_special=False,
            parse_special=False,
            space_prefix=False,
        )


class CompiledGrammar:
    """A checked grammar, ready to start matchers from (cheaply: a copy of a started one)."""

    def __init__(self, constraint: Constraint, start: llguidance.LLMatcher, n_vocab: int) -> None:
        self.constraint = constraint
        self._start = start
        self.n_vocab = n_vocab

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy(), self.n_vocab, self.constraint.field)

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.constraint.kind}, {self.constraint.text[:40]!r})"


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, m: llguidance.LLMatcher, n_vocab: int, field: str) -> None:
        self._m = m
        self.n_vocab = n_vocab
        self.field = field
        self.mask_s = 0.0  # seconds spent computing masks (the benchmark reads it)
        self.n_masks = 0

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def allowed(self) -> torch.Tensor:
        """(n_vocab,) bool: the tokens the grammar allows next."""
        import time

        t0 = time.perf_counter()
        bits = self._m.compute_bitmask()  # one bit per token, little-endian in 32-bit words
        self._raise_if_error()
        out = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")
        self.mask_s += time.perf_counter() - t0
        self.n_masks += 1
        return torch.from_numpy(out[: self.n_vocab].astype(np.bool_))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (n_vocab,) float -> a copy with the forbidden tokens at -inf."""
        ok = self.allowed()
        n = logits.shape[-1]
        if ok.shape[0] < n:  # rows the tokenizer has no entry for are never allowed
            ok = torch.cat([ok, torch.zeros(n - ok.shape[0], dtype=torch.bool)])
        if not bool(ok.any()):
            raise ConstraintError(f"{self.field}: the grammar allows no further token")
        return logits.masked_fill(~ok[:n], float("-inf"))

    def advance(self, token: int) -> None:
        if not self._m.consume_token(token):
            self._raise_if_error()
            raise ConstraintError(f"{self.field}: token {token} is not allowed by the grammar")

    def _raise_if_error(self) -> None:
        if self._m.is_error():
            raise ConstraintError(f"{self.field}: {self._m.get_error()}"[:500])


class ConstraintCompiler:
    """Compiles constraints for one vocabulary; an LRU of `maxsize` compiled grammars.

    Thread-safe: the server compiles off its event loop, and two requests with a new schema may
    arrive together. The tokenizer description is built on first use (about a second for a
    50k-token vocabulary)."""

    def __init__(
        self, tokenizer: Tokenizer, n_vocab: int, eog: Iterable[int], maxsize: int = 64
    ) -> None:
        self._tokenizer = tokenizer
        self.n_vocab = n_vocab
        self._eog = sorted(eog)
        self.maxsize = maxsize
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            import llguidance

            vocab = _Vocabulary(self._tokenizer, self.n_vocab, self._eog)
            wrapper = llguidance.TokenizerWrapper(vocab)
            self._ll = llguidance.LLTokenizer(
                wrapper, n_vocab=self.n_vocab, eos_token=self._eog or None
            )
        return self._ll

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar (from the cache when it was compiled before); ConstraintError
        naming the field and the problem when it does not compile."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                self.hits += 1
                return hit
            tok = self.lltokenizer
        compiled = self._compile(constraint, tok)
        with self._lock:
            self.misses += 1
            self._cache[constraint] = compiled
            self._cache.move_to_end(constraint)
            while len(self._cache) > self.maxsize:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: Constraint, tok: llguidance.LLTokenizer) -> CompiledGrammar:
        from llguidance import LLMatcher

        try:
            grammar = c.grammar()
        except ValueError as exc:  # a schema that is not JSON, say
            raise ConstraintError(f"{c.field}: {exc}"[:500]) from None
        bad, messages = LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if bad:
            raise ConstraintError(f"{c.field} does not compile: {_users_terms(messages[0])}")
        m = LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise ConstraintError(f"{c.field} does not compile: {_users_terms(m.get_error())}")
        return CompiledGrammar(c, m, self.n_vocab)


def _users_terms(message: str) -> str:
    """The compiler's complaint without its internals: a panic's backtrace cut, a panic said
    as what it means (the grammar is too large or malformed), the rest bounded."""
    first = message.split("\n<backtrace>")[0].strip()
    if first.startswith("panic:"):
        return "the grammar is too large or malformed for the grammar compiler"
    return first if len(first) <= 300 else first[:300] + "..."
