"""`graftlm serve` end to end in a subprocess, and its flag parsing."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import wait_until

from graftlm.commands.serve_args import (
    add_serve_arguments,
    check_lora_limits,
    parse_lora_modules,
    parse_size,
)


def test_parse_size() -> None:
    assert parse_size("1000") == 1000
    assert parse_size("64K") == 64 * 1024
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    with pytest.raises(ValueError, match="--max-lora-memory"):
        parse_size("lots")


def test_parse_lora_modules() -> None:
    groups = [["a=/x/a.gguf", "b=/x/b"], ['{"name": "c", "path": "/x/c.gguf"}']]
    assert parse_lora_modules(groups) == [("a", "/x/a.gguf"), ("b", "/x/b"), ("c", "/x/c.gguf")]
    for bad in ("noequals", "=path", "name=", '{"name": "x"}', "a\nb=/x/a.gguf", " a=/x/a.gguf"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([[bad]])


def test_flags_and_defaults() -> None:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    a = p.parse_args([])
    assert (a.host, a.port, a.parallel, a.temp, a.seed, a.n_predict) == (
        "127.0.0.1",
        8080,
        4,
        0.8,
        -1,
        -1,
    )
    a = p.parse_args(
        "-m m.gguf -c 512 -t 2 -np 3 --lora a.gguf --lora-scaled b.gguf:0.5 "
        "--lora-init-without-apply "
        "--api-key k --temp 0 --seed 3 -n 9 --lora-modules x=x.gguf y=y.gguf --max-loras 2 "
        "--max-lora-rank 16 --max-lora-memory 8M --allow-runtime-lora".split()
    )
    assert a.parallel == 3 and a.ctx_size == 512 and a.threads == 2 and a.lora == ["a.gguf"]
    assert a.lora_scaled == ["b.gguf:0.5"] and a.lora_init_without_apply and a.api_key == "k"
    assert (
        a.lora_modules == [["x=x.gguf", "y=y.gguf"]] and a.max_loras == 2 and a.max_lora_rank == 16
    )
    assert a.max_lora_memory == 8 * 2**20 and a.allow_runtime_lora and a.n_predict == 9
    assert a.max_body_size == 8 * 2**20 and a.lora_dir == [] and a.lora_wait == 60.0
    b = p.parse_args("--lora-dir /a --lora-dir /b --lora-wait 5 --max-body-size 1M".split())
    assert b.lora_dir == ["/a", "/b"] and b.lora_wait == 5.0 and b.max_body_size == 2**20


def test_lora_limits_below_1_are_refused_before_the_load(tmp_path: Path) -> None:
    """Each started a server that then refused (or held up for --lora-wait) every adapter
    request, or 403'd every runtime load."""
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    check_lora_limits(p.parse_args(["--max-loras", "1", "--max-lora-memory", "1K"]))
    check_lora_limits(p.parse_args(["--lora-dir", "/nonexistent"]))  # (runtime loads are off)
    for flags, words in (
        ("--max-loras 0", "--max-loras 0: must be at least 1"),
        ("--max-loras -3", "--max-loras -3: must be at least 1"),
        ("--max-lora-rank 0", "--max-lora-rank 0: must be at least 1"),
        ("--max-lora-memory 0", "--max-lora-memory 0: must be at least 1"),
        ("--lora-wait -1", "--lora-wait -1.0: must be 0 or more"),
        ("--lora-wait nan", "--lora-wait nan: must be 0 or more"),
        (f"--allow-runtime-lora --lora-dir {tmp_path / 'none'}", "none: no such directory"),
    ):
        with pytest.raises(ValueError) as exc:
            check_lora_limits(p.parse_args(flags.split()))
        assert words in str(exc.value)
    cmd = [sys.executable, "-m", "graftlm.commands.serve", "-m", "none.gguf", "--max-loras", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # (no model needed)
    assert out.returncode == 1 and "--max-loras 0: must be at least 1" in out.stderr, out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_subprocess(tiny_files: dict[str, Path]) -> None:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "graftlm.commands.serve",
        "-m",
        str(tiny_files["model"]),
        "--port",
        str(port),
        "-c",
        "128",
        "-np",
        "2",
        "--lora-scaled",
        f"{tiny_files['a0']}:0.25",
        "--lora-modules",
        f"alpha={tiny_files['alpha']}",
        "--temp",
        "0",
        "--log-level",
        "warning",
        "--sleep-idle-seconds",
        "0.5",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # (a start imports torch and loads the model)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        adapters = httpx.get(url + "/lora-adapters").json()
        assert [(a["id"], a["scale"]) for a in adapters] == [(0, 0.25)]
        names = {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
        assert names == {"tiny.gguf", "a0", "alpha"}
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "alpha", "prompt": "the", "max_tokens": 4},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(url + "/props").json()["total_slots"] == 2
        # asleep, then loaded again by serve's own reload: the same answer through the adapter
        wait_until(
            lambda: httpx.get(url + "/props").json()["is_sleeping"],
            120,
            "serve to sleep",
            every=0.1,
        )
        again = httpx.post(
            url + "/v1/completions",
            json={"model": "alpha", "prompt": "the", "max_tokens": 4},
            timeout=120,
        )
        # (served: it woke. Whether it is awake when asked next is the machine's speed against
        # the 0.5 s idle time: after a pause of the machine it sleeps again, so it is not asked)
        assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def test_serve_refuses_a_broken_adapter(tiny_files: dict[str, Path]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "graftlm.commands.serve",
        "-m",
        str(tiny_files["model"]),
        "--lora",
        str(tiny_files["broken"]),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "broken.gguf" in out.stderr
