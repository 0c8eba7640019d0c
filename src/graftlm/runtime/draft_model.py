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

    req: Request
    slot: int
    cached: int = 0
    drafted_at: int = 0


class ModelDrafter:
    """Drafts for the decode rows of a step with `model` (its own cache of n_slots slots)."""

    def __init__(self, model: Transformer, cfg: SpecConfig, n_slots: int) -> None:
        self.model = model
        self.cfg = cfg
        self.costs = StepCosts()  # (the engine reports its steps; drafting here is by n_max)
        cache = model.allocate_cache(n_slots)  # (default: every slot's whole context)
        for s in range(n_slots):  # each slot its own blocks, for the drafter's life
            cache.set_table(
                s, list(range(1 + s * cache.max_blocks, 1 + (s + 1) * cache.max_blocks))
            )
        self.free = list(range(n_slots))
        self.held: dict[int, _Row] = {}  # request id -> its row

    def _release_done(self) -> None:
        for rid, row in list(self.held.items()):
            if getattr(row.req, "done", False) or getattr(row.req, "cancelled", False):
                self.free.append(row.slot)
                del self.held[rid]

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], room: Sequence[int]) -> dict[int, list[int]]:
        self._release_done()
        rows: list[tuple[Request, int, int, float]] = []  # (req, n_max, n_min, p_min)
        for req, n_room in zip(reqs, room, strict=True):
            n_max, n_min, p_min = self.cfg.bounds(req.spec)
            n_max = min(n_max, n_room)
            if n_max < max(1, n_min):
                continue
            if req.id not in self.held:
                if not self.free:
                    continue  # more rows than slots (scoring's borrowed one): plain decoding
                self.held[req.id] = _Row(req, self.free.pop())
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
            tokens = torch.tensor([[drafts[r.id][-1]] for r, _, _ in live], dtype=torch.long)
            starts = [h.drafted_at + len(drafts[h.req.id]) - 1 for h in held]
            batch = Batch(tokens.to(self.model.device), [h.slot for h in held], starts,
                          [1] * len(live))  # fmt: skip
            logits = self.model.forward(batch).float().cpu()
            nxt = []
            for (req, n_max, p_min), logit in zip(live, logits, strict=True):
                prob, best = torch.softmax(logit, -1).max(-1)
                if float(prob) < p_min:
                    continue
                drafts[req.id].append(int(best))
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
            todo = []
            for req in reqs:
                h = self.held[req.id]
                toks = req.prompt + req.generated
                if h.cached < len(toks):
                    todo.append((h, toks[h.cached : h.cached + CATCH_UP], len(toks)))
            if not todo:
                break
            width = max(len(t) for _, t, _ in todo)
            tokens = torch.zeros(len(todo), width, dtype=torch.long)
            for i, (_, t, _) in enumerate(todo):
                tokens[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            batch = Batch(tokens.to(self.model.device), [h.slot for h, _, _ in todo],
                          [h.cached for h, _, _ in todo], [len(t) for _, t, _ in todo])  # fmt: skip
            logits = self.model.forward(batch).float().cpu()
            for (h, t, n_tok), logit in zip(todo, logits, strict=True):
                h.cached += len(t)
                h.drafted_at = h.cached
                if h.cached == n_tok:
                    prob, best = torch.softmax(logit, -1).max(-1)
                    out[h.req.id] = (int(best), float(prob))
        return [out[r.id] for r in reqs]

    def verified(self, req: Request, n_drafted: int, n_accepted: int) -> None:
        """The slot holds the row's tokens, its draft's first n_accepted kept, up to the last
        drafted token fed (the draft's own positions past the last kept are written again)."""
        h = self.held.get(req.id)
        if h is not None:
            h.cached = h.drafted_at + min(n_accepted, n_drafted - 1)


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
