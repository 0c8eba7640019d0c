"""The batching scheduler: the one admission queue, the sequences' states, and each step's plan.

Plain Python, no tensors (design decision 6). Every step the engine asks for a `StepPlan`: which
waiting requests start (in arrival order, under a cap on running requests and while the cache
has room), which prompt chunks are prefilled, and which sequences decode one token. The engine
turns the plan into a batch, runs the model, samples, and reports back (`finish`).

The plan names sequences and token ranges, never cache places: a `CacheAllocator` maps a
sequence to where its keys and values live. The engine's is the paged cache's
(`step/kv_allocator.py: PagedAllocator`); tests/runtime/test_scheduler.py's `SlotAllocator`, one
slot of the full context per sequence, serves tests of the scheduler alone.

- `can_admit(seq)` asks for the blocks of the sequence's first chunk (after looking its prompt
  up in the prefix cache, keyed by tokens and adapter settings; shared blocks cost nothing);
  `admit` shares the cached blocks and sets `n_prefilled` past them;
- before a plan is final every planned sequence grows to the end of its range (`Chunk.end`, or
  `n_past + 1` for a decode row); when the pool cannot give a sequence its blocks, the
  sequence admitted last is preempted (its full blocks stay cached, the rest are freed, and it
  goes back to the head of the queue to be recomputed from `prompt + generated[:-1]`, which the
  prefix cache mostly serves);
- `slot(seq)` names the sequence's row of the block table; `commit(seq, n)` enters the blocks
  its first n positions filled into the prefix cache; `release(seq)` drops its blocks.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from graftlm.lora.settings import NO_ADAPTERS, AdapterSettings

if TYPE_CHECKING:
    from graftlm.runtime.sampling import Sampler, SamplingParams
    from graftlm.runtime.speculative import Drafter, DraftState, SpecParams, SynthDraws

_ids = itertools.count()
# Several prompts' chunks in one step are packed (the engine's Batch.packed: only real tokens are
# computed, and `chunk` counts those); GRAFTLM_PADDED_PREFILL=1 pads them to the longest instead
# (the old way, kept for A/B: bench/prefill_packing.py).
PACKED_PREFILL = os.environ.get("GRAFTLM_PADDED_PREFILL", "") != "1"


@dataclass(eq=False)
class Request:
    """One sequence to continue. `lora` is the request's own settings, fixed when it was built:
    later changes to the model's scales do not reach it."""

    prompt: list[int]
    params: SamplingParams
    lora: AdapterSettings = NO_ADAPTERS
    eog: frozenset[int] = frozenset()
    on_token: Callable[[Request, int], None] | None = None
    # told (from the engine thread) the prompt tokens in the cache before each prefill chunk of
    # the prompt's first computation, and after the last: llama-server's prompt progress
    on_progress: Callable[[Request, int], None] | None = None
    use_cache: bool = True  # look the prompt up in the prefix cache (what it computes enters it)
    id: int = field(default_factory=lambda: next(_ids))
    # state, owned by the scheduler and the engine
    generated: list[int] = field(default_factory=list)
    n_prefilled: int = 0
    finish_reason: str | None = None
    error: BaseException | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_prompt_done: float | None = None
    t_end: float | None = None
    sampler: Sampler | None = None
    cancelled: bool = False
    # prompt tokens the prefix cache served at admission (not computed)
    n_cached: int = 0
    # after a preemption: the tokens to compute again (prompt + generated[:-1]), else None
    resume: list[int] | None = None
    # activated LoRA: (start, settings) from each start on, ascending from 0; () when `lora`
    # holds from the first token (see activation())
    segments: tuple[tuple[int, AdapterSettings], ...] = ()
    # aLoRA adapters the request named whose invocation tokens its prompt lacks (run as base)
    inactive: tuple[int, ...] = ()
    # the prefix cache's digests of the sequence's full blocks, memoised by its allocator
    block_digests: list[bytes] = field(default_factory=list)
    digest_epoch: int = -1
    # speculative decoding: the request's own bounds (None: the server's), its drafter's state,
    # its drafts verified, drafted and accepted tokens (llama-server's timings.draft_n /
    # draft_n_accepted)
    spec: SpecParams | None = None
    draft: DraftState | None = None
    n_drafts: int = 0
    n_drafted: int = 0
    n_draft_accepted: int = 0
    synth: SynthDraws | None = None  # synthetic acceptance's draws (llama.cpp's benchmarking aid)
    # llama-server's context shift: the context (what the cache holds, what positions count) is
    # the sequence's tokens less the `dropped` ones after its first n_keep
    n_keep: int = 0
    dropped: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def fill(self) -> list[int]:
        """The tokens to prefill before decoding: the prompt, or after a preemption the prompt
        and what was generated before the token to feed next."""
        return self.prompt if self.resume is None else self.resume

    @property
    def n_past(self) -> int:
        """The position of the token a decode step feeds (the last generated)."""
        return len(self.prompt) + max(0, len(self.generated) - 1) - self.dropped

    def context(self) -> list[int]:
        """The tokens the context holds: prompt, then generated, less those shifted out."""
        tokens = self.prompt + self.generated
        if self.dropped:
            del tokens[self.n_keep : self.n_keep + self.dropped]
        return tokens

    def settings_at(self, pos: int) -> AdapterSettings:
        """The adapter settings that compute position pos."""
        return settings_at(self.segments, self.lora, pos)

    def boundary_after(self, pos: int) -> int | None:
        """The first position past pos where the settings change, or None."""
        return next((start for start, _ in self.segments if start > pos), None)

    def tokens_from(self, start: int, n: int) -> list[int]:
        """At most n of the context's tokens from `start`, without copying the rest."""
        if self.dropped:
            return self.context()[start : start + n]
        p = len(self.prompt)
        head = self.prompt[start : start + n] if start < p else []
        return head + self.generated[max(0, start - p) : max(0, start - p) + n - len(head)]

    def tokens_upto(self, n: int) -> list[int]:
        """The context's first n tokens (prompt, then generated)."""
        if self.dropped:
            return self.context()[:n]
        if n <= len(self.prompt):
            return self.prompt[:n]
        return self.prompt + self.generated[: n - len(self.prompt)]


