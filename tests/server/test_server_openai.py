"""The official `openai` client against the server: completions, chat, adapters by name,
logprobs."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from server_fixtures import TinyServer

PROMPT = [5, 70, 33, 200, 41, 9]


@pytest.fixture(scope="module")
def client(server: TinyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _tokens_of(server: TinyServer, text: str) -> list[int]:
    return server.ref.tokenize(text, add_special=False, parse_special=True)


def test_models_lists_base_and_adapters(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {"tiny", "a0", "alpha", "beta"}
    assert models["tiny"].to_dict().get("parent") is None
    for name in ("a0", "alpha", "beta"):
        assert models[name].to_dict()["parent"] == "tiny"


def test_completion_greedy_equals_reference(server: TinyServer, client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert (
        out.usage is not None
        and out.usage.completion_tokens == 12
        and out.usage.prompt_tokens == len(PROMPT)
    )
    assert choice.text == server.ref.detokenize(server.ref_tokens(PROMPT, 12))


def test_streaming_completion_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("name", ["alpha", "a0"])
def test_model_field_names_an_adapter(server: TinyServer, client: openai.OpenAI, name: str) -> None:
    """`model` = an adapter's name: that adapter at scale 1 (a --lora-modules one is attached on
    first use)."""
    out = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    want = server.ref.detokenize(server.ref_tokens(PROMPT, 10, {name: 1.0}))
    assert out.choices[0].text == want
    assert out.choices[0].text != server.ref.detokenize(server.ref_tokens(PROMPT, 10))
    assert out.model == name


def test_per_request_lora_field(server: TinyServer, client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "lora": [{"id": 0, "scale": 0.7}]},
    )
    assert out.choices[0].text == server.ref.detokenize(server.ref_tokens(PROMPT, 10, {"a0": 0.7}))


def test_n_choices(client: openai.OpenAI) -> None:
    greedy = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, n=3
    )
    assert sorted(c.index for c in greedy.choices) == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1
    sampled = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=1.5,
        top_p=1.0,
        n=3,
        seed=7,
        extra_body={"ignore_eos": True, "top_k": 0, "min_p": 0.0},
    )
    again = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=1.5,
        top_p=1.0,
        n=3,
        seed=7,
        extra_body={"ignore_eos": True, "top_k": 0, "min_p": 0.0},
    )
    assert len({c.text for c in sampled.choices}) > 1  # seed + i per choice: different draws
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # and repeatable
    assert sampled.usage is not None and sampled.usage.completion_tokens == 72


def test_batch_of_prompts(server: TinyServer, client: openai.OpenAI) -> None:
    prompts = [PROMPT, PROMPT[:3]]
    out = client.completions.create(
        model="tiny",
        prompt=prompts,
        max_tokens=6,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    texts = {c.index: c.text for c in out.choices}
    assert texts[0] == texts[1] == server.ref.detokenize(server.ref_tokens(PROMPT, 6))
    assert texts[2] == texts[3] == server.ref.detokenize(server.ref_tokens(PROMPT[:3], 6))


def _stop_case(server: TinyServer) -> tuple[list[int], str, str]:
    """A prompt whose greedy text has a character unlike its first one: a stop string to cut at."""
    for k in range(40):
        prompt = [3 + k, 90 + k, 140 + k]
        text = server.ref.detokenize(server.ref_tokens(prompt, 24))
        for i, ch in enumerate(text):
            if i > 0 and ch != text[0] and text.find(ch) == i:
                return prompt, ch, text[:i]
    pytest.skip("no greedy text with two distinct characters")


def test_stop_strings(server: TinyServer, client: openai.OpenAI) -> None:
    prompt, stop, want = _stop_case(server)
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_chat_completion_and_stream(server: TinyServer, client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    msg = out.choices[0].message
    assert msg.role == "assistant"
    ids = server.ref.tokenize(
        server.ref.apply_chat_template([dict(m) for m in messages]),
        add_special=True,
        parse_special=True,
    )
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_chat_with_adapter_and_logprobs(server: TinyServer, client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "the the"}]
    out = client.chat.completions.create(
        model="beta",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    ids = server.ref.tokenize(
        server.ref.apply_chat_template([dict(m) for m in messages]),
        add_special=True,
        parse_special=True,
    )
    want = server.ref_tokens(ids, 6, {"beta": 1.0})
    assert out.choices[0].message.content == server.ref.detokenize(want)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    ref = server.ref_logprobs(ids + want, 3, {"beta": 1.0})[len(ids) - 1 :]
    for got, r in zip(content, ref, strict=True):
        assert got.logprob == pytest.approx(r["logprob"], abs=1e-4)
        assert len(got.top_logprobs) == 3
        assert got.top_logprobs[0].logprob == pytest.approx(r["top"][0][1], abs=1e-4)


@pytest.mark.parametrize("adapter", [None, "alpha"])
def test_echo_logprobs_max_tokens_0_equals_model_logprobs(
    server: TinyServer, client: openai.OpenAI, adapter: str | None
) -> None:
    """lm-evaluation-harness's scoring call: the prompt's own log-probabilities."""
    ids = [7, 19, 120, 44, 230, 18, 91, 3, 150]
    out = client.completions.create(
        model=adapter or "tiny", prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    ref = server.ref_logprobs(ids, 2, {adapter: 1.0} if adapter else None)
    assert lp.token_logprobs[1:] == pytest.approx([r["logprob"] for r in ref], abs=1e-5)
    for tops, r in zip(lp.top_logprobs[1:], ref, strict=True):
        assert max(tops.values()) == pytest.approx(r["top"][0][1], abs=1e-5)
    assert out.choices[0].text == server.ref.detokenize(ids)
    assert out.usage is not None and out.usage.completion_tokens == 0
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_generation(server: TinyServer, client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=4,
        echo=True,
        logprobs=1,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    gen = server.ref_tokens(PROMPT, 4)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    assert len(lp.token_logprobs) == len(PROMPT) + 4
    ref = server.ref_logprobs(PROMPT + gen, 1)
    assert lp.token_logprobs[1:] == pytest.approx([r["logprob"] for r in ref], abs=1e-4)
    assert out.choices[0].text == server.ref.detokenize(PROMPT) + server.ref.detokenize(gen)
