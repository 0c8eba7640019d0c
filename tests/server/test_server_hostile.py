"""Hostile requests: bodies past the limit, cross-site requests from a web page, JSON nested a
thousand deep, text that is not Unicode, runtime-load paths outside the allowed folders or that
would block; each a 4xx with an error object, nothing changed, and the server keeps serving."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import TinyServer
from server_fixtures import error_of as _err

import graftlm
from graftlm.server.app import ServerThread, build_state, create_app
from graftlm.server.state import ServerConfig


@pytest.fixture(scope="module")
def http(server: TinyServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60)


def _alive(http: httpx.Client) -> None:
    r = http.post("/completion", json={"prompt": "the", "n_predict": 2})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def small(tiny_files: dict[str, Path]) -> Iterator[tuple[str, ServerConfig]]:
    """A server with a 4 KiB body limit and an API key."""
    model = graftlm.load(tiny_files["model"], ctx_size=64, n_seq=2)
    config = ServerConfig(model_name="tiny", api_key="k", max_body_bytes=4096)
    state = build_state(model, config, parallel=1)
    srv = ServerThread(create_app(state)).start()
    try:
        yield srv.url, config
    finally:
        srv.stop()
        state.service.close()


def test_bodies_past_the_limit_are_413(small: tuple[str, ServerConfig]) -> None:
    url, _ = small
    key = {"Authorization": "Bearer k"}
    big = {"prompt": "x" * 10_000, "max_tokens": 1}
    _err(httpx.post(url + "/v1/completions", json=big, headers=key), 413, "4096", "--max-body")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = httpx.post(
        url + "/v1/completions",
        content=chunks(),
        headers={**key, "Content-Type": "application/json"},
    )
    _err(r, 413, "past the limit")
    ok = httpx.post(url + "/v1/completions", json={"prompt": "the", "max_tokens": 1}, headers=key)
    assert ok.status_code == 200, ok.text


def test_the_schema_is_not_public_behind_a_key(
    small: tuple[str, ServerConfig], http: httpx.Client
) -> None:
    url, _ = small
    assert httpx.get(url + "/openapi.json").status_code == 404
    assert http.get("/openapi.json").status_code == 200  # no key: nothing to hide


def test_cross_site_requests_are_refused(server: TinyServer, http: httpx.Client) -> None:
    """A page on another site posting a text/plain body (no preflight) cannot change scales."""
    before = http.get("/lora-adapters").json()
    body = '[{"id": 0, "scale": 1.0}]'
    for headers in (
        {"Origin": "https://evil.example", "Content-Type": "text/plain"},
        {"Origin": "null", "Content-Type": "text/plain"},
        {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"},
    ):
        r = http.post("/lora-adapters", content=body, headers=headers)
        assert _err(r, 403, "cross-site")["type"] == "permission_error"
    assert http.get("/lora-adapters").json() == before
    same = {"Origin": server.url, "Content-Type": "application/json"}
    assert http.post("/lora-adapters", content=body, headers=same).status_code == 200
    http.post("/lora-adapters", json=[{"id": e["id"], "scale": e["scale"]} for e in before])
    assert http.get("/lora-adapters").json() == before


def test_dns_rebinding_is_refused_by_host(server: TinyServer, http: httpx.Client) -> None:
    """A page of rebind.attacker.example, its name resolved to 127.0.0.1, is same-origin with
    the server in the browser's eyes (Host and Origin agree): its Host gives it away."""
    before = http.get("/lora-adapters").json()
    port = server.url.rsplit(":", 1)[1]
    evil = f"rebind.attacker.example:{port}"
    r = http.post("/lora-adapters", content='[{"id": 0, "scale": 1.0}]',
                  headers={"Host": evil, "Origin": f"http://{evil}", "Content-Type": "text/plain"})  # fmt: skip
    err = _err(r, 403, "rebind.attacker.example", "--allowed-hosts")
    assert err["code"] == "host_not_allowed"
    assert _err(http.get("/v1/models", headers={"Host": evil}), 403, "Host")
    assert http.get("/lora-adapters").json() == before
    for ok in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"app.localhost:{port}",
               f"10.1.2.3:{port}", "localhost"):  # fmt: skip
        assert http.get("/v1/models", headers={"Host": ok}).status_code == 200, ok


