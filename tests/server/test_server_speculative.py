"""Speculative decoding behind the server: llama-server's and vLLM's flags, the same tokens as
without it, llama-server's timings.draft_n / draft_n_accepted, per-request speculative.n_max,
the acceptance counters in /metrics, and bad settings refused at start-up or with a 400."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import SPEC, error_of, serving
from spec_helpers import pin_costs

import graftlm
from graftlm.commands.llama_server_flags import llama_server_notes
from graftlm.commands.serve_args import add_serve_arguments
from graftlm.commands.spec_args import spec_config
from graftlm.runtime.speculative import SpecConfig
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

# a prompt that repeats itself: n-gram drafts find it
PROMPT = [12, 80, 31, 77, 140, 9, 66, 201, 45, 12, 80, 31, 77, 140, 9, 66, 201, 45, 12, 80]
BODY = {"prompt": PROMPT, "n_predict": 40, "temperature": 0, "ignore_eos": True}


def _serve(path: Path, speculative: SpecConfig | None) -> Iterator[str]:
    model = graftlm.load(path, ctx_size=SPEC.n_ctx, n_seq=3, speculative=speculative)
    if speculative is not None:
        pin_costs(model.engine)
    state = build_state(model, ServerConfig(model_name="tiny"), parallel=2)
    with serving(state) as url:
        yield url


@pytest.fixture(scope="module")
def plain(tiny_files: dict[str, Path]) -> Iterator[str]:
    yield from _serve(tiny_files["model"], None)


@pytest.fixture(scope="module")
def spec(tiny_files: dict[str, Path]) -> Iterator[str]:
    yield from _serve(tiny_files["model"], SpecConfig())


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_same_tokens_and_llama_servers_draft_timings(plain: str, spec: str) -> None:
    want = _post(plain, "/completion", {**BODY, "return_tokens": True})
    got = _post(spec, "/completion", {**BODY, "return_tokens": True})
    assert got["tokens"] == want["tokens"] and got["content"] == want["content"]
    assert "draft_n" not in want["timings"]
    t = got["timings"]
    assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    # sampled with a seed: the same draws
    seeded = {**BODY, "temperature": 0.8, "seed": 5, "return_tokens": True}
    assert (
        _post(spec, "/completion", seeded)["tokens"]
        == _post(plain, "/completion", seeded)["tokens"]
    )
    # the OpenAI endpoint, streamed: the same text
    oai = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    chunks = httpx.post(spec + "/v1/completions", json={**oai, "stream": True}, timeout=60).text
    pieces = [
        json.loads(line[6:])["choices"][0]["text"]
        for line in chunks.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(pieces) == _post(plain, "/v1/completions", oai)["choices"][0]["text"]


def test_stop_strings_probabilities_and_the_prefix_cache_are_unchanged(
    plain: str, spec: str
) -> None:
    """n_probs come from the same logits (a row's are the same in any batch), a stop string
    ends the text where it ends without drafts, and a second request that extends the first's
    text is served from the blocks the first wrote while drafting: the same tokens."""
    body = {**BODY, "n_probs": 3, "return_tokens": True}
    want, got = _post(plain, "/completion", body), _post(spec, "/completion", body)
    assert got["tokens"] == want["tokens"]
    for g, w in zip(got["completion_probabilities"], want["completion_probabilities"], strict=True):
        # (this tiny model's float32 weights go through PyTorch's GEMM, whose sums depend on the
        # batch's rows in the last bits; quantized weights' native kernels give the same bits)
        assert [t["id"] for t in g["top_logprobs"]] == [t["id"] for t in w["top_logprobs"]]
        for a, b in zip(g["top_logprobs"], w["top_logprobs"], strict=True):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    text = want["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        stopped = {**BODY, "stop": [stop]}
        a, b = _post(plain, "/completion", stopped), _post(spec, "/completion", stopped)
        assert a["content"] == b["content"] and a["stop_type"] == b["stop_type"] == "word"
    longer = {**BODY, "prompt": PROMPT + got["tokens"][:24], "return_tokens": True}
    again = _post(spec, "/completion", longer)
    assert again["timings"]["cache_n"] >= 32  # the first request's blocks, drafted rows and all
    assert (
        again["tokens"] == _post(plain, "/completion", {**longer, "cache_prompt": False})["tokens"]
    )


def test_a_request_turns_drafting_off_or_bounds_it(spec: str) -> None:
    off = _post(spec, "/completion", {**BODY, "speculative.n_max": 0})
    assert "draft_n" not in off["timings"]
    short = _post(spec, "/completion", {**BODY, "speculative.n_max": 1})
    t = short["timings"]
    assert 0 < t["draft_n"] <= 39  # at most one a step
    error_of(httpx.post(spec + "/completion", json={**BODY, "speculative.n_max": -1}), 400)
    error_of(httpx.post(spec + "/completion", json={**BODY, "speculative.p_min": 2}), 400)


def test_metrics_count_drafts(spec: str) -> None:
    _post(spec, "/completion", BODY)
    values = {
        line.split()[0]: float(line.split()[1])
        for line in httpx.get(spec + "/metrics").text.splitlines()
        if line.startswith("llamacpp:spec_decode")
    }
    assert values["llamacpp:spec_decode_num_drafts_total"] > 0
    assert (
        values["llamacpp:spec_decode_num_draft_tokens_total"]
        >= values["llamacpp:spec_decode_num_accepted_tokens_total"]
        > 0
    )


def _args(line: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(line.split())


def test_flags() -> None:
    assert spec_config(_args("")) is None and spec_config(_args("--spec-type none")) is None
    cfg = spec_config(_args("--spec-type ngram-simple --spec-draft-n-max 6 --spec-draft-n-min 2"))
    assert cfg == SpecConfig(n_max=6, n_min=2)
    cfg = spec_config(_args("--spec-type ngram-mod --spec-ngram-simple-size-n 8"))
    assert cfg is not None and (cfg.lookup_min, cfg.lookup_max) == (2, 8)
    vllm = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    cfg = spec_config(_vllm(vllm))
    assert cfg == SpecConfig(n_max=5, lookup_min=2, lookup_max=4)
    # a draft model: -md alone, with draft-simple, or vLLM's draft_model
    for line in ("-md d.gguf", "-md d.gguf --spec-type draft-simple --spec-draft-n-max 8"):
        cfg = spec_config(_args(line))
        assert cfg is not None and cfg.method == "draft"
    args = _vllm('{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 3}')
    cfg = spec_config(args)
    assert cfg == SpecConfig(method="draft", n_max=3) and args.model_draft == "d.gguf"
    # llama.cpp's synthetic acceptance: rates, or a mean length as geometric rates
    cfg = spec_config(_args("-md d.gguf --spec-draft-n-max 3 --spec-synth-rates 1,0.5,0.25"))
    assert cfg is not None and cfg.synth_rates == (1.0, 0.5, 0.25)
    assert cfg.synth_probs == (1.0, 0.5, 0.5)
    cfg = spec_config(_args("--spec-type ngram-simple --spec-draft-n-max 4 --spec-synth-len 5"))
    assert cfg is not None and cfg.synth_rates == (1.0,) * 4
    # the flags graftlm reads are no longer noted as having no effect
    line = "--spec-type ngram-simple --spec-draft-n-max 4 --spec-synth-rates 1,1,1,1"
    notes = llama_server_notes(_args(line))
    assert not any(
        n.startswith(("--spec-type", "--spec-draft-n-max", "--spec-synth")) for n in notes
    )


def _vllm(text: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(["--speculative-config", text])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--spec-type", "draft-eagle3"], ["draft-eagle3", "not supported"]),
        (["--spec-type", "draft-simple"], ["draft-simple", "needs a draft model"]),
        (["--spec-type", "ngram-simple,bogus"], ["bogus", "unknown"]),
        (["-md", "d.gguf", "--spec-type", "ngram-mod"], ["-md d.gguf", "needs no draft model"]),
        (["--spec-type", "draft-simple,ngram-simple", "-md", "d.gguf"], ["one kind"]),
        (["--spec-type", "ngram-simple", "--spec-draft-n-max", "0"], ["--spec-draft-n-max 0"]),
        (["--speculative-config", "{nope"], ["--speculative-config", "not JSON"]),
        (["--speculative-config", '{"method": "eagle"}'], ["eagle"]),
        (["--speculative-config", '{"method": "draft_model"}'], ["needs model"]),
        (
            ["-md", "a.gguf", "--speculative-config", '{"model": "b.gguf"}'],
            ["-md or in --speculative-config"],
        ),
        (["--speculative-config", '{"num_speculative_tokens": "5"}'], ["whole number"]),
        (["--speculative-config", '{"gamma": 1}'], ["gamma"]),
        (["--spec-synth-rates", "0"], ["synthetic acceptance", "needs speculative decoding"]),
        (
            ["-md", "d.gguf", "--spec-draft-n-max", "2", "--spec-synth-rates", "1"],
            ["--spec-synth-rates (1.0,)", "must contain 2 values, got 1"],
        ),
        (
            ["-md", "d.gguf", "--spec-draft-n-max", "2", "--spec-synth-rates", "0.5,0.7"],
            ["non-increasing"],
        ),
        (["-md", "d.gguf", "--spec-synth-rates", "a,b"], ["--spec-synth-rates a,b", "numbers"]),
        (
            ["-md", "d.gguf", "--spec-synth-rates", "1", "--spec-synth-len", "2"],
            ["mutually exclusive"],
        ),
        (["-md", "d.gguf", "--spec-draft-n-max", "4", "--spec-synth-len", "6"], ["[1, 5]"]),
    ],
)
def test_bad_flags_are_named(argv: list[str], words: list[str]) -> None:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    with pytest.raises(ValueError) as info:
        spec_config(p.parse_args(argv))
    for w in words:
        assert w in str(info.value), (w, str(info.value))
