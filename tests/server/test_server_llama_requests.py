"""llama-server's request shapes, answered as it answers them (llama.cpp's own server tests check
these): /completion's prompt shapes, embeddings' inputs, chat's trailing assistant message, the
context overflow error, the Anthropic and Responses translations, /rerank, post_sampling_probs,
and the bounds on what one request makes the server produce. The rest:
test_server_llama_compat.py, test_server_llama_streams.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from llama_compat_helpers import GREEDY, PROMPT, data_events
from server_fixtures import SPEC, TinyServer, error_of

from graftlm.lora.settings import AdapterSettings


@pytest.fixture(scope="module")
def http(server: TinyServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60)


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
        e["type"]
        for e in data_events(http.post("/v1/messages", json=body | GREEDY | {"stream": True}))
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
    events = data_events(http.post("/responses", json=body | GREEDY | {"stream": True}))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (
        text
        == events[-1]["response"]["output"][0]["content"][0]["text"]
        == out["output"][0]["content"][0]["text"]
    )
    error_of(http.post("/v1/responses", json={"input": "x", "previous_response_id": "r"}), 400)


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
