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

import torch

from graftlm.errors import GraftError
from graftlm.models import Transformer
from graftlm.runtime.speculative import Request, SpecConfig, StepCosts
from graftlm.step.batch import Batch

CATCH_UP = 512  # the most tokens of one row a catch-up pass feeds


class ModelDrafter:
    """Drafts for the decode rows of a step with `model` (its own cache of n_slots slots)."""

    def __init__(self, model: Transformer, cfg: SpecConfig, n_slots: int) -> None:
        self.model = model
        self.cfg = cfg
        self.costs = StepCosts()  # (the engine reports its steps; drafting here is by n_max)
        cache = model.allocate_cache(n_slots, n_slots * _max_blocks(model) + 1)
        for s in range(n_slots):  # each slot its own whole context, for the drafter's life
            cache.set_table(
                s, list(range(1 + s * cache.max_blocks, 1 + (s + 1) * cache.max_blocks))
            )
        self.free = list(range(n_slots))
        # request id -> (the request, its slot, tokens its slot holds, its length when drafted)
        self.held: dict[int, list] = {}

    def _release_done(self) -> None:
        for rid, (req, slot, _, _) in list(self.held.items()):
            if getattr(req, "done", False) or getattr(req, "cancelled", False):
                self.free.append(slot)
                del self.held[rid]

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], room: Sequence[int]) -> dict[int, list[int]]:
        self._release_done()
        cfg = self.cfg
        rows: list[tuple[Request, int]] = []
        for req, n_room in zip(reqs, room, strict=True):
            own = req.spec
            n_max = cfg.n_max if own is None or own.n_max is None else own.n_max
            n_min = cfg.n_min if own is None or own.n_min is None else own.n_min
            n_max = min(n_max, n_room)
            if n_max < max(1, n_min):
                continue
            if req.id not in self.held:
                if not self.free:
                    continue  # more rows than slots (scoring's borrowed one): plain decoding
                self.held[req.id] = [req, self.free.pop(), 0, 0]
            rows.append((req, n_max))
        if not rows:
            return {}
        last = self._catch_up([r for r, _ in rows])
        drafts: dict[int, list[int]] = {}
        live = []
        for (req, n_max), (tok, p) in zip(rows, last, strict=True):
            p_min = self._p_min(req)
            if p < p_min:
                continue
            drafts[req.id] = [tok]
            if n_max > 1:
                live.append((req, n_max))
        while live:  # one draft step for every row still drafting
            held = [self.held[r.id] for r, _ in live]
            tokens = torch.tensor([[drafts[r.id][-1]] for r, _ in live], dtype=torch.long)
            starts = [h[3] + len(drafts[r.id]) - 1 for h, (r, _) in zip(held, live, strict=True)]
            batch = Batch(tokens.to(self.model.device), [h[1] for h in held], starts,
                          [1] * len(live))  # fmt: skip
            logits = self.model.forward(batch).float().cpu()
            nxt = []
            for (req, n_max), row in zip(live, logits, strict=True):
                prob, best = torch.softmax(row, -1).max(-1)
                if float(prob) < self._p_min(req):
                    continue
                drafts[req.id].append(int(best))
                if len(drafts[req.id]) < n_max:
                    nxt.append((req, n_max))
            live = nxt
        out = {}
        for req, _ in rows:
            d = drafts.get(req.id)
            own = req.spec
            n_min = cfg.n_min if own is None or own.n_min is None else own.n_min
            if d and len(d) >= n_min:
                out[req.id] = d
        return out

    def _p_min(self, req: Request) -> float:
        own = req.spec
        return self.cfg.p_min if own is None or own.p_min is None else own.p_min

    def _catch_up(self, reqs: list[Request]) -> list[tuple[int, float]]:
        """Feed each row's slot the tokens it lacks; the draft's next token after each row's
        tokens, and its probability."""
        out: list[tuple[int, float] | None] = [None] * len(reqs)
        while True:
            todo = []
            for i, req in enumerate(reqs):
                h = self.held[req.id]
                toks = req.prompt + req.generated
                if h[2] < len(toks):
                    todo.append((i, req, toks[h[2] : h[2] + CATCH_UP]))
            if not todo:
                break
            width = max(len(t) for _, _, t in todo)
            tokens = torch.zeros(len(todo), width, dtype=torch.long)
            for row, (_, _, t) in enumerate(todo):
                tokens[row, : len(t)] = torch.tensor(t, dtype=torch.long)
            held = [self.held[r.id] for _, r, _ in todo]
            batch = Batch(tokens.to(self.model.device), [h[1] for h in held], [h[2] for h in held],
                          [len(t) for _, _, t in todo])  # fmt: skip
            logits = self.model.forward(batch).float().cpu()
            for (i, req, t), h, row in zip(todo, held, logits, strict=True):
                h[2] += len(t)
                h[3] = h[2]
                if h[2] == len(req.prompt) + len(req.generated):
                    prob, best = torch.softmax(row, -1).max(-1)
                    out[i] = (int(best), float(prob))
        assert all(o is not None for o in out)
        return [o for o in out if o is not None]

    def verified(self, req: Request, n_drafted: int, n_accepted: int) -> None:
        """The slot holds the row's tokens, its draft's first n_accepted kept, up to the last
        drafted token fed (the draft's own positions past the last kept are written again)."""
        h = self.held.get(req.id)
        if h is not None:
            h[2] = h[3] + min(n_accepted, n_drafted - 1)


def _max_blocks(model: Transformer) -> int:
    from graftlm.step.kv_cache import BLOCK

    return -(-model.n_ctx // BLOCK)


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
