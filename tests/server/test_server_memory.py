"""The server's memory under requests that make it produce or hold much (issue 41): 1,000 mixed
requests, echoed prompts with their log-probabilities, the most alternatives n_probs allows, long
texts to /tokenize, adapters; the process's resident memory after all of them within 10% of what
it was after the first 100 (what a request holds is given back, nothing grows with the count)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from server_fixtures import serving
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

import graftlm
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig

N_REQUESTS = int(os.environ.get("MEMORY_REQUESTS", "1000"))
FIRST = N_REQUESTS // 10
WORDS = ("the", "cat", "sat", "on", "a", "mat", "hello", "world", "é", "42", "\n", "<s>")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _requests(n: int, n_vocab: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(5)
    kinds: list[Callable[[], tuple[str, dict[str, Any]]]] = [
        lambda: ("/v1/completions", {  # the prompt echoed with its log-probabilities
            "prompt": [rng.randrange(n_vocab) for _ in range(rng.randint(50, 300))],
            "max_tokens": 2, "echo": True, "logprobs": 5, "lora": [{"id": 0, "scale": 0.5}],
        }),
        lambda: ("/completion", {  # every alternative allowed, every token
            "prompt": _text(rng, 20), "n_predict": rng.randint(2, 12), "n_probs": 100,
            "ignore_eos": True, "seed": rng.randrange(1000),
        }),
        lambda: ("/tokenize", {"content": _text(rng, rng.randint(500, 5000)), "with_pieces": True}),
        lambda: ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": _text(rng, 50)}], "max_tokens": 8,
            "logprobs": True, "top_logprobs": 20, "model": rng.choice(["m", "named"]),
        }),
    ]  # fmt: skip
    return [rng.choice(kinds)() for _ in range(n)]


def test_resident_memory_stays_flat_over_1000_requests(tmp_path: Path) -> None:
    spec = TinySpec(n_ctx=512)
    model = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=spec.n_ctx)
    adapter = write_tiny_adapter(tmp_path / "a.gguf", spec)
    state = build_state(
        model, ServerConfig(model_name="m"), parallel=4, lora=[(str(adapter), 0.0)],
        lora_modules=[("named", str(write_tiny_adapter(tmp_path / "b.gguf", spec, seed=9)))],
    )  # fmt: skip
    reqs = _requests(N_REQUESTS, int(model.config.n_vocab))
    with serving(state) as url, httpx.Client(base_url=url, timeout=120) as http:

        def send(req: tuple[str, dict[str, Any]]) -> int:
            return http.post(req[0], json=req[1]).status_code

        with ThreadPoolExecutor(4) as pool:
            first = list(pool.map(send, reqs[:FIRST]))
            after_first = _rss()
            rest = list(pool.map(send, reqs[FIRST:]))
            after_all = _rss()
    codes = first + rest
    assert all(c < 500 for c in codes), sorted(set(codes))
    assert codes.count(200) > 0.9 * len(codes), {c: codes.count(c) for c in set(codes)}
    assert after_all <= after_first * 1.10, (after_first >> 20, after_all >> 20)
