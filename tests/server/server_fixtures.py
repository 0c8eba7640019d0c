"""Shared pieces of the server tests: the tiny model's spec, the running server's handle with
its in-process reference model, and where the real fixtures and goldens are."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tiny_models import TinySpec

import graftlm
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.server.app import ServerThread, create_app
from graftlm.server.state import ServerState

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


def error_of(r: httpx.Response, status: int, *words: str) -> dict:
    """The error object of a refused request, checked: the status, OpenAI's three fields, and
    the words its message must hold."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    for w in words:
        assert w in err["message"], (w, err["message"])
    return dict(err)
