"""Seeded fuzzers of hostile clients against a running server, each with its own oracle, all
with /health polled every 0.2 s (a second at most, never a failure), every answer below 500
and no error body quoting Python internals:

- Host and Origin pairs (raw HTTP: loopback names, IP literals bracketed or not, ports,
  trailing dots, mixed case, userinfo, punycode and raw UTF-8, empty and very long values,
  two Host headers, Sec-Fetch-Site values, GET and POST, content types), against a loopback
  server with and without --allowed-hosts;
- symlinks under --lora-dir (GGUF files and PEFT directories whose files link inside or out,
  through chains, loops, dangling links, directory links, hard links), loaded through
  /v1/load_lora_adapter (the one route that loads by path; llama-server has none);
- huge fields: every field of every endpoint's body set to a huge string, array, number,
  object or nesting, up to and past the body limit.

More cases: FUZZ_CASES=2000 (FUZZ_SEED=n)."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fuzz_helpers import SEED, HealthPoller, cases, clean, leaks
from server_fixtures import SPEC, serving
from tiny_models import write_tiny_adapter

import graftlm
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig, ServerState

WALL = 30.0  # seconds one request may take


@pytest.fixture(scope="module")
def model_file(tiny_files: dict[str, Path]) -> Path:
    return tiny_files["model"]


def _serve(
    model_file: Path, config: ServerConfig, ctx: int = SPEC.n_ctx
) -> Iterator[tuple[str, ServerState]]:
    model = graftlm.load(model_file, ctx_size=ctx, n_seq=2)
    state = build_state(model, config, parallel=1)
    with serving(state) as url:
        yield url, state


# -- Host and Origin -----------------------------------------------------------------------------

# The rule (server/guard.py's docstrings, and RFC 9110/9112 for the syntax), stated here
# without its code:
# 1. A Host the server does not answer to is refused (403): it answers to the loopback names
#    (localhost, 127.0.0.1, ::1), any name under .localhost, IP literals (a DNS rebinding needs
#    a name), and the --allowed-hosts names; names compare without case and without a
#    trailing dot, the port aside.
# 2. A request a browser marks cross-site is refused (403): `Sec-Fetch-Site: cross-site`, or an
#    `Origin` that is "null" or whose host and port are not the Host's. (No --cors-origins and
#    no API key: the server's own origin only.) Absent both, a client that is no browser.
# 3. Else it is served whatever its Content-Type (200 on these routes).
# So a write from a browser is accepted only when its Host is allowed and its Origin is the
# Host. Two Host headers, or none, are a 400 (RFC 9112 3.2); a Host that is not a host (userinfo,
# spaces, text that is not ASCII, a port that is not a number) may be refused any way but a 5xx.
NAMES = ["localhost", "LOCALHOST", "localhost.", "LocalHost.", "127.0.0.1", "[::1]", "::1",
         "app.localhost", "a.b.LOCALHOST", "10.1.2.3", "0x7f.1", "127.1", "2130706433",
         "[::ffff:127.0.0.1]", "rebind.attacker.example", "localhost.evil.example",
         "evil.localhost.example", "my.lan", "MY.LAN", "my.lan.", "sub.my.lan", "proxy.example",
         "xn--bcher-kva.example", "bücher.example", "", "a@localhost", "localhost@evil.example",
         "a" * 3000 + ".example", "local host", "[fe80::1]", "[::1", "localhost..",
         "192.168.1.1.nip.io", "127.0.0.1.evil.example"]  # fmt: skip
SITES = [None, None, "cross-site", "same-origin", "same-site", "none", "CROSS-SITE", "x"]
TYPES = [None, "application/json", "text/plain", "application/x-www-form-urlencoded",
         "multipart/form-data; boundary=x", "application/json; charset=utf-8"]  # fmt: skip
ROUTES = [("GET", "/v1/models", b""), ("POST", "/tokenize", b'{"content": "hi"}'),
          ("POST", "/lora-adapters", b"[]")]  # fmt: skip
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]*)(:[0-9]*)?$")


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool | None:
    """Rule 1 for a Host value; None where it is not a host at all."""
    m = _HOST.match(host)
    if not m or not host:
        return None
    name = m.group(1).lower()
    if name.startswith("["):
        name = name[1:-1]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
        return True
    name = name[:-1] if name.endswith(".") else name
    if name.startswith(".") or ".." in name or name.endswith("."):
        return None  # an empty label: no DNS name (no rebinding can send it)
    if name in ("localhost", "127.0.0.1") or name.endswith(".localhost"):
        return True
    if name in {a.lower().rstrip(".") for a in allowed}:
        return True
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        return False
    return True


def _request(port: int, method: str, path: str, headers: list[tuple[str, bytes]],
             body: bytes) -> tuple[int, str]:  # fmt: skip
    """One HTTP/1.1 request on its own connection, bytes as given: (status, body)."""
    head = f"{method} {path} HTTP/1.1\r\n".encode()
    for k, v in headers:
        head += k.encode() + b": " + v + b"\r\n"
    head += b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", port), timeout=WALL) as s:
        s.sendall(head + body)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    status = int(raw.split(b" ", 2)[1])
    return status, raw.partition(b"\r\n\r\n")[2].decode("utf-8", "replace")


@pytest.fixture(
    scope="module", params=[(), ("my.lan", "proxy.example.")], ids=["loopback", "allowed"]
)
def guarded(model_file: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, tuple[str, ...]]]:  # fmt: skip
    config = ServerConfig(model_name="tiny", allowed_hosts=request.param)
    for url, _ in _serve(model_file, config):
        yield url, request.param


def test_host_and_origin_pairs_follow_the_rule(guarded: tuple[str, tuple[str, ...]]) -> None:
    url, allowed = guarded
    port = int(url.rsplit(":", 1)[1])
    rng = random.Random(SEED)
    seen: dict[str, int] = {}
    with HealthPoller(url) as health:
        for i in range(cases(150)):
            name = rng.choice(NAMES)
            host = name + rng.choice(["", f":{port}", f":{port}", ":80", ":", ":99999", ":x"])
            origin_host = host if rng.random() < 0.5 else rng.choice(NAMES) + f":{port}"
            origin = rng.choice([None, None, f"http://{origin_host}", f"https://{origin_host}",
                                 f"HTTP://{origin_host.upper()}", "null", f"http://{origin_host}/",
                                 f"http://{host}"])  # fmt: skip
            site = rng.choice(SITES)
            ctype = rng.choice(TYPES)
            method, path, body = rng.choice(ROUTES)
            n_hosts = rng.choice([1] * 8 + [0, 2])
            headers = [("Host", host.encode("utf-8"))] * n_hosts
            if origin is not None:
                headers.append(("Origin", origin.encode("utf-8")))
            if site is not None:
                headers.append(("Sec-Fetch-Site", site.encode()))
            if ctype is not None:
                headers.append(("Content-Type", ctype.encode()))
            what = (i, method, path, headers)
            status, text = _request(port, method, path, headers, body)
            assert status < 500, (what, status, text[:300])
            assert not leaks(text), (what, text[:300])
            ok = host_allowed(host, allowed)
            if n_hosts != 1:
                expected: set[int] | None = {400}
            elif ok is None:
                expected = None  # not a host: anything but a 5xx
            elif not ok:
                expected = {400, 403}  # (400: a Host the HTTP parser refuses before the guard)
            else:
                same = origin is None or (
                    origin != "null" and origin.split("://", 1)[1].rstrip("/").lower() == host.lower()
                )  # fmt: skip
                expected = {200} if same and site != "cross-site" else {403}
            if expected is not None:
                assert status in expected, (what, status, expected, text[:300])
            if status == 403:
                assert "Host" in text or "cross-site" in text, (what, text[:300])
            seen[str(status)] = seen.get(str(status), 0) + 1
    health.check()
    print(f"\nHost/Origin ({allowed or 'loopback'}): {seen}")
    assert seen.get("200", 0) > 5 and seen.get("403", 0) > 5


# -- symlinks under --lora-dir -------------------------------------------------------------------


class Fifo:
    """A FIFO outside the allowed folder: opening it to read blocks until a writer comes, so a
    read shows as a hang. `opened()` tells whether a reader waits on it (and releases it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)

    def opened(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no reader
        except OSError:
            return False
        os.close(fd)  # the reader gets end-of-file
        return True


@pytest.fixture(scope="module")
def confined(
    model_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, Path]]:
    root = tmp_path_factory.mktemp("confined")
    inside, outside = root / "inside", root / "outside"
    inside.mkdir()
    outside.mkdir()
    config = ServerConfig(model_name="tiny", allow_runtime_lora=True, lora_dirs=(inside.resolve(),))
    for url, _ in _serve(model_file, config):
        yield url, inside, outside


