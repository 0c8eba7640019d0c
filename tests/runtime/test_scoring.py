"""Teacher-forced log-probabilities of a long prompt (the server's echo): the same numbers as
the whole logits' log-softmax, without ever holding the whole (n, V) logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import TinySpec, write_tiny_model

import graftlm


def test_prompt_logprobs_come_a_chunk_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41: `logprobs` with `echo` on a long prompt took a log-softmax over every position
    at once (n x V floats twice: 1 GB on SmolLM2 at 2,500 tokens), memory the process kept."""
    spec = TinySpec(n_ctx=256)
    model = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=256)
    model.engine.chunk = 32
    ids = [
        int(t)
        for t in torch.randint(
            3, int(model.config.n_vocab), (150,), generator=torch.Generator().manual_seed(1)
        )
    ]
    whole = torch.log_softmax(model.logits(ids)[:-1].float(), dim=-1)

    rows: list[int] = []
    real = torch.log_softmax

    def counting(x: torch.Tensor, dim: int) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(x, dim=dim)

    monkeypatch.setattr(torch, "log_softmax", counting)
    got = model.logprobs(ids, top=3)
    monkeypatch.undo()
    assert rows and max(rows) <= 32, rows
    assert len(got) == len(ids) - 1
    for i, entry in enumerate(got):
        assert entry["id"] == ids[i + 1]
        assert entry["logprob"] == pytest.approx(float(whole[i, ids[i + 1]]), abs=1e-6)
        tv, ti = whole[i].topk(3)
        assert [t for t, _ in entry["top"]] == ti.tolist()
        assert [v for _, v in entry["top"]] == pytest.approx(tv.tolist(), abs=1e-6)
