"""`graftlm ray-serve` on a local Ray cluster started here: two replicas of one thread each, four
adapters, two adapters a replica. Requests stay with the replica that loaded their adapter,
answers equal a single `graftlm serve`'s, streams pass the ingress, runtime loads reach every
replica, and a replica killed mid-request costs its own requests a 503, nobody else's."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

for _extra in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(_extra)
ray = pytest.importorskip("ray", reason="the ray extra is not installed")
serve = pytest.importorskip("ray.serve")

import httpx  # noqa: E402
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model  # noqa: E402

from graftlm.commands.ray_serve import add_ray_serve_arguments, spec_of  # noqa: E402
from graftlm.commands.serve import serving_state  # noqa: E402
from graftlm.server.app import ServerThread, create_app  # noqa: E402

SPEC = TinySpec(n_ctx=4096)  # long answers: a replica is killed mid-request
SRC = str(Path(__file__).resolve().parents[2] / "src")
ADAPTERS = ["a1", "a2", "a3", "a4"]
PROMPT = "the quick brown fox"
TIMEOUT = httpx.Timeout(300.0)  # a hang's bound (4000 tokens take ~8 s here, unloaded)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _args(files: dict[str, Path], lora_dir: Path, *extra: str) -> Any:
    import argparse

    p = argparse.ArgumentParser()
    add_ray_serve_arguments(p)
    modules = [f"{name}={files[name]}" for name in ADAPTERS]
    return p.parse_args(
        ["-m", str(files["model"]), "-a", "tiny", "-c", "16384", "-np", "4", "-t", "1"]
        + ["--lora-modules", *modules, "--max-loras", "2", "--allow-runtime-lora"]
        + ["--lora-dir", str(lora_dir), "--replicas", "2", *extra]
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ray")
    out = {"model": write_tiny_model(d / "tiny.gguf", SPEC)}
    for k, name in enumerate([*ADAPTERS, "a5"]):
        out[name] = write_tiny_adapter(d / f"{name}.gguf", SPEC, seed=31 + k)
    return out


@pytest.fixture(scope="module")
def app(files: dict[str, Path]) -> Iterator[str]:
    """The application on a local Ray cluster (2 CPUs): its URL."""
    # (PYTHONPATH for Ray's workers; the tests after these see the environment unchanged)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        yield from _app(files)


def _app(files: dict[str, Path]) -> Iterator[str]:
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=200 * 2**20,
            ignore_reinit_error=True,
            runtime_env={"env_vars": {"PYTHONPATH": SRC}},
            log_to_driver=False,
        )
    except Exception as exc:  # noqa: BLE001 - no Ray here: say why
        pytest.skip(f"a local Ray cluster cannot start here: {exc}")
    from graftlm.scaleout.deployments import start

    try:
        yield start(spec_of(_args(files, files["model"].parent)), "127.0.0.1", _free_port())
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single(files: dict[str, Path]) -> Iterator[str]:
    """One plain `graftlm serve` with the same flags: its URL."""
    state = serving_state(_args(files, files["model"].parent))
    srv = ServerThread(create_app(state)).start()
    try:
        yield srv.url
    finally:
        srv.stop()
        state.service.close()


def _complete(url: str, model: str, n: int = 8, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0} | extra
    return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)


def _replicas(url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{url}/replicas", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _settled(url: str, n: int = 2) -> dict[str, dict[str, Any]]:
    """The replicas' reports once `n` report and two reads a report apart agree."""
    last: Any = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        now = _replicas(url)
        view = {k: (r["loads"], r["resident"]) for k, r in now.items()}
        if len(now) == n and view == last:
            return now
        last = view
        time.sleep(0.6)
    raise AssertionError(f"the replicas' reports did not settle: {last}")


