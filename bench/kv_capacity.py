"""How many concurrent sequences the paged KV cache holds: `graftlm serve -np N` with a pool of
N x (prompt + generation) tokens, N concurrent requests of distinct prompts (nothing shared), and
the figures while they all run: the pool's blocks in use from /metrics, the KV bytes they are,
and the server's resident memory.

    .venv/bin/python bench/kv_capacity.py -np 64 --prompt-tokens 990 --gen 10 -ctk f16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def load(url: str, args: argparse.Namespace, pid: int) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
                   for _ in range(args.parallel)]  # fmt: skip
        body = {"n_predict": args.gen, "temperature": 0, "ignore_eos": True}
        tasks = [asyncio.create_task(client.post("/completion", json={**body, "prompt": p}))
                 for p in prompts]  # fmt: skip
        peak = (0.0, 0.0, 0.0, 0.0)
        while not all(t.done() for t in tasks):
            text = (await client.get("/metrics")).text
            used = metric(text, 'graftlm_kv_cache_blocks{state="used"}')
            running = metric(text, "graftlm_requests_running")
            if used > peak[0]:
                peak = (used, running, metric(text, "graftlm_kv_cache_bytes"), rss_mib(pid))
            await asyncio.sleep(0.5)
        done = [t.result() for t in tasks]
        assert all(r.status_code == 200 for r in done), [
            r.text for r in done if r.status_code != 200
        ]
        text = (await client.get("/metrics")).text
        total = metric(text, 'graftlm_kv_cache_blocks{state="total"}')
        block_tokens = metric(text, "graftlm_kv_cache_block_tokens")
    used, running, pool_bytes, rss = peak
    per_block = pool_bytes / (total + 1)
    print(f"{args.parallel} requests of {args.prompt_tokens} + {args.gen} tokens, cache {args.ctk}")
    print(f"pool: {total:.0f} blocks of {block_tokens:.0f} tokens, {pool_bytes / 2**30:.2f} GiB")
    print(f"peak: {used:.0f} blocks in use with {running:.0f} requests running = "
          f"{used * per_block / 2**30:.2f} GiB of K/V; server resident {rss / 1024:.2f} GiB")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-np", "--parallel", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=990)
    ap.add_argument("--gen", type=int, default=10)
    ap.add_argument("-ctk", default="f16")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18650)
    args = ap.parse_args()
    pool = args.parallel * (args.prompt_tokens + args.gen + 16)
    cmd = [sys.executable, "-m", "graftlm", "serve", "--port", str(args.port), "-np",
           str(args.parallel), "-c", str(pool), "-ctk", args.ctk, "-ctv", args.ctk, "-t",
           str(args.threads), "--no-cache-prompt"]  # fmt: skip
    if args.model:
        cmd += ["-m", args.model]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        asyncio.run(load(url, args, proc.pid))
    finally:
        proc.terminate()
        proc.wait(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
