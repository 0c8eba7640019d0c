"""Clients that never read their streams (issue 41): each holds a generation slot only until the
server's write timeout, then its sequences are cancelled, the slot serves the requests waiting,
and /metrics counts it. Before, such a client held its slot for as long as its answer ran."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import httpx
from server_fixtures import serving
from tiny_models import TinySpec, write_tiny_model

import graftlm
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

N_PREDICT = 20000  # far more than the socket buffers hold at n_probs 100 a token


def _silent_stream(url: str) -> socket.socket:
    """A streaming request whose client never reads a byte (a small receive buffer)."""
    host, port = url.split("//")[1].split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    body = json.dumps(
        {
            "prompt": "the",
            "n_predict": N_PREDICT,
            "stream": True,
            "ignore_eos": True,
            "n_probs": 100,
        }
    ).encode()
    head = f"POST /completion HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    s.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_a_client_that_does_not_read_gives_its_slot_back(tmp_path: Path) -> None:
    spec = TinySpec(n_ctx=N_PREDICT + 64)
    model = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=spec.n_ctx)
    state = build_state(model, ServerConfig(model_name="m", write_timeout=1.0), parallel=1)
    with serving(state) as url:
        # the rate of one stream that is read, to know how long the silent ones would run
        t0 = time.perf_counter()
        body = {"prompt": "the", "n_predict": 100, "ignore_eos": True, "n_probs": 100}
        assert httpx.post(url + "/completion", json=body, timeout=120).status_code == 200
        full_run = N_PREDICT * (time.perf_counter() - t0) / 100
        silent = _silent_stream(url)  # holds the one slot
        try:
            time.sleep(0.5)
            t0 = time.perf_counter()
            r = httpx.post(
                url + "/completion",
                json={"prompt": "hi", "n_predict": 4, "ignore_eos": True},
                timeout=600,
            )
            waited = time.perf_counter() - t0
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 4, r.text
            metrics = httpx.get(url + "/metrics").text
        finally:
            silent.close()
    assert _metric(metrics, "graftlm_slow_clients_total") == 1
    # before, the request waited for the silent answers to run out (full_run or more)
    assert waited < full_run / 2, (waited, full_run)
