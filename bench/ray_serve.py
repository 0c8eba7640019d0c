"""graftlm on Ray Serve: one replica of 2 threads vs two replicas of 1 thread, and routing by
adapter vs Serve's default routing, side by side on one local Ray cluster.

16 concurrent clients over 4 adapters (pirate, caps, rand_all from ../shared/fixtures, plus a
random rank-16 attention adapter written here) on SmolLM2-135M-Instruct Q4_1, greedy, through
the ingress's /v1/completions with `model` naming the adapter. Each client sends one request per
round, round r on adapter (client + r) mod 4; the first round warms up (cold loads), the timed
rounds follow. The adapter memory is the same in every set-up: 4 adapters on the one replica,
2 on each of two.

    1x2 affinity      1 replica, 2 threads, up to 4 adapters
    2x1 affinity      2 replicas, 1 thread each, up to 2 adapters each, routed by adapter
    2x1 no affinity   the same, routed without the adapter (Serve's power-of-two choices)

Prints aggregate tok/s, mean and p90 request latency of the timed rounds, and adapter loads
(attaches counted by the replicas' registries) in the warm-up and in the timed rounds.

    PYTHONPATH=src .venv/bin/python bench/ray_serve.py [--clients 16] [--tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import FIXTURES, PROMPTS  # noqa: E402

import graftlm  # noqa: E402
from graftlm.commands.ray_serve import add_ray_serve_arguments, spec_of  # noqa: E402


def write_attention_adapter(path: Path, cfg: graftlm.Model, rank: int = 16, seed: int = 0) -> Path:
    """A random rank-16 LoRA on attn_q/k/v/output of every layer, llama.cpp's GGUF layout."""
    c = cfg.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), c.arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    q_out, kv_out = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    shapes = {
        "attn_q": (c.n_embd, q_out),
        "attn_k": (c.n_embd, kv_out),
        "attn_v": (c.n_embd, kv_out),
        "attn_output": (q_out, c.n_embd),
    }
    for i in range(c.n_layer):
        for name, (n_in, n_out) in shapes.items():
            a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * 0.02).astype(np.float32)
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a", a)
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SETUPS = [  # name, replicas, threads, adapters a replica, routed by adapter
    ("1x2 affinity", 1, 2, 4, True),
    ("2x1 affinity", 2, 1, 2, True),
    ("2x1 no affinity", 2, 1, 2, False),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _round(url: str, names: list[str], r: int, clients: int, tokens: int) -> list[float]:
    """One request per client at once; each request's latency (s)."""

    async def one(c: httpx.AsyncClient, i: int) -> float:
        body = {
            "model": names[(i + r) % len(names)],
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        resp = await c.post("/v1/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"{body['model']}: {resp.status_code} {resp.text[:400]}")
        assert resp.json()["usage"]["completion_tokens"] == tokens
        return time.perf_counter() - t0

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        return list(await asyncio.gather(*(one(c, i) for i in range(clients))))


def _loads(url: str) -> int:
    """Adapter attaches over every replica, once two reports a second apart agree."""
    last = -1
    for _ in range(30):
        reports = httpx.get(f"{url}/replicas", timeout=60).json()
        n = sum(sum(r["loads"].values()) for r in reports.values())
        if n == last:
            return n
        last = n
        time.sleep(1.0)
    return last


def run_setup(
    setup: tuple[str, int, int, int, bool], modules: list[str], a: argparse.Namespace, port: int
) -> dict[str, Any]:
    from ray import serve

    from graftlm.scaleout.deployments import start

    name, replicas, threads, per_replica, affinity = setup
    p = argparse.ArgumentParser()
    add_ray_serve_arguments(p)
    flags = ["-c", "4096", "-np", str(a.clients), "-t", str(threads), "--replicas", str(replicas)]
    flags += ["--max-loras", str(per_replica), "--lora-modules", *modules]
    flags += [] if affinity else ["--no-affinity"]
    if a.model:
        flags += ["-m", a.model]
    url = start(spec_of(p.parse_args(flags)), "127.0.0.1", port)  # (one proxy, kept)
    names = [m.split("=", 1)[0] for m in modules]
    try:
        asyncio.run(_round(url, names, 0, a.clients, a.tokens))  # warm-up: the cold loads
        warm = _loads(url)
        latencies: list[float] = []
        t0 = time.perf_counter()
        for r in range(1, a.rounds + 1):
            latencies += asyncio.run(_round(url, names, r, a.clients, a.tokens))
        wall = time.perf_counter() - t0
        total = _loads(url)
    finally:
        serve.delete("graftlm")
    latencies.sort()
    return {
        "name": name,
        "tok_s": a.clients * a.rounds * a.tokens / wall,
        "mean": statistics.mean(latencies),
        "p90": latencies[int(0.9 * (len(latencies) - 1))],
        "warm_loads": warm,
        "loads": total - warm,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    p.add_argument("-m", "--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    a = p.parse_args()
    try:
        import ray
    except ImportError:
        print("needs the ray extra: pip install 'graftlm[ray]'", file=sys.stderr)
        return 1
    files = [FIXTURES / f for f in ("pirate-f32.gguf", "caps-f32.gguf", "rand_all-f32.gguf")]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        print(f"missing fixtures: {missing}", file=sys.stderr)
        return 1
    src = str(Path(__file__).resolve().parents[1] / "src")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 * 2**20,
        log_to_driver=False,
        runtime_env={
            "env_vars": {"PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        },
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = graftlm.load(a.model, ctx_size=256)
        files.append(write_attention_adapter(Path(tmp) / "attn_r16.gguf", model))
        del model
        modules = [f"{f.name.split('-')[0].removesuffix('.gguf')}={f}" for f in files]
        port = _free_port()
        try:
            for setup in SETUPS:
                results.append(run_setup(setup, modules, a, port))
                r = results[-1]
                print(f"{r['name']}: {r['tok_s']:.1f} tok/s", file=sys.stderr)
        finally:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    print(
        f"\n{a.clients} clients x {a.rounds} timed rounds x {a.tokens} tokens over 4 adapters, "
        "greedy, one local Ray cluster of 2 CPUs"
    )
    print(
        "| set-up | tok/s | mean latency (s) | p90 latency (s) | loads in warm-up | loads timed |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['tok_s']:.1f} | {r['mean']:.2f} | {r['p90']:.2f} | "
            f"{r['warm_loads']} | {r['loads']} |"
        )
    base = results[1]["tok_s"]
    print(f"\n2x1 affinity / 1x2:          {base / results[0]['tok_s']:.2f}")
    print(f"2x1 no affinity / affinity:  {results[2]['tok_s'] / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
