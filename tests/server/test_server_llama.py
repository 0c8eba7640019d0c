"""llama-server's endpoints and LoRA API, continuous batching across adapters, disconnects."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

import httpx
import pytest
from server_fixtures import (
    PARALLEL,
    TinyServer,
    steps_wait_for_a_cancel,
    wait_until,
    watch_inbox,
)

PROMPT = [12, 80, 31, 77, 140]


@pytest.fixture(scope="module")
def http(server: TinyServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60)


def _completion(http: httpx.Client, **body: object) -> dict:
    r = http.post(
        "/completion", json={"temperature": 0, "ignore_eos": True, "return_tokens": True, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_fields(server: TinyServer, http: httpx.Client) -> None:
    out = _completion(http, prompt=PROMPT, n_predict=8, n_probs=2, cache_prompt=True)
    assert out["tokens"] == server.ref_tokens(PROMPT, 8)
    assert out["content"] == server.ref.detokenize(out["tokens"])
    assert out["tokens_predicted"] == 8 and out["tokens_evaluated"] == len(PROMPT)
    assert out["stop"] is True and out["stop_type"] == "limit"
    t = out["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] == len(PROMPT) and t["predicted_ms"] >= 0
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == out["tokens"] and all(
        len(p["top_logprobs"]) == 2 for p in probs
    )


def test_completion_stream(http: httpx.Client) -> None:
    whole = _completion(http, prompt=PROMPT, n_predict=8)
    events = []
    with http.stream(
        "POST",
        "/completion",
        json={
            "prompt": PROMPT,
            "n_predict": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 8
    assert [t for e in events[:-1] for t in e["tokens"]] == whole["tokens"]


def test_lora_adapters_workflow(server: TinyServer, http: httpx.Client) -> None:
    """GET the list, POST scales (unlisted go to 0), then /completion runs with them."""
    listed = http.get("/lora-adapters").json()
    assert (
        listed[0]["id"] == 0 and listed[0]["path"].endswith("a0.gguf") and listed[0]["scale"] == 0.0
    )
    assert set(listed[0]) >= {"id", "path", "scale", "task_name", "prompt_prefix"}
    try:
        r = http.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}])
        assert r.status_code == 200, r.text
        scales = {a["id"]: a["scale"] for a in http.get("/lora-adapters").json()}
        assert scales[0] == 0.5 and all(s == 0.0 for i, s in scales.items() if i != 0)
        out = _completion(http, prompt=PROMPT, n_predict=8)
        assert out["tokens"] == server.ref_tokens(PROMPT, 8, {"a0": 0.5})
        # per-request lora overrides the global scales for that request only
        out = _completion(http, prompt=PROMPT, n_predict=8, lora=[{"id": 0, "scale": 0.0}])
        assert out["tokens"] == server.ref_tokens(PROMPT, 8)
        # an adapter chosen by name runs at scale 1, whatever the global scales
        out = _completion(http, prompt=PROMPT, n_predict=8, model="a0")
        assert out["tokens"] == server.ref_tokens(PROMPT, 8, {"a0": 1.0})
        assert http.post("/lora-adapters", json=[]).status_code == 200  # everything back to 0
        assert all(a["scale"] == 0.0 for a in http.get("/lora-adapters").json())
        out = _completion(http, prompt=PROMPT, n_predict=8)
        assert out["tokens"] == server.ref_tokens(PROMPT, 8)
    finally:
        http.post("/lora-adapters", json=[])


def test_concurrent_requests_with_different_adapters_equal_alone(
    server: TinyServer, http: httpx.Client
) -> None:
    """Six /completion requests, each with its own per-request scales, share decode steps; each
    answer equals the same request sent alone."""
    http.post(
        "/completion", json={"prompt": [1, 2], "n_predict": 1, "model": "alpha"}
    )  # attach alpha
    ids = {a["name"]: a["id"] for a in http.get("/lora-adapters").json()}
    settings = [
        [],
        [{"id": ids["a0"], "scale": 1.0}],
        [{"id": ids["a0"], "scale": 0.4}],
        [{"id": ids["alpha"], "scale": 1.0}],
        [{"id": ids["a0"], "scale": 0.5}, {"id": ids["alpha"], "scale": -0.7}],
        [{"id": ids["alpha"], "scale": 2.0}],
    ]
    prompts = [PROMPT[: 2 + k % 4] + [k + 3] for k in range(len(settings))]
    bodies: list[dict[str, Any]] = [
        {
            "prompt": p,
            "n_predict": 24,
            "temperature": 0,
            "ignore_eos": True,
            "return_tokens": True,
            "lora": s,
        }
        for p, s in zip(prompts, settings, strict=True)
    ]
    alone = [_completion(http, **b)["tokens"] for b in bodies]
    steps_before = _metric(http, "graftlm_batch_size_count")

    async def together() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/completion", json=b) for b in bodies))
        return [r.json()["tokens"] for r in rs]

    assert asyncio.run(together()) == alone
    by_name = {v: k for k, v in ids.items()}
    for b, toks in zip(bodies, alone, strict=True):
        lora = {by_name[x["id"]]: x["scale"] for x in b["lora"]}
        assert toks == server.ref_tokens(b["prompt"], 24, lora)
    assert _metric(http, "graftlm_batch_size_count") > steps_before
    assert PARALLEL >= len(bodies)


def _metric(http: httpx.Client, name: str) -> float:
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_mixed_batches_happen(server: TinyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests with different adapters run in the same engine step (batch size > 1). (The
    engine is held until all four are in its inbox: on a loaded machine they could otherwise
    come one by one, each served before the next.)"""
    bodies = [
        {
            "prompt": PROMPT,
            "n_predict": 40,
            "temperature": 0,
            "ignore_eos": True,
            "lora": [{"id": 0, "scale": 0.1 * k}],
        }
        for k in range(4)
    ]

    svc = server.state.service
    sent, all_in = [0], threading.Event()

    def seen(item: Any) -> None:
        if type(item).__name__ == "Submission":
            sent[0] += 1
            if sent[0] == len(bodies):
                all_in.set()

    async def run() -> None:
        watch_inbox(svc, monkeypatch, seen)
        held = svc.call(lambda: all_in.wait(300))  # the engine waits for all four
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
                rs = await asyncio.gather(*(c.post("/completion", json=b) for b in bodies))
        finally:
            all_in.set()  # (released whatever happened: the server is the session's)
        assert held.result(timeout=60), "the four requests were not all in the inbox in 300 s"
        assert all(r.status_code == 200 for r in rs)

    hist = server.state.metrics.batch_size
    before = {
        s.labels.get("le"): s.value
        for s in list(hist.collect())[0].samples
        if s.name.endswith("_bucket")
    }
    asyncio.run(run())
    after = {
        s.labels.get("le"): s.value
        for s in list(hist.collect())[0].samples
        if s.name.endswith("_bucket")
    }
    multi = (after["+Inf"] - after["1.0"]) - (before["+Inf"] - before["1.0"])
    assert multi > 0