def test_adapters_stay_with_the_replica_that_loaded_them(app: str) -> None:
    # from cold: the ingress sends the first request of each adapter alone, one adapter after
    # the other, so that Serve places each on the replica with the fewest; the rest follow it
    results: list[int] = []

    def client(k: int) -> None:
        for j in range(3):
            results.append(_complete(app, ADAPTERS[(k + j) % 4], n=6).status_code)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 36
    reports = _settled(app)
    for rid, r in reports.items():
        assert all(v <= 1 for v in r["loads"].values()), (rid, r["loads"])
        assert len(r["resident"]) <= 2, (rid, r["resident"])
    for name in ADAPTERS:  # each adapter loaded once in the whole application
        assert sum(r["loads"].get(name, 0) for r in reports.values()) == 1, (name, reports)
    # and every request for it was answered by that replica
    page = httpx.get(f"{app}/metrics", timeout=TIMEOUT).text
    served: dict[str, set[str]] = {}
    for line in page.splitlines():
        if line.startswith("graftlm_requests_total{"):
            labels = dict(
                kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            served.setdefault(labels["adapter"].strip('"'), set()).add(labels["replica"].strip('"'))
    for name in ADAPTERS:
        assert len(served[name]) == 1, (name, served)
    assert "graftlm_lora_adapter_loads_total" in page


def test_the_ingress_reads_what_its_router_knows(app: str) -> None:
    # the cold-start order waits for the router to learn where an adapter went; AdapterRouter
    # tells what it heard (from Serve's public replica records, no Ray internals): this says
    # that a handle's router is one that tells, and that what it tells is where adapters are
    from graftlm.scaleout.known import known_adapters

    handle = serve.get_deployment_handle("Replica", app_name="graftlm")
    assert _complete(app, "a1").status_code == 200
    handle.facts.remote().result()  # initialises this handle's router
    assert known_adapters("graftlm") is not None, "this handle's router is no AdapterRouter"

    def table() -> dict[str, frozenset[str]]:
        return known_adapters("graftlm") or {}

    reports = _settled(app)
    held = {n for r in reports.values() for n in r["resident"]}
    assert "a1" in held
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # this handle's router hears from the controller
        if set(table()) >= held:
            break
        time.sleep(0.1)
    assert set(table()) == held, (table(), held)
    for name in held:  # and by the replicas that hold them
        assert table()[name] == {k for k, r in reports.items() if name in r["resident"]}


def test_answers_equal_a_single_server(app: str, single: str) -> None:
    for name in ["tiny", *ADAPTERS]:
        a, b = _complete(app, name, n=12), _complete(single, name, n=12)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"], name
    # several adapters by name: routed by the heaviest (a2), a1 attached beside it there
    lora = [{"name": "a1", "scale": 0.3}, {"name": "a2", "scale": 1.0}]
    a, b = _complete(app, "tiny", n=12, lora=lora), _complete(single, "tiny", n=12, lora=lora)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    texts = {_complete(single, name, n=12).json()["choices"][0]["text"] for name in ADAPTERS}
    assert len(texts) > 1  # the adapters do change the answer: the comparison means something


def test_streaming_through_the_ingress(app: str, single: str) -> None:
    body = {
        "model": "a3",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
    }
    pieces, events = [], 0
    with httpx.stream("POST", f"{app}/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            choices = json.loads(line[6:])["choices"]
            if choices:  # [] in the closing usage chunk
                pieces.append(choices[0]["delta"].get("content") or "")
    whole = httpx.post(
        f"{single}/v1/chat/completions", json=body | {"stream": False}, timeout=TIMEOUT
    ).json()
    assert events > 2
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]


def test_models_and_client_errors(app: str) -> None:
    ids = [m["id"] for m in httpx.get(f"{app}/v1/models", timeout=TIMEOUT).json()["data"]]
    assert ids[0] == "tiny" and set(ids[1:]) == set(ADAPTERS)
    # as graftlm serve (and llama-server): a name nobody knows is served by the base model
    r, base = _complete(app, "nope"), _complete(app, "tiny")
    assert r.status_code == 200 and base.status_code == 200
    assert r.json()["choices"][0]["text"] == base.json()["choices"][0]["text"]
    r = httpx.post(
        f"{app}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{app}/lora-adapters", json=[{"id": 0, "scale": 1}], timeout=TIMEOUT)
    assert r.status_code == 501 and "lora" in r.json()["error"]["message"]


def test_runtime_load_and_unload_reach_every_replica(app: str, files: dict[str, Path]) -> None:
    r = httpx.post(
        f"{app}/v1/load_lora_adapter",
        json={"lora_name": "a5", "lora_path": str(files["a5"])},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    reports = _replicas(app)
    assert all(rep["version"] >= 1 for rep in reports.values()), reports
    ids = [m["id"] for m in httpx.get(f"{app}/v1/models", timeout=TIMEOUT).json()["data"]]
    assert "a5" in ids
    loaded, base = _complete(app, "a5", n=16), _complete(app, "tiny", n=16)
    assert loaded.status_code == 200 and base.status_code == 200
    assert loaded.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    r = httpx.post(f"{app}/v1/unload_lora_adapter", json={"lora_name": "a5"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    for _ in range(3):  # whichever replica answers, a5 was unloaded: a 404 naming it
        r = _complete(app, "a5", n=16)
        assert r.status_code == 404, r.text
        assert "'a5' was unloaded" in r.json()["error"]["message"], r.text
    r = httpx.post(
        f"{app}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": "/etc/passwd"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 403


def test_a_killed_replica_fails_only_its_own_requests(app: str) -> None:
    """Three long requests over two adapters held by different replicas (one streamed); a
    replica running at least one of them is killed. Each request either ends whole or fails
    with the clear replica_lost error (a 503, or an error event in a stream whose status line
    is gone); none hangs; afterwards both adapters are served. (Which replica runs each request
    is the router's choice under load, so the victim is the one seen running.)"""
    reports = _settled(app)
    holders: dict[str, set[str]] = {}
    for rid, r in reports.items():
        for name in r["resident"]:
            holders.setdefault(name, set()).add(rid)
    first = next(a for a in ADAPTERS if holders.get(a))
    second = next(a for a in ADAPTERS if holders.get(a) and holders[a] != holders[first])
    out: dict[str, httpx.Response] = {}
    events: list[str] = []

    def call(name: str) -> None:
        out[name] = _complete(app, name, n=4000, ignore_eos=True)

    def stream() -> None:
        body = {"model": first, "prompt": PROMPT, "max_tokens": 4000, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{app}/v1/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    threads = [threading.Thread(target=call, args=(a,)) for a in (first, second)]
    threads.append(threading.Thread(target=stream))
    for t in threads:
        t.start()
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:  # a replica that is generating
        for line in httpx.get(f"{app}/metrics", timeout=TIMEOUT).text.splitlines():
            if line.startswith("graftlm_requests_running{") and float(line.rsplit(" ", 1)[1]):
                victim = line.split('replica="', 1)[1].split('"', 1)[0]
                break
        time.sleep(0.05)
    assert victim in reports, (victim, list(reports))
    ray.kill(ray.get_actor(reports[victim]["actor_name"], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request hung on a dead replica"
    failed = 0
    for name in (first, second):
        r = out[name]
        if r.status_code == 503:
            err = r.json()["error"]
            assert err["code"] == "replica_lost" and "replica" in err["message"], r.text
            failed += 1
        else:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4000
    assert events
    if events[-1] == "data: [DONE]":  # it ran on the survivor: whole
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length", last
    else:  # the status line is gone: the stream ends with the error, not as finished
        assert json.loads(events[-1][6:])["error"]["code"] == "replica_lost"
        failed += 1
    assert failed >= 1  # the victim was running at least one of them
    # new requests go elsewhere (the survivor, or the victim's replacement)
    assert _complete(app, first).status_code == 200
    assert _complete(app, second).status_code == 200


def test_app_builder_and_flag_checks(files: dict[str, Path]) -> None:
    """Serve's builder (for `serve run` and KubeRay) takes the command's flags; bad replica
    counts are refused before anything starts."""
    from ray.serve import Application

    from graftlm.commands.ray_serve import app_builder, main

    built = app_builder({"flags": f"-m {files['model']} --replicas 3 -t 1 --max-loras 2"})
    assert isinstance(built, Application)
    for flags in (["--replicas", "0"], ["--min-replicas", "3", "--max-replicas", "2"]):
        with pytest.raises(ValueError, match="replicas"):
            spec_of(_args(files, files["model"].parent, *flags))
    # the adapter budget's flags and --lora-modules' names, as graftlm serve checks them
    for flags, words in (
        (["--max-lora-rank", "0"], "--max-lora-rank 0"),
        (["--lora-wait", "-1"], "--lora-wait"),
        (["--lora-modules", "a\tb=x.gguf"], "U\\+0009"),
    ):
        with pytest.raises(ValueError, match=words):
            spec_of(_args(files, files["model"].parent, *flags))
    assert main(["--replicas", "0"]) == 1
