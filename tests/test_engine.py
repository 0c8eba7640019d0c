"""The engine on tiny random models: cache, batching, sampling determinism."""

from __future__ import annotations

import pytest
import torch

import graftlm
from graftlm.runtime.batch import Batch
from graftlm.runtime.engine import Request
from graftlm.runtime.sampling import SamplingParams


@pytest.fixture(params=["tiny_llama", "tiny_gemma3"])
def tiny(request: pytest.FixtureRequest) -> graftlm.Model:
    return graftlm.load(request.getfixturevalue(request.param), ctx_size=64, n_seq=4)


def _ids(n: int, seed: int, vocab: int = 250) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_cached_decode_equals_full_forward(tiny: graftlm.Model) -> None:
    """Prefill then one token at a time through the cache gives the logits of one full pass."""
    ids = _ids(24, 0)  # longer than the tiny gemma3's sliding window of 8
    full = tiny.logits(ids)
    m = tiny.model
    m.forward(Batch.single(ids[:10], slot=1, start=0))
    steps = []
    for i in range(10, len(ids)):
        steps.append(m.forward(Batch.single([ids[i]], slot=1, start=i))[0])
    torch.testing.assert_close(torch.stack(steps), full[10:], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_pass(tiny: graftlm.Model) -> None:
    ids = _ids(30, 1)
    full = tiny.logits(ids)
    tiny.engine.chunk = 7
    torch.testing.assert_close(tiny.logits(ids), full, rtol=1e-4, atol=1e-4)


def test_batch_of_sequences_equals_one_at_a_time(tiny: graftlm.Model) -> None:
    """Several sequences of different lengths decoded in one batch = each decoded alone."""
    prompts = [_ids(5, 2), _ids(9, 3), _ids(13, 4)]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    alone = []
    for p in prompts:
        r = tiny.engine.submit(Request(p, greedy, {}))
        tiny.engine.run(r)
        alone.append(r.generated)
    reqs = [tiny.engine.submit(Request(p, greedy, {})) for p in prompts]
    while any(not r.done for r in reqs):
        tiny.engine.step()
    assert [r.generated for r in reqs] == alone


def test_seeded_sampling_repeats(tiny: graftlm.Model) -> None:
    ids = _ids(6, 5)

    def draw(seed: int) -> list[int]:
        params = SamplingParams(
            temperature=50.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=seed,
            max_tokens=16,
            ignore_eos=True,
        )
        r = tiny.engine.submit(Request(ids, params, {}))
        tiny.engine.run(r)
        return r.generated

    assert draw(42) == draw(42)
    assert draw(42) != draw(43)


def test_logprobs_shape_and_normalization(tiny: graftlm.Model) -> None:
    ids = _ids(8, 6)
    out = tiny.logprobs(ids, top=3)
    assert [o["id"] for o in out] == ids[1:]
    for o in out:
        assert len(o["top"]) == 3
        assert o["top"][0][1] >= o["top"][1][1] >= o["top"][2][1]
        assert o["logprob"] <= o["top"][0][1] + 1e-6
    lp = torch.log_softmax(tiny.logits(ids), -1)
    assert abs(float(lp[0].exp().sum()) - 1.0) < 1e-4