def activation(
    prompt: list[int], lora: AdapterSettings, invocations: Mapping[int, tuple[int, ...]]
) -> tuple[tuple[tuple[int, AdapterSettings], ...], tuple[int, ...]]:
    """Activated LoRA (PEFT's and llama.cpp's rule): an adapter with invocation tokens applies
    from the start of their last occurrence in the prompt on; before it, the other adapters
    alone compute (the base, when there are none), so those positions share the cache of that
    setting. An aLoRA whose invocation the prompt lacks does not apply at all. Returns the
    (start, settings) segments (() when nothing activates late) and the adapters left out."""
    starts: dict[int, int] = {}
    inactive: list[int] = []
    for aid, _ in lora.pairs:
        inv = invocations.get(aid)
        if not inv:
            continue
        n = len(inv)
        at = next(
            (i for i in range(len(prompt) - n, -1, -1) if tuple(prompt[i : i + n]) == inv), None
        )
        if at is None:
            inactive.append(aid)
        else:
            starts[aid] = at
    if not starts and not inactive:
        return (), ()
    live = [(aid, s) for aid, s in lora.pairs if aid not in inactive]
    points = sorted({0, *starts.values()})
    segments = tuple(
        (p, AdapterSettings((aid, s) for aid, s in live if starts.get(aid, 0) <= p)) for p in points
    )
    return segments, tuple(inactive)


def settings_at(
    segments: tuple[tuple[int, AdapterSettings], ...], lora: AdapterSettings, pos: int
) -> AdapterSettings:
    """The settings of `activation()`'s segments at position pos (lora when there are none)."""
    now = lora
    for start, s in segments:
        if start > pos:
            break
        now = s
    return now


class CacheAllocator(Protocol):
    """Where each running sequence's keys and values live (see the module docstring)."""

    n_slots: int

    @property
    def n_free(self) -> int: ...
    def can_admit(self, seq: Request) -> bool: ...
    def admit(self, seq: Request) -> None: ...
    def grow(self, seq: Request, n_tokens: int) -> bool: ...
    def commit(self, seq: Request, n_written: int) -> None: ...
    def release(self, seq: Request) -> None: ...
    def slot(self, seq: Request) -> int: ...
    def borrow(self, n_tokens: int) -> int: ...
    def give_back(self, slot: int) -> None: ...


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens [start, end) of one sequence, prefilled in this step."""

    seq: Request
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def tokens(self) -> list[int]:
        return self.seq.fill[self.start : self.end]

    @property
    def lora(self) -> AdapterSettings:
        """The settings of this chunk's tokens (a chunk never crosses an aLoRA start)."""
        return self.seq.settings_at(self.start)


