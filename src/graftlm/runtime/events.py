"""What goes through the engine service: a job in, its events out, and what a step reports.

A `Job` is one sequence to generate; the service answers it with `TokenEvent`s (and, when asked,
`ProgressEvent`s while the prompt is computed), then one `FinishEvent` or `ErrorEvent`. A
`ServiceObserver` (the server's metrics) is told after every step, with the cache's `CacheFacts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from graftlm.lora.settings import NO_ADAPTERS, AdapterSettings
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.speculative import SpecParams


@dataclass(frozen=True)
class Job:
    """One sequence to generate. `lora`: the adapter settings, fixed for the job's whole life.
    `logprobs`: None for none, k >= 0 for the chosen token's log-probability plus the top k."""

    prompt: list[int]
    params: SamplingParams
    lora: AdapterSettings = NO_ADAPTERS
    logprobs: int | None = None
    cache: bool = True  # may reuse what the prefix cache holds (llama-server's cache_prompt)
    # logprobs after the sampler chain (llama-server's post_sampling_probs): over the tokens the
    # draw chose among, with their probabilities after top-k, top-p, min-p and temperature
    post_sampling: bool = False
    # ProgressEvents while the prompt is computed (llama-server's return_progress)
    progress: bool = False
    # the request's own speculative bounds (llama-server's speculative.n_max / n_min / p_min)
    spec: SpecParams | None = None


@dataclass(frozen=True)
class TokenEvent:
    """A generated token and the text it released ("" while held back or for an end token).
    logprob and top come from the raw logits (before penalties and temperature)."""

    index: int
    token: int
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    """The end of a job. reason: "stop" (end token or stop string), "length" or "cancelled".
    `text` is whatever the detokenizer still held; `stop_word` the stop string that matched."""

    index: int
    reason: str
    text: str
    n_prompt: int
    n_generated: int
    stopped_eos: bool = False
    n_cached: int = 0  # prompt tokens the prefix cache served (not computed)
    # activated-LoRA adapters the request named whose invocation its prompt lacks (not applied)
    alora_inactive: tuple[int, ...] = ()
    stop_word: str | None = None
    t_submit: float = 0.0
    t_first: float | None = None
    t_prompt_done: float | None = None
    t_end: float | None = None
    n_drafts: int = 0  # speculative decoding: drafts verified, tokens drafted, tokens kept
    n_drafted: int = 0
    n_draft_accepted: int = 0
    truncated: bool = False  # a context shift dropped some of the sequence's tokens

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first token."""
        return None if self.t_first is None else self.t_first - self.t_submit

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.t_first is None or self.t_end is None or self.n_generated < 2:
            return None
        return (self.t_end - self.t_first) / (self.n_generated - 1)


@dataclass(frozen=True)
class ProgressEvent:
    """The prompt's computation so far: of `total` tokens, `cache` came from the prefix cache
    and `processed` (the cached ones included) are in the KV cache; `ms` since the first of
    these events, which comes before any token is computed (processed == cache)."""

    index: int
    total: int
    cache: int
    processed: int
    ms: float


@dataclass(frozen=True)
class ErrorEvent:
    index: int
    error: BaseException


Event = TokenEvent | FinishEvent | ProgressEvent | ErrorEvent


@dataclass(frozen=True)
class CacheFacts:
    """The paged KV cache after a step: its blocks and the prefix cache's counts so far."""

    blocks_total: int
    blocks_used: int
    blocks_cached: int
    block_tokens: int
    nbytes: int
    query_tokens: int
    hit_tokens: int
    evicted: int


@dataclass(frozen=True)
class StepWork:
    """What one engine step computed and what it cost: its prefill batch (rows, the prompt
    tokens in them and the tokens computed, padding counted), its decode rows, and its time on
    the engine thread (CPU: with one thread, the step's whole compute; wall)."""

    prefill_rows: int
    prefill_tokens: int
    prefill_padded: int
    decode_rows: int
    cpu_s: float
    wall_s: float


class ServiceObserver(Protocol):
    """Told after every engine step (from the engine thread): sequences in the step, requests
    running and waiting, what the step computed, and the cache's facts. rows == 0: no step was
    run, only the counts changed (the engine idles)."""

    def on_step(self, rows: int, running: int, waiting: int) -> None: ...
    def on_work(self, work: StepWork) -> None: ...
    def on_cache(self, facts: CacheFacts) -> None: ...
