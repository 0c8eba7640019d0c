"""The engine loop: one owner of the model, its cache slots and its adapters.

Requests wait in a queue; each `step()` admits what fits, prefills one chunk of one prompt, and
decodes one token for every running sequence in a single batch, whatever adapters each one uses.
The CLI, the Python API and the HTTP server are all clients of this loop.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graftlm.errors import RequestError
from graftlm.models import Transformer
from graftlm.runtime.sampling import Sampler, SamplingParams
from graftlm.step.batch import Batch, LoraRows

_ids = itertools.count()


@dataclass
class Request:
    """One sequence to continue. `lora` is copied when the request is created: later changes to
    the model's scales do not reach a request already admitted."""

    prompt: list[int]
    params: SamplingParams
    lora: dict[int, float]
    eog: frozenset[int] = frozenset()
    on_token: Callable[[Request, int], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    # state, owned by the engine
    generated: list[int] = field(default_factory=list)
    slot: int = -1
    n_prefilled: int = 0
    finish_reason: str | None = None
    error: BaseException | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_prompt_done: float | None = None
    t_end: float | None = None
    sampler: Sampler | None = None
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def n_past(self) -> int:
        return self.n_prefilled + max(0, len(self.generated) - 1)


class Engine:
    def __init__(self, model: Transformer, n_slots: int = 1, chunk: int = 512) -> None:
        self.model = model
        self.n_slots = n_slots
        self.chunk = chunk
        self.cache = model.allocate_cache(n_slots)
        self.free_slots = list(range(n_slots))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.RLock()

    @property
    def device(self) -> torch.device:
        """The model's device: every batch's tensors are made there."""
        return self.model.device

    # -- adapters ----------------------------------------------------------------------------------
    def lora_rows(self, settings: list[dict[int, float]]) -> LoraRows | None:
        """Per-row scales for a batch; None when no row uses any adapter (the plain base step)."""
        active = sorted({s for row in settings for s, v in row.items() if v != 0.0})
        if not active:
            return None
        # columns up to the highest active slot: only active slots are ever looked up
        scales = torch.zeros(len(settings), active[-1] + 1)
        for r, row in enumerate(settings):
            for s, v in row.items():
                if v != 0.0:
                    scales[r, s] = v
        return LoraRows(scales.to(self.device), tuple(active))

    # -- one-shot scoring --------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, ids: list[int], lora: dict[int, float]) -> torch.Tensor:
        """Logits (len(ids), n_vocab) on the CPU after each prefix, in chunks, on a borrowed
        cache slot."""
        if len(ids) > self.model.n_ctx:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, more than the context size {self.model.n_ctx}",
                "context_length_exceeded",
            )
        # Scoring is a prefill-shaped workload, where exact float32 dequantization costs what the
        # fast kernels cost; log-probabilities are the product here, so its batches are exact
        # (decode steps keep the fast kernels).
        with self.lock:
            slot = self._take_slot()
            try:
                rows = self.lora_rows([lora])
                out = []
                for start in range(0, len(ids), self.chunk):
                    piece = ids[start : start + self.chunk]
                    batch = Batch.single(piece, slot, start, rows, self.device, exact=True)
                    out.append(self.model.forward(batch, all_logits=True)[0])
                return torch.cat(out).cpu()
            finally:
                self.free_slots.append(slot)

    def _take_slot(self) -> int:
        if not self.free_slots:
            raise RequestError("no free sequence slot", "server_busy")
        return self.free_slots.pop(0)

    # -- the loop ----------------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        if not req.prompt:
            raise RequestError("the prompt is empty")
        if len(req.prompt) >= self.model.n_ctx:
            raise RequestError(
                f"the prompt has {len(req.prompt)} tokens; the context size is {self.model.n_ctx}",
                "context_length_exceeded",
            )
        req.sampler = Sampler(req.params)
        with self.lock:
            self.waiting.append(req)
        return req

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.t_end = time.perf_counter()
        self.running.remove(req)
        self.free_slots.append(req.slot)

    @torch.inference_mode()
    def step(self) -> None:
        with self.lock:
            for req in [r for r in self.running if r.cancelled]:
                self._finish(req, "cancelled")
            while self.waiting and self.free_slots:
                req = self.waiting.popleft()
                if req.cancelled:
                    continue
                req.slot = self._take_slot()
                self.running.append(req)
            prefilling = [r for r in self.running if r.n_prefilled < len(r.prompt)]
            if prefilling:
                self._prefill(prefilling)
            decoding = [
                r
                for r in self.running
                if r.n_prefilled == len(r.prompt) and r.generated and not r.done
            ]
            if decoding:
                self._decode(decoding)

    def _prefill(self, waiting: list[Request]) -> None:
        """One chunk of prompt: the next piece of the first request, and of as many more as fit
        in `chunk` tokens counted with padding (rows are padded to the longest piece), so that
        requests arriving together start decoding together."""
        group: list[Request] = []
        width = 0
        for req in waiting:
            n = min(len(req.prompt) - req.n_prefilled, self.chunk)
            if group and (len(group) + 1) * max(width, n) > self.chunk:
                break
            group.append(req)
            width = max(width, n)
        pieces = [r.prompt[r.n_prefilled : r.n_prefilled + width] for r in group]
        lora = self.lora_rows([r.lora for r in group])
        if len(group) == 1:
            batch = Batch.single(pieces[0], group[0].slot, group[0].n_prefilled, lora, self.device)
        else:
            tokens = torch.zeros(len(group), width, dtype=torch.long)  # padding: never read
            for row, piece in enumerate(pieces):
                tokens[row, : len(piece)] = torch.tensor(piece, dtype=torch.long)
            batch = Batch(
                tokens.to(self.device),
                [r.slot for r in group],
                [r.n_prefilled for r in group],
                [len(p) for p in pieces],
                lora,
            )
        logits = self.model.forward(batch).cpu()  # the samplers run on the CPU: one copy a step
        for req, piece, row in zip(group, pieces, logits, strict=True):
            req.n_prefilled += len(piece)
            if req.n_prefilled == len(req.prompt):
                req.t_prompt_done = time.perf_counter()
                self._emit(req, row)

    def _decode(self, reqs: list[Request]) -> None:
        tokens = torch.tensor(
            [[r.generated[-1]] for r in reqs], dtype=torch.long, device=self.device
        )
        batch = Batch(
            tokens,
            [r.slot for r in reqs],
            [r.n_past for r in reqs],
            [1] * len(reqs),
            self.lora_rows([r.lora for r in reqs]),
        )
        logits = self.model.forward(batch).cpu()  # the samplers run on the CPU: one copy a step
        for r, row in zip(reqs, logits, strict=False):
            self._emit(r, row)

    def _emit(self, req: Request, logits: torch.Tensor) -> None:
        assert req.sampler is not None
        try:
            tok = req.sampler(logits, req.prompt + req.generated)
            if not math.isfinite(float(logits[tok])):  # argmax picks a nan or an inf, if any
                raise FloatingPointError(f"the chosen token's logit is {float(logits[tok])}")
        except Exception as exc:  # noqa: BLE001 - this row's failure ends this request alone
            req.error = _sampling_error(req, logits, exc)
            self._finish(req, "error")
            return
        if req.t_first is None:
            req.t_first = time.perf_counter()
        req.generated.append(tok)
        if req.on_token is not None:
            req.on_token(req, tok)  # may end the request (a stop string)
        if req.done:
            return
        p = req.params
        if tok in req.eog and not p.ignore_eos:
            self._finish(req, "stop")
        elif 0 <= p.max_tokens <= len(req.generated):
            self._finish(req, "length")
        elif len(req.prompt) + len(req.generated) >= self.model.n_ctx:
            self._finish(req, "length")

    def stop(self, req: Request, reason: str = "stop") -> None:
        """End a request early (a stop string matched, the client left)."""
        with self.lock:
            if not req.done and req in self.running:
                self._finish(req, reason)
            elif not req.done:
                req.cancelled = True
                req.finish_reason = reason

    def run(self, req: Request) -> None:
        """Drive the loop until this request ends (for single-threaded clients)."""
        while not req.done:
            self.step()


def _sampling_error(req: Request, logits: torch.Tensor, exc: Exception) -> RequestError:
    """What to tell the one request whose token could not be sampled: the other rows of the step
    go on. Non-finite logits come from the request's own settings (an adapter at a scale too
    large for the model, say), so they are its error."""
    where = f"token {len(req.generated) + 1} of the generation"
    if not bool(torch.isfinite(logits).all()):
        return RequestError(
            f"the logits for {where} are not finite (inf or nan); the adapter scales "
            f"{req.lora or 'none'} may be too large for this model"
        )
    return RequestError(f"sampling {where} failed: {type(exc).__name__}: {exc}", "sampling_error")