@dataclass(frozen=True)
class StepPlan:
    """One step. `prefill`: the chunks of one prefill batch (packed: only their tokens computed;
    else rows padded to `width`).
    `decode`: the sequences that decode one token, in admission order, including those whose
    prompt ends in this step's prefill (they decode in the same step, from the token their
    prompt's logits gave); one that ended on that token is skipped. `n_running`: sequences
    running in this step, those just admitted included. `drafts`: request id -> the tokens
    drafted for that decode row, verified in this step (speculative decoding)."""

    admitted: tuple[Request, ...] = ()
    prefill: tuple[Chunk, ...] = ()
    decode: tuple[Request, ...] = ()
    n_running: int = 0
    drafts: Mapping[int, list[int]] = field(default_factory=dict)
    packed: bool = False

    @property
    def width(self) -> int:
        return max((c.length for c in self.prefill), default=0)

    @property
    def computed(self) -> int:
        """Prompt tokens the prefill batch computes: its chunks' own, or padded to `width`."""
        if self.packed or len(self.prefill) == 1:
            return sum(c.length for c in self.prefill)
        return len(self.prefill) * self.width

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """The admission queue (`waiting`, arrival order) and the running sequences.

    max_running: how many sequences run at once (default: every cache slot); the engine service
    sets it one below the slots so that a scoring pass always finds one. chunk: the most prompt
    tokens one step prefills (padding counted when `packed` is off)."""

    def __init__(
        self,
        allocator: CacheAllocator,
        chunk: int = 512,
        max_running: int | None = None,
        n_ctx: int = 1 << 62,
    ) -> None:
        self.allocator = allocator
        self.chunk = chunk
        self.max_running = allocator.n_slots if max_running is None else max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # speculative decoding (the engine's): drafts for decode rows, within n_ctx positions;
        # the drafter is told when a sequence ends, as the allocator is
        self.drafter: Drafter | None = None
        self.n_ctx = n_ctx
        # llama-server's --context-shift: a sequence that fills its context drops half of it
        # (after its n_keep first tokens) and goes on, else it ends there
        self.context_shift = False
        # several prompts' chunks packed (only real tokens computed and counted), else padded
        self.packed = PACKED_PREFILL

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, req: Request) -> None:
        self.waiting.append(req)

    def plan(self) -> StepPlan:
        """Admit what fits, then plan this step's prefill chunks and decode rows, every planned
        sequence's blocks taken (preempting the last admitted where the pool runs short)."""
        if self.context_shift:
            for r in [r for r in self.running if self.must_shift(r)]:
                self.shift(r)
        admitted: list[Request] = []
        while (
            self.waiting
            and len(self.running) < self.max_running
            and self.allocator.can_admit(self.waiting[0])
        ):
            req = self.waiting.popleft()
            if req.cancelled:
                continue
            self.allocator.admit(req)
            self.running.append(req)
            admitted.append(req)
        while True:
            prefill = self._prefill()
            completing = {c.seq.id for c in prefill if c.end == len(c.seq.fill)}
            decode = tuple(
                r
                for r in self.running
                if r.id in completing or (r.n_prefilled == len(r.fill) and r.generated)
            )
            if self._grow(prefill, decode):
                break
        admitted = [r for r in admitted if r in self.running]
        return StepPlan(tuple(admitted), prefill, decode, len(self.running), packed=self.packed)

    def draft_room(self, plan: StepPlan) -> tuple[list[Request], list[int]]:
        """The decode rows of `plan` that may draft (not those whose prompt ends in its
        prefill) and each one's room: the positions before the context's last (a sequence
        that reaches it ends or shifts before feeding it, so a token drafted there is never
        kept), and the tokens max_tokens still allows (the last kept token is the model's own,
        never a draft)."""
        completing = {c.seq.id for c in plan.prefill if c.end == len(c.seq.fill)}
        rows = [r for r in plan.decode if r.id not in completing]
        room = []
        for r in rows:
            n = self.n_ctx - 2 - r.n_past
            if r.params.max_tokens >= 0:
                n = min(n, r.params.max_tokens - len(r.generated) - 1)
            room.append(n)
        return rows, room

    def keep_drafts(self, plan: StepPlan, drafts: dict[int, list[int]]) -> StepPlan:
        """`plan` with the drafts whose blocks the pool can give now (a draft never preempts)."""
        for r in plan.decode:
            d = drafts.get(r.id)
            if d and not self.allocator.grow(r, r.n_past + 1 + len(d)):
                del drafts[r.id]
        return replace(plan, drafts=drafts)

    def _grow(self, prefill: tuple[Chunk, ...], decode: tuple[Request, ...]) -> bool:
        """Blocks for every planned range; False after preempting one sequence (plan again)."""
        ends: dict[int, tuple[Request, int]] = {c.seq.id: (c.seq, c.end) for c in prefill}
        for r in decode:  # a decode row writes the token it feeds, at n_past
            end = max(ends.get(r.id, (r, 0))[1], r.n_past + 1)
            ends[r.id] = (r, end)
        for seq, end in ends.values():
            if not self.allocator.grow(seq, end):
                self.preempt(self.running[-1])
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Back to the head of the queue, its cache room given up (its full blocks stay in the
        prefix cache): it is computed again from its prompt and what it generated."""
        self.allocator.commit(req, self._written(req))
        self.running.remove(req)
        self.allocator.release(req)
        if self.drafter is not None:
            self.drafter.release(req)
        if req.generated:
            req.resume = req.context()[:-1]
        req.n_prefilled = 0
        self.waiting.appendleft(req)

    def can_shift(self, req: Request) -> bool:
        """Whether req goes on past a full context (--context-shift) rather than ending there
        (an activated LoRA's starts are positions: such a sequence always ends)."""
        return self.context_shift and not req.segments

    def must_shift(self, req: Request) -> bool:
        """req is decoding, may shift, and its context is full: the token to feed has no
        position left."""
        return (
            self.can_shift(req)
            and bool(req.generated)
            and req.n_prefilled == len(req.fill)
            and req.n_past + 1 >= self.n_ctx
        )

    def shift(self, req: Request) -> None:
        """llama-server's context shift (server-context.cpp): keep the first n_keep tokens
        (at most n_ctx - 4), drop half of the rest, and go on. llama-server moves the kept keys'
        RoPE positions down in place; here the shortened context is computed again, as after a
        preemption (the keys and values are then exactly those of a prompt of these tokens)."""
        req.n_keep = max(0, min(req.n_keep, self.n_ctx - 4))
        n_left = req.n_past - req.n_keep
        n_discard = min(n_left // 2, max(0, n_left - 1))
        self.preempt(req)  # (its blocks enter the prefix cache under the context they held)
        req.dropped += n_discard
        req.block_digests.clear()  # (its blocks' digests were of the old context's tokens)
        req.resume = req.context()[:-1]

    @staticmethod
    def _written(req: Request) -> int:
        """Positions of req whose K/V are in the cache."""
        if req.n_prefilled < len(req.fill) or not req.generated:
            return req.n_prefilled
        return req.n_past  # (the last generated token is not fed yet)

    def _prefill(self) -> tuple[Chunk, ...]:
        """The next piece of the first prompt not yet prefilled, and of as many more as fit in
        `chunk` tokens, so that requests arriving together start decoding together. Packed, the
        tokens are the pieces' own and the last piece may be part of what its prompt has left
        (the step fills up); padded, they are counted with padding (rows padded to the longest
        piece) and a piece that does not fit whole waits."""
        group: list[Chunk] = []
        width = last = total = 0  # the rows' width, the latest start among them, their tokens
        for req in self.running:
            if req.n_prefilled >= len(req.fill):
                continue
            n = min(len(req.fill) - req.n_prefilled, self.chunk)
            edge = req.boundary_after(req.n_prefilled)  # an aLoRA start: the chunk ends there
            if edge is not None:
                n = min(n, edge - req.n_prefilled)
            if self.packed:  # the step's tokens fill up `chunk`: this prompt's piece, up to it
                if total >= self.chunk:
                    break
                n = min(n, self.chunk - total)
            w = max(width, n)
            # (a padded row's positions run to its start + the width: within the context, where
            # RoPE has angles; a row starting past cached blocks may not take a long one's width)
            if (
                group
                and not self.packed
                and (
                    (len(group) + 1) * w > self.chunk or max(last, req.n_prefilled) + w > self.n_ctx
                )
            ):
                break
            group.append(Chunk(req, req.n_prefilled, n))
            width, last, total = w, max(last, req.n_prefilled), total + n
        return tuple(group)

    def commit(self, plan: StepPlan) -> None:
        """After the engine ran the plan: the blocks its sequences filled enter the prefix
        cache."""
        for c in plan.prefill:
            if not c.seq.done:
                self.allocator.commit(c.seq, c.end)
        for r in plan.decode:
            if not r.done:
                self.allocator.commit(r, r.n_past)

    def finish(self, req: Request, reason: str) -> None:
        """A running sequence ends: its cache room is free for the next step."""
        req.finish_reason = reason
        req.t_end = time.perf_counter()
        self.allocator.commit(req, self._written(req))
        self.running.remove(req)
        self.allocator.release(req)
        if self.drafter is not None:
            self.drafter.release(req)

    def cancel(self, req: Request, reason: str) -> None:
        """End a request early, running or not yet started."""
        if req.done:
            return
        if req in self.running:
            self.finish(req, reason)
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if self.drafter is not None:  # (a preempted sequence may hold a draft's room)
            self.drafter.release(req)
        req.cancelled = True
        req.finish_reason = reason