def test_allowed_hosts_from_the_flags() -> None:
    import argparse

    from graftlm.commands.serve_args import add_serve_arguments
    from graftlm.commands.serve_options import allowed_hosts
    from graftlm.server.guard import Hosts

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert allowed_hosts(p.parse_args([])) == ("127.0.0.1",)
    assert allowed_hosts(p.parse_args(["--host", "0.0.0.0"])) is None  # any name reaches it
    got = allowed_hosts(p.parse_args(["--host", "0.0.0.0", "--allowed-hosts", "my.lan"]))
    assert got is not None and "my.lan" in got
    assert Hosts(got).allows("MY.LAN:8080") and not Hosts(got).allows("other.lan")
    assert Hosts(("*",)).allows("anything") and Hosts(None).allows("anything")
    assert not Hosts(()).allows("localhost.evil.example")


def test_nested_json_and_lone_surrogates_are_400(http: httpx.Client) -> None:
    deep = "[" * 1000 + "]" * 1000
    headers = {"Content-Type": "application/json"}
    _err(http.post("/lora-adapters", content=deep, headers=headers), 400, "nested")
    for path, raw in (
        ("/completion", '{"prompt": "a\\ud800b", "n_predict": 2}'),
        ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 2, "echo": true}'),
        ("/tokenize", '{"content": "x\\ud83d"}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("/completion", '{"prompt": "a", "n_predict": 1, "stop": ["\\ud800"]}'),
    ):
        r = http.post(path, content=raw, headers=headers)
        _err(r, 400, "Unicode")
    _alive(http)


def test_runtime_load_paths_are_confined(
    server: TinyServer, http: httpx.Client, tmp_path: Path
) -> None:
    load = "/v1/load_lora_adapter"
    for path in ("/etc/shadow", "/proc/self/environ", "/nonexistent/a.gguf"):
        err = _err(http.post(load, json={"lora_name": "x", "lora_path": path}), 403, "outside")
        said = err["message"].split("may read:")[0]  # (the allowed folders follow)
        assert "root:" not in said and "SHEL" not in said and "no such" not in said
    # a symlink inside an allowed folder that points outside is outside
    link = tmp_path / "sneaky.gguf"
    link.symlink_to("/etc/hostname")
    _err(http.post(load, json={"lora_name": "x", "lora_path": str(link)}), 403, "outside")
    # ... and so is a PEFT directory inside it whose files link outside
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").symlink_to("/etc/hostname")
    (peft / "adapter_model.safetensors").write_bytes(b"")
    err = _err(http.post(load, json={"lora_name": "x", "lora_path": str(peft)}), 403, "links")
    assert "adapter_config.json" in err["message"]
    long = str(tmp_path / ("a" * 300))
    r = http.post(load, json={"lora_name": "x", "lora_path": long})
    assert r.status_code == 400, r.text
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    _err(http.post(load, json={"lora_name": "x", "lora_path": str(fifo)}), 400, "regular file")
    assert "x" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    _alive(http)


def test_a_large_tokenize_does_not_hold_up_the_event_loop(
    server: TinyServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenizing a large body runs off the event loop: /health answers meanwhile. (The
    tokenizer is held until /health has answered: on the event loop it would hold /health too,
    whatever the machine's speed; a wall-clock comparison of the two was load-dependent.)"""
    text = "hello world, some text to split into tokens. " * 22_000  # ~1 MB (the cap: 1 Mi)
    prompter = server.state.prompter
    tokenize = prompter.tokenize
    entered, release = threading.Event(), threading.Event()

    def held(content: str, *args: Any, **kwargs: Any) -> list[int]:
        if content == text:
            entered.set()
            assert release.wait(300), "never released"
        return tokenize(content, *args, **kwargs)

    monkeypatch.setattr(prompter, "tokenize", held)
    done: list[int] = []

    def big() -> None:
        r = httpx.post(http.base_url.join("/tokenize"), json={"content": text}, timeout=600)
        assert r.status_code == 200
        done.append(len(r.json()["tokens"]))

    worker = threading.Thread(target=big)
    worker.start()
    try:
        assert entered.wait(300), "the large tokenize never started"
        assert http.get("/health").status_code == 200  # (60 s: it answers while held)
    finally:
        release.set()
        worker.join()
    assert done and done[0] > 22_000
