"""The engine on tiny random models: cache, batching, sampling determinism."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graftlm
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.step.batch import Batch, LoraRows


@pytest.fixture(params=["tiny_llama", "tiny_gemma3"])
def tiny(request: pytest.FixtureRequest) -> graftlm.Model:
    # float32 K/V: these compare paths through the cache at 1e-4 (a 16-bit cache rounds each
    # path's K/V, so paths that differ in the last bits can land an ulp of float16 apart)
    path = request.getfixturevalue(request.param)
    return graftlm.load(path, ctx_size=64, n_seq=4, cache_type="f32")


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
        r = tiny.engine.submit(Request(p, greedy))
        tiny.engine.run(r)
        alone.append(r.generated)
    reqs = [tiny.engine.submit(Request(p, greedy)) for p in prompts]
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
        r = tiny.engine.submit(Request(ids, params))
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


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
def test_requests_arriving_together_prefill_together(
    qtype: str, packed: bool, tmp_path: pytest.TempPathFactory
) -> None:
    """Prompts of different lengths (one longer than the chunk), with different adapters, are
    prefilled in shared chunks (packed, or padded to the longest) and then decoded together:
    each continuation equals the same request run alone (greedy), on a float32 and on a
    native-kernel model."""
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

    spec = TinySpec(qtype=Q[qtype], embd_type=Q.Q8_0 if qtype != "F32" else Q.F32)
    d = Path(str(tmp_path))
    m = graftlm.load(str(write_tiny_model(d / "m.gguf", spec)), ctx_size=96, n_seq=4)
    a = m.add_lora(write_tiny_adapter(d / "a.gguf", spec, seed=5), scale=0.0)
    m.engine.chunk = 24
    m.engine.scheduler.packed = packed
    prompts = [_ids(3, 1), _ids(11, 2), _ids(30, 3), _ids(6, 4)]
    loras = [{}, {a: 1.0}, {a: 0.5}, {a: -1.0}]

    def request(i: int) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        return Request(prompts[i], params, AdapterSettings(loras[i]))

    alone = []
    for i in range(4):
        r = m.engine.submit(request(i))
        m.engine.run(r)
        alone.append(r.generated)
    together = [m.engine.submit(request(i)) for i in range(4)]
    steps = 0
    while m.engine.busy:
        m.engine.step()
        steps += 1
    assert [r.generated for r in together] == alone
    # the first 16 tokens of the 30 are cached by now (run alone): 14 left. Packed, 24 tokens a
    # step: [3 + 11], [14 + 6]; padded: [3 + 11 padded to 2 x 11], [14], [6] (one request at a
    # time: four); a request decodes in its prefill step
    assert steps == (2 if packed else 3) + 6


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_row_whose_logits_blow_up_fails_alone(
    tiny_llama: object, tmp_path: object, temperature: float
) -> None:
    """An adapter at a scale the model cannot take (3e38: finite, but the logits come out inf or nan)
    ends that request with a RequestError; the requests sharing its steps go on, token for token
    as they would alone, and its slot comes back."""
    from pathlib import Path

    from tiny_models import write_tiny_adapter

    from graftlm.errors import RequestError

    m = graftlm.load(tiny_llama, ctx_size=64, n_seq=3)  # type: ignore[arg-type]
    a = m.add_lora(write_tiny_adapter(Path(str(tmp_path)) / "a.gguf"), 0.0)
    eng = m.engine

    def request(lora: dict[int, float], t: float = 0.0) -> Request:
        params = SamplingParams(temperature=t, max_tokens=6, seed=1)
        return Request([5, 6, 7, 8], params, AdapterSettings(lora))

    alone = [request({}), request({a: 1.0})]
    for r in alone:
        eng.run(eng.submit(r))
    reqs = [request({}), request({a: 3e38}, temperature), request({a: 1.0})]
    for r in reqs:
        eng.submit(r)
    while not all(r.done for r in reqs):
        eng.step()
    bad = reqs[1]
    assert bad.finish_reason == "error" and isinstance(bad.error, RequestError)
    assert "not finite" in str(bad.error) and "3e+38" in str(bad.error)
    assert [r.generated for r in (reqs[0], reqs[2])] == [r.generated for r in alone]
    assert not eng.running and len(eng.free_slots) == eng.n_slots
    # the API refuses it up front, before a step (its reach times 3e38 is past float16's range;
    # test_lora_scales_api.py), where the engine's guard above would end it
    with pytest.raises(RequestError, match=r"scale 3e\+38 takes .* this call would overflow"):
        m.generate([5, 6, 7], max_tokens=3, temperature=0, lora=[{"id": a, "scale": 3e38}])


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1e39])
def test_scales_outside_float32_are_refused(
    tiny_llama: object, tmp_path: object, scale: float
) -> None:
    from pathlib import Path

    from tiny_models import write_tiny_adapter

    from graftlm.errors import GraftError, RequestError

    m = graftlm.load(tiny_llama, ctx_size=64)  # type: ignore[arg-type]
    a = m.add_lora(write_tiny_adapter(Path(str(tmp_path)) / "a.gguf"), 0.5)
    with pytest.raises(RequestError, match=f"adapter {a}: scale"):
        m.generate([5, 6], max_tokens=2, lora=[{"id": a, "scale": scale}])
    with pytest.raises(GraftError, match="finite|float32"):
        m.set_lora_scales({a: scale})
    assert m.loras[0]["scale"] == 0.5  # refused: nothing changed


@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
def test_the_decode_scale_table_follows_the_rows(qtype: str, tmp_path: object) -> None:
    """The decode step's scale table is the last step's own object only while its rows'
    settings are those it was built for: a row leaving and another joining at other scales
    (the same count of rows), or a row's scale changing, builds it anew, and each request's
    tokens are those it makes alone (float32 model: the PyTorch twin; Q4_1: the native decode
    layers, whose scale board is filled from the table). No step writes into a table it shares
    with the next: each still holds what its rows' settings give."""
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q
    from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

    from graftlm.runtime.engine import lora_rows

    spec = TinySpec(qtype=Q[qtype], embd_type=Q.Q8_0 if qtype != "F32" else Q.F32)
    d = Path(str(tmp_path))
    m = graftlm.load(str(write_tiny_model(d / "m.gguf", spec)), ctx_size=64, n_seq=2)
    a = m.add_lora(write_tiny_adapter(d / "a.gguf", spec, seed=5), scale=0.0)
    b = m.add_lora(write_tiny_adapter(d / "b.gguf", spec, seed=6), scale=0.0)
    eng = m.engine

    one, half = AdapterSettings({a: 1.0}), AdapterSettings({a: 0.5})
    first = eng._decode_lora([one, half])
    assert eng._decode_lora([AdapterSettings({a: 1.0}), AdapterSettings({a: 0.5})]) is first
    for rows in ([one, AdapterSettings({a: -1.0})], [half, one], [one, AdapterSettings({b: 1.0})]):
        got, want = eng._decode_lora(rows), lora_rows(rows, eng.device)
        assert got is not None and want is not None and got is not first
        assert torch.equal(got.scales, want.scales) and got.active == want.active
    assert eng._decode_lora([AdapterSettings(), AdapterSettings()]) is None

    def request(lora: dict[int, float], n: int, seed: int) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return Request(_ids(5, seed), params, AdapterSettings(lora))

    plan = [({a: 1.0}, 3, 1), ({a: 0.5}, 9, 2), ({a: -1.0}, 4, 3), ({b: 1.0}, 3, 4)]
    alone = []
    for lora, n, seed in plan:
        r = eng.submit(request(lora, n, seed))
        eng.run(r)
        alone.append(r.generated)
    tables: dict[int, tuple[LoraRows, tuple[object, ...]]] = {}  # each step's, and its key

    def step() -> None:
        eng.step()
        if eng._rows is not None:
            tables.setdefault(id(eng._rows), (eng._rows, eng._rows_key))

    # two rows a step throughout: the first row leaves and the third joins, then the fourth
    reqs = [eng.submit(request(*plan[0])), eng.submit(request(*plan[1]))]
    for p in plan[2:]:
        while all(not r.done for r in reqs[-2:]):
            step()
        reqs.append(eng.submit(request(*p)))
    while eng.busy:
        step()
    assert [r.generated for r in reqs] == alone
    # no step wrote into a table it shared with the next ones, nor can rebind its fields
    assert tables
    for rows, key in tables.values():
        want = lora_rows(list(key[1:]), eng.device)  # type: ignore[arg-type]
        assert want is not None and torch.equal(rows.scales, want.scales)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.scales = first.scales * 2  # type: ignore[misc]