def test_tokenize_detokenize_template(server: TinyServer, http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"content": "the the"}).json()
    assert r["tokens"] == server.ref.tokenize("the the", add_special=False, parse_special=True)
    pieces = http.post("/tokenize", json={"content": "the the", "with_pieces": True}).json()[
        "tokens"
    ]
    assert [p["id"] for p in pieces] == r["tokens"] and "".join(
        p["piece"] for p in pieces
    ) == "the the"
    # llama-server's name for the text and vLLM's: both send this body
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
        "content": "the the",
        "prompt": "the the",
    }
    messages = [{"role": "user", "content": "hi"}]
    assert http.post("/apply-template", json={"messages": messages}).json()[
        "prompt"
    ] == server.ref.apply_chat_template(messages)


def test_health_props_metrics(
    server: TinyServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    props = http.get("/props").json()
    assert (
        props["total_slots"] == PARALLEL
        and props["default_generation_settings"]["n_ctx"] == server.state.service.n_ctx
    )
    _completion(http, prompt=PROMPT, n_predict=3, model="beta")
    _completion(http, prompt=PROMPT, n_predict=3)  # (the base's labels, when run alone)
    text = http.get("/metrics").text
    for name in (
        "graftlm_requests_total",
        "graftlm_generation_tokens_total",
        "graftlm_prompt_tokens_total",
        "graftlm_requests_running",
        "graftlm_requests_waiting",
        "graftlm_batch_size_bucket",
        "graftlm_time_to_first_token_seconds_bucket",
        "graftlm_time_per_output_token_seconds_bucket",
        "graftlm_lora_adapters_resident",
        "graftlm_lora_adapter_bytes",
        "graftlm_lora_requests_waiting",
    ):
        assert name in text, name
    assert 'adapter="beta"' in text and 'adapter="base"' in text
    assert _metric(http, "graftlm_lora_adapter_bytes") > 0
    # beta (a --lora-modules adapter) was attached on first use: its cold-load time observed
    assert _metric(http, "graftlm_lora_adapter_load_seconds_count") >= 1
    assert _metric(http, "graftlm_lora_adapter_load_seconds_sum") > 0
    assert _metric(http, "graftlm_lora_adapter_wait_seconds_count") >= 1
    assert _metric(http, "graftlm_lora_requests_waiting") == 0  # (none now)
    # a runtime load waiting for its read: counted while it waits, then no more
    registry = server.state.registry
    gate, real = threading.Event(), registry.service.prepare_adapter

    def gated(path: str) -> Any:
        assert gate.wait(60), "the test never let the read go"
        return real(path)

    monkeypatch.setattr(registry.service, "prepare_adapter", gated)
    body = {"lora_name": "waits-for-its-read", "lora_path": str(server.adapters["delta"])}
    answers: list[httpx.Response] = []

    def load() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as other:
            answers.append(other.post("/v1/load_lora_adapter", json=body))

    loading = threading.Thread(target=load)
    loading.start()
    try:
        wait_until(lambda: registry.queued == 1, 60, "the load to wait for its read")
        assert _metric(http, "graftlm_lora_requests_waiting") == 1
    finally:
        gate.set()
        loading.join(60)
    assert answers and answers[0].status_code == 200, answers
    assert _metric(http, "graftlm_lora_requests_waiting") == 0
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": body["lora_name"]}).is_success


def test_client_disconnect_frees_the_slot(
    server: TinyServer,
    http: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    svc = server.state.service
    cancelled = svc.n_cancelled
    steps_wait_for_a_cancel(svc, monkeypatch, request)
    body = {
        "prompt": PROMPT,
        "n_predict": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/completion", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    wait_until(lambda: not (svc.n_running or svc.engine.busy), 120, "the engine to be idle")
    assert svc.n_cancelled == cancelled + 1
    assert not svc.engine.running and len(svc.engine.free_slots) == svc.engine.n_slots
    assert _completion(http, prompt=PROMPT, n_predict=2)["tokens_predicted"] == 2


def test_non_streaming_client_that_leaves_is_cancelled(
    server: TinyServer, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    svc = server.state.service
    cancelled = svc.n_cancelled
    # (the 1000 tokens outlast the disconnect check)
    steps_wait_for_a_cancel(svc, monkeypatch, request)
    body = {"prompt": PROMPT, "n_predict": 1000, "temperature": 0, "ignore_eos": True}
    data = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # a client that leaves
        head = f"POST /completion HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_until(lambda: svc.n_running, 120, "the request to be generating", every=0.002)
        assert svc.n_running == 1
    wait_until(lambda: svc.n_cancelled != cancelled, 120, "the cancellation")
    assert svc.n_cancelled == cancelled + 1
    wait_until(lambda: not svc.engine.busy, 120, "the engine to be idle")
    assert len(svc.engine.free_slots) == svc.engine.n_slots


def test_tokenize_takes_vllms_body_for_remote_tokenizer_clients(
    server: TinyServer, http: httpx.Client
) -> None:
    """lm-eval's `tokenizer_backend=remote` and other vLLM clients send `prompt` and
    `add_special_tokens` (default true), with `model`, and read vLLM's fields back; a body with
    both texts, or neither, is a 400 that names both fields."""
    ref = server.ref.tokenize("the the", add_special=True, parse_special=True)
    r = http.post("/tokenize", json={"model": "any", "prompt": "the the"})
    assert r.status_code == 200
    out = r.json()
    assert out["tokens"] == ref and out["count"] == len(ref) and out["token_strs"] is None
    assert (
        out["max_model_len"]
        == http.get("/props").json()["default_generation_settings"]["n_ctx_seq"]
    )
    plain = http.post("/tokenize", json={"prompt": "the the", "add_special_tokens": False}).json()
    assert plain["tokens"] == server.ref.tokenize("the the", add_special=False, parse_special=True)
    strs = http.post("/tokenize", json={"prompt": "the", "return_token_strs": True}).json()
    assert "".join(strs["token_strs"]).endswith("the")
    # lm-eval's RemoteTokenizer, call for call: /tokenizer_info with an eos_token, encode without
    # specials, decode by "prompt"
    assert "eos_token" in http.get("/tokenizer_info").json()
    ids = http.post("/tokenize", json={"prompt": "the the", "add_special_tokens": False}).json()
    back = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()
    assert back["prompt"] == "the the"
    for bad in ({"prompt": "a", "content": "a"}, {"model": "any"}):
        r = http.post("/tokenize", json=bad)
        assert r.status_code == 400 and "content" in r.text and "prompt" in r.text, r.text
