"""A bounded soak on loopback: 300 /completion requests from 16 concurrent clients, each with its
own random adapters, scales, sampling seed and prompt, against a real uvicorn server over a tiny
random model (16 generating slots).

Checks: no errors; every answer equals the same request run alone afterwards (or differs only
after a near-tie: at the first differing token the alone run's top two log-probabilities were
within NEAR_TIE of each other); the process's memory stays flat after warm-up; the server is left
clean (no slot, lease or queued request leaked).

Half the requests sample (temperature > 0, top-k/top-p/min-p varied) with a seed: the sampler is
per request and seeded, so alone or in a batch it must draw the same tokens from the same logits;
the near-tie rule is applied to them as to greedy ones. The alone runs ask for n_probs=2 (the
log-probabilities of the raw logits), which must not change what is drawn.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from server_fixtures import wait_until
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

import graftlm
from graftlm.server.app import ServerThread, build_state, create_app
from graftlm.server.state import ServerConfig, ServerState

SPEC = TinySpec(n_ctx=128)
N_REQUESTS = 300
N_CLIENTS = 16
PARALLEL = 16
ADAPTERS = ("s0", "s1", "s2", "s3")
WARMUP = 50  # requests finished before the first memory reading
NEAR_TIE = 0.05  # top-two log-probability gap under which a differing token is accepted
RSS_GROWTH_LIMIT = 64 << 20
SCALES = (0.0, -1.0, -0.5, 0.25, 0.5, 1.0, 1.5, 2.0)
WORDS = ("the", "a", "cat", "sat", "on", "mat", "the the", "hello", "world", "é", "42", "\n")


@dataclass
class Soak:
    url: str
    state: ServerState
    ids: dict[str, int]  # adapter name -> id
    n_vocab: int


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Soak]:
    d = tmp_path_factory.mktemp("soak")
    model_path = write_tiny_model(d / "tiny.gguf", SPEC, seed=3)
    files = [
        write_tiny_adapter(d / f"{name}.gguf", SPEC, seed=101 + k, rank=2 + k)
        for k, name in enumerate(ADAPTERS)
    ]
    model = graftlm.load(model_path, ctx_size=SPEC.n_ctx, n_seq=PARALLEL + 1)
    state = build_state(
        model,
        ServerConfig(model_name="soak"),
        parallel=PARALLEL,
        lora=[(str(f), 0.0) for f in files],
    )
    ids = {a["name"]: a["id"] for a in state.registry.adapter_list()}
    assert set(ids) == set(ADAPTERS)
    srv = ServerThread(create_app(state)).start()
    try:
        yield Soak(srv.url, state, ids, int(model.config.n_vocab))
    finally:
        srv.stop()
        state.service.close()


def _rss() -> int:
    """Resident bytes of this process (the server runs in it, in threads)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _bodies(soak: Soak, rng: random.Random) -> list[dict[str, Any]]:
    bodies = []
    for _ in range(N_REQUESTS):
        names = rng.sample(ADAPTERS, rng.randint(0, len(ADAPTERS)))
        lora = [{"id": soak.ids[n], "scale": rng.choice(SCALES)} for n in names]
        if rng.random() < 0.25:
            prompt: str | list[int] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        else:
            prompt = [rng.randrange(soak.n_vocab) for _ in range(rng.randint(1, 24))]
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": rng.randint(4, 12),
            "seed": rng.randrange(2**31),
            "ignore_eos": rng.random() < 0.8,
            "return_tokens": True,
            "lora": lora,
        }
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body["temperature"] = rng.choice((0.5, 0.8, 1.0, 1.5))
            body["top_k"] = rng.choice((0, 5, 40))
            body["top_p"] = rng.choice((1.0, 0.9))
            body["min_p"] = rng.choice((0.0, 0.05))
        if rng.random() < 0.1:  # an adapter by name: it runs at 1 unless `lora` says otherwise
            body["model"] = rng.choice(ADAPTERS)
        if rng.random() < 0.2:
            body["n_probs"] = 2
        body["stream"] = rng.random() < 0.2
        bodies.append(body)
    return bodies


@dataclass
class Answer:
    status: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    error: str = ""


async def _send(client: httpx.AsyncClient, body: dict[str, Any]) -> Answer:
    try:
        if not body["stream"]:
            r = await client.post("/completion", json=body)
            if r.status_code != 200:
                return Answer(r.status_code, error=r.text[:300])
            out = r.json()
            return Answer(200, out["tokens"], out["content"])
        ans = Answer()
        async with client.stream("POST", "/completion", json=body) as r:
            ans.status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    ans.error = json.dumps(ev["error"])[:300]
                    continue
                ans.tokens += ev["tokens"]
                ans.text += ev["content"]
        return ans
    except Exception as exc:  # noqa: BLE001 - counted as an error, reported below
        return Answer(error=f"{type(exc).__name__}: {exc}")


