"""The ingress's pieces that need no Ray: the routing rule, the replica's in-process run of a
request through graftlm's app, and the merge of the replicas' metrics."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from fastapi import FastAPI  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from graftlm.scaleout.forward import Forwarded, Head, merge_metrics, route_key, run_asgi  # noqa: E402

BASE, PINNED = {"tiny", "tiny.gguf"}, {"a0"}


@pytest.mark.parametrize(
    ("payload", "key"),
    [
        ({"model": "pirate"}, "pirate"),  # model names an adapter
        ({"model": "tiny"}, ""),  # the base: anywhere
        ({"model": "a0"}, ""),  # pinned: on every replica
        ({}, ""),
        ({"model": "tiny", "lora": [{"name": "x", "scale": 0.3}, {"name": "y", "scale": -1}]}, "y"),
        ({"lora": [{"name": "x", "scale": 1}, {"name": "y", "scale": 1.0}]}, "x"),  # ties: first
        ({"model": "p", "lora": [{"name": "y", "scale": 2}]}, "p"),  # model first
        ({"lora": [{"id": 0, "scale": 1}, {"name": "a0", "scale": 1}]}, ""),
        ({"lora": "nonsense"}, ""),
        ([1, 2], ""),  # not an object: the replica answers the 400
        (None, ""),
    ],
)
def test_route_key(payload: object, key: str) -> None:
    assert route_key(payload, BASE, PINNED) == key


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return {"got": body}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def gen():  # type: ignore[no-untyped-def]
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def _run(req: Forwarded) -> list[Head | bytes]:
    async def go() -> list[Head | bytes]:
        return [p async for p in run_asgi(_app(), req)]

    return asyncio.run(go())


def test_run_asgi_answers_and_streams() -> None:
    out = _run(
        Forwarded("POST", "/echo", b"", [(b"content-type", b"application/json")], b'{"a": 1}')
    )
    assert isinstance(out[0], Head) and out[0].status == 200
    assert b"".join(p for p in out[1:] if isinstance(p, bytes)) == b'{"got":{"a":1}}'
    out = _run(Forwarded("GET", "/stream"))
    assert isinstance(out[0], Head) and out[0].status == 200
    assert [p for p in out[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    out = _run(Forwarded("GET", "/nowhere"))
    assert isinstance(out[0], Head) and out[0].status == 404


def test_merge_metrics_labels_every_sample_by_replica() -> None:
    from graftlm.server.metrics import Metrics

    pages = []
    for replica, n in (("r1", 3), ("r2", 5)):
        m = Metrics()
        for _ in range(n):
            m.finished(["a1"], "completions", 4, 8, 0.1, 0.01)
        m.adapter_loaded("a1", 0.02, 0.0)
        pages.append((replica, m.render()[0].decode()))
    merged = merge_metrics(pages)
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    reqs = {
        (s.labels["replica"], s.labels["adapter"]): s.value
        for s in fams["graftlm_requests"].samples
        if s.name == "graftlm_requests_total"
    }
    assert reqs == {("r1", "a1"): 3.0, ("r2", "a1"): 5.0}
    assert fams["graftlm_requests"].type == "counter"
    loads = [s for s in fams["graftlm_lora_adapter_loads"].samples if s.name.endswith("_total")]
    assert sorted(s.labels["replica"] for s in loads) == ["r1", "r2"]
    ttft = fams["graftlm_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    count = [s for s in ttft.samples if s.name.endswith("_count")]
    assert {s.labels["replica"]: s.value for s in count} == {"r1": 3.0, "r2": 5.0}
    assert merged.count("# TYPE graftlm_requests_total counter") == 1


def test_replica_options_pass_autoscaling_and_threads_through() -> None:
    from graftlm.scaleout.spec import ScaleSpec

    fixed = ScaleSpec(build_state=dict, threads=2, replicas=3).replica_options()
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"]["num_cpus"] == 2
    assert fixed["ray_actor_options"]["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "2"
    auto = ScaleSpec(
        build_state=dict, min_replicas=1, max_replicas=4, target_ongoing_requests=8
    ).replica_options()
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 1,
        "target_ongoing_requests": 8,
    }
    with pytest.raises(ValueError, match="min <= max"):
        ScaleSpec(build_state=dict, min_replicas=3, max_replicas=2).replica_options()
