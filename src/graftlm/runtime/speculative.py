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

How many tokens to draft is a cost decision. A decode step of R rows costs about
`c + b * R` (the weights are read once; each row adds its products), with b / c = ROW_COST
here. One more drafted token pays off when the tokens it is expected to add (its row's
acceptance rate a to the power of its place in the draft) exceed the share of a step it costs,
`b * R / (c + b * R)` with R the rows already planned. So a lone row drafts several tokens at a
modest acceptance, a full batch drafts only where acceptance is high, and a row whose drafts
keep failing stops drafting (its estimate decays back toward the prior, so it probes again
now and then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from graftlm.errors import RequestError

# A decode row's cost as a share of a one-row step's fixed cost (reading the weights), measured
# on a 2-core Zen 4 (`bench/speculative.py`): about 0.29 for SmolLM2-135M, 0.21 for a Llama-1B
# shape. Taking the larger drafts a little less than it could on big models, never more.
ROW_COST = 0.3
PRIOR = (1.0, 1.0)  # the acceptance estimate's prior: one accepted, one rejected
DECAY = 0.99  # per step a row could draft: old evidence fades toward the prior


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
    """The server's speculative decoding. method: "ngram" (the only one so far). n_max: the
    most tokens drafted for a row in one step; n_min: a shorter draft is not verified.
    lookup_min / lookup_max: the n-gram lengths looked up (longest first). p_min: a draft
    model's confidence floor (kept for the flag; n-gram drafts have no probability)."""

    method: str = "ngram"
    n_max: int = 16
    n_min: int = 0
    lookup_min: int = 2
    lookup_max: int = 5
    p_min: float = 0.0

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise RequestError(
                f"speculative method {self.method!r} is not supported (supported: ngram)"
            )
        if not 1 <= self.n_max <= 64:
            raise RequestError(f"the draft's n_max must be in [1, 64], got {self.n_max}")
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


class Request(Protocol):
    """What the drafter reads and keeps on a sequence (the scheduler's `Request`)."""

    id: int
    prompt: list[int]
    generated: list[int]
    spec: SpecParams | None
    draft: DraftState | None


@dataclass(eq=False)
class DraftState:
    """One row's drafting: its tokens so far, the latest end of every n-gram in them, and its
    acceptance evidence (accepted, rejected drafted tokens, decayed)."""

    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    n_generated: int = 0  # generated tokens already in `tokens`
    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class NgramDrafter:
    """Drafts for the decode rows of a step (`propose`) and learns from the verdicts
    (`verified`); its per-row state lives on the request (`Request.draft`)."""

    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg

    def _state(self, req: Request) -> DraftState:
        st = req.draft
        if st is None or st.n_generated > len(req.generated):  # new, or recomputed differently
            st = DraftState(tokens=list(req.prompt))
            req.draft = st
            self._index(st, 0)
        new = req.generated[st.n_generated :]
        if new:
            start = len(st.tokens)
            st.tokens.extend(new)
            st.n_generated = len(req.generated)
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
        """k tokens that followed the latest earlier occurrence of the longest suffix; where
        that runs into the end, the draft goes on copying itself (a loop of period L - e
        continues), so a repeating tail drafts at full length."""
        toks = st.tokens
        n_tok = len(toks)
        for n in range(min(self.cfg.lookup_max, n_tok - 1), self.cfg.lookup_min - 1, -1):
            e = st.ends.get(tuple(toks[n_tok - n :]))
            if e is not None:
                draft = toks[e : e + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (n_tok - e)])
                return draft
        return []

    def propose(self, reqs: Sequence[Request], room: Sequence[int]) -> dict[int, list[int]]:
        """Drafts for these decode rows (request id -> tokens), each at most its room (what its
        context and max_tokens leave). Rows without a draft are left out."""
        cfg = self.cfg
        wants: list[tuple[Request, DraftState, list[int], float]] = []
        for req, n_room in zip(reqs, room, strict=True):
            own = req.spec
            n_max = cfg.n_max if own is None or own.n_max is None else min(own.n_max, 64)
            n_max = min(n_max, n_room)
            if n_max <= 0:
                continue
            st = self._state(req)
            draft = self.lookup(st, n_max)
            if not draft:
                continue
            st.accepted += (1.0 - DECAY) * (PRIOR[0] - st.accepted)
            st.rejected += (1.0 - DECAY) * (PRIOR[1] - st.rejected)
            n_min = cfg.n_min if own is None or own.n_min is None else own.n_min
            if len(draft) < max(n_min, 1):
                continue
            wants.append((req, st, draft, st.rate))
        if not wants:
            return {}
        # the batch's rows grow one drafted token at a time, the most promising first
        rows = len(reqs)
        taken = {id(w[0]): 0 for w in wants}
        while True:
            best = None
            for w in wants:
                i = taken[id(w[0])]
                if i < len(w[2]) and (best is None or w[3] ** (i + 1) > best[1]):
                    best = (w, w[3] ** (i + 1))
            if best is None:
                break
            worth = ROW_COST * rows / (1.0 + ROW_COST * rows)
            if best[1] <= worth:
                break
            taken[id(best[0][0])] += 1
            rows += 1
        out: dict[int, list[int]] = {}
        for req, _st, draft, _ in wants:
            n = taken[id(req)]
            own = req.spec
            n_min = cfg.n_min if own is None or own.n_min is None else own.n_min
            if n > 0 and n >= n_min:
                out[req.id] = draft[:n]
        return out

    def verified(self, req: Request, n_drafted: int, n_accepted: int) -> None:
        """A row's draft of n_drafted tokens kept its first n_accepted."""
        st = req.draft
        if st is None:
            return
        st.accepted += n_accepted
        st.rejected += 1.0 if n_accepted < n_drafted else 0.0
