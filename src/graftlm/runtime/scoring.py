"""Teacher-forced scoring: the logits after each prefix of a sequence, and the log-probability of
each next token with its most likely alternatives. `Model.logits`/`Model.logprobs` and the
server's `prompt_logprobs` (on the engine thread) both come from here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graftlm.errors import RequestError
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.engine import Engine
from graftlm.runtime.prompting import Prompter

POOLINGS = ("mean", "cls", "last")  # llama.cpp's poolings of one vector an input


class Scorer:
    def __init__(self, engine: Engine, prompter: Prompter) -> None:
        self.engine = engine
        self.prompter = prompter

    def logits(self, ids: Sequence[int], lora: AdapterSettings) -> torch.Tensor:
        """Raw logits (len(ids), n_vocab) after each prefix of ids, in one pass."""
        self.prompter.check_ids(ids)
        if len(ids) == 0:
            raise RequestError("nothing to score: the ids are empty")
        return self.engine.score(list(ids), lora)

    @torch.inference_mode()
    def embedding(
        self, ids: Sequence[int], lora: AdapterSettings, pooling: str = "mean"
    ) -> list[float]:
        """The final-norm hidden state pooled over ids (n_embd,), L2-normalized, with these
        adapter settings; in chunks, on a borrowed cache slot, on the exact path. pooling (as
        llama.cpp's): "mean" over the tokens, "cls" the first token's, "last" the last's."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r}: not one of {', '.join(POOLINGS)}")
        hidden = self._hidden(ids, lora, "embed")
        if pooling == "mean":
            pooled = hidden.mean(0)
        else:
            pooled = hidden[0] if pooling == "cls" else hidden[-1]
        return torch.nn.functional.normalize(pooled, dim=0).tolist()

    @torch.inference_mode()
    def token_embeddings(self, ids: Sequence[int], lora: AdapterSettings) -> list[list[float]]:
        """llama.cpp's pooling "none": every token's final-norm hidden state, not normalized."""
        return self._hidden(ids, lora, "embed").tolist()

    def _hidden(self, ids: Sequence[int], lora: AdapterSettings, what: str) -> torch.Tensor:
        self.prompter.check_ids(ids)
        if len(ids) == 0:
            raise RequestError(f"nothing to {what}: the input is empty")
        return self.engine.score(list(ids), lora, hidden=True).float()  # (len(ids), n_embd)

    @torch.inference_mode()
    def rank_score(self, ids: Sequence[int], lora: AdapterSettings) -> float:
        """llama.cpp's rank pooling for a model without a classification head: the first
        component of the last token's final-norm hidden state."""
        return float(self._hidden(ids, lora, "score")[-1, 0])

    def logprobs(self, ids: Sequence[int], top: int, lora: AdapterSettings) -> list[dict[str, Any]]:
        """For i in 1..len(ids)-1: {"id": ids[i], "logprob": log p(ids[i] | ids[:i]), "top":
        [[token, logprob], ...] the `top` most likely, best first (at most the vocabulary)}."""
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise RequestError(f"top must be a whole number >= 0, got {top!r}")
        top = min(top, self.prompter.n_vocab)
        ids = list(ids)
        if len(ids) < 2:
            return []
        self.prompter.check_ids(ids)
        target = torch.tensor([*ids[1:], 0])  # the last position predicts nothing: dropped

        def keep(start: int, logits: torch.Tensor) -> torch.Tensor:
            """A chunk's rows reduced to [chosen, top values, top ids] (float64 holds the ids
            exactly), so a long prompt never holds all its (n, V) logits at once."""
            lp = torch.log_softmax(logits.float(), dim=-1)
            chosen = lp.gather(1, target[start : start + len(lp)].unsqueeze(1))
            tv, ti = lp.topk(top, dim=-1)
            return torch.cat([chosen.double(), tv.double(), ti.double()], dim=1)

        kept = self.engine.score(ids, lora, each=keep)[:-1]
        chosen = kept[:, 0].tolist()
        tv_l, ti_l = kept[:, 1 : 1 + top].tolist(), kept[:, 1 + top :].long().tolist()
        return [
            {
                "id": ids[i + 1],
                "logprob": chosen[i],
                "top": [[t, v] for t, v in zip(ti_l[i], tv_l[i], strict=False)],
            }
            for i in range(len(ids) - 1)
        ]
