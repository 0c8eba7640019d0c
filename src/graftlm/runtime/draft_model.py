"""Speculative decoding with a draft model: a small model of the target's vocabulary drafts each
row's next tokens greedily (llama-server's `-md` with `--spec-type draft-simple`).

The drafter keeps its own KV cache, one slot of the whole context per running row, and what each
row's slot holds: the row's tokens up to `n_cached`. Before drafting, a row's slot catches up
with the tokens it lacks (its prompt the first time, then the tokens the last verification kept
and the target's own); then every drafting row runs one decode step of the draft model per
drafted token, in one batch, stopping where the draft's top probability falls below p_min or at
n_max tokens. The target verifies as for any draft (runtime/speculative.py): the output is the
target's alone. The draft model runs without adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graftlm.errors import GraftError
from graftlm.models import Transformer
from graftlm.runtime.speculative import Request, SpecConfig, StepCosts
from graftlm.step.batch import Batch

CATCH_UP = 512  # the most tokens of one row a catch-up pass feeds


@dataclass(eq=False)
class _Row:
    """A row's place in the draft model's cache: its slot, how many of its tokens the slot
    holds, and its length when it last drafted (the first drafted token's position)."""

    slot: int
    cached: int = 0
    drafted_at: int = 0


class ModelDrafter:
    """Drafts for the decode rows of a step with `model` (its own cache of n_slots slots)."""

    def __init__(self, model: Transformer, cfg: SpecConfig, n_slots: int) -> None:
        self.model = model
        self.cfg = cfg
        self.costs = StepCosts()  # (the engine reports its steps; drafting here is by n_max)
        # the default pool: every slot its whole context, its own blocks for the drafter's life
        model.allocate_cache(n_slots)
        self.free = list(range(n_slots))
        self.held: dict[int, _Row] = {}  # request id -> its row

    def release(self, req: Request) -> None:
        row = self.held.pop(req.id, None)
        if row is not None:
            self.free.append(row.slot)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], room: Sequence[int]) -> dict[int, list[int]]:
        rows: list[tuple[Request, int, int, float]] = []  # (req, n_max, n_min, p_min)
        for req, n_room in zip(reqs, room, strict=True):
            n_max, n_min, p_min = self.cfg.bounds(req.spec)
            n_max = min(n_max, n_room)
            if n_max < max(1, n_min):
                continue
            if req.id not in self.held:
                if not self.free:
                    continue  # more rows than slots (preempted ones hold theirs): plain decoding
                self.held[req.id] = _Row(self.free.pop())
            rows.append((req, n_max, n_min, p_min))
        if not rows:
            return {}
        last = self._catch_up([r for r, _, _, _ in rows])
        drafts: dict[int, list[int]] = {}
        live = []
        for (req, n_max, _, p_min), (tok, p) in zip(rows, last, strict=True):
            if p < p_min:
                continue
            drafts[req.id] = [tok]
            if n_max > 1:
                live.append((req, n_max, p_min))
        while live:  # one draft step for every row still drafting
            held = [self.held[r.id] for r, _, _ in live]
            batch = Batch.padded(
                [[drafts[r.id][-1]] for r, _, _ in live],
                [h.slot for h in held],
                [
                    h.drafted_at + len(drafts[r.id]) - 1
                    for h, (r, _, _) in zip(held, live, strict=True)
                ],
                device=self.model.device,
            )
            probs, bests = _top(self.model.forward(batch))
            nxt = []
            for (req, n_max, p_min), prob, best in zip(live, probs, bests, strict=True):
                if prob < p_min:
                    continue
                drafts[req.id].append(best)
                if len(drafts[req.id]) < n_max:
                    nxt.append((req, n_max, p_min))
            live = nxt
        return {
            req.id: drafts[req.id]
            for req, _, n_min, _ in rows
            if req.id in drafts and len(drafts[req.id]) >= n_min
        }

    def _catch_up(self, reqs: list[Request]) -> list[tuple[int, float]]:
        """Feed each row's slot the tokens it lacks; the draft's next token after each row's
        tokens, and its probability."""
        out: dict[int, tuple[int, float]] = {}
        while True:
            todo = []  # (request id, its row, the tokens it lacks (at most CATCH_UP), its length)
            for req in reqs:
                h = self.held[req.id]
                n_tok = req.n_past + 1  # (the context's tokens: a shift drops some)
                if h.cached < n_tok:
                    todo.append((req.id, h, req.tokens_from(h.cached, CATCH_UP), n_tok))
            if not todo:
                break
            # (padded to the longest, a row's positions run to its start + the width: they must
            # stay within the context; the rows left out go in the next pass)
            width = last = 0
            for k, (_, h, t, _) in enumerate(todo):
                if k and max(last, h.cached) + max(width, len(t)) > self.model.n_ctx:
                    todo = todo[:k]
                    break
                width, last = max(width, len(t)), max(last, h.cached)
            batch = Batch.padded([t for _, _, t, _ in todo], [h.slot for _, h, _, _ in todo],
                                 [h.cached for _, h, _, _ in todo], device=self.model.device)  # fmt: skip
            probs, bests = _top(self.model.forward(batch))
            for (rid, h, t, n_tok), prob, best in zip(todo, probs, bests, strict=True):
                h.cached += len(t)
                h.drafted_at = h.cached
                if h.cached == n_tok:
                    out[rid] = (best, prob)
        return [out[r.id] for r in reqs]

    def verified(self, req: Request, n_drafted: int, n_accepted: int) -> None:
        """The slot holds the row's tokens, its draft's first n_accepted kept, up to the last
        drafted token fed (the draft's own positions past the last kept are written again)."""
        h = self.held.get(req.id)
        if h is not None:
            h.cached = h.drafted_at + min(n_accepted, n_drafted - 1)


def _top(logits: torch.Tensor) -> tuple[list[float], list[int]]:
    """Each row's most likely token and its probability, (B, n_vocab) in one pass on the
    logits' device: 2 B numbers come back."""
    prob, best = torch.softmax(logits.float(), -1).max(-1)
    return prob.tolist(), best.tolist()


def check_vocabulary(target: list[str], draft: list[str], draft_path: str) -> None:
    """The draft must spell every token as the target does (its ids are verified as-is)."""
    if len(target) != len(draft):
        raise GraftError(
            f"{draft_path}: the draft model's vocabulary has {len(draft)} tokens, the model's "
            f"{len(target)}: a draft needs the model's vocabulary"
        )
    bad = next((i for i, (a, b) in enumerate(zip(target, draft, strict=True)) if a != b), None)
    if bad is not None:
        raise GraftError(
            f"{draft_path}: the draft model's token {bad} is {draft[bad]!r}, the model's "
            f"{target[bad]!r}: a draft needs the model's vocabulary"
        )
