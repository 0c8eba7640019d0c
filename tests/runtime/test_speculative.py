"""Speculative decoding: the n-gram drafter alone (plain Python), then the engine verifying drafts
on tiny models: greedy tokens identical with speculation on and off, seeded sampling identical,
constraints, stop strings, max_tokens, the context's end, mixed adapters, a short cache pool and a
sliding window; drafts that are wrong at every place (a test drafter) and right ones."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from spec_helpers import pin_costs

import graftlm
from graftlm.errors import GraftError, RequestError
from graftlm.lora.settings import NO_ADAPTERS, AdapterSettings
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.runtime.speculative import (
    DraftState,
    NgramDrafter,
    SpecConfig,
    SpecParams,
    StepCosts,
    SynthDraws,
    synth_rates_of_length,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _ids(n: int, seed: int, vocab: int = 250) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# -- the drafter alone ------------------------------------------------------------------------------


def _state(drafter: NgramDrafter, tokens: list[int]) -> DraftState:
    req = Request(tokens, GREEDY)
    return drafter._state(req)


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence() -> None:
    d = NgramDrafter(SpecConfig(lookup_min=2, lookup_max=3))
    # "5 6" occurs twice (followed by 7, then by 9); "4 5 6" once (followed by 7): longest wins
    st = _state(d, [4, 5, 6, 7, 8, 1, 5, 6, 9, 2, 4, 5, 6])
    assert d.lookup(st, 3) == [7, 8, 1]
    # without the 3-gram, the latest "5 6" (followed by 9) wins
    st = _state(d, [4, 5, 6, 7, 8, 1, 5, 6, 9, 2, 3, 5, 6])
    assert d.lookup(st, 2) == [9, 2]
    assert d.lookup(_state(d, [1, 2, 3, 4, 5, 6]), 4) == []  # nothing repeats


def test_a_draft_that_runs_into_the_end_continues_the_loop() -> None:
    d = NgramDrafter(SpecConfig(lookup_min=2, lookup_max=2))
    st = _state(d, [9, 1, 2, 3, 1, 2])  # "1 2" last ended at 3: period 3
    assert d.lookup(st, 7) == [3, 1, 2, 3, 1, 2, 3]
    st = _state(d, [8, 8, 8])
    assert d.lookup(st, 4) == [8, 8, 8, 8]


def test_the_index_follows_generated_tokens() -> None:
    d = NgramDrafter(SpecConfig(lookup_min=2, lookup_max=2))
    req = Request([1, 2, 3, 4], GREEDY)
    assert d.lookup(d._state(req), 2) == []
    req.generated += [1, 2]  # "1 2" again: what followed it first
    st = d._state(req)
    assert st.tokens == [1, 2, 3, 4, 1, 2] and d.lookup(st, 2) == [3, 4]


def test_propose_respects_room_bounds_and_the_cost_of_rows() -> None:
    cfg = SpecConfig(n_max=8, lookup_min=2, lookup_max=2)
    loop = [7, 3] * 10
    one = Request(list(loop), GREEDY)
    one.generated = [7]
    d = NgramDrafter(cfg)
    assert 0 < len(d.propose([one], [100])[one.id]) <= 8
    assert len(d.propose([one], [3])[one.id]) <= 3  # its room (context, max_tokens)
    assert d.propose([one], [0]) == {}
    off = Request(list(loop), GREEDY, spec=SpecParams(n_max=0))
    off.generated = [7]
    assert d.propose([off], [100]) == {}
    # a row that keeps being right drafts longer; a lone row drafts more than one of 16
    for _ in range(20):
        n = len(d.propose([one], [100])[one.id])
        d.verified(one, n, n)
    assert len(d.propose([one], [100])[one.id]) == 8
    many = [Request(list(loop), GREEDY) for _ in range(16)]
    for r in many:
        r.generated = [7]
    fresh = NgramDrafter(cfg)
    lone = sum(map(len, fresh.propose(many[:1], [100]).values()))
    crowd = fresh.propose(many, [100] * 16)
    assert sum(map(len, crowd.values())) < 16 * lone
    # a row whose drafts keep failing stops drafting
    bad = Request(list(loop), GREEDY)
    bad.generated = [7]
    for _ in range(4):
        got = d.propose([bad], [100]).get(bad.id, [])
        d.verified(bad, len(got), 0)
    assert all(d.propose([bad], [100]) == {} for _ in range(10))
    # n_min: a draft shorter than it is not verified
    strict = Request(list(loop), GREEDY, spec=SpecParams(n_min=8))
    strict.generated = [7]
    assert d.propose([strict], [4]) == {}


def test_measured_step_costs_decide_how_much_to_draft() -> None:
    costs = StepCosts()
    assert costs.estimate(3) == pytest.approx(StepCosts.shape(3))  # nothing seen: the prior
    costs.observe(1, 0.010)
    costs.observe(1, 0.020)  # an average over recent steps
    assert 0.010 < costs.estimate(1) < 0.020
    costs.observe(4, 0.020)
    assert costs.estimate(5) == pytest.approx(0.020 * StepCosts.shape(5) / StepCosts.shape(4))

    def drafted(step_seconds: dict[int, float]) -> int:
        d = NgramDrafter(SpecConfig(n_max=8, lookup_min=2, lookup_max=2))
        for rows, t in step_seconds.items():
            d.costs.observe(rows, t)
        r = Request([7, 3] * 10, GREEDY)
        r.generated = [7]
        return len(d.propose([r], [100]).get(r.id, []))

    cheap = {n: 0.010 * (1 + 0.02 * (n - 1)) for n in range(1, 10)}
    dear = {n: 0.010 * (1 + 2.0 * (n > 1) + 0.5 * (n - 1)) for n in range(1, 10)}
    assert drafted(cheap) >= 5 and drafted(dear) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": "eagle"}, "method"),
        ({"n_max": 0}, "n_max"),
        ({"n_min": 9, "n_max": 8}, "n_min"),
        ({"lookup_min": 3, "lookup_max": 2}, "lookup"),
        ({"p_min": 1.5}, "p_min"),
    ],
)
def test_bad_settings_are_named(kwargs: dict, field: str) -> None:
    with pytest.raises(RequestError, match=field):
        SpecConfig(**kwargs)


def test_synthetic_rates_as_llama_cpp_resolves_them() -> None:
    # llama.cpp's tests/test-speculative (common_speculative_synth_rates_resolve)
    rates = synth_rates_of_length(3.4, 4)
    assert rates == pytest.approx((0.80581, 0.64933, 0.52323, 0.42163), abs=1e-5)
    assert 1.0 + sum(rates) == pytest.approx(3.4, abs=1e-8)
    assert synth_rates_of_length(1.0, 4) == (0.0,) * 4
    assert synth_rates_of_length(5.0, 4) == (1.0,) * 4
    for bad in (5.1, float("nan"), 0.5):
        with pytest.raises(RequestError, match=r"length must be finite and within \[1, 5\]"):
            synth_rates_of_length(bad, 4)
    # the chance of keeping place i once the places before it are kept: rate_i / rate_(i-1)
    cfg = SpecConfig(n_max=4, synth_rates=(0.8, 0.4, 0.0, 0.0))
    assert cfg.synth_probs == (0.8, 0.5, 0.0, 0.0)
    # no longer a draft than the rates, whatever the request asks
    assert cfg.bounds(SpecParams(n_max=10))[0] == 4
    for rates, words in (
        ((1.0,) * 3, "must contain 4 values, got 3"),
        ((1.0, 1.0, 1.5, 1.0), "finite and within"),
        ((0.5, 0.6, 0.1, 0.0), "non-increasing"),
    ):
        with pytest.raises(RequestError, match=words):
            SpecConfig(n_max=4, synth_rates=rates)


def test_synthetic_draws_are_llama_servers() -> None:
    """std::mt19937 seeded with 4242, read by std::uniform_real_distribution<double>(0, 1)
    (libstdc++)."""
    draws = SynthDraws(4242)
    want = [0.80856906956176955, 0.24104133666036989, 0.45280400731461307, 0.33380064770730894]
    assert [draws.uniform() for _ in want] == want
    assert SynthDraws(None).uniform() != SynthDraws(None).uniform()  # unseeded: its own draws


def test_bad_request_bounds_are_named() -> None:
    with pytest.raises(RequestError, match="speculative.n_max"):
        SpecParams(n_max=-1)
    with pytest.raises(RequestError, match="speculative.p_min"):
        SpecParams(p_min=2.0)


# -- the engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

    d = tmp_path_factory.mktemp("spec")
    spec = TinySpec()
    return (
        write_tiny_model(d / "m.gguf", spec),
        write_tiny_adapter(d / "a.gguf", spec, seed=1),
        write_tiny_adapter(d / "b.gguf", spec, seed=2),
    )


@pytest.fixture(scope="module")
def tiny(files: tuple[Path, Path, Path]) -> graftlm.Model:
    m = graftlm.load(files[0], ctx_size=256, n_seq=4)
    m.add_lora(files[1])
    m.add_lora(files[2])
    return m


class ScriptedDrafter:
    """Drafts the reference continuation with some places made wrong (each draft wrong at a
    random place, or right throughout), so every accepted length is verified."""

    def __init__(self, truth: dict[int, list[int]], seed: int = 0, n: int = 5) -> None:
        self.truth = truth  # request id -> its tokens generated without speculation
        self.rng = random.Random(seed)
        self.n = n
        self.verdicts: list[tuple[int, int]] = []
        self.costs = StepCosts()
        self.cfg = SpecConfig()

    def propose(self, reqs: Sequence[Request], room: Sequence[int]) -> dict[int, list[int]]:
        out = {}
        for r, n_room in zip(reqs, room, strict=True):
            ref = self.truth[r.id][len(r.generated) :]
            k = min(self.n, n_room, len(ref) + 1)
            if k <= 0:
                continue
            draft = (ref + [5])[:k]
            wrong = self.rng.randrange(k + 1)
            if wrong < k:
                draft[wrong] = (draft[wrong] + 1) % 250
            out[r.id] = draft
        return out

    def verified(self, req: Request, n_drafted: int, n_accepted: int) -> None:
        self.verdicts.append((n_drafted, n_accepted))

    def release(self, req: Request) -> None:
        pass


def _generate(
    m: graftlm.Model,
    prompts: list[list[int]],
    params: SamplingParams = GREEDY,
    loras: list[AdapterSettings] | None = None,
) -> list[Request]:
    reqs = [
        Request(list(p), params, (loras or [NO_ADAPTERS] * len(prompts))[i])
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        m.engine.submit(r)
    while m.engine.busy:
        m.engine.step()
    return reqs


def _with(m: graftlm.Model, drafter: object | None) -> None:
    m.engine.drafter = drafter  # type: ignore[assignment]
    m.engine.scheduler.drafter = drafter  # type: ignore[assignment]


def test_scripted_drafts_leave_every_row_as_plain_decoding_left_it(tiny: graftlm.Model) -> None:
    prompts = [_ids(9 + 4 * i, seed=i) for i in range(4)]
    loras = [NO_ADAPTERS, AdapterSettings({0: 1.0}), AdapterSettings({1: 0.7}), NO_ADAPTERS]
    _with(tiny, None)
    plain = _generate(tiny, prompts, loras=loras)
    # the same requests again with drafts: the drafter keys its truth by the new requests' ids
    reqs = [Request(list(p), GREEDY, lora) for p, lora in zip(prompts, loras, strict=True)]
    drafter = ScriptedDrafter({r.id: p.generated for r, p in zip(reqs, plain, strict=True)})
    _with(tiny, drafter)
    try:
        for r in reqs:
            tiny.engine.submit(r)
        while tiny.engine.busy:
            tiny.engine.step()
    finally:
        _with(tiny, None)
    for r, p in zip(reqs, plain, strict=True):
        assert r.generated == p.generated
        assert r.finish_reason == p.finish_reason == "length"
    accepted = {a for _, a in drafter.verdicts}
    assert {0, 5} <= accepted and len(accepted) == 6  # every accepted length, 0 to 5, was seen
    assert sum(r.n_drafted for r in reqs) == sum(n for n, _ in drafter.verdicts)
    assert sum(r.n_draft_accepted for r in reqs) == sum(a for _, a in drafter.verdicts)


def _repeating(n: int, seed: int) -> list[int]:
    base = _ids(n, seed)
    return base + base + base[: n // 2]


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SamplingParams(temperature=0.9, seed=11, max_tokens=40, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, repeat_penalty=1.3, repeat_last_n=8
        ),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded", "penalties", "max_tokens"],
)
def test_ngram_speculation_gives_the_same_tokens(
    tiny: graftlm.Model, params: SamplingParams
) -> None:
    prompts = [_repeating(12, seed=s) for s in (5, 6, 7)]
    _with(tiny, None)
    plain = _generate(tiny, prompts, params)
    tiny.engine.speculative = SpecConfig(n_max=6)
    pin_costs(tiny.engine)
    try:
        spec = _generate(tiny, prompts, params)
    finally:
        tiny.engine.speculative = None
    for s, p in zip(spec, plain, strict=True):
        assert s.generated == p.generated
        assert s.finish_reason == p.finish_reason
    if params.max_tokens > 10:
        assert sum(r.n_draft_accepted for r in spec) > 0  # the drafts were used, not only tried


def test_speculation_stops_at_the_context_end(files: tuple[Path, Path, Path]) -> None:
    m = graftlm.load(files[0], ctx_size=48, n_seq=2)
    prompt = _repeating(12, seed=8)  # 30 tokens: 18 positions left
    params = SamplingParams(temperature=0.0, max_tokens=-1, ignore_eos=True)
    (plain,) = _generate(m, [prompt], params)
    m.engine.speculative = SpecConfig()
    (spec,) = _generate(m, [prompt], params)
    assert spec.generated == plain.generated and len(plain.generated) == 48 - 30
    assert spec.finish_reason == plain.finish_reason == "length"


def test_a_short_pool_drops_drafts_before_it_preempts(files: tuple[Path, Path, Path]) -> None:
    # 4 sequences in a pool too small for all of them at full length: plain decoding preempts
    m = graftlm.load(files[0], ctx_size=64, n_seq=4, cache_blocks=9)
    prompts = [_repeating(8, seed=s) for s in range(4)]
    plain = _generate(m, prompts)
    m.engine.speculative = SpecConfig()
    spec = _generate(m, prompts)
    assert [r.generated for r in spec] == [r.generated for r in plain]


def test_the_sliding_window_sees_the_same_positions(tiny_gemma3: Path) -> None:
    m = graftlm.load(tiny_gemma3, ctx_size=128, n_seq=2)  # window 8: drafts cross it
    prompts = [_repeating(10, seed=s) for s in (1, 2)]
    plain = _generate(m, prompts)
    reqs = [Request(list(p), GREEDY) for p in prompts]
    drafter = ScriptedDrafter({r.id: p.generated for r, p in zip(reqs, plain, strict=True)}, n=9)
    _with(m, drafter)
    for r in reqs:
        m.engine.submit(r)
    while m.engine.busy:
        m.engine.step()
    assert [r.generated for r in reqs] == [r.generated for r in plain]
    # ten rows of one slot, more positions than the window, and most of such drafts kept
    assert max(n for n, _ in drafter.verdicts) == 9
    assert max(a for _, a in drafter.verdicts) >= 8


def test_a_grammar_only_keeps_what_it_allows(tiny: graftlm.Model) -> None:
    from graftlm.runtime.constraints import Constraint

    grammar = tiny.prompter.compile(Constraint("regex", "(ab|ba)+c", "regex"))
    params = SamplingParams(temperature=0.0, max_tokens=30, grammar=grammar)
    prompt = _repeating(12, seed=3)
    _with(tiny, None)
    (plain,) = _generate(tiny, [prompt], params)
    reqs = [Request(list(prompt), params)]
    # the plain run's tokens, one place made wrong in most drafts (a token the grammar may or
    # may not allow there)
    drafter = ScriptedDrafter({reqs[0].id: plain.generated}, n=3)
    _with(tiny, drafter)
    try:
        tiny.engine.submit(reqs[0])
        tiny.engine.run(reqs[0])
    finally:
        _with(tiny, None)
    assert reqs[0].generated == plain.generated and reqs[0].finish_reason == plain.finish_reason
    assert 0 < reqs[0].n_draft_accepted < reqs[0].n_drafted


PASSAGE = (
    "The committee met on Tuesday morning to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the public library by ten percent, to "
    "repair the roads in the north district before the winter, and to hire two more teachers for "
    "the primary school on Mill Street. The treasurer warned that the town's reserves were lower "
    "than last year, because the new bridge had cost more than expected."
)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_models_copy_faster_in_steps_and_say_the_same(
    which: str, request: pytest.FixtureRequest
) -> None:
    """A real model repeating a passage: the same greedy text with n-gram drafts, in far fewer
    steps (most drafted tokens kept)."""
    path = request.getfixturevalue(f"{which}_file")
    m = graftlm.load(path, ctx_size=1024)
    ids = m.prompter.prompt_ids(
        m.prompter.chat_prompt([{"role": "user", "content": f"Repeat exactly:\n\n{PASSAGE}"}])
    )
    params = SamplingParams(temperature=0.0, max_tokens=60)
    out = {}
    for spec in (None, SpecConfig()):
        m.engine.speculative = spec
        if spec is not None:
            pin_costs(m.engine)
        r = Request(list(ids), params, eog=m.prompter.eog)
        m.engine.submit(r)
        steps = 0
        while not r.done:
            m.engine.step()
            steps += 1
        out[spec is not None] = (r.generated, steps, r.n_drafted, r.n_draft_accepted)
    (plain, n_plain, _, _), (spec_tokens, n_spec, drafted, accepted) = out[False], out[True]
    assert spec_tokens == plain
    assert n_spec < 0.6 * n_plain and accepted > 0.6 * drafted


# -- a draft model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A target, a smaller draft of the same vocabulary, and a model of another vocabulary."""
    from tiny_models import TinySpec, write_tiny_model

    d = tmp_path_factory.mktemp("draft")
    return (
        write_tiny_model(d / "target.gguf", TinySpec(n_layer=3), seed=4),
        write_tiny_model(d / "draft.gguf", TinySpec(n_layer=1, n_embd=32, n_ff=48), seed=5),
        write_tiny_model(d / "gemma.gguf", TinySpec(arch="gemma3", n_head=2, n_head_kv=1)),
    )


