"""The prefix cache as a client sees it: llama-server's cache_prompt, tokens_cached and
timings.cache_n, OpenAI's usage.prompt_tokens_details.cached_tokens, the Prometheus counters, and
the same tokens as computed in full."""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx
import pytest
from server_fixtures import TinyServer


@pytest.fixture(scope="module")
def http(server: TinyServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60)


def _prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)  # a prompt no other test sends
    return [rng.randrange(3, 250) for _ in range(n)]


def _completion(http: httpx.Client, **body: object) -> dict:
    r = http.post("/completion", json={"temperature": 0, "ignore_eos": True, "n_predict": 4,
                                       "return_tokens": True, **body})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def _metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_a_repeated_prompt_is_served_from_the_cache(server: TinyServer, http: httpx.Client) -> None:
    prompt = _prompt(1)
    hits_before = _metric(http, "graftlm_prefix_cache_hits_total")
    first = _completion(http, prompt=prompt)
    second = _completion(http, prompt=prompt)
    off = _completion(http, prompt=prompt, cache_prompt=False)
    assert first["timings"]["cache_n"] == 0 and first["timings"]["prompt_n"] == 100
    assert second["timings"]["cache_n"] == 96 and second["timings"]["prompt_n"] == 4  # 6 blocks
    assert off["timings"]["cache_n"] == 0
    assert first["tokens_cached"] == second["tokens_cached"] == 100 + 4 - 1
    assert first["tokens"] == second["tokens"] == off["tokens"] == server.ref_tokens(prompt, 4)
    assert _metric(http, "graftlm_prefix_cache_hits_total") - hits_before == 96
    assert _metric(http, 'graftlm_kv_cache_blocks{state="total"}') > 0
    assert _metric(http, 'graftlm_kv_cache_blocks{state="cached"}') >= 6


def test_another_adapter_setting_finds_nothing_of_the_base(
    server: TinyServer, http: httpx.Client
) -> None:
    prompt = _prompt(2)
    _completion(http, prompt=prompt)  # the base's blocks
    a = _completion(http, prompt=prompt, lora=[{"id": 0, "scale": 1.0}])
    half = _completion(http, prompt=prompt, lora=[{"id": 0, "scale": 0.5}])
    again = _completion(http, prompt=prompt, lora=[{"id": 0, "scale": 1.0}])
    assert a["timings"]["cache_n"] == 0 and half["timings"]["cache_n"] == 0
    assert again["timings"]["cache_n"] == 96
    assert a["tokens"] == again["tokens"] == server.ref_tokens(prompt, 4, {"a0": 1.0})


def test_openai_usage_reports_cached_tokens(server: TinyServer, http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": _prompt(3, 70), "max_tokens": 3, "temperature": 0}
    first = http.post("/v1/completions", json=body).json()
    second = http.post("/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    assert second["usage"]["prompt_tokens"] == 70
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_an_activated_lora_is_listed_and_off_without_its_invocation(
    server: TinyServer, http: httpx.Client, tmp_path: Path
) -> None:
    from server_fixtures import SPEC
    from tiny_models import write_tiny_adapter

    path = write_tiny_adapter(tmp_path / "al.gguf", SPEC, seed=40,
                              metadata={"adapter.alora.invocation_tokens": [7, 8, 9]})  # fmt: skip
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "al", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    try:
        without = _completion(http, model="al", prompt=_prompt(4, 40))
        listed = {a["name"]: a for a in http.get("/lora-adapters").json()}
        assert listed["al"]["alora_invocation_tokens"] == [7, 8, 9]
        assert without["alora_inactive"] == [listed["al"]["id"]]
        base = _completion(http, prompt=_prompt(4, 40))
        assert without["tokens"] == base["tokens"]  # ran as the base
        invoked = _completion(http, model="al", prompt=_prompt(4, 40) + [7, 8, 9, 20])
        assert "alora_inactive" not in invoked
        assert invoked["timings"]["cache_n"] == 32  # the base's blocks before the invocation
    finally:
        http.post("/v1/unload_lora_adapter", json={"lora_name": "al"})
