"""/v1/embeddings, llama-server's /embedding and vLLM's /tokenizer_info on the tiny server: the
vectors equal the in-process reference's (`Model.embed`), with and without an adapter."""

from __future__ import annotations

import base64
import math
import struct
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_fixtures import SPEC, TinyServer, error_of, serving

import graftlm
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig


@pytest.fixture(scope="module")
def client(server: TinyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_embeddings_equal_the_reference(server: TinyServer, client: openai.OpenAI) -> None:
    texts = ["the cat", "a the a"]
    out = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1]
    for d, t in zip(out.data, texts, strict=True):
        assert len(d.embedding) == SPEC.n_embd
        assert math.isclose(sum(x * x for x in d.embedding), 1.0, rel_tol=1e-5)
        ref = server.ref.embed(t)
        assert max(abs(a - b) for a, b in zip(d.embedding, ref, strict=True)) < 1e-5
    assert out.usage.prompt_tokens == sum(len(server.ref.tokenize(t)) for t in texts)
    alpha = client.embeddings.create(model="alpha", input="the cat").data[0].embedding
    ref = server.ref.embed("the cat", lora=[{"id": server.ref_ids["alpha"], "scale": 1.0}])
    assert max(abs(a - b) for a, b in zip(alpha, ref, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(alpha, out.data[0].embedding, strict=True)) > 1e-3


def test_base64_and_llama_embedding(server: TinyServer) -> None:
    http = httpx.Client(base_url=server.url, timeout=60)
    plain = http.post("/v1/embeddings", json={"input": [5, 70, 33]}).json()["data"][0]["embedding"]
    b64 = http.post("/v1/embeddings", json={"input": [5, 70, 33], "encoding_format": "base64"})
    raw = base64.b64decode(b64.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(plain, abs=1e-6)
    llama = http.post("/embedding", json={"content": "the cat"}).json()
    assert llama[0]["index"] == 0
    assert llama[0]["embedding"][0] == pytest.approx(server.ref.embed("the cat"), abs=1e-5)
    error_of(http.post("/v1/embeddings", json={"input": "x", "dimensions": 8}), 400, "dimensions")
    error_of(http.post("/v1/embeddings", json={"input": []}), 400, "input")
    long = [5] * (SPEC.n_ctx + 1)
    error_of(http.post("/v1/embeddings", json={"input": long}), 400, "too large", str(SPEC.n_ctx))


def test_tokenizer_info(server: TinyServer) -> None:
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["vocab_size"] == server.ref.config.n_vocab
    assert info["model_max_length"] == SPEC.n_ctx
    assert info["eos_token"] == "<|im_end|>" and set(info["eog_token_ids"]) >= {2}


def test_pooling_as_llama_server(server: TinyServer, tiny_files: dict[str, Path]) -> None:
    """--pooling none: /embedding gives every token's vector, not normalized, and /v1/embeddings
    refuses; cls and last pool the first and last of those vectors, mean their mean."""
    ids = [5, 70, 33, 12]
    pooled = {}
    for pooling in ("none", "cls", "last"):
        model = graftlm.load(tiny_files["model"], ctx_size=SPEC.n_ctx, n_seq=2)
        state = build_state(model, ServerConfig(model_name="tiny", pooling=pooling), parallel=1)
        with serving(state) as url:
            http = httpx.Client(base_url=url, timeout=60)
            if pooling == "none":
                (one,) = http.post("/embedding", json={"content": ids}).json()
                tokens = torch.tensor(one["embedding"])
                error_of(http.post("/v1/embeddings", json={"input": ids}), 400, "none")
            else:
                data = http.post("/v1/embeddings", json={"input": ids}).json()["data"]
                pooled[pooling] = torch.tensor(data[0]["embedding"])
    assert tokens.shape == (len(ids), SPEC.n_embd)
    assert all(abs(float(v.norm()) - 1.0) > 1e-3 for v in tokens)  # not normalized
    norm = torch.nn.functional.normalize
    assert torch.allclose(pooled["cls"], norm(tokens[0], dim=0), atol=1e-5)
    assert torch.allclose(pooled["last"], norm(tokens[-1], dim=0), atol=1e-5)
    mean = httpx.post(server.url + "/v1/embeddings", json={"input": ids}, timeout=60).json()
    assert torch.allclose(
        torch.tensor(mean["data"][0]["embedding"]), norm(tokens.mean(0), dim=0), atol=1e-5
    )
    assert not torch.allclose(pooled["cls"], pooled["last"], atol=1e-3)
