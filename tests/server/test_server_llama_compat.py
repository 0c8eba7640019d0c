"""What makes the server a drop-in for llama-server (llama.cpp's own server tests check these; this
file holds them in CI): CORS, the unknown-model rule and its strict flag, the prompt shapes of
/completion, the stream framing, the Anthropic and Responses translations, /slots, /metrics names,
and the flags `graftlm serve` takes from a llama-server command line."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_fixtures import SPEC, TinyServer, error_of, serving

import graftlm
from graftlm.commands.llama_server_flags import llama_server_notes
from graftlm.commands.serve_args import add_serve_arguments
from graftlm.commands.serve_options import http_config
from graftlm.lora.settings import AdapterSettings
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

PROMPT = [12, 80, 31, 77, 140]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(server: TinyServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60)


def _server(tiny_files: dict[str, Path], **config: Any) -> Iterator[str]:
    model = graftlm.load(tiny_files["model"], ctx_size=SPEC.n_ctx, n_seq=3)
    state = build_state(
        model,
        ServerConfig(model_name="tiny", **config),
        parallel=2,
        lora_modules=[("alpha", str(tiny_files["alpha"]))],
    )
    with serving(state) as url:
        yield url


@pytest.fixture(scope="module")
def strict(tiny_files: dict[str, Path]) -> Iterator[str]:
    """--strict-model-names --cors-origins localhost,https://app.example --no-slots --no-metrics"""
    yield from _server(
        tiny_files,
        strict_model_names=True,
        cors_origins=("localhost", "https://app.example"),
        slots=False,
        metrics=False,
        aliases=("tiny", "chat-alias"),
        extra_model_names=("chat-alias",),
        tags=("chat", "small"),
        gcp=True,
    )


@pytest.fixture(scope="module")
def keyed(tiny_files: dict[str, Path]) -> Iterator[str]:
    """--api-key k (no --cors-origins): open to any origin, as llama-server."""
    yield from _server(tiny_files, api_key="k")


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# -- the unknown-model rule --
def test_strict_model_names_answers_404_listing_names(strict: str) -> None:
    r = httpx.post(strict + "/v1/completions", json={"prompt": "the", "model": "gpt-7"})
    err = error_of(r, 404, "gpt-7", "alpha", "tiny")
    assert err["code"] == "model_not_found"
    ok = httpx.post(
        strict + "/v1/completions", json={"prompt": PROMPT, "model": "alpha", "max_tokens": 2}
    )
    assert ok.status_code == 200 and ok.json()["model"] == "alpha"


# -- CORS --
def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(
        url + "/v1/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization",
        },
    )


def test_cors_listed_origins(strict: str) -> None:
    for origin in (
        "http://localhost:3000",
        "http://127.0.0.1",
        "http://[::1]:8080",
        "https://app.example",
    ):
        r = _preflight(strict, origin)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        body = {"prompt": PROMPT, "max_tokens": 1}
        r = httpx.post(strict + "/v1/completions", json=body, headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    for origin in ("http://evil.com", "http://localhost.evil.com", "https://app.example.org"):
        r = _preflight(strict, origin)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = httpx.post(
            strict + "/v1/completions", json={"prompt": PROMPT}, headers={"Origin": origin}
        )
        error_of(r, 403, "cross-site")


def test_cors_default_without_a_key_is_same_origin_only(http: httpx.Client) -> None:
    r = _preflight(str(http.base_url).rstrip("/"), "http://web.example")
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = http.post(
        "/v1/completions", json={"prompt": PROMPT}, headers={"Origin": "http://web.example"}
    )
    error_of(r, 403, "cross-site")


def test_cors_default_with_a_key_is_open(keyed: str) -> None:
    r = _preflight(keyed, "http://web.example")
    assert r.headers["access-control-allow-origin"] == "http://web.example"
    assert r.headers["access-control-allow-credentials"] == "true"
    headers = {"Origin": "http://web.example"}
    error_of(httpx.post(keyed + "/v1/completions", json={"prompt": PROMPT}, headers=headers), 401)
    ok = httpx.post(
        keyed + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1},
        headers=headers | {"Authorization": "Bearer k"},
    )
    assert (
        ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://web.example"
    )


