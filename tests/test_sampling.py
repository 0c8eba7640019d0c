from __future__ import annotations

import pytest
import torch

from graftlm.errors import RequestError
from graftlm.runtime.sampling import Sampler, SamplingParams, argmax, penalty_window


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(temperature=0))(logits) == 1


def _rows(kind: str, gen: torch.Generator) -> torch.Tensor:
    """(3, 517) logits of one kind: ties among few values, NaNs, infinities, all -inf, signed
    zeros, or plain random."""
    x = torch.randn(3, 517, generator=gen)
    if kind == "ties":
        return torch.randint(-2, 2, (3, 517), generator=gen).float()
    if kind == "nan":
        x[x > 1.2] = float("nan")
    elif kind == "inf":
        x[x > 1.0] = float("inf")
    elif kind == "-inf":
        x[:] = float("-inf")
    elif kind == "zeros":
        x = torch.where(x > 0, torch.tensor(0.0), torch.tensor(-0.0))
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "nan", "inf", "-inf", "zeros"])
def test_argmax_is_torchs(kind: str) -> None:
    """The fast argmax (numpy's, on CPU float32) against its twin torch.argmax: the same index,
    the first maximum or the first NaN, on rows, one row, a strided view, and other dtypes."""
    gen = torch.Generator().manual_seed(len(kind))
    for _ in range(20):
        x = _rows(kind, gen)
        for t in (x, x[1], x[:, ::3], x.T, x.to(torch.bfloat16), x.double()):
            got = argmax(t)
            assert got.dtype is torch.int64 and got.shape == t.shape[:-1], (t.shape, t.dtype)
            assert torch.equal(got, torch.argmax(t, dim=-1)), (kind, t.shape, t.dtype)


def test_argmax_of_a_vocabulary_row_in_inference_mode() -> None:
    """As the engine calls it: a head's rows of gpt-oss's 201,088 logits made under
    inference_mode, one row and a batch, ties and a late NaN included."""
    gen = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        x = torch.randn(4, 201_088, generator=gen)
        x[1, 150_000] = x[1, 9] = x[1].max() + 1.0  # a tie: the first one
        x[2, 200_000] = float("nan")
        for t in (x, x[0], x[3]):
            assert t.is_inference()
            assert torch.equal(argmax(t), torch.argmax(t, dim=-1)), t.shape
        assert int(argmax(x[1])) == 9
    assert Sampler(SamplingParams(temperature=0))(torch.tensor([1.0, float("nan"), 2.0])) == 1


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(100)
    s = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=1))
    assert all(s(logits) == int(logits.argmax()) for _ in range(20))


def test_min_p_and_top_p_cut_the_tail() -> None:
    logits = torch.tensor([5.0, 4.9, -5.0, -6.0, -7.0])
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1, seed=0))
    assert {s(logits) for _ in range(200)} == {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=0))
    assert {s(logits) for _ in range(100)} == {0}


def test_repeat_penalty_follows_llama_cpp() -> None:
    """Positive logits are divided, negative multiplied; frequency and presence subtract."""
    s = Sampler(SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    logits = torch.tensor([4.0, -4.0, 1.0])
    out = s.penalize(logits, [0, 0, 1])
    assert out.tolist() == [4.0 / 2 - 2 * 0.5 - 0.25, -4.0 * 2 - 0.5 - 0.25, 1.0]
    assert logits.tolist() == [4.0, -4.0, 1.0]  # the caller's logits are untouched


def test_same_seed_same_draws() -> None:
    logits = torch.randn(1000)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a, b = Sampler(p), Sampler(p)
    assert [a(logits) for _ in range(30)] == [b(logits) for _ in range(30)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", float("nan")),
        ("frequency_penalty", float("inf")),
        ("repeat_penalty", float("nan")),
        ("repeat_penalty", -1.0),
        ("temperature", float("nan")),
        ("top_p", float("nan")),
        ("seed", 2**64),
        ("seed", 1.5),
    ],
)
def test_bad_settings_are_request_errors(field: str, value: object) -> None:
    """Refused by name (a RequestError, and a ValueError for the server's 400): a NaN penalty
    used to invert itself, a seed of 2^64 to kill the request on the engine thread."""
    with pytest.raises(RequestError, match=field) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_a_tiny_temperature_is_greedy() -> None:
    """1e-45 overflowed the division (inf and nan probabilities); below 1e-5 it is the argmax."""
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    s = Sampler(SamplingParams(temperature=1e-45, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    assert s(logits) == 1
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    Sampler(SamplingParams(seed=2**64 - 1))  # the largest seed torch takes


@pytest.mark.parametrize("last_n", [-1, 0, 1, 3, 64])
def test_the_penalty_window_is_the_tail_of_the_whole_sequence(last_n: int) -> None:
    """The engine hands the sampler only the tokens the penalties read, never a copy of the
    whole sequence: the same penalized logits as the whole history gives."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    for n_prompt, n_gen in [(0, 0), (0, 5), (7, 0), (2, 2), (40, 30), (100, 70)]:
        prompt = torch.randint(0, 50, (n_prompt,), generator=g).tolist()
        generated = torch.randint(0, 50, (n_gen,), generator=g).tolist()
        for p in (
            SamplingParams(repeat_last_n=last_n, repeat_penalty=1.3, frequency_penalty=0.2),
            SamplingParams(repeat_last_n=last_n),  # no penalty: nothing to read
        ):
            window = penalty_window(p, prompt, generated)
            whole = Sampler(p).penalize(logits, prompt + generated)
            assert torch.equal(Sampler(p).penalize(logits, window), whole)
            if p.repeat_penalty == 1.0 or last_n == 0:
                assert list(window) == []
            else:
                assert list(window) == (prompt + generated)[-last_n if last_n > 0 else 0 :]


def test_argmax_only_is_decided_from_the_settings_once() -> None:
    """The engine takes one argmax for a batch's rows whose sampler draws the argmax alone;
    anything that changes the logits or the draw keeps the row's own sampler."""
    assert Sampler(SamplingParams(temperature=0.0)).argmax_only
    assert not Sampler(SamplingParams(temperature=0.8)).argmax_only
    assert not Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.1)).argmax_only
    assert not Sampler(SamplingParams(temperature=0.0, logit_bias=((1, 2.0),))).argmax_only

    class Own(Sampler):
        def draw(self, logits: torch.Tensor) -> int:
            return 0

    assert not Own(SamplingParams(temperature=0.0)).argmax_only
