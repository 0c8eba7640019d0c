"""Sleep mode (llama-server's --sleep-idle-seconds): after a time with no request the engine lets
its model and KV cache go, and the next request loads them again, adapters and all."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from server_fixtures import PARALLEL, SPEC, error_of, serving, wait_until

import graftlm
from graftlm.runtime.service import EngineService
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig, ServerState

IDLE_S = 0.4


def _load(path: Path) -> graftlm.Model:
    return graftlm.load(path, ctx_size=SPEC.n_ctx, n_seq=PARALLEL + 1)


def _state(
    files: dict[str, Path], reload: Callable[[], graftlm.Model], idle_s: float = IDLE_S
) -> ServerState:
    return build_state(
        _load(files["model"]),  # held by nothing but the state: sleep can free it
        ServerConfig(model_name="tiny", temperature=0.0),
        parallel=PARALLEL,
        lora=[(str(files["a0"]), 0.0)],
        lora_modules=[("alpha", str(files["alpha"]))],
        reload=reload,
        sleep_idle_s=idle_s,
    )


def _sleeping(url: str) -> bool:
    r = httpx.get(url + "/props")
    assert r.status_code == 200
    return bool(r.json()["is_sleeping"])


def _wait_asleep(url: str, timeout: float = 60.0) -> None:
    wait_until(lambda: _sleeping(url), timeout, "the server to go to sleep", every=0.05)


@contextmanager
def _kept_awake(svc: EngineService) -> Iterator[None]:
    """The block's requests run without the engine sleeping between them, however long the
    machine takes between one request and the next (a hold does not wake a sleeping engine: a
    request does)."""
    svc.hold()
    try:
        yield
    finally:
        svc.unhold()


def _complete(url: str, **extra: object) -> list[int]:
    body = {"prompt": "the cat", "n_predict": 6, "temperature": 0, "return_tokens": True}
    r = httpx.post(url + "/completion", json=body | extra, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


@pytest.fixture
def asleep_server(tiny_files: dict[str, Path]) -> Iterator[tuple[str, ServerState]]:
    state = _state(tiny_files, lambda: _load(tiny_files["model"]))
    with serving(state) as url:
        yield url, state


def test_sleep_releases_the_model_and_a_request_brings_it_back_with_its_adapters(
    asleep_server: tuple[str, ServerState],
) -> None:
    url, state = asleep_server
    svc = state.service
    lora = [{"id": 0, "scale": 0.7}]
    with _kept_awake(svc):
        base, scaled = _complete(url), _complete(url, lora=lora)
        named = _complete(url, model="alpha")  # attached on first use, at runtime
        adapters = httpx.get(url + "/lora-adapters").json()
        engine, weights = weakref.ref(svc.engine), weakref.ref(svc.engine.model)
        # (counted from here: the server may have slept once before the first request came)
        sleeps, wakes = svc.n_sleeps, svc.n_wakes
    assert len({tuple(base), tuple(scaled), tuple(named)}) == 3  # the adapters change the answer

    _wait_asleep(url)
    gc.collect()
    assert engine() is None and weights() is None  # the weights and the KV cache are gone
    # the read-only endpoints answer and leave it asleep
    for path in ("/health", "/props", "/v1/models", "/models", "/metrics"):
        assert httpx.get(url + path).status_code == 200, path
    assert _sleeping(url) and svc.n_wakes == wakes

    # the same answers after the reload: every adapter back under its id, at its scale
    with _kept_awake(svc):
        assert _complete(url, model="alpha") == named
        assert not _sleeping(url) and svc.n_wakes == wakes + 1
        assert _complete(url, lora=lora) == scaled and _complete(url) == base
        assert httpx.get(url + "/lora-adapters").json() == adapters
        assert svc.n_sleeps == sleeps + 1


def test_any_other_request_wakes_it_and_token_counts_agree(
    asleep_server: tuple[str, ServerState],
) -> None:
    url, state = asleep_server
    msgs = [{"role": "user", "content": "Hello world"}]
    counts = []
    for path, body in [
        ("/tokenize", {"content": "Hello"}),
        ("/chat/completions/input_tokens", {"messages": msgs}),
        ("/v1/responses/input_tokens", {"input": "Hello world"}),
        ("/v1/messages/count_tokens", {"messages": msgs}),
    ]:
        _wait_asleep(url)
        wakes = state.service.n_wakes
        with _kept_awake(state.service):  # (awake until it is asked, however slow the machine)
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 200, (path, r.text)
            assert not _sleeping(url) and state.service.n_wakes == wakes + 1, path
        counts.append(r.json().get("input_tokens"))
    # one user message: the same prompt by every API, as the chat template renders it
    assert counts[1] == counts[2] == counts[3] and counts[1] > 2


def test_work_keeps_it_awake(tiny_files: dict[str, Path]) -> None:
    idle = 0.1
    state = _state(tiny_files, lambda: _load(tiny_files["model"]), idle_s=idle)
    svc = state.service
    with serving(state) as url:
        # a generation that runs for several idle times: no sleep while it runs (counted only
        # while the engine runs it: before it, and after its end, the server may sleep, the
        # machine perhaps taking more than an idle time between two requests, and the client
        # reading what the sockets' buffers still hold after the end)
        body = {"prompt": "the", "n_predict": 1000, "stream": True, "ignore_eos": True}
        seen: list[tuple[int, float]] = []  # (sleeps, time) at tokens read while it runs
        with httpx.stream("POST", url + "/completion", json=body, timeout=120) as r:
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                sleeps, now = svc.n_sleeps, time.monotonic()
                if svc.n_running:  # (read after the count: it ran until then)
                    seen.append((sleeps, now))
        # (else the test proves nothing)
        assert n > 1000 and seen[-1][1] - seen[0][1] > 2 * idle, (n, len(seen))
        assert seen[-1][0] == seen[0][0]
        # a caller that holds it (an HTTP request between its engine calls); the request wakes
        # it if it slept before the hold
        svc.hold()
        try:
            _complete(url)
            time.sleep(5 * idle)
            assert not svc.sleeping
        finally:
            svc.unhold()
        _wait_asleep(url, timeout=60.0)


def test_metrics_are_served_asleep_unchanged_and_their_rates_are_per_scrape(
    asleep_server: tuple[str, ServerState],
) -> None:
    url, state = asleep_server

    def metric(text: str, name: str) -> float:
        (line,) = [x for x in text.splitlines() if x.startswith(f"llamacpp:{name} ")]
        return float(line.split()[1])

    with _kept_awake(state.service):  # (scraped awake, however slow the machine)
        _complete(url, n_predict=8)
        first = httpx.get(url + "/metrics").text
        assert metric(first, "predicted_tokens_seconds") > 0
        awake = httpx.get(url + "/metrics").text  # nothing finished since the last scrape
        assert metric(awake, "predicted_tokens_seconds") == 0
        assert not state.service.sleeping
    assert metric(awake, "tokens_predicted_total") == metric(first, "tokens_predicted_total") > 0
    _wait_asleep(url)
    assert httpx.get(url + "/metrics").text == awake
    assert _sleeping(url)


def test_a_model_that_cannot_be_loaded_again_is_a_503_and_it_stays_asleep(
    tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    # broken only after the first answer: the server may sleep before it comes (a machine
    # slower than the idle time between the start and the request) and wake for it
    broken = {"now": False}

    def reload() -> graftlm.Model:
        if broken["now"]:
            raise graftlm.ModelFileError(f"{tmp_path / 'gone.gguf'}: no such file")
        return _load(tiny_files["model"])

    state = _state(tiny_files, reload)
    with serving(state) as url:
        before = _complete(url, model="alpha")
        broken["now"] = True
        _wait_asleep(url)
        r = httpx.post(url + "/completion", json={"prompt": "the", "n_predict": 2}, timeout=60)
        error_of(r, 503, "could not be loaded again after sleep", "gone.gguf")
        assert _sleeping(url) and httpx.get(url + "/health").status_code == 200
        broken["now"] = False
        with _kept_awake(state.service):
            assert _complete(url, model="alpha") == before
            assert not _sleeping(url)


def test_sleep_needs_a_reload_and_a_positive_time(tiny_files: dict[str, Path]) -> None:
    model = _load(tiny_files["model"])
    config = ServerConfig(model_name="tiny")
    for reload, idle in [(None, 1.0), (lambda: model, 0.0)]:
        with pytest.raises(graftlm.GraftError, match="needs a reload and a time > 0"):
            build_state(model, config, reload=reload, sleep_idle_s=idle)