def test_header_names_go_out_as_llama_server_spells_them(keyed: str) -> None:
    """On the wire, not only case-insensitively: clients that copy headers into a plain dict
    look up `Access-Control-Allow-Origin`."""
    names = [k for k, _ in _preflight(keyed, "http://web.example").headers.raw]
    assert b"Access-Control-Allow-Origin" in names and b"Access-Control-Max-Age" in names
    r = httpx.get(keyed + "/health")
    names = [k for k, _ in r.headers.raw]
    assert b"Content-Type" in names and b"content-type" not in names


# -- requests --
def test_any_content_type_is_read_as_json(http: httpx.Client) -> None:
    body = json.dumps({"prompt": PROMPT, "n_predict": 2, **GREEDY})
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": kind} if kind else {}
        r = http.post("/completion", content=body, headers=headers)
        assert r.status_code == 200, (kind, r.text)


def test_completion_prompt_shapes(server: TinyServer, http: httpx.Client) -> None:
    text = server.ref.detokenize(PROMPT)
    one = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, **GREEDY}).json()
    assert one["content"] == server.ref.detokenize(server.ref_tokens(PROMPT, 4))
    batch = http.post("/completion", json={"prompt": [PROMPT, PROMPT], "n_predict": 4, **GREEDY})
    assert batch.status_code == 200
    assert [a["content"] for a in batch.json()] == [one["content"]] * 2
    assert [a["index"] for a in batch.json()] == [0, 1]
    obj = http.post(
        "/completion", json={"prompt": {"prompt_string": text}, "n_predict": 4, **GREEDY}
    )
    assert obj.status_code == 200
    mixed = http.post("/completion", json={"prompt": [PROMPT, text], "n_predict": 4, **GREEDY})
    assert mixed.status_code == 200 and len(mixed.json()) == 2
    inline = http.post("/completion", json={"prompt": [*PROMPT, text], "n_predict": 2, **GREEDY})
    assert inline.status_code == 200
    assert inline.json()["tokens_evaluated"] > len(PROMPT)
    error_of(
        http.post("/completion", json={"prompt": {"multimodal_data": ["x"]}}), 400, "multimodal"
    )
    error_of(
        http.post("/completion", json={"prompt": [PROMPT, PROMPT], "stream": True}), 400, "stream"
    )
    fields = http.post(
        "/completion",
        json={
            "prompt": PROMPT,
            "n_predict": 3,
            "response_fields": ["content", "generation_settings/n_predict"],
        },
    ).json()
    assert set(fields) == {"content", "generation_settings/n_predict"}
    assert fields["generation_settings/n_predict"] == 3


def test_embedding_input_shapes(http: httpx.Client) -> None:
    def embed(value: Any) -> list[list[float]]:
        r = http.post("/v1/embeddings", json={"input": value})
        assert r.status_code == 200, r.text
        return [d["embedding"] for d in r.json()["data"]]

    (plain,) = embed("hello world")
    parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    assert embed(["hello world", parts]) == [plain, plain]
    assert embed({"prompt_string": "hello world"}) == [plain]
    c = {"content": [{"type": "text", "text": "c"}]}
    assert len(embed(["a", [12, 34], [12, "b", 34], c])) == 4
    # as llama-server: content is a list of parts, never a bare string
    error_of(http.post("/v1/embeddings", json={"input": {"content": "c"}}), 400, "content")
    image = {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}
    error_of(http.post("/v1/embeddings", json={"input": image}), 400, "image_url")
    error_of(http.post("/v1/embeddings", json={"input": []}), 400, "empty")


