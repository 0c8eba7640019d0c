"""Speculative decoding: tokens drafted for a row, verified in the step's one batch.

Plain Python, no tensors, like the scheduler that calls it. A row with a draft d_1..d_k feeds
[last, d_1, ..., d_k] at positions n_past .. n_past + k as k + 1 rows of the decode batch, one
token each on the same cache slot (the decode step writes every row's keys and values before any
row attends, so each position sees exactly the positions before it, as in a prompt chunk). The
engine samples the logits of those positions in order with the row's own sampler, as plain
decoding would; the first sampled token that differs from the draft ends the row's step, and the
positions after it are written again later. So greedy output is identical with speculation on and
off, and sampled output is drawn from the same distribution (llama.cpp's rule for a greedy draft,
`common_sampler_sample_and_accept_n`; for a one-token draft of probability one it is the standard
rejection rule). A seeded row even draws the same tokens: its generator is called once per token
it keeps, either way; a grammar's matcher likewise only sees the tokens kept.

The drafter here is n-gram lookup in the row's own prompt and output (llama-server's
`ngram-simple`, vLLM's `ngram` method): the longest of the last `lookup_max` .. `lookup_min`
tokens that occurred before, and what followed its latest occurrence.

How many tokens to draft is a cost decision, made for the whole step: the drafted tokens are
taken in order of the tokens they are expected to add (a row's acceptance rate a to the power of
the token's place in its draft), and the step gets the number n that maximizes the expected
tokens per second, (R + sum of the first n values) / t(R + n), with R the rows of the step
without drafts and t(rows) a decode step's time at that many rows as this engine measures it
(`StepCosts`: the weights are read once a step, each row adds its products; on a 2-core Zen 4 the
second row of a SmolLM2 step adds about 60%, later ones about 15%). A lone row on a model whose
second row is cheap drafts several tokens at a modest acceptance; a full batch, or a model whose
rows are dear, drafts only where acceptance is high; a row whose drafts keep failing stops
drafting (its own evidence decays, so it probes again now and then). A row's acceptance rate
starts from what drafts from n-grams of the same length did for every row (the prior: a match of
n tokens keeps n of n + 1 drafted tokens) and moves with its own verdicts.

Synthetic acceptance (llama.cpp's `--spec-synth-rates` / `--spec-synth-len`, a benchmarking aid:
the output is not the model's) replaces the verdict: drafted token i is kept with probability
rate_i / rate_(i-1) given that the ones before it were (`SpecConfig.synth_probs`, so rate_i is
the unconditional chance that i + 1 tokens are kept), by a generator of the request's own seeded
by its seed; a drafted end-of-generation token is never kept. The target's token is still drawn
at every verified position (its sampler's generator moves as without), and taken at the first
place not kept; a grammar only advances by the target's tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from graftlm.errors import RequestError

MAX_STEP_DRAFT = 64  # drafted tokens a step verifies at most
DECAY = 0.99  # per step a row could draft: its old evidence fades (toward the shared estimate)
SHARED_WEIGHT = 4.0  # the shared estimate counts as this many drafted tokens beside a row's own
# A decode step's time at R rows before any is measured, as a multiple of one row's:
# 1 + SECOND (R > 1) + EACH (R - 1); measured on a 2-core Zen 4: SmolLM2-135M 0.6 and 0.15, a
# Llama-1B shape 0.3 and 0.12. The larger are the prior: drafting starts cautious.
SECOND, EACH = 0.6, 0.15


class StepCosts:
    """A decode step's time by its number of rows, as measured (an average over the recent
    steps of each size); sizes not seen yet are estimated from the nearest one seen, scaled by
    the prior's shape."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    @staticmethod
    def shape(rows: int) -> float:
        return 1.0 + (SECOND if rows > 1 else 0.0) + EACH * (rows - 1)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + 0.2 * (seconds - old)

    def estimate(self, rows: int) -> float:
        if rows in self.seconds:
            return self.seconds[rows]
        if not self.seconds:
            return self.shape(rows)
        near = min(self.seconds, key=lambda r: (abs(r - rows), r))
        return self.seconds[near] * self.shape(rows) / self.shape(near)