async def _soak(url: str, bodies: list[dict[str, Any]]) -> tuple[list[Answer], int]:
    """Every body from N_CLIENTS clients, each on its own connection; the RSS after WARMUP."""
    answers: list[Answer | None] = [None] * len(bodies)
    todo = iter(range(len(bodies)))
    done = 0
    rss_warm = 0

    async def client() -> None:
        nonlocal done, rss_warm
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            for i in todo:  # shared: each index is taken by exactly one client
                answers[i] = await _send(c, bodies[i])
                done += 1
                if done == WARMUP:
                    rss_warm = _rss()

    await asyncio.wait_for(asyncio.gather(*(client() for _ in range(N_CLIENTS))), timeout=300)
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None], rss_warm


def _batch_sizes(state: ServerState) -> dict[str, float]:
    """The engine-step histogram: cumulative counts by bucket ("le"), plus "sum"."""
    out: dict[str, float] = {}
    for sample in list(state.metrics.batch_size.collect())[0].samples:
        if sample.name.endswith("_bucket"):
            out[sample.labels["le"]] = sample.value
        elif sample.name.endswith("_sum"):
            out["sum"] = sample.value
    return out


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def test_soak_concurrent_adapters_equal_alone(soak: Soak) -> None:
    rng = random.Random(20240611)
    bodies = _bodies(soak, rng)
    svc, registry = soak.state.service, soak.state.registry
    cancelled = svc.n_cancelled
    steps_before = _batch_sizes(soak.state)

    t0 = time.perf_counter()
    answers, rss_warm = asyncio.run(_soak(soak.url, bodies))
    soak_s = time.perf_counter() - t0
    rss_end = _rss()
    steps = {k: v - steps_before[k] for k, v in _batch_sizes(soak.state).items()}

    errors = [(i, a.status, a.error) for i, a in enumerate(answers) if a.status != 200 or a.error]
    assert not errors, f"{len(errors)} of {N_REQUESTS} requests failed: {errors[:5]}"
    for b, a in zip(bodies, answers, strict=True):
        assert len(a.tokens) <= b["n_predict"] and (a.tokens or not b["ignore_eos"])
        assert len(a.tokens) == b["n_predict"] or not b["ignore_eos"]

    # the clients really shared engine steps: wide batches on average, some near full
    mean_rows = steps["sum"] / steps["+Inf"]
    wide = steps["+Inf"] - steps["12.0"]  # steps with more than 12 sequences
    assert mean_rows > 4 and wide > 0, steps

    # the server is left clean: every slot back, no lease held, nothing queued or cancelled
    wait_until(lambda: not (svc.engine.busy or svc.n_running), 120, "the engine to empty")
    assert not svc.engine.busy and len(svc.engine.free_slots) == svc.engine.n_slots
    assert all(e.refs == 0 for e in registry.by_id.values())
    assert svc.n_cancelled == cancelled

    # every request again, alone, with the top two log-probabilities of each generated token
    t1 = time.perf_counter()
    near_ties: list[tuple[int, int, float]] = []
    mismatches: list[str] = []
    with httpx.Client(base_url=soak.url, timeout=60) as http:
        for i, (b, a) in enumerate(zip(bodies, answers, strict=True)):
            r = http.post("/completion", json={**b, "stream": False, "n_probs": 2})
            assert r.status_code == 200, r.text
            alone = r.json()
            k = _first_difference(a.tokens, alone["tokens"])
            if k is None:
                if a.text != alone["content"]:
                    mismatches.append(f"request {i}: same tokens, different text")
                continue
            gap = float("inf")
            probs = alone["completion_probabilities"]
            if k < len(probs):
                top = probs[k]["top_logprobs"]
                gap = top[0]["logprob"] - top[1]["logprob"]
            if gap < NEAR_TIE:
                near_ties.append((i, k, gap))
            else:
                mismatches.append(
                    f"request {i} {b}: token {k} differs (batched {a.tokens}, alone "
                    f"{alone['tokens']}); alone top-two gap there {gap:.4f}"
                )
    alone_s = time.perf_counter() - t1
    rss_after = _rss()

    growth = max(rss_end, rss_after) - rss_warm
    print(
        f"\nsoak: {N_REQUESTS} requests from {N_CLIENTS} clients in {soak_s:.1f}s "
        f"({steps['+Inf']:.0f} engine steps, {mean_rows:.1f} sequences per step, {wide:.0f} "
        f"with more than 12), "
        f"errors {len(errors)}, compared {len(answers)} alone in {alone_s:.1f}s, "
        f"near-tie differences {len(near_ties)} {near_ties}, mismatches {len(mismatches)}, "
        f"RSS after {WARMUP} requests {rss_warm / 2**20:.1f} MiB, after the soak "
        f"{rss_end / 2**20:.1f} MiB, after the alone runs {rss_after / 2**20:.1f} MiB "
        f"(+{growth / 2**20:.1f} MiB)"
    )
    assert not mismatches, "\n".join(mismatches[:5])
    assert rss_warm > 0 and growth < RSS_GROWTH_LIMIT