def test_completions_without_v1_is_the_native_endpoint(http: httpx.Client) -> None:
    r = http.post("/completions", json={"prompt": PROMPT, "n_predict": 2, **GREEDY})
    assert r.status_code == 200 and "content" in r.json() and "choices" not in r.json()
    assert (
        "choices" in http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    )


def test_chat_trailing_assistant_rules(http: httpx.Client) -> None:
    user = {"role": "user", "content": "hi"}
    two = [user, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    error_of(http.post("/v1/chat/completions", json={"messages": two}), 400, "two assistant")
    both = {"add_generation_prompt": True, "continue_final_message": True}
    prefill = [user, {"role": "assistant", "content": "Well"}]
    error_of(http.post("/v1/chat/completions", json={"messages": prefill, **both}), 400, "both")
    plain = http.post("/apply-template", json={"messages": [user]}).json()["prompt"]
    bare = http.post(
        "/apply-template", json={"messages": [user], "add_generation_prompt": False}
    ).json()["prompt"]
    assert plain.startswith(bare) and len(plain) > len(bare)
    cont = http.post("/apply-template", json={"messages": prefill}).json()["prompt"]
    assert cont == plain + "Well"  # the final assistant message is continued


def test_context_overflow_error_as_llama_server(http: httpx.Client) -> None:
    err = error_of(http.post("/completion", json={"prompt": [5] * (SPEC.n_ctx + 4)}), 400)
    assert err["type"] == "exceed_context_size_error"
    assert err["n_prompt_tokens"] == SPEC.n_ctx + 4 and err["n_ctx"] == SPEC.n_ctx


# -- the stream framing --
def test_chat_stream_framing(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    events = _events(http.post("/v1/chat/completions", json=body | GREEDY))
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
    assert all(e["choices"] for e in _events(http.post("/v1/chat/completions", json=off)))
    per = _events(
        http.post("/v1/chat/completions", json=body | GREEDY | {"timings_per_token": True})
    )
    assert "timings" not in per[0] and any("timings" in e for e in per[1:-1])


def test_timings_of_one_token(http: httpx.Client) -> None:
    t = http.post("/completion", json={"prompt": PROMPT, "n_predict": 1, **GREEDY}).json()[
        "timings"
    ]
    assert t["predicted_n"] == 1 and t["predicted_per_second"] == 0.0
    assert t["predicted_per_token_ms"] == 0.0 and t["prompt_ms"] > 0


# -- the Anthropic and Responses APIs --
def test_anthropic_messages(http: httpx.Client) -> None:
    body = {
        "model": "alpha",
        "max_tokens": 4,
        "system": "be brief",
        "messages": [{"role": "user", "content": "hi"}],
    }
    r = http.post("/v1/messages", json=body | GREEDY)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (
        out["type"] == "message" and out["model"] == "alpha" and out["content"][0]["type"] == "text"
    )
    assert out["stop_reason"] == "max_tokens" and out["usage"]["output_tokens"] == 4
    n = http.post(
        "/v1/messages/count_tokens", json={"messages": body["messages"], "system": "be brief"}
    )
    assert (
        n.json()["input_tokens"]
        == out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"]
    )
    kinds = [
        e["type"] for e in _events(http.post("/v1/messages", json=body | GREEDY | {"stream": True}))
    ]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in kinds and kinds.count("content_block_start") == kinds.count(
        "content_block_stop"
    )
    error_of(http.post("/v1/messages", json={"max_tokens": 4}), 400, "messages")
    bad_text = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    r = http.post("/v1/messages", json={"max_tokens": 4, "messages": bad_text})
    error_of(r, 400, "messages[0].content[0].text", "expected a string")
    r = http.post("/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                        "system": [{"type": "text", "text": 5}]})  # fmt: skip
    error_of(r, 400, "system[0].text: expected a string, got int")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
    error_of(
        http.post(
            "/v1/messages",
            json={"max_tokens": 4, "messages": [{"role": "user", "content": [image]}]},
        ),
        400,
        "image",
    )


def test_anthropic_tool_history_translates(http: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}],
        },
    ]
    n = http.post("/v1/messages/count_tokens", json={"messages": messages})
    assert n.status_code == 200, n.text
    fewer = http.post("/v1/messages/count_tokens", json={"messages": messages[:1]})
    assert n.json()["input_tokens"] > fewer.json()["input_tokens"]