def test_a_draft_model_drafts_and_the_output_is_the_targets(
    draft_files: tuple[Path, Path, Path],
) -> None:
    target, draft, _ = draft_files
    prompts = [_ids(7 + 3 * i, seed=20 + i) for i in range(3)]
    plain = _generate(graftlm.load(target, ctx_size=128, n_seq=2), prompts)
    m = graftlm.load(target, ctx_size=128, n_seq=2, draft_model=draft)
    assert m.engine.speculative == SpecConfig(method="draft")
    for params in (GREEDY, SamplingParams(temperature=0.7, seed=3, max_tokens=30, ignore_eos=True)):
        want = plain if params is GREEDY else _generate(graftlm.load(target, ctx_size=128, n_seq=2),
                                                        prompts, params)  # fmt: skip
        got = _generate(m, prompts, params)  # 3 requests through 2 slots: slots come back
        assert [r.generated for r in got] == [r.generated for r in want]
        assert all(r.n_drafted > 0 for r in got)
    # the target as its own draft: every drafted token is kept
    same = graftlm.load(target, ctx_size=128, n_seq=2, draft_model=target)
    for r in _generate(same, prompts):
        assert r.n_draft_accepted == r.n_drafted > 0
    # p_min 1: no draft is that sure; n_max bounds every draft
    m.engine.speculative = SpecConfig(method="draft", p_min=1.0)
    assert all(r.n_drafted == 0 for r in _generate(m, prompts))
    m.engine.speculative = SpecConfig(method="draft", n_max=2)
    got = _generate(m, prompts)
    assert all(r.n_drafted <= 2 * r.n_drafts for r in got)
    assert [r.generated for r in got] == [r.generated for r in plain]