def _adapter_sources(model_file: Path, d: Path) -> dict[str, Path]:
    """A valid GGUF adapter and PEFT directory, a text file and a FIFO, in `d`."""
    from graftlm.lora.convert import gguf_to_peft

    gguf_file = write_tiny_adapter(d / "real.gguf", SPEC, seed=5)
    gguf_to_peft(gguf_file, model_file, d / "peft")
    (d / "secret.txt").write_text("root:$6$secret:19000:0:99999:7:::\n")
    return {"gguf": gguf_file, "peft": d / "peft", "text": d / "secret.txt"}


def _link_targets(rng: random.Random, here: dict[str, Path], there: dict[str, Path],
                  fifo: Path, d: Path) -> list[Path]:  # fmt: skip
    return [here["gguf"], here["peft"], here["text"], there["gguf"], there["peft"], there["text"],
            fifo, d / "missing", Path("/etc/hostname"), Path("/proc/self/environ"), d]  # fmt: skip


def _build(rng: random.Random, case: Path, here: dict[str, Path], there: dict[str, Path],
           fifo: Path) -> Path:  # fmt: skip
    """A random structure in `case` (inside the allowed folder); the path to load."""
    case.mkdir()
    targets = _link_targets(rng, here, there, fifo, case)
    kind = rng.choice(["link", "chain", "loop", "peft", "peft", "dirlink", "hard", "plain"])
    if kind == "link":
        p = case / "a.gguf"
        p.symlink_to(rng.choice(targets))
        return p
    if kind == "chain":  # links through links, each hop inside or out
        hops = [case / f"hop{k}" for k in range(rng.randint(1, 4))]
        end = rng.choice(targets)
        for k, hop in enumerate(hops):
            nxt = hops[k + 1] if k + 1 < len(hops) else end
            if rng.random() < 0.3:  # a hop through the outside folder
                bounce = there["gguf"].parent / f"bounce-{case.name}-{k}"
                bounce.symlink_to(nxt)
                nxt = bounce
            hop.symlink_to(nxt)
        return hops[0]
    if kind == "loop":
        (case / "x").symlink_to(case / "y")
        (case / "y").symlink_to(case / "x")
        return case / rng.choice(["x", "y"])
    if kind == "dirlink":  # a directory link, then a file under it
        (case / "d").symlink_to(rng.choice([here["peft"], there["peft"], case, Path("/etc")]))
        return case / "d" / rng.choice(["", "adapter_config.json", "hostname"])
    if kind == "hard":  # hard links are files of the folder they are in
        src = rng.choice([here["gguf"], there["gguf"], there["text"]])
        os.link(src, case / "h.gguf")
        return case / "h.gguf"
    if kind == "plain":
        return rng.choice([here["gguf"], here["peft"]])
    # a PEFT directory inside, each of its two files a copy, a link inside, or a link out
    peft = case / "peft"
    peft.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        r = rng.random()
        if r < 0.4:
            (peft / name).write_bytes((here["peft"] / name).read_bytes())
        elif r < 0.6:
            (peft / name).symlink_to(here["peft"] / name)
        else:
            (peft / name).symlink_to(rng.choice([there["peft"] / name, fifo, there["text"],
                                                 case / "missing", Path("/etc/hostname")]))  # fmt: skip
    return peft


