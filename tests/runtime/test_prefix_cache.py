"""The paged cache's allocator and prefix cache: the pool alone (plain Python), then the engine
on a tiny model: reuse across requests, never across adapter settings, preemption when the pool
runs short, and the same tokens and log-probabilities as computed from scratch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graftlm
from graftlm.errors import RequestError
from graftlm.lora.settings import NO_ADAPTERS, AdapterSettings
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.step.kv_allocator import BlockPool, PagedAllocator

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _ids(n: int, seed: int, vocab: int = 250) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# -- the pool alone ---------------------------------------------------------------------------------


def test_pool_evicts_the_least_recently_used_unheld_block_only() -> None:
    pool = BlockPool(5)  # blocks 1..4
    a, b, c = pool.take(), pool.take(), pool.take()
    for blk, d in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.enter(blk, d)
    pool.drop(a)  # a idle first, then c; b still held
    pool.drop(c)
    assert pool.n_available == 3 and pool.n_cached == 3
    fresh = pool.take()  # the free block first
    assert fresh not in (a, b, c)
    assert pool.take() == a and b"a" not in pool.by_digest  # then the oldest idle: a, evicted
    pool.share(c)  # looked up again: held, no longer evictable
    with pytest.raises(RequestError, match="pool is full"):
        pool.take()
    assert pool.by_digest[b"b"] == b and pool.by_digest[b"c"] == c and pool.stats.evicted == 1


def _alloc(n_blocks: int = 9, n_slots: int = 3, max_blocks: int = 4) -> tuple[PagedAllocator, dict]:
    tables: dict[int, list[int]] = {}
    alloc = PagedAllocator(n_slots, n_blocks, 4, max_blocks, lambda s, b: tables.__setitem__(s, b))
    alloc.admit_tokens = 16
    return alloc, tables


def test_lookup_shares_the_longest_cached_run_and_leaves_a_token_to_compute() -> None:
    alloc, tables = _alloc()
    first = Request(list(range(10, 22)), GREEDY)  # 12 tokens: 3 full blocks of 4
    alloc.admit(first)
    assert first.n_prefilled == 0 and alloc.grow(first, 12)
    alloc.commit(first, 12)
    held = tables[alloc.slot(first)]
    again = Request(list(range(10, 22)), GREEDY)  # the same 12: the last block is computed again
    alloc.admit(again)
    assert again.n_cached == again.n_prefilled == 8
    assert tables[alloc.slot(again)] == held[:2]
    longer = Request([*range(10, 22), 99, 98], GREEDY)
    alloc.admit(longer)
    assert longer.n_cached == 12 and tables[alloc.slot(longer)] == held
    alloc.release(first)
    assert alloc.pool.refs[held[0]] == 2 and alloc.pool.refs[held[2]] == 1


def test_blocks_are_keyed_by_adapter_settings_and_by_the_adapters_loaded() -> None:
    alloc, _ = _alloc(n_blocks=20, n_slots=6)
    prompt = list(range(30, 39))  # 2 full blocks
    settings = [
        NO_ADAPTERS,
        AdapterSettings({0: 1.0}),
        AdapterSettings({0: 0.5}),
        AdapterSettings({0: 1.0, 1: 1.0}),
    ]
    for lora in settings:  # each its own setting: nothing of another's is found
        r = Request(prompt, GREEDY, lora)
        alloc.admit(r)
        assert r.n_cached == 0
        alloc.grow(r, len(prompt))
        alloc.commit(r, len(prompt))
        alloc.release(r)
    for lora in settings:
        r = Request(prompt, GREEDY, lora)
        alloc.admit(r)
        assert r.n_cached == 8, lora
        alloc.release(r)
    alloc.adapters_changed()  # an adapter reloaded: only the base's blocks are found
    for lora in settings:
        r = Request(prompt, GREEDY, lora)
        alloc.admit(r)
        assert r.n_cached == (8 if lora == NO_ADAPTERS else 0), lora
        alloc.release(r)


# -- the engine on a tiny model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

    d = tmp_path_factory.mktemp("prefix")
    spec = TinySpec()
    model = write_tiny_model(d / "m.gguf", spec)
    return (
        model,
        write_tiny_adapter(d / "a.gguf", spec, seed=1),
        write_tiny_adapter(d / "b.gguf", spec, seed=2),
    )


def _recording(req: Request) -> list[torch.Tensor]:
    """Greedy sampling that keeps each step's log-probabilities."""
    seen: list[torch.Tensor] = []

    def sample(logits: torch.Tensor, history: list[int]) -> int:
        seen.append(torch.log_softmax(logits.double(), -1))
        return int(logits.argmax())

    req.sampler = sample  # type: ignore[assignment]
    return seen


