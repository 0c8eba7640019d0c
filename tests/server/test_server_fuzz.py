"""A seeded fuzzer over the server's request bodies: every endpoint gets valid bodies with one
field mutated (a wrong type, an extreme number, a huge or nested value, a lone surrogate, a
missing field). Every answer is below 500 and carries an error object when it is not a 200,
and the server keeps serving. More cases: FUZZ_CASES=2000."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import httpx
import pytest
from server_fixtures import TinyServer

BASES: list[tuple[str, dict[str, Any]]] = [
    ("/completion", {"prompt": "the", "n_predict": 2, "temperature": 0.5, "n_probs": 1}),
    ("/v1/completions", {"prompt": "the", "max_tokens": 2, "logprobs": 1, "echo": True}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_p": 0.9},
    ),
    ("/tokenize", {"content": "hello", "with_pieces": True}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
    ("/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "lora": [{"id": 0, "scale": 0.5}]}),
    ("/completion", {"prompt": "a", "n_predict": 2, "stop": ["b"], "seed": 3, "top_k": 5}),
]
VALUES: list[Any] = [
    None, True, -1, 0, 2**63, 2**64 + 1, -(2**70), 1e308, -1e308, 1e-320, float("nan"),
    float("inf"), "", "x" * 5000, "\ud800", [], [[]], [None], {}, {"a": {"b": []}},
    [1.5, "x"], "[[[[" * 10, list(range(300)), [-5], 10**30,
]  # fmt: skip
N = int(os.environ.get("FUZZ_CASES", "160"))


def _mutate(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    key = rng.choice(list(out))
    kind = rng.random()
    if kind < 0.15:
        del out[key]
    elif kind < 0.25:
        out[rng.choice(["n", "stream", "lora", "model", "logit_bias", "x" * 50])] = rng.choice(
            VALUES
        )
    elif kind < 0.35 and isinstance(out[key], list) and out[key]:
        out[key][0] = rng.choice(VALUES)
    else:
        out[key] = rng.choice(VALUES)
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_mutated_requests_are_answered_below_500(server: TinyServer, seed: int) -> None:
    rng = random.Random(seed)
    http = httpx.Client(base_url=server.url, timeout=60)
    seen: dict[int, int] = {}
    for i in range(N // 2):
        path, base = rng.choice(BASES)
        body = _mutate(base, rng)
        raw = json.dumps(body)  # (NaN and Infinity as some encoders write them)
        r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (i, path, raw[:300], r.text[:300])
        if r.status_code != 200 and "stream" not in raw:
            assert "error" in r.json(), (path, raw[:300], r.text[:300])
    assert seen.get(400, 0) > 5 and seen.get(200, 0) > 5  # both reached
    r = http.post("/completion", json={"prompt": "the", "n_predict": 2})
    assert r.status_code == 200
