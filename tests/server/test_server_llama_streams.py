"""llama-server's stream framing (llama.cpp's own server tests check it): the chat stream's chunks,
a one-token answer's timings, and return_progress's reports before each prompt chunk on the
native and the OpenAI endpoints. The rest: test_server_llama_compat.py,
test_server_llama_requests.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from llama_compat_helpers import GREEDY, PROMPT, data_events
from server_fixtures import SPEC, TinyServer, serving

import graftlm
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig


@pytest.fixture(scope="module")
def http(server: TinyServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60)


# -- the stream framing --
def test_chat_stream_framing(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    events = data_events(http.post("/v1/chat/completions", json=body | GREEDY))
    first, *rest = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(e["system_fingerprint"].startswith("b") for e in events)
    finish = [e for e in rest if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["delta"] == {}
    content = [e for e in rest if e["choices"] and "content" in e["choices"][0]["delta"]]
    assert content and all(e["choices"][0]["delta"]["content"] for e in content)
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["timings"]["predicted_n"] == 4
    off = body | GREEDY | {"stream_options": {"include_usage": False}}
    assert all(e["choices"] for e in data_events(http.post("/v1/chat/completions", json=off)))
    per = data_events(
        http.post("/v1/chat/completions", json=body | GREEDY | {"timings_per_token": True})
    )
    assert "timings" not in per[0] and any("timings" in e for e in per[1:-1])


def test_timings_of_one_token(http: httpx.Client) -> None:
    t = http.post("/completion", json={"prompt": PROMPT, "n_predict": 1, **GREEDY}).json()[
        "timings"
    ]
    assert t["predicted_n"] == 1 and t["predicted_per_second"] == 0.0
    assert t["predicted_per_token_ms"] == 0.0 and t["prompt_ms"] > 0


# -- return_progress --
@pytest.fixture(scope="module")
def chunked(tiny_files: dict[str, Path]) -> Iterator[str]:
    """A server whose steps compute at most 8 prompt tokens (serve's -b 8)."""
    model = graftlm.load(tiny_files["model"], ctx_size=SPEC.n_ctx, n_seq=3)
    model.engine.chunk = 8
    state = build_state(model, ServerConfig(model_name="tiny"), parallel=2)
    with serving(state) as url:
        yield url


def _progress(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["prompt_progress"] for e in events if "prompt_progress" in e]


def test_return_progress_reports_before_each_prompt_chunk_and_after_the_last(
    chunked: str,
) -> None:
    prompt = list(range(20, 40))  # 20 tokens: chunks of 8, 8 and 4
    body = {"prompt": prompt, "n_predict": 3, "stream": True, "return_progress": True, **GREEDY}
    body |= {"timings_per_token": True, "cache_prompt": False}
    events = data_events(httpx.post(chunked + "/completion", json=body, timeout=60))
    progress = _progress(events)
    assert [(p["total"], p["cache"], p["processed"]) for p in progress] == [
        (20, 0, 0),
        (20, 0, 8),
        (20, 0, 16),
        (20, 0, 20),
    ]
    ms = [p["time_ms"] for p in progress]
    assert ms == sorted(ms) and ms[0] == 0
    reports = [e for e in events if "prompt_progress" in e]
    assert all(e["content"] == "" and e["tokens"] == [] and not e["stop"] for e in reports)
    assert [e["timings"]["prompt_n"] for e in reports] == [0, 8, 16, 20]
    assert reports[0]["timings"]["prompt_ms"] == 0.0
    assert all(e["timings"]["predicted_n"] == 0 for e in reports)
    pieces = [e for e in events if e.get("tokens")]
    assert len(pieces) == 3 and all("timings" in e for e in pieces)  # timings_per_token
    assert events.index(reports[-1]) < events.index(pieces[0])  # all before the first token
    # the same prompt again, from the prefix cache: its first block is served, 4 tokens computed
    events = data_events(
        httpx.post(chunked + "/completion", json=body | {"cache_prompt": True}, timeout=60)
    )
    assert [(p["cache"], p["processed"]) for p in _progress(events)] == [(16, 16), (16, 20)]
    # without return_progress, or without stream, none
    quiet = data_events(httpx.post(chunked + "/completion", json=body | {"return_progress": False}))
    assert not _progress(quiet) and all("timings" in e for e in quiet)
    whole = httpx.post(chunked + "/completion", json=body | {"stream": False}, timeout=60).json()
    assert "prompt_progress" not in whole


def test_return_progress_on_the_openai_endpoints(chunked: str) -> None:
    chat = {
        "messages": [{"role": "user", "content": "a b c d e f g h i j k l m n o p"}],
        "max_tokens": 2,
        "stream": True,
        "return_progress": True,
        "cache_prompt": False,
        **GREEDY,
    }
    events = data_events(httpx.post(chunked + "/v1/chat/completions", json=chat, timeout=60))
    reports = [e for e in events if "prompt_progress" in e]
    assert len(reports) >= 3  # the chat is longer than two chunks
    for e in reports:  # as llama-server: each on a role chunk
        assert e["choices"][0]["delta"] == {"role": "assistant", "content": None}
        assert "timings" not in e  # only with timings_per_token
    assert reports[-1]["prompt_progress"]["processed"] == reports[-1]["prompt_progress"]["total"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    plain = httpx.post(
        chunked + "/v1/chat/completions", json=chat | {"stream": False}, timeout=60
    ).json()
    assert text == plain["choices"][0]["message"]["content"]  # the answer is unchanged

    comp = {"prompt": list(range(20, 40)), "max_tokens": 2, "stream": True} | GREEDY
    comp |= {"return_progress": True, "cache_prompt": False}
    events = data_events(httpx.post(chunked + "/v1/completions", json=comp, timeout=60))
    reports = [e for e in events if "prompt_progress" in e]
    assert [e["prompt_progress"]["processed"] for e in reports] == [0, 8, 16, 20]
    assert all(e["choices"][0]["text"] == "" for e in reports)

    resp = {"input": "a b c d e f g h i j k l m n o p", "max_output_tokens": 2, "stream": True}
    resp |= {"return_progress": True, "timings_per_token": True, "temperature": 0}
    r = httpx.post(chunked + "/v1/responses", json=resp, timeout=60)
    data = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
    reports = [d for d in data if "prompt_progress" in d]
    assert reports and all(d["type"] == "response.in_progress" for d in reports)
    assert all("prompt_per_second" in d["timings"] for d in reports)