def test_a_draft_of_another_vocabulary_is_refused(draft_files: tuple[Path, Path, Path]) -> None:
    target, _, other = draft_files
    with pytest.raises(GraftError, match="gemma.gguf.*vocabulary"):
        graftlm.load(target, ctx_size=64, draft_model=other)
    with pytest.raises(GraftError, match="needs a draft model"):
        graftlm.load(target, ctx_size=64, speculative=SpecConfig(method="draft"))


# -- synthetic acceptance (llama.cpp's --spec-synth-rates) ------------------------------------------


def test_synthetic_acceptance_keeps_drafts_by_chance_alone(
    draft_files: tuple[Path, Path, Path],
) -> None:
    target, draft, _ = draft_files
    prompts = [_ids(7 + 3 * i, seed=30 + i) for i in range(3)]
    m = graftlm.load(target, ctx_size=128, n_seq=2, draft_model=draft)
    seeded = SamplingParams(temperature=0.7, seed=3, max_tokens=30, ignore_eos=True)
    wants = {}
    for params in (GREEDY, seeded):
        m.engine.speculative = SpecConfig(method="draft")
        want = wants[params] = _generate(m, prompts, params)
        # rates 0: every draft is verified and none kept, the output is the model's own
        m.engine.speculative = SpecConfig(method="draft", n_max=4, synth_rates=(0.0,) * 4)
        got = _generate(m, prompts, params)
        assert [r.generated for r in got] == [r.generated for r in want]
        assert all(r.n_drafted > 0 and r.n_draft_accepted == 0 for r in got)
    # rates 1: every drafted token is kept, though the model would not have said it
    m.engine.speculative = SpecConfig(method="draft", n_max=4, synth_rates=(1.0,) * 4)
    got = _generate(m, prompts)
    assert all(r.n_draft_accepted == r.n_drafted > 0 for r in got)
    assert [r.generated for r in got] != [r.generated for r in wants[GREEDY]]
    assert all(len(r.generated) == 40 and r.finish_reason == "length" for r in got)
    # a seed gives the same verdicts
    m.engine.speculative = SpecConfig(method="draft", n_max=4, synth_rates=(0.9, 0.6, 0.4, 0.2))
    runs = [_generate(m, prompts, seeded) for _ in range(2)]
    assert [(r.n_drafted, r.n_draft_accepted) for r in runs[0]] == [
        (r.n_drafted, r.n_draft_accepted) for r in runs[1]
    ]
    assert 0 < sum(r.n_draft_accepted for r in runs[0]) < sum(r.n_drafted for r in runs[0])


