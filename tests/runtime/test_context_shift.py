"""llama-server's context shift (--context-shift): a sequence that fills its context keeps its first
n_keep tokens, drops half of the rest and goes on. The shortened context is computed again, so the
logits after a shift are those of a prompt of the context's tokens computed fresh (the oracle
here: `Engine.score` of those tokens); without the flag a sequence still ends at the context's
end; speculative decoding and a draft model give the same tokens as without."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import graftlm
from graftlm.lora.settings import NO_ADAPTERS
from graftlm.runtime.sampling import Sampler, SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.runtime.speculative import SpecConfig

N_CTX = 48
PARAMS = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tiny_models import TinySpec, write_tiny_model

    d = tmp_path_factory.mktemp("shift")
    return (
        write_tiny_model(d / "target.gguf", TinySpec(n_layer=3), seed=4),
        write_tiny_model(d / "draft.gguf", TinySpec(n_layer=1, n_embd=32, n_ff=48), seed=5),
    )


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def _loop(base: list[int]) -> list[int]:
    return base + base + base[: len(base) // 2]  # repeats itself: n-gram drafts find it


class Recording(Sampler):
    """Keeps the logits of every draw and the context each came after."""

    def __init__(self, params: SamplingParams) -> None:
        super().__init__(params)
        self.req: Request | None = None
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        assert self.req is not None
        self.seen.append((self.req.context(), logits.float().clone()))
        return super().__call__(logits, history)


def _run(m: graftlm.Model, prompts: list[list[int]], n_keep: int = 0) -> list[Request]:
    reqs = []
    for p in prompts:
        r = Request(list(p), PARAMS, n_keep=n_keep)
        r.sampler = rec = Recording(PARAMS)
        rec.req = r
        reqs.append(r)
        m.engine.submit(r)
    while m.engine.busy:
        m.engine.step()
    return reqs


def test_without_the_flag_a_sequence_ends_at_the_contexts_end(files: tuple[Path, Path]) -> None:
    m = graftlm.load(files[0], ctx_size=N_CTX, n_seq=2)
    (r,) = _run(m, [_ids(30, seed=1)])
    assert len(r.generated) == N_CTX - 30 and r.finish_reason == "length" and r.dropped == 0


def test_after_a_shift_the_logits_are_those_of_the_context_computed_fresh(
    files: tuple[Path, Path],
) -> None:
    m = graftlm.load(files[0], ctx_size=N_CTX, n_seq=3)
    (before,) = _run(m, [_ids(30, seed=1)])
    m.engine.context_shift = True
    prompts = [_ids(30, seed=1), _ids(41, seed=2)]
    reqs = _run(m, prompts)
    for r in reqs:
        assert len(r.generated) == 70 and r.finish_reason == "length"
        assert r.dropped > 0 and len(r.context()) <= N_CTX
    # up to the first shift, the tokens of a run without it
    assert reqs[0].generated[: N_CTX - 30] == before.generated
    # every draw after a shift saw the logits of its context computed as a fresh prompt
    n_checked = 0
    for r in reqs:
        assert isinstance(r.sampler, Recording)
        for context, logits in r.sampler.seen:
            if len(context) == len(r.prompt) + len(r.generated):  # (no shift yet)
                continue
            fresh = m.engine.score(context, NO_ADAPTERS)[-1]
            torch.testing.assert_close(logits, fresh, atol=2e-2, rtol=2e-2)
            n_checked += 1
    assert n_checked > 40


def test_the_first_n_keep_tokens_stay_and_half_the_rest_goes(files: tuple[Path, Path]) -> None:
    m = graftlm.load(files[0], ctx_size=N_CTX, n_seq=2)
    m.engine.context_shift = True
    prompt = _ids(40, seed=3)
    (r,) = _run(m, [prompt], n_keep=5)
    assert r.context()[:5] == prompt[:5] and r.context()[-1] == r.generated[-1]
    # llama-server's rule: at n_past 47 (the context full), 42 tokens after the kept ones, 21
    # dropped; the next draw sees 27 tokens, and every 21 tokens 21 more go: at the 8th, 29th and
    # 50th generated token
    seen = [len(c) for c, _ in r.sampler.seen]  # type: ignore[union-attr]
    assert max(seen) == N_CTX - 1 and min(seen) == N_CTX - 21
    assert r.dropped == 3 * 21


def test_speculation_and_a_draft_model_give_the_same_tokens(files: tuple[Path, Path]) -> None:
    target, draft = files
    prompts = [_loop(_ids(12, seed=s)) for s in (5, 6)]  # 30 tokens each
    m = graftlm.load(target, ctx_size=N_CTX, n_seq=3)
    m.engine.context_shift = True
    plain = _run(m, prompts)
    m.engine.speculative = SpecConfig(n_max=6)
    ngram = _run(m, prompts)
    d = graftlm.load(target, ctx_size=N_CTX, n_seq=3, draft_model=draft)
    d.engine.context_shift = True
    drafted = _run(d, prompts)
    for got in (ngram, drafted):
        assert [r.generated for r in got] == [r.generated for r in plain]
        assert [r.dropped for r in got] == [r.dropped for r in plain]
        assert sum(r.n_drafted for r in got) > 0


def test_a_padded_prefill_row_stays_within_the_context(files: tuple[Path, Path]) -> None:
    """A row starting past cached blocks beside a longer one: padded to the longer one's width,
    its positions would run past the context (RoPE has no angles there); it waits a step."""
    m = graftlm.load(files[0], ctx_size=N_CTX, n_seq=3)
    (cached,) = _run(m, [_ids(47, seed=1)])  # its first 32 tokens enter the prefix cache
    a, b = _run(m, [_ids(47, seed=1), _ids(47, seed=2)])
    assert a.n_cached == 32 and a.generated == cached.generated and b.generated
