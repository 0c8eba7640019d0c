"""Serving throughput with LoRA adapters: base vs one adapter vs mixed adapters, side by side.

16 concurrent clients, 64 generated tokens each, greedy, on SmolLM2-135M-Instruct Q4_1 with four
f32 adapters attached (pirate, caps, rand_all from ../shared/fixtures, plus a random rank-16
attention-only adapter written here), as in reference/llama_cpp_figures.md:

    base   every request at scale 0 (no adapter)
    same   every request on adapter 0, scale 1
    mixed  request i on adapter i mod 4, scale 1

Prints aggregate tok/s for each, the ratios mixed/base and same/base measured in this run, and how
the mixed figure compares with llama-server's 119 tok/s (its base: 256 tok/s) on the same kind of
2-core machine. Absolute figures depend on the machine; the ratios are the point.

    .venv/bin/python bench/serve_bench.py [--clients 16] [--tokens 64] [--threads 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import gguf
import httpx
import numpy as np

import graftlm
from graftlm.server.app import ServerThread, build_state, create_app
from graftlm.server.state import ServerConfig

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "smollm2"
LLAMA_SERVER = {"base": 256.0, "same": 206.0, "mixed": 119.0}  # tok/s, -np 16, 2 threads
PROMPTS = [
    "Tell me about the sea.",
    "Write a short poem about ships.",
    "What is the capital of France?",
    "Explain how a compass works.",
    "Describe a storm at sea.",
    "Give three tips for sailing.",
    "What do parrots eat?",
    "Why is the ocean salty?",
]


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


async def one_round(
    url: str, clients: int, tokens: int, lora_of: list[list[dict[str, float]]]
) -> tuple[float, int]:
    """All clients at once; (wall seconds, tokens generated)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        bodies = [
            {
                "prompt": PROMPTS[i % len(PROMPTS)],
                "n_predict": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "lora": lora_of[i],
            }
            for i in range(clients)
        ]
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(c.post("/completion", json=b) for b in bodies))
        wall = time.perf_counter() - t0
    for r in rs:
        r.raise_for_status()
    return wall, sum(r.json()["tokens_predicted"] for r in rs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="rounds per scenario (best is reported)")
    p.add_argument(
        "-m", "--model", default=None, help="GGUF model (default: SmolLM2-135M-Instruct Q4_1)"
    )
    args = p.parse_args()

    t0 = time.perf_counter()
    model = graftlm.load(args.model, threads=args.threads, ctx_size=256, n_seq=args.clients + 1)
    print(f"loaded {model.path.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        files = [FIXTURES / f for f in ("pirate-f32.gguf", "caps-f32.gguf", "rand_all-f32.gguf")]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            print(f"missing fixtures: {missing}", file=sys.stderr)
            return 1
        files.append(write_attention_adapter(Path(tmp) / "attn_r16.gguf", model))
        state = build_state(
            model,
            ServerConfig(model_name="bench"),
            parallel=args.clients,
            lora=[(str(f), 0.0) for f in files],
        )
        scenarios: dict[str, list[list[dict[str, float]]]] = {
            "base": [[] for _ in range(args.clients)],
            "same": [[{"id": 0, "scale": 1.0}] for _ in range(args.clients)],
            "mixed": [[{"id": i % 4, "scale": 1.0}] for i in range(args.clients)],
        }
        results: dict[str, float] = {}
        with ServerThread(create_app(state)) as srv:
            asyncio.run(one_round(srv.url, 2, 4, scenarios["mixed"][:2]))  # warm-up
            for name, lora_of in scenarios.items():
                rates = []
                for _ in range(args.rounds):
                    wall, n = asyncio.run(one_round(srv.url, args.clients, args.tokens, lora_of))
                    rates.append(n / wall)
                results[name] = max(rates)
                print(
                    f"{name:6s} {results[name]:8.1f} tok/s  "
                    f"(rounds: {', '.join(f'{r:.1f}' for r in rates)})"
                )
            steps = list(state.metrics.batch_size.collect())[0].samples
            count = next(s.value for s in steps if s.name.endswith("_count"))
            total = next(s.value for s in steps if s.name.endswith("_sum"))
        state.service.close()
    print()
    print(
        f"{args.clients} clients x {args.tokens} tokens, greedy, {args.threads} threads; "
        f"mean sequences per engine step {total / max(count, 1):.1f}"
    )
    print(f"{'':6s} {'graftlm':>10s} {'llama-server':>13s} {'ratio':>7s}")
    for name in ("base", "same", "mixed"):
        ours, theirs = results[name], LLAMA_SERVER[name]
        print(f"{name:6s} {ours:10.1f} {theirs:13.1f} {ours / theirs:7.2f}")
    print()
    print(
        f"mixed/base (this run):          {results['mixed'] / results['base']:.2f}"
        f"   (llama-server: {LLAMA_SERVER['mixed'] / LLAMA_SERVER['base']:.2f})"
    )
    print(
        f"same/base  (this run):          {results['same'] / results['base']:.2f}"
        f"   (llama-server: {LLAMA_SERVER['same'] / LLAMA_SERVER['base']:.2f})"
    )
    print(f"mixed vs llama-server's 119 tok/s: {results['mixed'] / LLAMA_SERVER['mixed']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