def _reads(path: Path) -> list[Path]:
    """What loading `path` reads: the file, or a PEFT directory's two files (each resolved)."""
    real = Path(os.path.realpath(path))
    if real.is_dir():
        return [Path(os.path.realpath(real / n)) for n in ("adapter_config.json",
                                                           "adapter_model.safetensors")]  # fmt: skip
    return [real]


def test_symlinks_under_the_lora_dir_never_leave_it(
    confined: tuple[str, Path, Path], model_file: Path
) -> None:
    """Oracle: a load whose path or PEFT files resolve (every link followed, as the kernel
    follows them) outside the allowed folder is a 403, and nothing outside is opened (a FIFO
    there would hang the read); one that stays inside loads (200) when it is a valid adapter
    and is a 4xx otherwise; never a 5xx."""
    url, inside, outside = confined
    rng = random.Random(SEED)
    here = _adapter_sources(model_file, inside)
    there = _adapter_sources(model_file, outside)
    fifo = Fifo(outside / "fifo")
    http = httpx.Client(base_url=url, timeout=WALL)
    seen: dict[str, int] = {}
    with HealthPoller(url) as health:
        for i in range(cases(60)):
            path = _build(rng, inside / f"case{i}", here, there, fifo.path)
            what = (i, str(path), [os.readlink(p) for p in path.parent.iterdir() if p.is_symlink()])
            try:
                reads = _reads(path)
            except OSError:  # a loop: resolving fails; the server must say so
                reads = None
            done: list[httpx.Response] = []
            load = {"lora_name": f"c{i}", "lora_path": str(path)}
            t = threading.Thread(
                target=lambda done=done, load=load: done.append(
                    http.post("/v1/load_lora_adapter", json=load)
                )
            )
            t.start()
            t.join(WALL)
            opened = fifo.opened()  # (releases a reader that hangs on it)
            t.join(WALL)
            assert not opened, ("the FIFO outside was opened", what)
            assert done, ("no answer", what)
            r = done[0]
            clean(r, what)
            leaves = reads is not None and any(
                not p.is_relative_to(inside.resolve()) for p in reads
            )
            if leaves:
                assert r.status_code == 403, (what, r.status_code, r.text[:300])
                said = r.json()["error"]["message"]
                assert "root:" not in said and "secret" not in said, (what, said)
            elif r.status_code == 200:
                assert reads is not None and all(p.is_file() for p in reads), what
                http.post("/v1/unload_lora_adapter", json={"lora_name": f"c{i}"})
            else:
                assert 400 <= r.status_code < 500, (what, r.text[:300])
            seen[str(r.status_code)] = seen.get(str(r.status_code), 0) + 1
    health.check()
    print(f"\nsymlinks: {seen}")
    assert seen.get("403", 0) > 3 and seen.get("200", 0) > 3


