"""Clients that never read their streams (issue 41): each holds a generation slot only until the
server's write timeout, then its sequences are cancelled, the slot serves the requests waiting,
and /metrics counts it. Before, such a client held its slot for as long as its answer ran."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import httpx
from server_fixtures import serving, wait_until
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
    svc = state.service
    with serving(state) as url:
        silent = _silent_stream(url)  # holds the one slot
        try:
            # (until the engine runs it, however loaded the machine)
            wait_until(lambda: svc.n_running, 300, "the silent stream to start", every=0.01)
            r = httpx.post(
                url + "/completion",
                json={"prompt": "hi", "n_predict": 4, "ignore_eos": True},
                timeout=600,
            )
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 4, r.text
            metrics = httpx.get(url + "/metrics").text
        finally:
            silent.close()
    assert _metric(metrics, "graftlm_slow_clients_total") == 1
    # before, the request waited for the silent answer to run out (N_PREDICT tokens decoded
    # before its own 3 decode steps): counted in the engine's decode steps, not in seconds, so
    # that a loaded machine's pauses do not count (the silent answer ran until the sockets'
    # buffers filled, a few hundred tokens, plus the write timeout's second)
    decoded = _metric(metrics, "graftlm_engine_decode_rows_total")
    assert decoded < N_PREDICT / 2, decoded