class FixedDrafter:
    """Drafts the same tokens every step (as many as the row's room takes)."""

    def __init__(self, draft: list[int], cfg: SpecConfig) -> None:
        self.draft = draft
        self.cfg = cfg
        self.costs = StepCosts()

    def propose(self, reqs: Sequence[Request], room: Sequence[int]) -> dict[int, list[int]]:
        return {r.id: self.draft[:n] for r, n in zip(reqs, room, strict=True) if n > 0}

    def verified(self, req: Request, n_drafted: int, n_accepted: int) -> None:
        pass

    def release(self, req: Request) -> None:
        pass


def _run_with(m: graftlm.Model, drafter: FixedDrafter, req: Request) -> None:
    _with(m, drafter)
    try:
        m.engine.submit(req)
        m.engine.run(req)
    finally:
        _with(m, None)


def test_synthetic_acceptance_never_keeps_a_drafted_end(tiny: graftlm.Model) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    req = Request(_ids(10, seed=4), params, eog=frozenset({9}))
    _run_with(tiny, FixedDrafter([5, 9, 6], SpecConfig(n_max=3, synth_rates=(1.0,) * 3)), req)
    assert req.n_drafts > 0 and req.n_draft_accepted == req.n_drafts  # the 5 of each draft
    assert len(req.generated) == 20


def test_synthetic_tokens_do_not_advance_a_grammar(tiny: graftlm.Model) -> None:
    """As llama-server: a kept drafted token is outside the grammar's account (the output is
    not valid), the model's own tokens still follow it, and nothing fails."""
    from graftlm.runtime.constraints import Constraint

    grammar = tiny.prompter.compile(Constraint("regex", "(ab|ba)+c", "regex"))
    params = SamplingParams(temperature=0.0, max_tokens=12, grammar=grammar)
    req = Request(_repeating(12, seed=3), params)
    _run_with(tiny, FixedDrafter([7] * 3, SpecConfig(n_max=3, synth_rates=(1.0,) * 3)), req)
    assert req.error is None and req.n_drafted > 0 and req.n_draft_accepted == req.n_drafted
    assert 7 in req.generated
