"""llama.cpp's own answers on a file, for tests that compare graftlm with it: llama-server from
../shared/llama.cpp started on 127.0.0.1, asked, stopped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from shared_data import SHARED

LLAMA_SERVER = SHARED / "llama.cpp" / "bin" / "llama-server"


def llama_top_logprobs(
    model: Path, prompts: list[list[int]], lora: Path | None = None
) -> list[dict[int, float]]:
    """llama-server's top-10 log-probabilities of the next token after each prompt (float32
    keys and values, no flash attention: the computation graftlm's reference path makes), with
    the adapter `lora` at scale 1 where given."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LD_LIBRARY_PATH": str(LLAMA_SERVER.parent)}
    cmd = [str(LLAMA_SERVER), "-m", str(model), *(["--lora", str(lora)] if lora else []),
           "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "256", "-np", "1",
           "-ctk", "f32", "-ctv", "f32", "-fa", "off"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # (a bound for a hang: 30 s was tight at load)
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.skip(f"llama-server exited with {proc.returncode}")
                time.sleep(0.1)
        out = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": 1, "n_probs": 10, "temperature": 0,
                    "cache_prompt": False}  # fmt: skip
            req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            top = json.load(urllib.request.urlopen(req, timeout=60))["completion_probabilities"]
            out.append({t["id"]: t["logprob"] for t in top[0]["top_logprobs"]})
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=10)
