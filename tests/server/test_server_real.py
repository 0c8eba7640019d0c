"""End to end on SmolLM2-135M with the fixture adapters: the server's scoring call against the
log-probabilities llama-server recorded (../shared/golden), adapters chosen by id and by name."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from server_fixtures import FIXTURES, golden, serving

import graftlm
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

pytestmark = pytest.mark.real

ADAPTERS = ["pirate-f32.gguf", "caps-f32.gguf", "rand_all-f32.gguf"]


@pytest.fixture(scope="module")
def smol() -> Iterator[str]:
    try:
        model = graftlm.load(None, ctx_size=1024, n_seq=5)
    except graftlm.ModelFileError as exc:
        pytest.skip(str(exc))
    files = [str(FIXTURES / "smollm2" / f) for f in ADAPTERS]
    state = build_state(
        model,
        ServerConfig(model_name="smollm2", temperature=0.0),
        parallel=4,
        lora=[(f, 0.0) for f in files],
        lora_modules=[("pirate", files[0]), ("caps-peft", str(FIXTURES / "smollm2" / "caps"))],
    )
    with serving(state) as url:
        yield url


def test_scoring_matches_llama_server_goldens(smol: str) -> None:
    """echo + logprobs + max_tokens 0 on prompt + golden continuation, each case's adapters per
    request: the log-probabilities of the generated tokens agree with llama.cpp's."""
    ids = {name: k for k, name in enumerate(ADAPTERS)}
    diffs: list[float] = []
    for case in golden("smollm2_generate.json")["cases"]:
        lora = [{"id": ids[a["file"]], "scale": a["scale"]} for a in case["adapters"]]
        tokens = case["prompt_ids"] + case["generated_ids"]
        r = httpx.post(
            smol + "/v1/completions",
            json={"prompt": tokens, "echo": True, "logprobs": 1, "max_tokens": 0, "lora": lora},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["logprobs"]["token_logprobs"][len(case["prompt_ids"]) :]
        want = [s["logprob"] for s in case["steps"]][: len(got)]
        assert len(got) == len(case["steps"]) and len(got) > 0
        diffs += [abs(a - b) for a, b in zip(got, want, strict=True)]
    # the project's golden thresholds (tests/test_golden.py), over all positions of all cases
    assert sum(diffs) / len(diffs) <= 0.06 and max(diffs) <= 0.5, (
        sum(diffs) / len(diffs),
        max(diffs),
    )


def test_adapter_by_name_equals_adapter_by_id(smol: str) -> None:
    client = openai.OpenAI(base_url=smol + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the capital of France?"}
    ]
    by_name = client.chat.completions.create(
        model="pirate", messages=messages, max_tokens=24, temperature=0
    )
    by_id = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=24,
        temperature=0,
        extra_body={"lora": [{"id": 0, "scale": 1.0}]},
    )
    base = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0
    )
    assert by_name.choices[0].message.content == by_id.choices[0].message.content
    assert by_name.choices[0].message.content != base.choices[0].message.content
    chunks = client.chat.completions.create(
        model="pirate", messages=messages, max_tokens=24, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == by_name.choices[0].message.content
    )


def test_peft_directory_by_name_scores_like_its_gguf(smol: str) -> None:
    """A --lora-modules PEFT directory, attached on first use, against the same adapter converted
    to GGUF (id 1) per request."""
    ids = [1, 504, 3575, 282, 4649, 314, 7042, 30]

    def score(body: dict[str, object]) -> list[float]:
        r = httpx.post(
            smol + "/v1/completions",
            json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, **body},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]

    by_peft = score({"model": "caps-peft"})
    by_gguf = score({"lora": [{"id": 1, "scale": 1.0}]})
    assert by_peft == pytest.approx(by_gguf, abs=1e-3)
    assert by_peft != pytest.approx(score({}), abs=1e-3)