def test_responses_api(http: httpx.Client) -> None:
    body = {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 4, "model": "beta"}
    out = http.post("/v1/responses", json=body | GREEDY).json()
    assert out["id"].startswith("resp_") and out["model"] == "beta"
    assert out["output"][0]["id"].startswith("msg_") and out["usage"]["output_tokens"] == 4
    events = _events(http.post("/responses", json=body | GREEDY | {"stream": True}))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (
        text
        == events[-1]["response"]["output"][0]["content"][0]["text"]
        == out["output"][0]["content"][0]["text"]
    )
    error_of(http.post("/v1/responses", json={"input": "x", "previous_response_id": "r"}), 400)


# -- /slots, /metrics, /props --
def test_slots_and_metrics(http: httpx.Client, strict: str) -> None:
    slots = http.get("/slots").json()
    assert all(s["is_processing"] is False for s in slots) and slots[0]["n_ctx"] > 0
    error_of(httpx.get(strict + "/slots"), 501, "--no-slots")
    error_of(httpx.get(strict + "/metrics"), 501, "--no-metrics")
    http.post("/completion", json={"prompt": PROMPT, "n_predict": 3, **GREEDY})
    text = http.get("/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("llamacpp:")
    }
    assert "# TYPE llamacpp:prompt_tokens_total counter" in text
    assert "# TYPE llamacpp:requests_processing gauge" in text
    assert values["llamacpp:tokens_predicted_total"] >= 3 and values["llamacpp:n_decode_total"] > 0
    assert "graftlm_requests_total" in text  # graftlm's own stay beside them


def test_more_llama_server_fields(http: httpx.Client, strict: str) -> None:
    model = httpx.get(strict + "/v1/models").json()["data"][0]
    assert model["id"] == "tiny" and set(model["aliases"]) == {"tiny", "chat-alias"}
    assert model["tags"] == ["chat", "small"]
    served = httpx.post(strict + "/v1/completions", json={"prompt": PROMPT, "model": "chat-alias"})
    assert served.status_code == 200 and served.json()["model"] == "chat-alias"
    body = {"prompt": PROMPT, "n_predict": 2, "temperature": 0}
    eos = http.post("/completion", json=body | {"ignore_eos": True}).json()
    bias = eos["generation_settings"]["logit_bias"]
    assert bias and all(b["bias"] is None for b in bias)  # -inf, as JSON null
    assert http.post("/completion", json=body).json()["generation_settings"]["logit_bias"] == []
    chat = {"messages": [{"role": "user", "content": "hello there"}]}
    n = http.post("/chat/completions/input_tokens", json=chat).json()["input_tokens"]
    prompt = http.post("/apply-template", json=chat).json()["prompt"]
    assert n == len(
        http.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
    )
    verbose = http.post(
        "/v1/chat/completions", json=chat | {"max_tokens": 1, "verbose": True}
    ).json()
    assert verbose["__verbose"]["prompt"] == prompt
    assert (
        "__verbose" not in http.post("/v1/chat/completions", json=chat | {"max_tokens": 1}).json()
    )
    assert "Process-Start-Time-Unix" in http.get("/metrics").headers


