"""Token sampling with llama.cpp's chain and defaults.

Order (llama.cpp's common sampler): penalties -> top-k -> top-p -> min-p -> temperature -> draw.
top-p and min-p look at the distribution before temperature, as llama.cpp's do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from graftlm.errors import RequestError

if TYPE_CHECKING:
    from graftlm.runtime.constraints import CompiledGrammar

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1), int64 (...): each row's first maximum, or its first NaN where
    it has one. A CPU float32 tensor goes through numpy's vectorised argmax, which finds the same
    index (tests/test_sampling.py) in a twelfth of the time: over gpt-oss's 201,088 logits in
    cache 0.014 ms against torch's 0.17, one thread (a greedy engine step outside its forward,
    the logits fresh from the head: 0.47 against 0.57 ms)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype is torch.float32
        and logits.dim() > 0
        and logits.shape[-1] > 0
        and not logits.requires_grad
    ):
        return torch.from_numpy(np.asarray(logits.numpy().argmax(axis=-1), dtype=np.int64))
    return torch.argmax(logits, dim=-1)


class SamplingError(RequestError, ValueError):
    """A sampling setting out of range: a bad request (a ValueError for the server's schemas)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = -1  # -1: until the context is full or generation ends
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # (token id, bias) pairs added to the logits before sampling; -inf (or -100) bans a token.
    # The ids are checked against the vocabulary where it is known (`Prompter.logit_bias`).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the grammar every generated token must follow (a `Sampler` starts its own matcher)
    grammar: CompiledGrammar | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty",
                     "presence_penalty"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SamplingError(f"{name} must be a finite number, got {v!r}")
        for stop in self.stop:
            try:
                stop.encode("utf-8")
            except (UnicodeEncodeError, AttributeError):
                raise SamplingError(f"stop must be valid Unicode strings, got {stop!r}") from None
        for tok, bias in self.logit_bias:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise SamplingError(f"logit_bias: {tok!r} is not a token id")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise SamplingError(f"logit_bias[{tok}] must be a number, got {bias!r}")
            if not (-100 <= bias <= 100 or bias == -math.inf):
                raise SamplingError(f"logit_bias[{tok}] must be in [-100, 100], got {bias}")
        if self.top_p < 0 or self.top_p > 1:
            raise SamplingError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.min_p < 0 or self.min_p > 1:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty < 0:
            raise SamplingError(f"repeat_penalty must be >= 0, got {self.repeat_penalty}")
        if self.seed is not None and not (
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed < 1 << 64
        ):
            raise SamplingError(
                f"seed must be a whole number below 2^64 (negative: random), got {self.seed!r}"
            )

    @property
    def greedy(self) -> bool:
        """Greedy below GREEDY_BELOW, as vLLM does: dividing logits by a temperature that small
        overflows float32 (1e-45 gives inf and nan), and the draw is the argmax anyway."""
        return self.temperature < GREEDY_BELOW


def penalizes(p: SamplingParams) -> bool:
    """Whether a penalty reads the history at all."""
    return p.repeat_last_n != 0 and (
        p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    )


def penalty_window(
    p: SamplingParams, prompt: Sequence[int], generated: Sequence[int]
) -> Sequence[int]:
    """The tokens of the sequence prompt + generated that `Sampler.penalize` reads: its last
    repeat_last_n (all at -1), none without a penalty; the rest is not copied (the engine asks
    every token, at any depth)."""
    n = p.repeat_last_n
    if not penalizes(p):
        return ()
    if n < 0:
        return [*prompt, *generated]
    if len(generated) >= n:
        return generated[len(generated) - n :]
    return [*prompt[max(0, len(prompt) - (n - len(generated))) :], *generated]


class Sampler:
    """Samples one sequence's tokens; its own seeded generator makes runs repeatable.

    After the penalties, the request's logit bias is added and its grammar's mask applied (the
    forbidden tokens at -inf), for greedy and sampled draws alike; the grammar's matcher is then
    advanced by the token drawn."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.matcher = params.grammar.matcher() if params.grammar is not None else None
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
            # -100 is OpenAI's ban: made exact, so no logit is large enough to beat it
            vals = [-math.inf if b <= -100 else float(b) for _, b in params.logit_bias]
            self._bias = ids, torch.tensor(vals, dtype=torch.float32)
        self.generator = torch.Generator()
        seed = params.seed if params.seed is not None and params.seed >= 0 else None
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # the draw is the argmax of the logits as they come (no penalty, bias or grammar, and
        # this class's own draw): a batch's rows of such samplers take one argmax together
        self.argmax_only = (
            params.greedy
            and not penalizes(params)
            and self._bias is None
            and self.matcher is None
            and type(self).__call__ is Sampler.__call__
            and type(self).draw is Sampler.draw
        )

    def penalize(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        p = self.params
        if not penalizes(p) or not history:
            return logits
        window = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history
        ids, counts = torch.tensor(window, dtype=torch.long).unique(return_counts=True)
        x = logits[ids]
        if p.repeat_penalty != 1.0:
            x = torch.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty)
        x = x - counts.to(x.dtype) * p.frequency_penalty - p.presence_penalty
        logits = logits.clone()
        logits[ids] = x
        return logits

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """logits (n_vocab,) float -> the next token id."""
        logits = self.penalize(logits.float(), history)
        if self._bias is not None:
            ids, vals = self._bias
            if int(ids.max()) >= logits.shape[-1]:
                raise SamplingError(f"logit_bias: token {int(ids.max())} is outside the vocabulary")
            logits = logits.index_add(0, ids, vals)  # a copy: the engine's row stays as it was
        if self.matcher is not None:
            logits = self.matcher.apply(logits)
        tok = self.draw(logits)
        if self.matcher is not None:
            self.matcher.advance(tok)
        return tok

    def draw(self, logits: torch.Tensor) -> int:
        """logits (n_vocab,) float, penalized, biased and masked -> a token id."""
        if self.params.greedy:
            return int(argmax(logits))
        return self.pick(*self.candidates(logits))

    def pick(self, probs: torch.Tensor, idx: torch.Tensor) -> int:
        """One of `candidates()`: the first when greedy, else drawn by probability."""
        if self.params.greedy:
            return int(idx[0])
        return int(idx[torch.multinomial(probs, 1, generator=self.generator)])

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens the draw chooses among and their probabilities, after top-k, top-p, min-p
        and temperature (greedy: the best token, probability 1), most likely first."""
        p = self.params
        if p.greedy:
            return torch.ones(1), argmax(logits).reshape(1)
        n = logits.shape[-1]
        k = p.top_k if 0 < p.top_k < n else n
        vals, idx = torch.topk(logits, k)  # sorted, highest first
        keep = k
        if p.top_p < 1.0:
            probs = torch.softmax(vals, -1)
            cum = torch.cumsum(probs, -1)
            # smallest prefix whose mass reaches top_p (at least one token)
            keep = min(keep, int(torch.searchsorted(cum, torch.tensor([p.top_p])).item()) + 1)
        if p.min_p > 0.0:
            probs = torch.softmax(vals[:keep], -1)
            keep = max(1, int((probs >= p.min_p * probs[0]).sum()))
        vals, idx = vals[:keep], idx[:keep]
        return torch.softmax(vals / p.temperature, -1), idx