@dataclass(frozen=True)
class SpecParams:
    """A request's own bounds (llama-server's `speculative.n_max` / `n_min` / `p_min`): None
    leaves the server's. n_max 0 turns drafting off for the request."""

    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None

    def __post_init__(self) -> None:
        for name in ("n_max", "n_min"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise RequestError(f"speculative.{name} must be a whole number >= 0, got {v!r}")
        if self.p_min is not None and not (
            isinstance(self.p_min, (int, float)) and 0.0 <= self.p_min <= 1.0
        ):
            raise RequestError(f"speculative.p_min must be in [0, 1], got {self.p_min!r}")


@dataclass(frozen=True)
class SpecConfig:
    """The server's speculative decoding. method: "ngram" (from the row's own tokens) or
    "draft" (a draft model, runtime/draft_model.py). n_max: the most tokens drafted for a row in
    one step; n_min: a shorter draft is not verified. lookup_min / lookup_max: the n-gram
    lengths looked up (longest first). p_min: a draft model's drafting stops at a token it gives
    a lower probability (n-gram drafts have none)."""

    method: str = "ngram"
    n_max: int = 16
    n_min: int = 0
    lookup_min: int = 2
    lookup_max: int = 5
    p_min: float = 0.0
    # llama.cpp's --spec-synth-rates: the unconditional chance that the first i + 1 drafted
    # tokens are kept, one per draft place (n_max of them, non-increasing); () verifies for real
    synth_rates: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise RequestError(
                f"speculative method {self.method!r} is not supported (supported: ngram, draft)"
            )
        if not 1 <= self.n_max <= MAX_STEP_DRAFT:
            raise RequestError(
                f"the draft's n_max must be in [1, {MAX_STEP_DRAFT}], got {self.n_max}"
            )
        if not 0 <= self.n_min <= self.n_max:
            raise RequestError(
                f"the draft's n_min must be in [0, n_max={self.n_max}], got {self.n_min}"
            )
        if not 1 <= self.lookup_min <= self.lookup_max <= 64:
            raise RequestError(
                "the n-gram lookup lengths must satisfy 1 <= min <= max <= 64, got "
                f"min {self.lookup_min}, max {self.lookup_max}"
            )
        if not 0.0 <= self.p_min <= 1.0:
            raise RequestError(f"the draft's p_min must be in [0, 1], got {self.p_min}")
        check_synth_rates(self.synth_rates, self.n_max)

    @property
    def synth_probs(self) -> tuple[float, ...]:
        """Synthetic acceptance's chance of keeping drafted token i once the ones before it are
        kept: rate_i / rate_(i-1) (0 after a rate of 0), as llama.cpp's
        common_speculative_init."""
        out, prev = [], 1.0
        for rate in self.synth_rates:
            out.append(rate / prev if prev > 0.0 else 0.0)
            prev = rate
        return tuple(out)

    def bounds(self, own: SpecParams | None) -> tuple[int, int, float]:
        """(n_max, n_min, p_min) for a request: its own where it set them, else these (with
        synthetic acceptance, no longer a draft than its rates)."""
        if own is None:
            return self.n_max, self.n_min, self.p_min
        n_max = self.n_max if own.n_max is None else min(own.n_max, MAX_STEP_DRAFT)
        if self.synth_rates:
            n_max = min(n_max, len(self.synth_rates))
        return (
            n_max,
            self.n_min if own.n_min is None else own.n_min,
            self.p_min if own.p_min is None else own.p_min,
        )


def check_synth_rates(rates: Sequence[float], n_max: int) -> None:
    """llama.cpp's rules for --spec-synth-rates (common_speculative_synth_rates_resolve), with
    its messages."""
    if not rates:
        return
    if len(rates) != n_max:
        raise RequestError(
            f"synthetic acceptance rates must contain {n_max} values, got {len(rates)}"
        )
    for i, rate in enumerate(rates):
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise RequestError("synthetic acceptance rates must be finite and within [0, 1]")
        if i > 0 and rate > rates[i - 1]:
            raise RequestError("synthetic acceptance rates must be monotonically non-increasing")


def synth_rates_of_length(length: float, n_max: int) -> tuple[float, ...]:
    """llama.cpp's --spec-synth-len: the rates p, p^2, .. p^n_max whose mean accepted length,
    the target's token included (1 + their sum), is `length` (p found by bisection, as
    common_speculative_synth_rates_resolve)."""
    top = n_max + 1.0
    if not (math.isfinite(length) and 1.0 <= length <= top):
        raise RequestError(f"synthetic acceptance length must be finite and within [1, {top:.0f}]")
    p = 0.0
    if length == top:
        p = 1.0
    elif length > 1.0:
        lo, hi = 0.0, 1.0
        for _ in range(32):
            mid = 0.5 * (lo + hi)
            total, term = 0.0, mid
            for _ in range(n_max):
                total += term
                term *= mid
            if total < length - 1.0:
                lo = mid
            else:
                hi = mid
        p = 0.5 * (lo + hi)
    rates, rate = [], p
    for _ in range(n_max):
        rates.append(rate)
        rate *= p
    return tuple(rates)


class SynthDraws:
    """A request's draws for synthetic acceptance: llama-server's per-slot std::mt19937 seeded
    with the request's seed (a random one without), read as std::uniform_real_distribution
    <double> reads it (two 32-bit outputs, (a + b 2^32) / 2^64), so a seed gives llama-server's
    verdicts for the same drafts."""

    def __init__(self, seed: int | None) -> None:
        self.rng = random.Random()
        if seed is None or seed < 0:
            seed = random.SystemRandom().getrandbits(32)
        # std::mt19937::seed(s), Knuth's initialization (Python seeds its MT19937 otherwise)
        mt = [seed & 0xFFFFFFFF]
        for i in range(1, 624):
            prev = mt[-1]
            mt.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
        self.rng.setstate((3, (*mt, 624), None))

    def uniform(self) -> float:
        """The next draw in [0, 1)."""
        a = self.rng.getrandbits(32)
        b = self.rng.getrandbits(32)
        return min((a + b * 2.0**32) / 2.0**64, 1.0 - 2.0**-53)  # (libstdc++ keeps it below 1)

    def keep(self, prob: float) -> bool:
        return self.uniform() < prob


class Request(Protocol):
    """What the drafter reads and keeps on a sequence (the scheduler's `Request`)."""

    id: int
    prompt: list[int]
    generated: list[int]
    spec: SpecParams | None
    draft: DraftState | None
    dropped: int  # tokens a context shift dropped (the context is `context()`)

    @property
    def n_past(self) -> int: ...
    def context(self) -> list[int]: ...
    def tokens_from(self, start: int, n: int) -> list[int]: ...


class Drafter(Protocol):
    """What the scheduler and the engine ask of a drafter (n-grams here, a draft model in
    runtime/draft_model.py)."""

    cfg: SpecConfig
    costs: StepCosts  # the engine reports each decode step's rows and time

    def propose(self, reqs: Sequence[Request], room: Sequence[int]) -> dict[int, list[int]]: ...
    def verified(self, req: Request, n_drafted: int, n_accepted: int) -> None: ...
    def release(self, req: Request) -> None:
        """The request ended: what the drafter holds for it goes."""


@dataclass(eq=False)
class DraftState:
    """One row's drafting: its tokens so far, the latest end of every n-gram in them, its
    acceptance evidence (drafted tokens accepted, drafts cut short; decayed) and the length of
    the n-gram its last draft came from."""

    tokens: list[int] = field(default_factory=list)  # the prompt, then the generated tokens
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    accepted: float = 0.0
    rejected: float = 0.0
    matched: int = 0


class NgramDrafter:
    """Drafts for the decode rows of a step (`propose`) and learns from the verdicts
    (`verified`); its per-row state lives on the request (`Request.draft`)."""

    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self.costs = StepCosts()  # the engine reports each decode step's rows and time
        # what drafts from an n-gram of each length did, over every row (accepted, cut short;
        # decayed): a row's estimate starts from it. Prior: a match of n tokens, n of n + 1.
        self.by_length = {n: [float(n), 1.0] for n in range(cfg.lookup_min, cfg.lookup_max + 1)}

    def rate(self, st: DraftState) -> float:
        """A row's chance that its next drafted token is kept: its own evidence beside what
        drafts from n-grams of its match's length did for every row."""
        acc, rej = self.by_length[st.matched]
        w = min(1.0, SHARED_WEIGHT / (acc + rej))
        return (st.accepted + w * acc) / (st.accepted + st.rejected + w * (acc + rej))

    def _state(self, req: Request) -> DraftState:
        st = req.draft
        if st is None:
            st = DraftState(tokens=list(req.prompt))
            req.draft = st
            self._index(st, 0)
        start = len(st.tokens)
        new = req.generated[start - len(req.prompt) :]  # (generated never shrinks)
        if new:
            st.tokens.extend(new)
            self._index(st, start)
        return st

    def _index(self, st: DraftState, start: int) -> None:
        """Enter the n-grams ending before each of tokens[start:] (key -> where the next token
        is), the later occurrence replacing the earlier."""
        lo, hi = self.cfg.lookup_min, self.cfg.lookup_max
        toks, ends = st.tokens, st.ends
        for e in range(max(start, lo), len(toks)):
            for n in range(lo, min(hi, e) + 1):
                ends[tuple(toks[e - n : e])] = e

    def lookup(self, st: DraftState, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest suffix (its length
        kept in st.matched); where that runs into the end, the draft goes on copying itself (a
        loop of period L - e continues), so a repeating tail drafts at full length."""
        toks = st.tokens
        n_tok = len(toks)
        for n in range(min(self.cfg.lookup_max, n_tok - 1), self.cfg.lookup_min - 1, -1):
            e = st.ends.get(tuple(toks[n_tok - n :]))
            if e is not None:
                draft = toks[e : e + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (n_tok - e)])
                st.matched = n
                return draft
        return []

    def propose(self, reqs: Sequence[Request], room: Sequence[int]) -> dict[int, list[int]]:
        """Drafts for these decode rows (request id -> tokens), each at most its room (what its
        context and max_tokens leave). Rows without a draft are left out."""
        wants: list[tuple[Request, int, list[int], float]] = []  # (req, n_min, draft, rate)
        for req, n_room in zip(reqs, room, strict=True):
            n_max, n_min, _ = self.cfg.bounds(req.spec)
            n_max = min(n_max, n_room)
            if n_max <= 0:
                continue
            st = self._state(req)
            draft = self.lookup(st, n_max)
            if not draft:
                continue
            st.accepted *= DECAY
            st.rejected *= DECAY
            if len(draft) < max(n_min, 1):
                continue
            wants.append((req, n_min, draft, self.rate(st)))
        if not wants:
            return {}
        # every drafted token's expected gain, best first (a row's gains fall along its draft,
        # so any prefix of this order takes a prefix of each row's draft)
        gains = sorted(
            ((rate ** (i + 1), w) for w, (_, _, draft, rate) in enumerate(wants)
             for i in range(len(draft))),
            key=lambda g: -g[0],
        )  # fmt: skip
        rows = len(reqs)
        best_n, best = 0, rows / self.costs.estimate(rows)
        total = float(rows)
        for n, (gain, _) in enumerate(gains[:MAX_STEP_DRAFT], 1):
            total += gain
            rate = total / self.costs.estimate(rows + n)
            if rate > best:
                best_n, best = n, rate
        taken = [0] * len(wants)
        for _, w in gains[:best_n]:
            taken[w] += 1
        out: dict[int, list[int]] = {}
        for (req, n_min, draft, _), n in zip(wants, taken, strict=True):
            if n > 0 and n >= n_min:
                out[req.id] = draft[:n]
        return out

    def release(self, req: Request) -> None:
        """(A row's state lives on its request and goes with it; a verdict may still come in
        the step the row ends, for the shared estimate.)"""

    def verified(self, req: Request, n_drafted: int, n_accepted: int) -> None:
        """A row's draft of n_drafted tokens kept its first n_accepted."""
        st = req.draft
        if st is None:
            return
        cut = 1.0 if n_accepted < n_drafted else 0.0
        st.accepted += n_accepted
        st.rejected += cut
        shared = self.by_length[st.matched]
        shared[0] = shared[0] * DECAY + n_accepted
        shared[1] = shared[1] * DECAY + cut
