"""What every server fuzzer checks besides its own oracle: /health answers within a second
throughout the run (a background poller), no error body shows Python internals, and a render
that runs away from its bounds cannot take the test machine's memory with it."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import threading
import time
from collections.abc import Iterator

import httpx

# what a traceback, a repr or a library's internals leave in a message (0x7f...: an address)
INTERNALS = ("Traceback", 'File "', "object has no attribute", "NoneType", "<built-in")
_ADDRESS = re.compile(r"0x7f[0-9a-f]{6,}")


def leaks(text: str) -> list[str]:
    """The marks of internals in `text`."""
    return [w for w in INTERNALS if w in text] + _ADDRESS.findall(text)


CASES = int(os.environ.get("FUZZ_CASES", "0"))  # 0: each fuzzer's own CI count
SEED = int(os.environ.get("FUZZ_SEED", "1"))


def cases(ci: int) -> int:
    """The number of cases to run: FUZZ_CASES offline (2000), else the CI count."""
    return CASES or ci


def clean(r: httpx.Response, what: object = "") -> None:
    """An answer below 500; an error answer carries a message and no internals."""
    assert r.status_code < 500, (what, r.status_code, r.text[:500])
    if r.status_code >= 400:
        leaked = leaks(r.text)
        assert not leaked, (what, leaked, r.text[:500])
        if r.headers.get("content-type", "").startswith("application/json"):
            assert r.json()["error"]["message"], (what, r.text[:500])


def clean_message(msg: str, what: object = "") -> None:
    leaked = leaks(msg)
    assert not leaked, (what, leaked, msg[:500])


class HealthPoller:
    """GET /health every 0.2 s on its own connection while the block runs; `check()` asserts
    every answer was a 200 within a second."""

    def __init__(self, url: str, every: float = 0.2) -> None:
        self.url = url
        self.every = every
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            self._poll(http)  # at once, every `every` s, and once more as the block ends
            while not self._stop.wait(self.every):
                self._poll(http)
            self._poll(http)

    def _poll(self, http: httpx.Client) -> None:
        t0 = time.perf_counter()
        try:
            r = http.get("/health")
            if r.status_code != 200:
                self.failures.append(f"{r.status_code} {r.text[:200]}")
        except httpx.HTTPError as exc:
            self.failures.append(repr(exc))
        self.latencies.append(time.perf_counter() - t0)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def check(self) -> None:
        assert self.latencies, "the poller never ran"
        assert not self.failures, self.failures[:5]
        worst = max(self.latencies)
        assert worst < 1.0, f"/health took {worst:.2f} s (of {len(self.latencies)} polls)"


def _data_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def memory_fence(extra: int = 4 << 30) -> Iterator[None]:
    """The process's data segment bounded to what it holds now plus `extra` for the block: an
    allocation that a bound failed to stop is a MemoryError in the test, not the kernel's OOM
    killer on a shared machine."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = _data_bytes() + extra
    except (OSError, ValueError):
        yield
        return
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