# -- huge fields ---------------------------------------------------------------------------------

LIMIT = 1 << 18  # the body limit of the server under test (the default is 8 MiB)
ENDPOINTS: list[tuple[str, dict[str, Any]]] = [
    ("/completion", {"prompt": "the", "n_predict": 2, "n_probs": 1, "stop": ["x"], "seed": 1}),
    ("/v1/completions", {"prompt": "the", "max_tokens": 2, "logprobs": 1, "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "logprobs": True, "top_logprobs": 2, "stop": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "tools": [{"type": "function", "function": {"name": "f",
                              "parameters": {"type": "object"}}}]}),
    ("/tokenize", {"content": "hello", "with_pieces": True}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
    ("/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/rerank", {"query": "a", "documents": ["b", "c"]}),
    ("/v1/embeddings", {"input": "hello"}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/lora-adapters", {"0": {"id": 0, "scale": 0.5}}),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}),
    ("/v1/unload_lora_adapter", {"lora_name": "x"}),
    ("/completion", {"prompt": "a", "n_predict": 2, "json_schema": {"type": "string"}}),
    ("/completion", {"prompt": "a", "n_predict": 2, "grammar": "root ::= \"a\""}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "logit_bias": {"1": 1.0}}),
]  # fmt: skip


def _huge(rng: random.Random) -> tuple[Any, str]:
    """A huge value, sized to land under, near or past the body limit: (value, what)."""
    n = rng.choice([1000, LIMIT // 8, LIMIT // 3, LIMIT - 200, LIMIT + 10])
    kind = rng.choice(["str", "unicode", "ints", "floats", "strs", "dicts", "nest", "obj",
                       "bignum", "bigfloat", "key"])  # fmt: skip
    if kind == "str":
        return "x" * n, f"str {n}"
    if kind == "unicode":
        return "é🙂" * (n // 6), f"unicode {n}"
    if kind == "ints":
        return [rng.choice([1, 2**40, -1]) for _ in range(n // 4)], f"ints {n // 4}"
    if kind == "floats":
        return [1e308] * (n // 8), f"floats {n // 8}"
    if kind == "strs":
        return ["ab"] * (n // 6), f"strs {n // 6}"
    if kind == "dicts":
        return [{"role": "user", "content": "x"}] * (n // 36), f"dicts {n // 36}"
    if kind == "nest":
        depth = rng.choice([50, 900, 5000, n // 2])
        return "NEST" * depth, f"nest {depth}"  # (spliced in as raw JSON)
    if kind == "obj":
        return {f"k{i}": i for i in range(n // 12)}, f"obj {n // 12}"
    if kind == "bignum":
        return "DIGITS" * min(n, LIMIT - 500), f"bignum {min(n, LIMIT - 500)} digits"
    if kind == "bigfloat":
        return float("1" + "0" * 400), "bigfloat"  # written as 1e400: inf on parse
    return {"x" * n: 1}, f"key {n}"


def _body(base: dict[str, Any], rng: random.Random) -> tuple[bytes, str]:
    body = json.loads(json.dumps(base))
    value, what = _huge(rng)
    key = rng.choice(list(body) + ["extra"])
    target, field = body, key
    inner = body.get(key)
    if isinstance(inner, list) and inner and isinstance(inner[0], dict) and rng.random() < 0.5:
        target, field = inner[0], rng.choice(list(inner[0]))  # a field of a message or tool
    target[field] = "__HUGE__"
    raw = json.dumps(body)
    if isinstance(value, str) and value.startswith("NEST"):
        depth = value.count("NEST")
        text = (
            "[" * depth + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth
        )
    elif isinstance(value, str) and value.startswith("DIGITS"):
        text = "9" * value.count("DIGITS")  # (past the digits Python's int() converts)
    elif isinstance(value, float):
        text = "1e400"
    else:
        text = json.dumps(value)
    return raw.replace('"__HUGE__"', text, 1).encode(), f"{key}.{field}={what}"


@pytest.fixture(scope="module")
def limited(model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = ServerConfig(model_name="tiny", max_body_bytes=LIMIT, allow_runtime_lora=True,
                          lora_dirs=(tmp_path_factory.mktemp("none").resolve(),))  # fmt: skip
    for url, _ in _serve(model_file, config, ctx=128):  # (a generation to the end is short)
        yield url


def test_huge_fields_are_refused_or_served_below_500(limited: str) -> None:
    rng = random.Random(SEED)
    # (twice in 2,000-case runs on a loaded machine a small request waited past 30 s and did
    # not on replay: the bound for a hang here is a minute. Traced with a watchdog that dumped
    # the engine's state: a small body can ask for a whole context (max_output_tokens as a
    # 1,000-digit number: 107 tokens here), and at nice 10 on two cores shared at load 14 the
    # dump at 8 s found the engine decoding it (27 tokens so far), nothing else running,
    # waiting or deferred: 0.3 s a token, where a quiet machine takes 0.1 s for all 107)
    http = httpx.Client(base_url=limited, timeout=2 * WALL)
    seen: dict[str, int] = {}
    slowest: tuple[float, tuple[object, ...]] = (0.0, ())
    with HealthPoller(limited) as health:
        for i in range(cases(120)):
            path, base = rng.choice(ENDPOINTS)
            raw, what = _body(base, rng)
            t0 = time.perf_counter()
            info = (i, path, what, len(raw))
            try:
                r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            except httpx.TimeoutException:
                raise AssertionError(("no answer", info)) from None
            took = time.perf_counter() - t0
            assert took < 2 * WALL, (info, took)
            slowest = max(slowest, (took, info))
            clean(r, info)
            if len(raw) > LIMIT:
                assert r.status_code == 413, (info, r.status_code, r.text[:300])
            seen[str(r.status_code)] = seen.get(str(r.status_code), 0) + 1
    health.check()
    print(f"\nhuge fields: {seen}; slowest {slowest[0]:.2f} s: {slowest[1]}")
    assert seen.get("413", 0) > 0 and seen.get("400", 0) > 0
    assert (
        httpx.post(limited + "/completion", json={"prompt": "a", "n_predict": 1}).status_code == 200
    )


def test_a_host_or_origin_that_is_no_url_is_refused_not_a_500(
    guarded: tuple[str, tuple[str, ...]],
) -> None:
    """Found by the Host/Origin fuzzer: an unclosed IPv6 bracket in Host or Origin raised
    ValueError out of urlsplit in the guard: a 500 quoting it."""
    url, _ = guarded
    port = int(url.rsplit(":", 1)[1])
    for headers in (
        [("Host", b"[::1")],
        [("Host", f"localhost:{port}".encode()), ("Origin", b"http://[::1/")],
    ):
        status, text = _request(port, "POST", "/lora-adapters", headers, b"[]")
        assert status == 403, (headers, status, text[:300])
        assert not leaks(text) and "ValueError" not in text, text


def test_a_number_past_4300_digits_is_a_400(limited: str) -> None:
    """Found by the huge-fields fuzzer: POST /lora-adapters (a route that reads its own JSON)
    with a 32,768-digit number answered 500 with Python's advice to raise its digit limit."""
    body = '[{"id": 0, "scale": ' + "9" * 5000 + "}]"
    r = httpx.post(
        limited + "/lora-adapters", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert "4300 digits" in r.json()["error"]["message"] and "sys." not in r.text


def test_thousands_of_prompts_in_one_request_are_a_400(limited: str) -> None:
    """Found by the huge-fields fuzzer: 14,563 two-letter prompts to /completion (or documents
    to /rerank) held the server's one slot past 30 s (each is its own answer; a body limit
    allows a million)."""
    from graftlm.server.inputs import MAX_PROMPTS

    for path, body in (
        ("/completion", {"prompt": ["ab"] * (MAX_PROMPTS + 1), "n_predict": 1}),
        ("/v1/completions", {"prompt": ["ab"] * (MAX_PROMPTS + 1), "max_tokens": 1}),
        ("/v1/embeddings", {"input": ["ab"] * (MAX_PROMPTS + 1)}),
        ("/rerank", {"query": "a", "documents": ["ab"] * (MAX_PROMPTS + 1)}),
    ):
        t0 = time.perf_counter()
        r = httpx.post(limited + path, json=body, timeout=WALL)
        assert r.status_code == 400, (path, r.text[:300])
        assert f"limit of {MAX_PROMPTS}" in r.json()["error"]["message"], r.text
        assert time.perf_counter() - t0 < 5
