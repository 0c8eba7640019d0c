"""Per-request `lora` entries by adapter name: several named adapters at their scales in one
request (attached on first use), checked against the reference model; and refused clearly."""

from __future__ import annotations

import httpx
from server_fixtures import TinyServer, error_of

PROMPT = [4, 50, 99, 7]


def _complete(server: TinyServer, **body: object) -> httpx.Response:
    fields = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.base_url}/completions", json=fields | body, timeout=60)


def test_several_adapters_by_name_in_one_request(server: TinyServer) -> None:
    lora = [{"name": "alpha", "scale": 0.5}, {"name": "beta", "scale": 1.0}]
    r = _complete(server, lora=lora)
    assert r.status_code == 200, r.text
    want = server.ref_tokens(PROMPT, 8, {"alpha": 0.5, "beta": 1.0})
    assert r.json()["choices"][0]["text"] == server.ref.detokenize(want)
    # by name laid over `model`, as ids are; a pinned adapter by name too
    r = _complete(server, model="alpha", lora=[{"name": "a0", "scale": 0.25}])
    want = server.ref_tokens(PROMPT, 8, {"alpha": 1.0, "a0": 0.25})
    assert r.json()["choices"][0]["text"] == server.ref.detokenize(want)
    combos = [{}, {"alpha": 1.0}, {"beta": 1.0}, {"alpha": 0.5, "beta": 1.0}]
    outs = {tuple(server.ref_tokens(PROMPT, 8, c)) for c in combos}
    assert len(outs) > 1  # the adapters do change the answer: the comparisons mean something


def test_lora_names_refused_clearly(server: TinyServer) -> None:
    error_of(_complete(server, lora=[{"name": "nope", "scale": 1.0}]), 404, "nope")
    error_of(_complete(server, lora=[{"name": "alpha", "id": 0, "scale": 1.0}]), 400, "one of")
    error_of(_complete(server, lora=[{"scale": 1.0}]), 400, "'id' or by 'name'")
    error_of(_complete(server, lora=[{"name": "alpha", "scale": 1e9}]), 400, "scale")
    # nothing stays held by the refused requests: every adapter can be evicted again
    assert all(e.refs == 0 for e in server.state.registry.names.values())