def test_vertex_predict(http: httpx.Client, strict: str) -> None:
    chat = {
        "@requestFormat": "chatCompletions",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    }
    r = httpx.post(strict + "/predict", json={"instances": [chat, chat]}, timeout=60)
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert len(preds) == 2 and all(p["choices"][0]["message"]["role"] == "assistant" for p in preds)
    error_of(httpx.post(strict + "/predict", json={"instances": []}), 400, "instances")
    assert (
        http.post("/predict", json={"instances": [chat]}).status_code == 404
    )  # only with AIP_MODE


# -- the command line --
LLAMA_SERVER_ARGS = (
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1,::1 --offline --hf-repo-draft x "
    "--batch-size 32 --ubatch-size 32 -ngl 99 -fa on --cont-batching --embedding --metrics "
    "--kv-unified --swa-full --slots --pooling mean --alias tiny,tiny-2 --tags a,b -c 512 -np 2 "
    "-ctk f16 -ctv f16 --n-predict 64 --slot-save-path /tmp --grp-attn-n 2 --verbose "
    "--context-shift --spec-type none --no-ui --jinja --reasoning-format none --reasoning off "
    "--sleep-idle-seconds 5 --cache-ram 0 --no-cache-idle-slots --cors-origins localhost "
    "--reranking --api-key-file k.txt -dev none"
)


def test_a_llama_server_command_line_parses() -> None:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    a = p.parse_args(LLAMA_SERVER_ARGS.split())
    assert a.n_gpu_layers == "99" and a.batch_size == 32 and a.n_predict == 64 and a.ctx_size == 512
    assert a.host == "127.0.0.1,::1" and a.alias == "tiny,tiny-2" and a.log_level == "debug"
    assert a.api_key_file == "k.txt" and not a.ui and a.sleep_idle_seconds == 5
    assert a.context_shift  # (read by graftlm: llama-server's context shift)
    cfg = http_config(a)
    assert cfg["cors_origins"] == ("localhost",) and cfg["tags"] == ("a", "b")
    assert cfg["metrics"] and cfg["slots"]
    notes = llama_server_notes(a)
    for flag in ("--offline", "--jinja", "--embedding", "--reranking", "-dev"):
        assert sum(n.startswith(flag) for n in notes) == 1, (flag, notes)
    mapped = (
        "--metrics",
        "--slots",
        "--tags",
        "--no-ui",
        "--sleep-idle-seconds",
        "--context-shift",
    )
    assert not any(n.startswith(mapped) for n in notes)
    b = p.parse_args("--no-metrics --no-slots -ngl 99".split())
    assert not b.metrics and not b.slots and b.n_predict == -1  # -ngl is not `-n gl`


# -- /rerank --
def _rank_ref(server: TinyServer, query: str, doc: str, lora: dict[str, float]) -> float:
    """The score as llama.cpp's rank pooling computes it without a classification head, from the
    reference model: the first component of the last token's final-norm hidden state."""
    tok = server.ref.tokenizer
    bos = [tok.bos_id] if tok.add_bos else []
    eos = [tok.eos_id] if tok.add_eos else []
    q = server.ref.tokenize(query, add_special=False)
    d = server.ref.tokenize(doc, add_special=False)
    settings = AdapterSettings({server.ref_ids[k]: v for k, v in lora.items()})
    hidden = server.ref.engine.score([*bos, *q, *eos, *d, *eos], settings, hidden=True)
    return float(hidden[-1, 0])


