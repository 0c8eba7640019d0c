"""Shared pieces of the llama-server compatibility tests (test_server_llama_compat.py,
test_server_llama_requests.py, test_server_llama_streams.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx

PROMPT = [12, 80, 31, 77, 140]
GREEDY = {"temperature": 0, "ignore_eos": True}


def data_events(r: httpx.Response) -> list[dict[str, Any]]:
    """The JSON of each `data:` line of a server-sent event stream, [DONE] left out."""
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out
