"""Multi-turn chat traffic with a shared system prompt, side by side: graftlm with its prefix
cache, graftlm without it, and llama-server (-np N, cache_prompt on), one server after another on
the same model, the same adapters and the same conversations, in alternating rounds.

Traffic: `--conversations` concurrent conversations of `--turns` turns each, every one starting
with the same system prompt of about `--system-tokens` tokens and growing its own history (each
turn: a short user message, then the server's answer of `--max-tokens` tokens, greedy, end token
ignored, so every server generates the same number of tokens). Half the conversations run on
adapters, spread over four adapter settings (the SmolLM2 fixtures pirate, caps and rand_all, and
pirate again at scale 0.5: llama-server and graftlm both take a request's `lora` list). Reported
per server: time to first token (p50, p95) of each turn, and aggregate generated tokens per second
over the whole run; then the ratios.

    .venv/bin/python bench/prefix_chat.py --llama-server /tmp/lcpp/llama-server --rounds 2

(On an AVX-512 Xeon without AMX granted, copy ../shared/llama.cpp/bin somewhere and delete
libggml-cpu-sapphirerapids.so, or llama.cpp picks it and dies.) Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import running  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
ADAPTERS = ["pirate", "caps", "rand_all"]
# (adapter index, scale) of the four adapter settings; None: base
SETTINGS: list[tuple[int, float] | None] = [
    None,
    (0, 1.0),
    None,
    (1, 1.0),
    None,
    (2, 1.0),
    None,
    (0, 0.5),
]
WORDS = ("river stone lantern orchard harbor meadow copper violet winter signal garden forest "
         "engine ladder mirror silver anchor candle thunder pepper").split()  # fmt: skip


def system_prompt(n_tokens: int) -> str:
    rng = random.Random(7)
    words = [rng.choice(WORDS) for _ in range(int(n_tokens * 0.9))]
    return "You are a helpful assistant. Background notes: " + " ".join(words) + "."


@dataclass
class Result:
    ttft: dict[int, list[float]] = field(default_factory=dict)  # turn -> seconds
    tokens: int = 0
    wall: float = 0.0


async def converse(
    client: httpx.AsyncClient,
    conv: int,
    args: argparse.Namespace,
    system: str,
    model: str,
    out: Result,
) -> None:
    setting = None if args.base_only else SETTINGS[conv % len(SETTINGS)]
    messages = [{"role": "system", "content": system}]
    rng = random.Random(100 + conv)
    for turn in range(args.turns):
        question = " ".join(rng.choice(WORDS) for _ in range(12))
        messages.append({"role": "user", "content": f"Tell me about the {question}."})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "lora": [] if setting is None else [{"id": setting[0], "scale": setting[1]}],
        }
        t0 = time.perf_counter()
        first = None
        text = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                for ch in ev.get("choices", []):
                    piece = ch.get("delta", {}).get("content")
                    if piece:
                        if first is None:
                            first = time.perf_counter() - t0
                        text.append(piece)
        out.ttft.setdefault(turn + 1, []).append(first if first is not None else float("nan"))
        out.tokens += args.max_tokens
        messages.append({"role": "assistant", "content": "".join(text)})


async def traffic(url: str, args: argparse.Namespace) -> Result:
    system = system_prompt(args.system_tokens)
    out = Result()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        convs = [converse(client, c, args, system, model, out) for c in range(args.conversations)]
        await asyncio.gather(*convs)
        out.wall = time.perf_counter() - t0
    return out


def server_cmd(kind: str, args: argparse.Namespace, port: int) -> list[str]:
    loras = [str(SHARED / "fixtures" / "smollm2" / f"{a}-f32.gguf") for a in ADAPTERS]
    n = args.conversations
    if kind == "llama-server":
        cmd = [args.llama_server, "-m", args.model, "--port", str(port), "-np", str(n),
               "-c", str(n * args.ctx), "-t", str(args.threads), "--cache-prompt"]  # fmt: skip
        for p in loras:
            cmd += ["--lora-scaled", f"{p}:0"]
        return cmd
    cmd = [sys.executable, "-m", "graftlm", "serve", "-m", args.model, "--port", str(port),
           "-np", str(n), "-c", str(n * args.ctx), "-t", str(args.threads)]  # fmt: skip
    for p in loras:
        cmd += ["--lora-scaled", f"{p}:0"]
    if kind == "graftlm-nocache":
        cmd.append("--no-cache-prompt")
    return cmd


def run_one(kind: str, args: argparse.Namespace, port: int) -> Result:
    with running(server_cmd(kind, args, port), port) as url:
        return asyncio.run(traffic(url, args))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=str(SHARED / "llama.cpp" / "bin" / "llama-server"))
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024, help="context per conversation")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--base-only", action="store_true", help="every conversation on the base")
    ap.add_argument("--only", nargs="+", default=["graftlm", "graftlm-nocache", "llama-server"])
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT / "src"))
        from graftlm.resources import default_model_path

        args.model = str(default_model_path())
    results: dict[str, list[Result]] = {k: [] for k in args.only}
    for rnd in range(args.rounds):
        order = args.only if rnd % 2 == 0 else list(reversed(args.only))  # alternated
        for kind in order:
            r = run_one(kind, args, 18500 + rnd * 10 + args.only.index(kind))
            results[kind].append(r)
            print(f"round {rnd + 1} {kind}: {r.tokens / r.wall:.1f} tok/s, {r.wall:.1f} s",
                  flush=True)  # fmt: skip
    print(f"\n{args.conversations} conversations x {args.turns} turns, system prompt "
          f"~{args.system_tokens} tokens, {args.max_tokens} tokens an answer, {args.threads} "
          f"threads, {args.rounds} round(s)")  # fmt: skip
    header = "server".ljust(18) + "".join(f"turn {t} p50/p95 (s)".rjust(22) for t in
                                          range(1, args.turns + 1)) + "tok/s".rjust(10)  # fmt: skip
    print(header)
    summary: dict[str, tuple[list[float], float]] = {}
    for kind, rs in results.items():
        cells = []
        p50s = []
        for t in range(1, args.turns + 1):
            xs = [x for r in rs for x in r.ttft.get(t, [])]
            p50s.append(statistics.median(xs))
            cells.append(f"{statistics.median(xs):.3f}/{pct(xs, 0.95):.3f}".rjust(22))
        tps = statistics.median(r.tokens / r.wall for r in rs)
        summary[kind] = (p50s, tps)
        print(kind.ljust(18) + "".join(cells) + f"{tps:10.1f}")
    if "graftlm" in summary and "graftlm-nocache" in summary:
        on, off = summary["graftlm"], summary["graftlm-nocache"]
        ratios = ", ".join(f"turn {t + 1} {off[0][t] / on[0][t]:.2f}x" for t in range(args.turns))
        print(f"time to first token, without / with the cache: {ratios}")
    if "graftlm" in summary and "llama-server" in summary:
        print(f"throughput, graftlm / llama-server: "
              f"{summary['graftlm'][1] / summary['llama-server'][1]:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
