"""llama-server's --context-shift behind the server: a /completion past the context goes on to
n_predict and says `truncated`; without the flag it stops at the context's end, not truncated."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest
from server_fixtures import serving

import graftlm
from graftlm.commands.llama_server_flags import llama_server_notes
from graftlm.commands.serve_args import add_serve_arguments
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

PROMPT = list(range(20, 60))  # 40 tokens of a 64-token context


@pytest.mark.parametrize("shift", [True, False])
def test_a_completion_past_the_context(tiny_files: dict[str, Path], shift: bool) -> None:
    model = graftlm.load(tiny_files["model"], ctx_size=64, n_seq=2)
    model.engine.context_shift = shift
    body = {"prompt": PROMPT, "n_predict": 60, "temperature": 0, "ignore_eos": True}
    with serving(build_state(model, ServerConfig(model_name="tiny"), parallel=1)) as url:
        r = httpx.post(url + "/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["truncated"] is shift
    assert out["tokens_predicted"] == (60 if shift else 64 - 40)
    assert out["stop_type"] == "limit"


def test_the_flag() -> None:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args([]).context_shift is False
    args = p.parse_args(["--context-shift"])
    assert args.context_shift is True
    assert not any(n.startswith("--context-shift") for n in llama_server_notes(args))
    assert p.parse_args(["--no-context-shift"]).context_shift is False
