"""Bad input: each case a 4xx with an OpenAI error object, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from server_fixtures import SPEC, TinyServer, serving
from server_fixtures import error_of as _check
from tiny_models import write_tiny_adapter

import graftlm
from graftlm.lora.adapter import _signs  # (the input reaches are measured on)
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(server: TinyServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60)


CASES = [
    # (name, path, json body, status, words the message must contain)
    (
        "wrong type max_tokens",
        "/v1/completions",
        {"prompt": "the", "max_tokens": "ten"},
        400,
        ["max_tokens"],
    ),
    (
        "wrong type temperature",
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": "hot"},
        400,
        ["temperature"],
    ),
    ("prompt missing", "/v1/completions", {"max_tokens": 3}, 400, ["prompt"]),
    ("prompt a number", "/v1/completions", {"prompt": 5}, 400, ["prompt"]),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, ["messages"]),
    (
        "message without role",
        "/v1/chat/completions",
        {"messages": [{"content": "hi"}]},
        400,
        ["role"],
    ),
    ("max_tokens < 0", "/v1/completions", {"prompt": "the", "max_tokens": -1}, 400, ["max_tokens"]),
    (
        "chat max_tokens < 0",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": -5},
        400,
        ["max_tokens"],
    ),
    ("top_p above 1", "/v1/completions", {"prompt": "the", "top_p": 1.5}, 400, ["top_p"]),
    ("token id out of range", "/v1/completions", {"prompt": [1, 99999]}, 400, ["99999"]),
    (
        "unknown adapter id",
        "/v1/completions",
        {"prompt": "the", "lora": [{"id": 99, "scale": 1}]},
        400,
        ["99", "valid ids"],
    ),
    (
        "non-number scale",
        "/v1/completions",
        {"prompt": "the", "lora": [{"id": 0, "scale": "big"}]},
        400,
        ["scale"],
    ),
    (
        "scale a bool",
        "/completion",
        {"prompt": "the", "lora": [{"id": 0, "scale": True}]},
        400,
        ["scale"],
    ),
    (
        "lora not a list",
        "/v1/chat/completions",
        {"messages": CHAT, "lora": {"id": 0}},
        400,
        ["lora"],
    ),
    ("unknown id /lora-adapters", "/lora-adapters", [{"id": 42, "scale": 1.0}], 400, ["42"]),
    ("non-array /lora-adapters", "/lora-adapters", {"id": 0, "scale": 1.0}, 400, ["array"]),
    (
        "non-number scale /lora-adapters",
        "/lora-adapters",
        [{"id": 0, "scale": "x"}],
        400,
        ["scale"],
    ),
    ("entry without scale /lora-adapters", "/lora-adapters", [{"id": 0}], 400, ["scale"]),
    (
        "scale past float32",
        "/v1/completions",
        {"prompt": "the", "lora": [{"id": 0, "scale": 1e39}]},
        400,
        ["scale", "float32"],
    ),
    (
        "scale past float32 /lora-adapters",
        "/lora-adapters",
        [{"id": 0, "scale": -1e39}],
        400,
        ["scale", "float32"],
    ),
    (
        "n_predict wrong type",
        "/completion",
        {"prompt": "the", "n_predict": [1]},
        400,
        ["n_predict"],
    ),
    ("detokenize bad ids", "/detokenize", {"tokens": [-4]}, 400, ["-4"]),
    (
        "NaN penalty",
        "/completion",
        {"prompt": "the", "presence_penalty": float("nan")},
        400,
        ["presence_penalty", "finite"],
    ),
    (
        "inf penalty",
        "/v1/completions",
        {"prompt": "the", "frequency_penalty": float("inf")},
        400,
        ["frequency_penalty"],
    ),
    ("seed past 2^64", "/completion", {"prompt": "the", "seed": 2**64}, 400, ["seed"]),
    ("tokenize without content", "/tokenize", {}, 400, ["content"]),
    (
        "load_lora_adapter missing path",
        "/v1/load_lora_adapter",
        {"lora_name": "x"},
        400,
        ["lora_path"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(http: httpx.Client, case: tuple) -> None:
    _, path, body, status, words = case
    raw = json.dumps(body)  # (Python's encoder writes NaN and Infinity, as some clients do)
    _check(
        http.post(path, content=raw, headers={"Content-Type": "application/json"}), status, *words
    )


def test_extreme_values_that_mean_something_are_served(http: httpx.Client) -> None:
    """A temperature of 1e-45 is greedy (it overflowed to nan probabilities); n_probs is served
    up to its cap of 100 (past it a 400 naming the limit: 2**70 made a 187 MB answer)."""
    tiny = http.post("/completion", json={"prompt": "the", "n_predict": 3, "temperature": 1e-45})
    greedy = http.post("/completion", json={"prompt": "the", "n_predict": 3, "temperature": 0})
    assert tiny.status_code == 200 and tiny.json()["content"] == greedy.json()["content"]
    r = http.post("/completion", json={"prompt": "the", "n_predict": 1, "n_probs": 1_000_000})
    _check(r, 400, "n_probs", "100")
    r = http.post("/completion", json={"prompt": "the", "n_predict": 1, "n_probs": 100})
    assert r.status_code == 200, r.text
    (p,) = r.json()["completion_probabilities"]
    assert len(p["top_logprobs"]) == 100


def test_malformed_json(http: httpx.Client) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/completion", "/lora-adapters"):
        r = http.post(
            path, content=b'{"prompt": "the", ', headers={"Content-Type": "application/json"}
        )
        _check(r, 400, "JSON")
    _check(http.post("/v1/completions", content=b"not json at all"), 400, "JSON")


def test_unknown_model_is_served_by_the_base(server: TinyServer, http: httpx.Client) -> None:
    """As llama-server: a `model` the server does not know (every OpenAI SDK example sends one)
    is served by the base model, and the answer names the base (--strict-model-names: 404)."""
    body = {"prompt": [12, 80, 31], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body | {"model": "gpt-3.5-turbo"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"
    base = http.post("/v1/completions", json=body).json()
    assert r.json()["choices"][0]["text"] == base["choices"][0]["text"]
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "model": "nope", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_context_length_exceeded(http: httpx.Client) -> None:
    too_long = [5] * (SPEC.n_ctx + 10)
    err = _check(
        http.post("/v1/completions", json={"prompt": too_long, "max_tokens": 2}),
        400,
        str(SPEC.n_ctx),
    )
    assert err["code"] == "context_length_exceeded"
    err = _check(http.post("/completion", json={"prompt": too_long}), 400)
    assert err["code"] == "context_length_exceeded"
    full = [5] * SPEC.n_ctx  # fits to be scored, leaves no room to generate
    assert (
        _check(http.post("/v1/completions", json={"prompt": full, "max_tokens": 1}), 400)["code"]
        == "context_length_exceeded"
    )


def test_runtime_lora_errors(server: TinyServer, http: httpx.Client, tmp_path: Path) -> None:
    broken = server.adapters["a0"].parent / "broken.gguf"
    _check(
        http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(broken)}),
        400,
        "broken.gguf",
    )
    _check(
        http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "bad", "lora_path": str(tmp_path / "none.gguf")},
        ),
        400,
        "none.gguf",
    )
    _check(
        http.post(
            "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(server.model_path)}
        ),
        400,
        "adapter",
    )
    d, qo = SPEC.n_embd, SPEC.n_head * SPEC.head_dim
    empty = (np.zeros((0, d), np.float32), np.zeros((qo, 0), np.float32))
    rank0 = write_tiny_adapter(
        tmp_path / "r0.gguf", SPEC, {"blk.0.attn_q": (d, qo)}, overrides={"blk.0.attn_q": empty}
    )  # (was a 500: ZeroDivisionError)
    load = {"lora_name": "bad", "lora_path": str(rank0)}
    _check(http.post("/v1/load_lora_adapter", json=load), 400, "'bad'", "rank 0", "r0.gguf")
    _check(
        http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"}),
        404,
        "never-loaded",
    )
    names = {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert "bad" not in names


ODD_NAMES = [
    ("a\x00b", "U+0000"),
    ("line\nbreak", "U+000A"),
    ("tab\tname", "U+0009"),
    ("abc\u202edef", "U+202E"),  # right-to-left override: shows as another name
    (" ", "white space"),
    ("padded ", "white space"),
    ("x" * 257, "got 257"),
    ("a\u2066b", "U+2066"),  # a bidirectional isolate
    ("a\u200bb", "U+200B"),  # a zero-width space: shows as "ab"
]


@pytest.mark.parametrize("name,words", ODD_NAMES, ids=[repr(n[0])[:12] for n in ODD_NAMES])
def test_runtime_adapter_names_that_cannot_be_shown_are_400(
    server: TinyServer, http: httpx.Client, name: str, words: str
) -> None:
    """A name that /v1/models, /metrics and the logs cannot show as it is: a 400 naming the
    field, nothing loaded (they were all loaded)."""
    path = str(server.adapters["gamma"])
    r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    _check(r, 400, "lora_name", words)
    assert name not in server.state.registry.names


def test_runtime_adapter_names_of_any_script_load(server: TinyServer, http: httpx.Client) -> None:
    path = str(server.adapters["gamma"])
    # Persian with a zero-width non-joiner; an emoji sequence joined by zero-width joiners
    for name in ("org/adapter-v1.2", "名前", "x" * 256, "می\u200cخواهم", "👩\u200d💻"):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert r.status_code == 200, r.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def _unseen_adapter(path: Path) -> Path:
    """An adapter on blk.0's attn_v whose A rows (each +-0.5 on two inputs that the fixed +-1
    input the registry measures reaches on holds at the same sign) give 0 on that input: its
    reach there is 0, so no scale of it is refused up front, while on the model's activations
    its delta is not 0 (the check is a bound for one input, not a guarantee for every input)."""
    n_in, n_out, rank = SPEC.n_embd, SPEC.n_head_kv * SPEC.head_dim, 4
    signs = _signs(n_in, torch.float32).numpy()
    a = np.zeros((rank, n_in), np.float32)
    for r in range(rank):
        same = np.flatnonzero(signs == signs[r])  # (inputs of row r's sign)
        i, j = r, int(same[same > r][0])
        a[r, i], a[r, j] = 0.5, -0.5
    b = np.random.default_rng(7).standard_normal((n_out, rank)).astype(np.float32) * 0.2
    target = {"blk.0.attn_v": (n_in, n_out)}
    return write_tiny_adapter(path, SPEC, target, overrides={"blk.0.attn_v": (a, b)})


def test_a_request_whose_logits_blow_up_fails_alone(
    server: TinyServer, tmp_path: Path, http: httpx.Client
) -> None:
    """Requests in the same steps as one whose adapter scale makes its logits inf or nan: that
    one gets a 400 naming the cause, the others their usual tokens, and the server its slots.
    (A scale past an adapter's reach is refused before the request runs: test_adapter_scales;
    this adapter's reach on the check's input is 0, so its 3e38 runs and blows up.)"""
    path = _unseen_adapter(tmp_path / "unseen.gguf")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "unseen", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    ids = [5, 6, 7, 8]
    good = {"model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    bad = {**good, "lora": [{"name": "unseen", "scale": 3e38}]}

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            bodies = [good, bad, {**bad, "temperature": 1.0}, good]
            return await asyncio.gather(*[c.post("/v1/completions", json=b) for b in bodies])

    try:
        rs = asyncio.run(go())
    finally:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "unseen"}).is_success
    for r in (rs[1], rs[2]):
        _check(r, 400, "not finite", "3e+38")
    want = server.ref.detokenize(server.ref_tokens(ids, 5))
    assert [r.json()["choices"][0]["text"] for r in (rs[0], rs[3])] == [want, want]
    svc = server.state.service
    assert svc.alive and not svc.engine.running and len(svc.engine.free_slots) == svc.engine.n_slots


def test_a_requests_own_scale_past_its_adapters_range_is_a_400(
    server: TinyServer, tmp_path: Path, http: httpx.Client
) -> None:
    """A request's own `lora` scale at which the adapter's delta leaves float16's range on the
    registry's +-1 input is refused before its prompt runs: a 400 invalid_scale naming the
    adapter and its scale, the adapter still attached, and the next request served."""
    d, qo = SPEC.n_embd, SPEC.n_head * SPEC.head_dim
    path = write_tiny_adapter(tmp_path / "big.gguf", SPEC, {"blk.0.attn_q": (d, qo)})
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
    try:
        r = http.post("/v1/completions", json={**body, "lora": [{"name": "big", "scale": 3e38}]})
        err = _check(r, 400, "big", "scale 3e+38", "this request would overflow")
        assert err["code"] == "invalid_scale", err
        names = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert "big" in names
        r = http.post("/v1/completions", json={**body, "lora": [{"name": "big", "scale": 0.5}]})
        assert r.status_code == 200, r.text
    finally:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "big"}).is_success


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _check(http.get("/v1/nothing-here"), 404)
    _check(http.get("/v1/completions"), 405)


def test_still_serving_after_errors(server: TinyServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="the", max_tokens=-3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model="tiny", prompt="the", max_tokens=3, extra_body={"lora": [{"id": 99, "scale": 1}]}
        )
    out = client.completions.create(model="tiny", prompt="the", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    svc = server.state.service
    assert svc.alive and not svc.engine.running and len(svc.engine.free_slots) == svc.engine.n_slots
    assert all(e.refs == 0 for e in server.state.registry.by_id.values())


# -- the API key ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(tiny_files: dict[str, Path]) -> Iterator[str]:
    model = graftlm.load(tiny_files["model"], ctx_size=64, n_seq=2)
    state = build_state(model, ServerConfig(model_name="tiny", api_key="sekret"), parallel=1)
    with serving(state) as url:
        yield url


def test_api_key(keyed: str) -> None:
    body = {"prompt": "the", "max_tokens": 2}
    err = _check(httpx.post(keyed + "/v1/completions", json=body), 401, "API key")
    assert err["type"] == "authentication_error"
    _check(
        httpx.post(keyed + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}),
        401,
        "invalid",
    )
    _check(httpx.get(keyed + "/lora-adapters"), 401)
    _check(
        httpx.post(
            keyed + "/completion",
            json={"prompt": "the", "n_predict": 1},
            headers={"X-Api-Key": "nope"},
        ),
        401,
    )
    assert httpx.get(keyed + "/health").status_code == 200  # public, as in llama-server
    ok = httpx.post(
        keyed + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}
    )
    assert ok.status_code == 200, ok.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed + "/v1", api_key="bad", max_retries=0).models.list()
    good = openai.OpenAI(base_url=keyed + "/v1", api_key="sekret", max_retries=0)
    assert good.completions.create(model="tiny", prompt="the", max_tokens=2).choices


@pytest.mark.parametrize(
    "path,field,nested",
    [
        ("/v1/embeddings", "input", False),
        ("/embedding", "content", False),
        ("/v1/completions", "prompt", True),
        ("/completion", "prompt", False),
        ("/detokenize", "tokens", False),
    ],
)
def test_a_long_list_of_stray_numbers_is_one_named_error(
    http: httpx.Client, path: str, field: str, nested: bool
) -> None:
    """32,743 floats where token ids go made 130,974 validation errors (one an item and a shape of
    the union), a second of the event loop that /health waited behind, and a 400 listing them
    all: now the first stray item is the one error, named."""
    items: list = [7] * 32_000 + [0.5] * 743
    r = http.post(path, json={field: [items] if nested else items})
    err = _check(r, 400, "is 0.5, not a text or a token id")
    assert f"item [{'0][' if nested else ''}32000]" in err["message"]
    assert len(r.content) < 2_000
    assert _check(http.post(path, json={field: [None] * 40_000}), 400, "item [0] is None")
