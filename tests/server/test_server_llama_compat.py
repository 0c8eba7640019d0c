"""What makes the server a drop-in for llama-server (llama.cpp's own server tests check these; these
files hold them in CI): CORS, the unknown-model rule and its strict flag, /slots, /metrics names,
llama-server's extra fields, and the flags `graftlm serve` takes from a llama-server command line.
The requests' shapes and the Anthropic and Responses translations: test_server_llama_requests.py;
the stream framing and prompt progress: test_server_llama_streams.py."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from llama_compat_helpers import GREEDY, PROMPT
from server_fixtures import SPEC, TinyServer, error_of, serving

import graftlm
from graftlm.commands.llama_server_flags import llama_server_notes
from graftlm.commands.serve_args import add_serve_arguments
from graftlm.commands.serve_options import http_config
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig


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
