"""The engine: one owner of the model and its cache, running the scheduler's plan each step.

The scheduler (plain Python) decides what a step does; the engine turns that plan into one batch
of tensors (prefill chunks of several prompts packed together, or one decode row per running
sequence, each row with its own adapter scales), runs `model.forward`, samples each row's token
and updates the sequences. The CLI, the Python API and the HTTP server are all clients of it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from graftlm.errors import GraftError, RequestError
from graftlm.lora.settings import AdapterSettings
from graftlm.models import Transformer
from graftlm.runtime.draft_model import ModelDrafter
from graftlm.runtime.sampling import Sampler, argmax, penalty_window
from graftlm.runtime.scheduler import (
    Chunk,
    Request,
    Scheduler,
    StepPlan,
    activation,
    settings_at,
)
from graftlm.runtime.speculative import Drafter, NgramDrafter, SpecConfig, SynthDraws
from graftlm.step.batch import Batch, LoraRows
from graftlm.step.kv_allocator import PagedAllocator


def lora_rows(settings: Sequence[Mapping[int, float]], device: torch.device) -> LoraRows | None:
    """Per-row scales for a batch, one row's settings each; None when no row uses any adapter
    (the plain base step)."""
    active = sorted({s for row in settings for s, v in row.items() if v != 0.0})
    if not active:
        return None
    # columns up to the highest active slot: only active slots are ever looked up
    at: tuple[list[int], list[int]] = ([], [])
    values: list[float] = []
    for r, row in enumerate(settings):
        for s, v in row.items():
            if v != 0.0:  # (a zero may name a slot past the highest active one)
                at[0].append(r)
                at[1].append(s)
                values.append(v)
    table = torch.zeros(len(settings), active[-1] + 1)
    table[at] = torch.tensor(values)
    return LoraRows(table.to(device), tuple(active))


class Engine:
    """n_slots: sequences at once (rows of the block table). n_blocks: the paged cache's pool
    (default: every sequence's whole context, plus the unowned block 0); kv_dtype: its values'
    type (default float16). prefix_cache: reuse cached blocks across requests (on by default).
    speculative: draft tokens and verify them in the step (runtime/speculative.py; off by
    default); draft_model: the model that drafts for the method "draft"."""

    def __init__(
        self,
        model: Transformer,
        n_slots: int = 1,
        chunk: int = 512,
        n_blocks: int | None = None,
        kv_dtype: torch.dtype | None = None,
        prefix_cache: bool = True,
        speculative: SpecConfig | None = None,
        draft_model: Transformer | None = None,
    ) -> None:
        self.model = model
        self.cache = model.allocate_cache(n_slots, n_blocks, kv_dtype)
        cache = self.cache
        self.slots = PagedAllocator(
            n_slots, cache.n_blocks, cache.block, cache.max_blocks, cache.set_table, prefix_cache
        )
        self.scheduler = Scheduler(self.slots, chunk, n_ctx=self.n_ctx)
        self.slots.admit_tokens = chunk
        self.lock = threading.RLock()
        self.draft_model: Transformer | None = draft_model  # speculative method "draft"
        self.speculative = speculative
        self._adapters_seen = model.seams.generation.value
        # the last decode step's rows' settings and their scale table (_decode_lora)
        self._rows_key: tuple[object, ...] = ()
        self._rows: LoraRows | None = None
        # activated-LoRA adapters by id -> their invocation tokens (the model's adapter set's)
        self.invocations: Callable[[], Mapping[int, tuple[int, ...]]] = dict

    # -- facts (the server's metrics and the tests read them) -------------------------------------
    @property
    def device(self) -> torch.device:
        """The model's device: every batch's tensors are made there."""
        return self.model.device

    @property
    def n_slots(self) -> int:
        return self.slots.n_slots

    @property
    def chunk(self) -> int:
        """The most prompt tokens one step prefills (padding counted when the scheduler pads), and
        a scoring pass's piece."""
        return self.scheduler.chunk

    @chunk.setter
    def chunk(self, n: int) -> None:
        self.scheduler.chunk = n
        self.slots.admit_tokens = n

    @property
    def free_slots(self) -> list[int]:
        return list(self.slots.free)

    @property
    def n_ctx(self) -> int:
        """The most tokens one sequence holds: the model's context, or the pool's when smaller."""
        return min(self.model.n_ctx, self.slots.capacity)

    @property
    def context_shift(self) -> bool:
        """llama-server's --context-shift: a sequence that fills the context drops half of it
        and goes on (runtime/scheduler.py: Scheduler.shift); off, it ends there."""
        return self.scheduler.context_shift

    @context_shift.setter
    def context_shift(self, on: bool) -> None:
        self.scheduler.context_shift = on

    @property
    def prefix_cache(self) -> bool:
        return self.slots.prefix

    @prefix_cache.setter
    def prefix_cache(self, on: bool) -> None:
        with self.lock:
            self.slots.prefix = on
            if not on:
                self.slots.pool.forget()

    def _check_adapters(self) -> None:
        """What adapters computed is not served once any adapter changed (held blocks stay)."""
        seen = self.model.seams.generation.value
        if seen != self._adapters_seen:
            self._adapters_seen = seen
            self.slots.adapters_changed()

    @property
    def drafter(self) -> Drafter | None:
        """Speculative decoding's drafter (None: off); the scheduler's, which tells it when a
        sequence ends."""
        return self.scheduler.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self.scheduler.drafter = drafter

    @property
    def speculative(self) -> SpecConfig | None:
        """Speculative decoding's settings (None: off)."""
        return None if self.drafter is None else self.drafter.cfg

    @speculative.setter
    def speculative(self, cfg: SpecConfig | None) -> None:
        with self.lock:
            if cfg is None:
                self.drafter = None
            elif cfg.method == "draft":
                if self.draft_model is None:
                    raise GraftError("speculative method 'draft' needs a draft model (-md)")
                self.drafter = ModelDrafter(self.draft_model, cfg, self.n_slots)
            else:
                self.drafter = NgramDrafter(cfg)

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    # -- adapters ----------------------------------------------------------------------------------
    def lora_rows(self, settings: Sequence[Mapping[int, float]]) -> LoraRows | None:
        """`lora_rows` on this model's device."""
        return lora_rows(settings, self.device)

    def _decode_lora(self, settings: list[AdapterSettings]) -> LoraRows | None:
        """`lora_rows` of a decode step's rows; the last step's own object while the rows'
        settings are those it had (most steps: the same sequences, in the same order), so the
        table is built, and copied to the native layers' scale board, once per change."""
        key = (self.device, *settings)
        if key != self._rows_key:
            self._rows_key, self._rows = key, self.lora_rows(settings)
        return self._rows

    # -- one-shot scoring --------------------------------------------------------------------------
    @torch.inference_mode()
    def score(
        self,
        ids: list[int],
        lora: AdapterSettings,
        hidden: bool = False,
        each: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits (len(ids), n_vocab) on the CPU after each prefix, in chunks, on a borrowed
        cache slot (an activated LoRA's start ends a chunk). hidden: the final-norm hidden
        states (len(ids), n_embd) instead (embeddings). each(start, chunk): what to keep of
        each chunk's rows, concatenated in place of the whole (a long prompt's logits need not
        all be held at once)."""
        if len(ids) > self.n_ctx:
            what = "input" if hidden else "prompt"
            raise RequestError(
                f"the {what} has {len(ids)} tokens, more than the context size {self.n_ctx}",
                "context_length_exceeded",
            )
        # Scoring is a prefill-shaped workload, where exact float32 dequantization costs what the
        # fast kernels cost; log-probabilities are the product here, so its batches are exact
        # (decode steps keep the fast kernels).
        with self.lock:
            slot = self.slots.borrow(len(ids))
            try:
                segments, _ = activation(ids, lora, self.invocations())
                edges = sorted(
                    {s for s, _ in segments} | {len(ids)} | set(range(0, len(ids), self.chunk))
                )
                out = []
                for start, end in zip(edges, edges[1:], strict=False):
                    rows = self.lora_rows([settings_at(segments, lora, start)])
                    piece = ids[start:end]
                    batch = Batch.single(piece, slot, start, rows, self.device, exact=True)
                    rows_out = self.model.forward(batch, all_logits=True, hidden=hidden)[0].cpu()
                    out.append(rows_out if each is None else each(start, rows_out))
                return torch.cat(out)
            finally:
                self.slots.give_back(slot)

    # -- the loop ----------------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue a request (RequestError when its prompt is empty or leaves no room). A sampler
        set beforehand is kept (the service's, which also records log-probabilities)."""
        if not req.prompt:
            raise RequestError("the prompt is empty")
        if len(req.prompt) >= self.n_ctx:
            raise RequestError(
                f"the prompt has {len(req.prompt)} tokens; the context size is {self.n_ctx}"
                + (
                    f" (the KV cache pool holds {self.slots.capacity})"
                    if self.slots.capacity < self.model.n_ctx
                    else ""
                )
                + f": generating needs at least {len(req.prompt) + 1}",
                "context_length_exceeded",
            )
        if req.sampler is None:
            req.sampler = Sampler(req.params)
        invocations = self.invocations()
        if invocations and not req.segments:
            req.segments, req.inactive = activation(req.prompt, req.lora, invocations)
        with self.lock:
            self.scheduler.submit(req)
        return req

    @torch.inference_mode()
    def step(self) -> StepPlan:
        """Plan one step and run it; the plan says what it did."""
        with self.lock:
            self._check_adapters()
            plan = self.scheduler.plan()
            if self.drafter is not None:  # (a draft model runs here: the engine runs models)
                rows, room = self.scheduler.draft_room(plan)
                if rows:
                    plan = self.scheduler.keep_drafts(plan, self.drafter.propose(rows, room))
            if plan.prefill:
                self._prefill(plan.prefill, plan.packed)
            decoding = [r for r in plan.decode if not r.done]  # a first token may have ended one
            if decoding:
                self._decode(decoding, plan.drafts)
            self.scheduler.commit(plan)
            return plan

    def _prefill(self, chunks: Sequence[Chunk], packed: bool) -> None:
        """One batch of prompt chunks (packed, or padded to the longest: as the plan was
        budgeted, StepPlan.packed); a prompt that ends here samples its first token."""
        lora = self.lora_rows([c.lora for c in chunks])
        slot = self.slots.slot
        for c in chunks:
            if c.seq.on_progress is not None and c.seq.resume is None:
                c.seq.on_progress(c.seq, c.start)
        if len(chunks) == 1:
            c = chunks[0]
            batch = Batch.single(c.tokens, slot(c.seq), c.start, lora, self.device)
        else:  # (packed: the real tokens alone; the scheduler's `packed` counted them so)
            make = Batch.packed if packed else Batch.padded
            batch = make([c.tokens for c in chunks], [slot(c.seq) for c in chunks],
                         [c.start for c in chunks], lora, self.device)  # fmt: skip
        logits = self.model.forward(batch).cpu()  # the samplers run on the CPU: one copy a step
        for c, row in zip(chunks, logits, strict=True):
            req = c.seq
            req.n_prefilled = c.end
            # (a preempted sequence computed again decodes on from the token it had)
            if req.n_prefilled == len(req.fill) and req.resume is None:
                req.t_prompt_done = time.perf_counter()
                if req.on_progress is not None:
                    req.on_progress(req, c.end)
                self._emit(req, row)

    def _decode(
        self, reqs: Sequence[Request], drafts: Mapping[int, list[int]] | None = None
    ) -> None:
        """One token for each of these sequences, in one batch, and for a sequence with a draft
        (speculative decoding) the draft's tokens too: one row each at the next positions of
        its slot, kept while the row's sampler draws them (runtime/speculative.py). The rows go
        in order of their adapter ids, so the rows of one adapter are neighbours: the native
        delta reads each adapter's A once for a run of rows and adds B's blocks to two rows at
        a time."""
        drafts = drafts or {}  # (test_device.py decodes without)
        settings = [r.settings_at(r.n_past) for r in reqs]
        order = sorted(range(len(reqs)), key=lambda i: tuple(s for s, _ in settings[i].pairs))
        tokens: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        row_settings: list[AdapterSettings] = []
        first = [0] * len(reqs)  # each request's first row of the batch
        for i in order:
            r = reqs[i]
            feed = [r.generated[-1], *drafts.get(r.id, ())]
            first[i] = len(tokens)
            tokens += feed
            slots += [self.slots.slot(r)] * len(feed)
            starts += range(r.n_past, r.n_past + len(feed))
            row_settings += [settings[i]] * len(feed)
        batch = Batch(
            torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, 1),
            slots,
            starts,
            [1] * len(tokens),
            self._decode_lora(row_settings),
        )
        t0 = time.perf_counter()
        logits = self.model.forward(batch).cpu()  # the samplers run on the CPU: one copy a step
        if self.drafter is not None:  # what a step of this many rows costs, for the next drafts
            self.drafter.costs.observe(len(tokens), time.perf_counter() - t0)
        synth = self.speculative.synth_probs if self.speculative is not None else ()
        # the rows whose draw is the argmax (greedy, nothing else): one argmax for them all
        best = _argmax_rows(logits, reqs)
        for i, r in enumerate(reqs):  # (in the requests' own order)
            at = first[i]
            draft = drafts.get(r.id, ())
            if draft and synth:
                kept = self._keep_synthetic(r, logits[at : at + len(draft) + 1], draft, synth)
            else:
                self._emit(r, logits[at], best=None if best is None else best[at])
                kept = 0
                for tok in draft:  # the drafted token fed next was the one drawn: its logits hold
                    if r.done or r.generated[-1] != tok:
                        break
                    kept += 1
                    self._emit(r, logits[at + kept], best=None if best is None else best[at + kept])
            if draft:
                r.n_drafts += 1
                r.n_drafted += len(draft)
                r.n_draft_accepted += kept
                if self.drafter is not None:
                    self.drafter.verified(r, len(draft), kept)

    def _keep_synthetic(
        self, req: Request, logits: torch.Tensor, draft: Sequence[int], probs: Sequence[float]
    ) -> int:
        """Synthetic acceptance (runtime/speculative.py): each drafted token kept by chance, the
        target's token drawn at every place and taken at the first place not kept (after the
        whole draft, the next one); how many drafted tokens were kept. logits: (len(draft) + 1,
        n_vocab), the rows the draft's places computed."""
        if req.synth is None:
            req.synth = SynthDraws(req.params.seed)
        for i, tok in enumerate(draft):
            keep = req.synth.keep(probs[i] if i < len(probs) else 0.0) and tok not in req.eog
            self._emit(req, logits[i], tok if keep else None)
            if not keep or req.done:
                return i + int(keep)
        self._emit(req, logits[len(draft)])
        return len(draft)

    def _emit(
        self,
        req: Request,
        logits: torch.Tensor,
        kept: int | None = None,
        best: tuple[int, float] | None = None,
    ) -> None:
        """Sample the request's next token from its logits and append it; `kept`: a drafted
        token synthetic acceptance keeps instead (drawn past, as llama-server's own draw is, its
        grammar not advanced); `best`: the logits' argmax and its logit, taken with the batch's
        other rows, for a sampler whose draw is that (`Sampler.argmax_only`)."""
        assert req.sampler is not None
        try:
            if kept is None and best is not None and _argmax_only(req):
                tok, value = best
            else:
                if kept is None:
                    tok = req.sampler(logits, penalty_window(req.params, req.prompt, req.generated))
                else:
                    req.sampler.draw(logits.float())  # (the generator moves as it would have)
                    tok = kept
                value = float(logits[tok])
            if not math.isfinite(value):  # argmax picks a nan or an inf, if any
                raise FloatingPointError(f"the chosen token's logit is {value}")
        except Exception as exc:  # noqa: BLE001 - this row's failure ends this request alone
            req.error = _sampling_error(req, logits, exc)
            self.scheduler.finish(req, "error")
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
            self.scheduler.finish(req, "stop")
        elif 0 <= p.max_tokens <= len(req.generated):
            self.scheduler.finish(req, "length")
        elif req.n_past + 1 >= self.n_ctx and not self.scheduler.can_shift(req):
            self.scheduler.finish(req, "length")

    def stop(self, req: Request, reason: str = "stop") -> None:
        """End a request early (a stop string matched, the client left)."""
        with self.lock:
            self.scheduler.cancel(req, reason)

    def run(self, req: Request) -> None:
        """Drive the loop until this request ends (for single-threaded clients)."""
        while not req.done:
            self.step()


def _argmax_only(req: Request) -> bool:
    """Whether the request's sampler draws the argmax of the logits as they come (a caller's
    own sampler, any callable, is asked every token)."""
    return getattr(req.sampler, "argmax_only", False) is True


def _argmax_rows(logits: torch.Tensor, reqs: Sequence[Request]) -> list[tuple[int, float]] | None:
    """Every row's argmax and its logit, (B,) of them in two calls, when some request samples
    by the argmax alone; None when none does. Each is the row's first maximum, as the row's own
    argmax gives."""
    if not any(_argmax_only(r) for r in reqs):
        return None
    best = argmax(logits).unsqueeze(-1)  # (B, 1)
    values = logits.gather(-1, best).view(-1).tolist()
    return list(zip(best.view(-1).tolist(), values, strict=True))


def _sampling_error(req: Request, logits: torch.Tensor, exc: Exception) -> RequestError:
    """What to tell the one request whose token could not be sampled: the other rows of the step
    go on. Non-finite logits come from the request's own settings (an adapter at a scale too
    large for the model, say), so they are its error."""
    where = f"token {len(req.generated) + 1} of the generation"
    if not bool(torch.isfinite(logits).all()):
        return RequestError(
            f"the logits for {where} are not finite (inf or nan); the adapter scales "
            f"{dict(req.lora) or 'none'} may be too large for this model"
        )
    return RequestError(f"sampling {where} failed: {type(exc).__name__}: {exc}", "sampling_error")