def test_rerank_scores_orders_and_shapes(server: TinyServer, http: httpx.Client) -> None:
    docs = ["the cat sat", "a dog ran far", "on the mat", "hello"]
    for lora in ({}, {"alpha": 1.0}):
        body: dict[str, Any] = {"query": "where is it", "documents": docs}
        if lora:
            body["model"] = "alpha"
        r = http.post("/rerank", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        want = [_rank_ref(server, "where is it", d, lora) for d in docs]
        got = {x["index"]: x["relevance_score"] for x in out["results"]}
        assert got == pytest.approx(dict(enumerate(want)), abs=1e-4)
        assert [x["index"] for x in out["results"]] == sorted(range(4), key=lambda i: -want[i])
        assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 0
    base = http.post("/v1/rerank", json={"query": "where is it", "documents": docs}).json()
    assert base["results"] != out["results"]  # the adapter changed the scores
    tei = http.post("/rerank", json={"query": "where is it", "texts": docs, "top_n": 2}).json()
    assert [x["index"] for x in tei] == [x["index"] for x in base["results"][:2]]
    assert all(set(x) == {"index", "score"} for x in tei)
    with_text = http.post(
        "/rerank", json={"query": "q", "texts": docs, "return_text": True, "top_n": 99}
    ).json()
    assert len(with_text) == 4 and {x["text"] for x in with_text} == set(docs)
    for bad in ([], None, 123, [1, 2, 3]):
        error_of(http.post("/rerank", json={"query": "q", "documents": bad}), 400)
    error_of(http.post("/rerank", json={"query": "q", "documents": ["a"], "top_n": 0}), 400)


# -- post_sampling_probs --
def test_post_sampling_probs_are_the_sampler_chains(server: TinyServer, http: httpx.Client) -> None:
    body = {
        "prompt": PROMPT,
        "n_predict": 4,
        "n_probs": 5,
        "temperature": 0.7,
        "top_k": 3,
        "top_p": 1.0,
        "min_p": 0.0,
        "seed": 7,
        "post_sampling_probs": True,
        "backend_sampling": True,
    }
    out = http.post("/completion", json=body).json()
    probs = out["completion_probabilities"]
    assert len(probs) == 4
    first = server.ref.logits(PROMPT)[-1].float()
    vals, idx = first.topk(3)
    want = torch.softmax(vals / 0.7, -1)
    got = probs[0]["top_probs"]
    assert [x["id"] for x in got] == idx.tolist()
    assert [x["prob"] for x in got] == pytest.approx(want.tolist(), abs=1e-4)
    for tok in probs:
        assert "logprob" not in tok and 0.0 < tok["prob"] <= 1.0
        assert len(tok["top_probs"]) == 3 and sum(x["prob"] for x in tok["top_probs"]) == (
            pytest.approx(1.0, abs=1e-5)
        )
        assert tok["id"] in [x["id"] for x in tok["top_probs"]]
    greedy = http.post("/completion", json=body | {"temperature": 0.0}).json()
    for tok in greedy["completion_probabilities"]:
        assert tok["prob"] == 1.0 and [x["id"] for x in tok["top_probs"]] == [tok["id"]]
    raw = http.post("/completion", json=body | {"post_sampling_probs": False}).json()
    assert all("logprob" in t and "top_logprobs" in t for t in raw["completion_probabilities"])


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
    events = _events(httpx.post(chunked + "/completion", json=body, timeout=60))
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
    events = _events(
        httpx.post(chunked + "/completion", json=body | {"cache_prompt": True}, timeout=60)
    )
    assert [(p["cache"], p["processed"]) for p in _progress(events)] == [(16, 16), (16, 20)]
    # without return_progress, or without stream, none
    quiet = _events(httpx.post(chunked + "/completion", json=body | {"return_progress": False}))
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
    events = _events(httpx.post(chunked + "/v1/chat/completions", json=chat, timeout=60))
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
    events = _events(httpx.post(chunked + "/v1/completions", json=comp, timeout=60))
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


def test_serve_maps_batch_size_to_the_prompt_chunk() -> None:
    from graftlm.commands.llama_flags import llama_flag_notes

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["-b", "64", "-ub", "32"])
    assert args.batch_size == 64
    assert llama_flag_notes(args, maps_batch=True) == [
        "-ub: no effect; -b sets the prompt tokens one step prefills"
    ]
    assert any("-b/-ub: no effect" in n for n in llama_flag_notes(args))  # run and bench


