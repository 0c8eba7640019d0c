"""`graftlm ray-serve` stopped by SIGTERM (issue 40): it exits 0 without a trace (Python's or
Ray's native one), shuts Serve and the Ray instance it started down, so that nothing of its
process group (raylet, GCS, Ray's dashboard and runtime-env agents) lives on, and while it
serves it does not log a line for every replica's report to the directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

for _extra in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(_extra)
pytest.importorskip("ray", reason="the ray extra is not installed")
pytest.importorskip("ray.serve")

import httpx  # noqa: E402
from tiny_models import TinySpec, write_tiny_model  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
UP_S = 300  # Ray and one replica starting on a busy two-core machine
# (bounds for a hang, not speeds: a descheduled VM can take ten times the usual)
DOWN_S = 300  # Serve's replicas stopped (a few seconds each), then Ray's processes
GONE_S = 120  # the agents Ray's raylet started exit after it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(pgid: int) -> list[str]:
    """The live processes of process group `pgid` (zombies left to init are not counted)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
        state, _ppid, group = rest.split()[:3]
        if int(group) == pgid and state != "Z":
            found.append(f"{stat.parent.name} {name}")
    return found


@pytest.fixture
def ray_tmp() -> Iterator[str]:
    """Ray's temp folder for the instance the command starts (short: it holds sockets)."""
    d = tempfile.mkdtemp(prefix="grs", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_sigterm_shuts_serve_and_its_ray_down(tmp_path: Path, ray_tmp: str) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", TinySpec())
    port = _free_port()
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RAY_ADDRESS", None)  # a Ray instance of its own
    cmd = [sys.executable, "-m", "graftlm.commands.ray_serve", "-m", str(model), "-a", "tiny"]
    cmd += ["-c", "256", "-t", "1", "--replicas", "1", "--port", str(port)]
    log = tmp_path / "stderr.txt"
    with log.open("wb") as err:
        # its own process group: every process it starts (Ray's included) is found by it
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + UP_S
        while "graftlm on Ray Serve at" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, f"not serving after {UP_S} s: {log}"
            time.sleep(0.5)
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny", r.text
        time.sleep(2.0)  # four reports of its replica to the directory
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=DOWN_S)
        text = log.read_text(errors="replace")
        assert rc == 0, text[-4000:]
        assert "Traceback" not in text, text[-4000:]
        assert "SIGTERM received" not in text, text[-4000:]  # Ray's native stack dump
        assert "CALL report" not in text, "the directory logs every report"
        left = _group(proc.pid)
        deadline = time.monotonic() + GONE_S
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _group(proc.pid)
        assert not left, f"still running {GONE_S} s after ray-serve exited: {left}"
    finally:
        if proc.poll() is None or _group(proc.pid):
            with contextlib.suppress(ProcessLookupError):  # the group this test started, alone
                os.killpg(proc.pid, signal.SIGKILL)