def _run(m: graftlm.Model, prompt: list[int], lora: AdapterSettings = NO_ADAPTERS):
    req = Request(list(prompt), GREEDY, lora)
    logps = _recording(req)
    m.engine.submit(req)
    m.engine.run(req)
    return req, torch.stack(logps)


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_a_cached_prefix_gives_what_computing_it_again_gives(
    adapters: tuple[Path, Path, Path], cache_type: str
) -> None:
    """Under base, A, A at 0.5 and A + B: the first request of a prompt finds nothing, the
    second finds its full blocks and computes the rest, with the same tokens and log-probabilities
    as an engine without the prefix cache."""
    model, a_path, b_path = adapters
    on = graftlm.load(model, ctx_size=128, n_seq=2, cache_type=cache_type)
    off = graftlm.load(model, ctx_size=128, n_seq=2, cache_type=cache_type, prefix_cache=False)
    ids = []
    for m in (on, off):
        ids = [m.add_lora(a_path), m.add_lora(b_path)]
    a, b = ids
    prompt = _ids(45, 3)
    for lora in (
        NO_ADAPTERS,
        AdapterSettings({a: 1.0}),
        AdapterSettings({a: 0.5}),
        AdapterSettings({a: 1.0, b: 1.0}),
    ):
        first, lp_first = _run(on, prompt, lora)
        second, lp_second = _run(on, prompt, lora)
        fresh, lp_fresh = _run(off, prompt, lora)
        assert first.n_cached == 0 and fresh.n_cached == 0, lora
        assert second.n_cached == 32, lora  # 2 of the prompt's full blocks of 16 (45 - 1 // 16)
        assert second.generated == fresh.generated == first.generated, lora
        torch.testing.assert_close(
            lp_second, lp_fresh, rtol=0, atol=2e-4 if cache_type == "f16" else 1e-5
        )
        torch.testing.assert_close(lp_first, lp_fresh, rtol=0, atol=0)  # nothing cached: the same


def test_a_chat_turn_reuses_the_turn_before(adapters: tuple[Path, Path, Path]) -> None:
    """The second turn's prompt is the first's, its answer and more: every full block of the
    first turn, its generated tokens included, is found."""
    m = graftlm.load(adapters[0], ctx_size=128, n_seq=1)
    prompt = _ids(40, 5)
    first, _ = _run(m, prompt)
    turn2 = prompt + first.generated + _ids(9, 6)
    second, _ = _run(m, turn2)
    assert second.n_cached == (len(prompt) + len(first.generated) - 1) // 16 * 16 == 32


def test_a_short_pool_preempts_and_every_request_ends_as_it_would_alone(
    adapters: tuple[Path, Path, Path],
) -> None:
    """A pool of 6 blocks (96 positions) for four requests of 40-token prompts that each grow to
    56 positions: admission waits, decoding rows that cannot grow preempt the last admitted, which
    is computed again later; every request ends with the tokens it gets alone."""
    model = adapters[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = graftlm.load(model, ctx_size=128, n_seq=1, cache_type="f32")
    prompts = [_ids(40, 10 + i) for i in range(4)]
    want = []
    for p in prompts:
        r = Request(p, params)
        alone.engine.submit(r)
        alone.engine.run(r)
        want.append(r.generated)
    short = graftlm.load(model, ctx_size=128, n_seq=4, cache_type="f32", cache_blocks=7)
    eng = short.engine
    reqs = [eng.submit(Request(p, params)) for p in prompts]
    preempted = 0
    for _ in range(500):
        if not eng.busy:
            break
        eng.step()
        preempted += sum(1 for r in eng.waiting if r.resume is not None)
        assert eng.slots.pool.n_used <= 6
    assert not eng.busy and preempted > 0
    assert [r.generated for r in reqs] == want
    assert all(r.finish_reason == "length" for r in reqs)


def test_a_prompt_longer_than_the_pool_is_refused_naming_the_sizes(
    adapters: tuple[Path, Path, Path],
) -> None:
    m = graftlm.load(adapters[0], ctx_size=128, n_seq=2, cache_blocks=3)  # 2 blocks: 32 tokens
    with pytest.raises(RequestError, match=r"40 tokens; the context size is 32 .*pool holds 32"):
        m.engine.submit(Request(_ids(40, 1), GREEDY))
    assert m.engine.n_ctx == 32


def test_model_chat_turns_compute_only_what_is_new(adapters: tuple[Path, Path, Path]) -> None:
    """Model.chat: the second turn's prompt (the first turn, its answer and a new message) finds
    the first turn's blocks; the answer is the one a model without the cache gives."""
    on = graftlm.load(adapters[0], ctx_size=256)
    off = graftlm.load(adapters[0], ctx_size=256, prefix_cache=False)
    history = [{"role": "system", "content": "You answer briefly. " * 8},
               {"role": "user", "content": "one two three"}]  # fmt: skip
    answers = []
    for m in (on, off):
        msgs = list(history)
        first = m.chat(msgs, max_tokens=8, temperature=0)
        assert m.last_timings.n_cached == 0
        n_first = m.last_timings.n_prompt
        msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "four"}]
        answers.append(m.chat(msgs, max_tokens=8, temperature=0))
        n_prompt, n_cached = m.last_timings.n_prompt, m.last_timings.n_cached
        if m is on:
            # at least the first turn's prompt, in whole blocks (the answer's text may tokenize
            # otherwise than it was generated, which ends the match there)
            assert n_cached >= (n_first - 1) // 16 * 16 > 0, (n_first, n_prompt, n_cached)
        else:
            assert n_cached == 0
    assert answers[0] == answers[1]


