"""End to end on SmolLM2-135M with the fixture adapters: the server's scoring call against the
log-probabilities llama-server recorded (../shared/golden), adapters chosen by id and by name."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

import graftlm
from server_fixtures import FIXTURES, golden
from graftlm.server.app import ServerThread, build_state, create_app
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
        model, ServerConfig(model_name="smollm2", temperature=0.0), parallel=4,
        lora=[(f, 0.0) for f in files], lora_modules=[("pirate", files[0])],
    )
    srv = ServerThread(create_app(state)).start()
    try:
        yield srv.url
    finally:
        srv.stop()
        state.service.close()


def test_scoring_matches_llama_server_goldens(smol: str) -> None:
    """echo + logprobs + max_tokens 0 on prompt + golden continuation, each case's adapters per
    request: the log-probability of every generated token agrees with llama.cpp's."""
    ids = {name: k for k, name in enumerate(ADAPTERS)}
    worst = []
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
        diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
        worst.append((max(diffs), case["name"]))
        assert sum(diffs) / len(diffs) < 0.05, (case["name"], diffs)
        assert max(diffs) < 0.3, (case["name"], diffs)


def test_adapter_by_name_equals_adapter_by_id(smol: str) -> None:
    client = openai.OpenAI(base_url=smol + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    by_name = client.chat.completions.create(model="pirate", messages=messages, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    by_id = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0,  # type: ignore[arg-type]
        extra_body={"lora": [{"id": 0, "scale": 1.0}]},
    )
    base = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert by_name.choices[0].message.content == by_id.choices[0].message.content
    assert by_name.choices[0].message.content != base.choices[0].message.content
    chunks = client.chat.completions.create(model="pirate", messages=messages, max_tokens=24, temperature=0, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == by_name.choices[0].message.content