def test_pooling_and_tools_flags_map_as_llama_server_does() -> None:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert http_config(p.parse_args([]))["pooling"] == "mean"
    assert http_config(p.parse_args(["--pooling", "last"]))["pooling"] == "last"
    assert http_config(p.parse_args(["--pooling", "rank"]))["pooling"] == "mean"
    with pytest.raises(ValueError, match="--pooling max: not one of"):
        http_config(p.parse_args(["--pooling", "max"]))
    assert not any(
        n.startswith("--pooling") for n in llama_server_notes(p.parse_args(["--pooling", "cls"]))
    )
    # --tools: CORS for loopback pages only unless --cors-origins says otherwise
    assert http_config(p.parse_args([]))["cors_origins"] is None
    assert http_config(p.parse_args(["--tools", "all"]))["cors_origins"] == ("localhost",)
    both = p.parse_args(["--tools", "all", "--cors-origins", "https://app.example"])
    assert http_config(both)["cors_origins"] == ("https://app.example",)


def test_chat_template_kwargs_from_the_request_and_the_flags(
    tiny_files: dict[str, Path], http: httpx.Client
) -> None:
    """A request's chat_template_kwargs reach the template (over the server's, which
    --chat-template-kwargs and --reasoning set); the template's own names are refused."""
    thinking = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if not enable_thinking %}</think>{% endif %}{{ greeting | default('') }}"
    )
    model = graftlm.load(tiny_files["model"], ctx_size=SPEC.n_ctx, n_seq=2, chat_template=thinking)
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["--reasoning", "off", "--chat-template-kwargs", '{"greeting": "hey"}'])
    from graftlm.commands.serve import chat_template_kwargs

    model.prompter.template_kwargs = chat_template_kwargs(args)
    state = build_state(model, ServerConfig(model_name="tiny"), parallel=1)
    user = {"role": "user", "content": "hi"}
    with serving(state) as url:

        def prompt(**body: Any) -> str:
            r = httpx.post(url + "/apply-template", json={"messages": [user], **body}, timeout=60)
            assert r.status_code == 200, r.text
            return str(r.json()["prompt"])

        assert prompt() == "hi</think>hey"
        assert prompt(chat_template_kwargs={"enable_thinking": True, "greeting": "yo"}) == "hiyo"
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [user], "max_tokens": 1, "chat_template_kwargs": {"messages": []}})  # fmt: skip
        error_of(r, 400, "messages")
    # the request's field on a server with the model's own template: accepted
    r = http.post("/v1/chat/completions", json={
        "messages": [user], "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert r.status_code == 200, r.text
    for bad in (["--chat-template-kwargs", "[1]"], ["--chat-template-kwargs", '{"tools": 1}']):
        with pytest.raises(ValueError, match="--chat-template-kwargs"):
            chat_template_kwargs(p.parse_args(bad))


def test_what_one_request_makes_the_server_produce_is_bounded(http: httpx.Client) -> None:
    """n_probs past 100 (2**70 made a 187 MB answer) and /tokenize past 1 Mi characters are
    400s naming the field and the limit."""
    error_of(http.post("/completion", json={"prompt": PROMPT, "n_probs": 2**70}), 400, "n_probs")
    error_of(http.post("/completion", json={"prompt": PROMPT, "n_probs": 101}), 400, "100")
    ok = http.post("/completion", json={"prompt": PROMPT, "n_probs": 100, "n_predict": 1})
    assert ok.status_code == 200
    big = "a" * ((1 << 20) + 1)
    error_of(http.post("/tokenize", json={"content": big}), 400, "content", str(1 << 20))
    error_of(http.post("/tokenize", json={"prompt": big}), 400, "prompt")


def test_openai_completions_take_llama_servers_n_predict(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body | {"n_predict": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    want = http.post("/v1/completions", json=body | {"max_tokens": 3}).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == want
    error_of(http.post("/v1/completions", json=body | {"n_predict": 3, "max_tokens": 2}), 400,
             "n_predict")  # fmt: skip