def test_an_activated_lora_reuses_the_base_conversation(tmp_path: Path) -> None:
    """aLoRA's point: a conversation the base computed, then the aLoRA invoked on it. Every
    full block before the invocation is the base's and is found; the plain LoRA of the same
    weights finds nothing (it changes every position). Both give what an engine without the
    cache gives, and the aLoRA's answer differs from the base's. A prompt without the
    invocation runs as base and says so (`inactive`)."""
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

    spec = TinySpec()
    model = write_tiny_model(tmp_path / "m.gguf", spec)
    invocation = [7, 8, 9]
    alora_file = write_tiny_adapter(tmp_path / "al.gguf", spec, seed=3,
                                    metadata={"adapter.alora.invocation_tokens": invocation})  # fmt: skip
    plain_file = write_tiny_adapter(tmp_path / "pl.gguf", spec, seed=3)
    conversation = _ids(70, 21)
    prompt = conversation + invocation + _ids(5, 22)
    results = {}
    for cache in (True, False):
        m = graftlm.load(model, ctx_size=256, cache_type="f32", prefix_cache=cache)
        al, pl = m.add_lora(alora_file), m.add_lora(plain_file)
        base_first, _ = _run(m, conversation)
        with_alora, lp_a = _run(m, prompt, AdapterSettings({al: 1.0}))
        with_plain, lp_p = _run(m, prompt, AdapterSettings({pl: 1.0}))
        base, lp_b = _run(m, prompt)
        missing, _ = _run(m, conversation + [3], AdapterSettings({al: 1.0}))
        results[cache] = (with_alora, lp_a, with_plain, lp_p, base, lp_b, missing)
        if cache:
            assert with_alora.n_cached == 64  # 4 blocks: positions 0..63, all before 70
            assert with_plain.n_cached == 0
            assert base.n_cached == 64
    on, off = results[True], results[False]
    for i in (0, 2, 4):
        assert on[i].generated == off[i].generated
        torch.testing.assert_close(on[i + 1], off[i + 1], rtol=0, atol=1e-5)
    assert on[0].generated != on[4].generated or not torch.allclose(on[1], on[5])
    assert not torch.allclose(on[1], on[3])  # the aLoRA is not the plain LoRA
    assert on[6].inactive == (0,) and on[6].segments == ((0, NO_ADAPTERS),)


def test_an_embedding_is_computed_on_blocks_of_its_own(adapters: tuple[Path, Path, Path]) -> None:
    """Model.embed borrows a slot with blocks for every position: the same vector as a direct
    pass on a fresh cache (identity tables), and it leaves the pool as it found it."""
    from graftlm.step.batch import Batch

    m = graftlm.load(adapters[0], ctx_size=128, n_seq=2)
    ids = _ids(50, 8)
    available = m.engine.slots.pool.n_available
    got = torch.tensor(m.embed(ids))
    assert m.engine.slots.pool.n_available == available
    fresh = graftlm.load(adapters[0], ctx_size=128, n_seq=2)
    with torch.inference_mode():
        h = fresh.model.forward(Batch.single(ids, 1, 0, exact=True), hidden=True)[0]
    want = torch.nn.functional.normalize(h.float().mean(0), dim=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_cancelled_request_gives_its_blocks_back(adapters: tuple[Path, Path, Path]) -> None:
    """Stopped mid-prompt or mid-generation (a client that left), a request holds no block; its
    full blocks stay findable in the prefix cache."""
    m = graftlm.load(adapters[0], ctx_size=128, n_seq=2)
    eng = m.engine
    eng.chunk = 16
    for steps in (1, 5):  # inside the prompt (3 chunks of 16), then while decoding
        req = eng.submit(
            Request(_ids(40, 30 + steps), SamplingParams(temperature=0.0, max_tokens=50))
        )
        for _ in range(steps):
            eng.step()
        assert eng.slots.pool.n_used > 0
        eng.stop(req, "cancelled")
        assert req.done and eng.slots.pool.n_used == 0 and not eng.busy
    assert eng.slots.pool.n_cached >= 2
