"""Shared pieces of the server tests: the tiny model's spec, the running server's handle with
its in-process reference model, and where the real fixtures and goldens are."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from tiny_models import TinySpec

import graftlm
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.runtime.service import EngineService
from graftlm.server.app import ServerThread, create_app
from graftlm.server.state import ServerState

T = TypeVar("T")
SPEC = TinySpec(n_ctx=1024)
PARALLEL = 6
SHARED = Path(__file__).resolve().parents[3] / "shared"
FIXTURES = SHARED / "fixtures"


def golden(name: str) -> Any:
    return json.loads((SHARED / "golden" / name).read_text())


@dataclass
class TinyServer:
    url: str
    state: ServerState
    model_path: Path
    adapters: dict[str, Path]  # name -> file
    ref: graftlm.Model
    ref_ids: dict[str, int]  # name -> id in the reference model

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def ref_tokens(
        self, prompt: list[int], n: int, lora: dict[str, float] | None = None
    ) -> list[int]:
        """Greedy continuation from the reference model, adapters (by name) at these scales."""
        settings = {self.ref_ids[k]: v for k, v in (lora or {}).items() if v != 0.0}
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        req = self.ref.engine.submit(Request(list(prompt), params, AdapterSettings(settings)))
        self.ref.engine.run(req)
        return req.generated

    def ref_logprobs(
        self, ids: list[int], top: int, lora: dict[str, float] | None = None
    ) -> list[dict]:
        settings = [{"id": self.ref_ids[k], "scale": v} for k, v in (lora or {}).items()]
        return self.ref.logprobs(ids, top=top, lora=settings)


@contextmanager
def serving(state: ServerState) -> Iterator[str]:
    """The app of `state` on 127.0.0.1 for the block: its URL; stopped and its engine closed
    after."""
    srv = ServerThread(create_app(state)).start()
    try:
        yield srv.url
    finally:
        srv.stop()
        state.service.close()


def wait_until(
    pred: Callable[[], T], timeout: float, what: str | Callable[[], str], every: float = 0.02
) -> T:
    """pred()'s first true value, asked every `every` s; once `timeout` s have passed, an
    AssertionError naming `what` (a callable: told at that moment, to say what was still
    missing). The timeout is a hang's bound, never a speed."""
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{timeout:g} s waiting for {what() if callable(what) else what}")
        time.sleep(every)
    return value


async def await_until(
    pred: Callable[[], T], timeout: float, what: str | Callable[[], str], every: float = 0.01
) -> T:
    """wait_until for a coroutine: the event loop runs while it waits."""
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{timeout:g} s waiting for {what() if callable(what) else what}")
        await asyncio.sleep(every)
    return value


def error_of(r: httpx.Response, status: int, *words: str) -> dict:
    """The error object of a refused request, checked: the status, OpenAI's three fields, and
    the words its message must hold."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    for w in words:
        assert w in err["message"], (w, err["message"])
    return dict(err)


def steps_wait_for_a_cancel(
    svc: EngineService,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    free: int = 5,
) -> None:
    """After `free` engine steps, every step waits until a cancellation has been asked: the
    request cannot end before its client's leaving is seen, however slow the machine (a
    generation that ended first was no cancellation).

    The test's end releases the engine whatever happened (the server is the session's: a held
    engine would time out every test after it), and a wait that ran out fails the test at its
    teardown (the engine's step swallows the error: it only fails that step's requests)."""
    step = svc.engine.step
    asked, n, failures = threading.Event(), [0], []

    def gated() -> Any:
        n[0] += 1
        if n[0] > free and not asked.wait(300):
            failures.append(f"step {n[0]}: no cancellation was asked in 300 s")
            raise AssertionError(failures[-1])
        return step()

    def seen(item: Any) -> None:
        if isinstance(item, tuple) and item[0] == "cancel":
            asked.set()

    def release() -> None:
        asked.set()
        assert not failures, failures

    request.addfinalizer(release)
    monkeypatch.setattr(svc.engine, "step", gated)  # (the engine in use: not one woken later)
    watch_inbox(svc, monkeypatch, seen)


def watch_inbox(
    svc: EngineService, monkeypatch: pytest.MonkeyPatch, seen: Callable[[Any], None]
) -> None:
    """`seen` is told of everything put into the engine service's inbox (requests, calls,
    cancellations) as it is put in."""
    inbox = svc._inbox

    class Watched:
        def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
            seen(item)
            inbox.put(item, *args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(inbox, name)

    monkeypatch.setattr(svc, "_inbox", Watched())
