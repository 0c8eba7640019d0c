"""Batched serving with LoRA adapters, side by side with llama-server: base, one adapter, mixed.

Both servers run as processes on the same GGUF with the same adapters attached at scale 0
(`-np CLIENTS -c CLIENTS*CTX -t THREADS --lora-scaled FILE:0 ...`), and take the same traffic
one after the other, in alternating order each round: CLIENTS concurrent `/completion` requests,
each a different short prompt, TOKENS generated tokens each (greedy, end token ignored, so both
generate the same count), in three scenarios:

    base   every request at scale 0 (no adapter)
    same   every request on adapter 0, scale 1
    mixed  request i on adapter i mod N, scale 1 (N adapters)

Both servers read a request's `lora` list. graftlm computes the mixed requests in one batch;
llama-server batches only requests whose adapter settings are equal, so mixed traffic is served
in turns. Printed: aggregate generated tokens per second of each server in each scenario (the best
round), the ratio graftlm / llama-server, and each server's mixed/base.

    .venv/bin/python bench/serve_bench.py                       # SmolLM2 and its three fixtures
    .venv/bin/python bench/serve_bench.py -m DIR/llama-1b-q4_k_m.gguf \\
        --lora DIR/llama-1b-lora-r16.gguf --lora DIR/llama-1b-lora-r16-s2.gguf ...

(`bench/real_shapes.py DIR --shape llama-1b --adapter --adapters 4` writes a 1B-shaped model and
four adapters.) llama-server runs from a copy of `../shared/llama.cpp/bin` without its
sapphirerapids CPU variant, which these VMs (AVX-512 without AMX granted) can pick and die on.
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
FIXTURES = SHARED / "fixtures" / "smollm2"
SERVERS = ("graftlm", "llama-server")
SCENARIOS = ("base", "same", "mixed")
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


def llama_bin_copy(folder: Path, dest: Path) -> Path:
    """llama.cpp's bin/ copied without the sapphirerapids variant; the llama-server in it."""
    shutil.copytree(folder, dest, symlinks=True)
    (dest / "libggml-cpu-sapphirerapids.so").unlink(missing_ok=True)
    return dest / "llama-server"


def server_cmd(kind: str, args: argparse.Namespace, server: Path, port: int) -> list[str]:
    n = args.clients
    common = ["-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-np", str(n),
              "-c", str(n * args.ctx), "-t", str(args.threads)]  # fmt: skip
    for f in args.lora:
        common += ["--lora-scaled", f"{f}:0"]
    if kind == "llama-server":
        return [str(server), *common]
    return [sys.executable, "-m", "graftlm", "serve", *common]


@contextmanager
def running(
    cmd: list[str],
    port: int,
    log: Path | None = None,
    timeout: float = 600,
    pid_file: Path | None = None,
) -> Iterator[str]:
    """The server `cmd` (graftlm from this tree's src/) started, its /health answered; its URL.
    Stopped on leaving (terminated, killed after 30 s). Its output goes to `log`, else nowhere;
    its process id to `pid_file`, where given."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    with open(log or os.devnull, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        if pid_file is not None:
            pid_file.write_text(str(proc.pid))
        url = f"http://127.0.0.1:{port}"
        try:
            t0 = time.perf_counter()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"the server at {url} did not come up in {timeout:.0f} s")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def body(i: int, tokens: int) -> dict[str, object]:
    """Request i's body on the base: its own prompt (no two share a whole prompt), `tokens`
    greedy tokens, the end token ignored (both servers generate the same count)."""
    prompt = f"{PROMPTS[i % len(PROMPTS)]} (request {i})"
    return {"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False}  # fmt: skip


def bodies(args: argparse.Namespace, scenario: str) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(args.clients):
        lora = {"base": [], "same": [{"id": 0, "scale": 1.0}]}.get(
            scenario, [{"id": i % len(args.lora), "scale": 1.0}]
        )
        out.append(dict(body(i, args.tokens), lora=lora))
    return out


@dataclass(frozen=True)
class Round:
    wall: float  # seconds, first request sent to last answer
    tokens: int  # generated, all requests together
    replies: list[dict[str, Any]]  # each request's answer (the JSON), in the order sent

    @property
    def texts(self) -> list[str]:
        return [str(r["content"]) for r in self.replies]


async def one_round(url: str, batch: list[dict[str, object]], clients: int = 0) -> Round:
    """The requests to /completion, `clients` at a time (0: all at once)."""
    room = asyncio.Semaphore(clients or len(batch))
    async with httpx.AsyncClient(base_url=url, timeout=1800) as c:

        async def one(b: dict[str, object]) -> httpx.Response:
            async with room:
                return await c.post("/completion", json=b)

        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one(b) for b in batch))
        wall = time.perf_counter() - t0
    for r in rs:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
    replies = [r.json() for r in rs]
    return Round(wall, sum(int(j["tokens_predicted"]) for j in replies), replies)


def run_server(kind: str, args: argparse.Namespace, server: Path, port: int) -> dict[str, float]:
    """Starts one server, runs every scenario once on it; tok/s by scenario."""
    log = Path(args.work) / f"{kind}-{port}.log"
    with running(server_cmd(kind, args, server, port), port, log) as url:
        warm = bodies(args, "mixed")[: min(2, args.clients)]
        asyncio.run(one_round(url, [dict(b, n_predict=4) for b in warm]))
        out = {}
        for scenario in SCENARIOS:
            r = asyncio.run(one_round(url, bodies(args, scenario)))
            wall, n = r.wall, r.tokens
            out[scenario] = n / wall
            print(f"  {kind:12s} {scenario:5s} {n / wall:8.1f} tok/s ({n} tokens, {wall:.1f} s)",
                  flush=True)  # fmt: skip
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded SmolLM2)")
    p.add_argument("--lora", action="append", default=None,
                   help="an adapter, repeatable (default: the SmolLM2 fixtures)")  # fmt: skip
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--ctx", type=int, default=256, help="context per client")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="rounds per server (best is reported)")
    p.add_argument("--llama-bin", type=Path, default=SHARED / "llama.cpp" / "bin")
    p.add_argument("--only", choices=SERVERS, action="append", help="run one server only")
    args = p.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT / "src"))
        from graftlm.resources import default_model_path

        args.model = str(default_model_path())
    if args.lora is None:
        args.lora = [str(FIXTURES / f"{a}-f32.gguf") for a in ("pirate", "caps", "rand_all")]
    missing = [f for f in [args.model, *args.lora] if not Path(f).exists()]
    if missing:
        print(f"missing files: {missing}", file=sys.stderr)
        return 1
    kinds = args.only or list(SERVERS)
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        args.work = tmp
        server = llama_bin_copy(args.llama_bin, Path(tmp) / "llama-bin")
        print(f"{Path(args.model).name}, {len(args.lora)} adapters, {args.clients} clients x "
              f"{args.tokens} tokens, {args.threads} threads", flush=True)  # fmt: skip
        for rnd in range(args.rounds):
            order = kinds if rnd % 2 == 0 else kinds[::-1]  # alternated
            print(f"round {rnd + 1}", flush=True)
            for kind in order:
                results[kind].append(run_server(kind, args, server, 18600 + rnd * 10 + len(kind)))
    best = {k: {s: max(r[s] for r in rs) for s in SCENARIOS} for k, rs in results.items()}
    print()
    print(
        f"{'scenario':9s}" + "".join(f"{k:>14s}" for k in kinds) + ("   ratio" * (len(kinds) == 2))
    )
    for s in SCENARIOS:
        row = f"{s:9s}" + "".join(f"{best[k][s]:14.1f}" for k in kinds)
        if len(kinds) == 2:
            row += f"  {best['graftlm'][s] / best['llama-server'][s]:6.2f}x"
        print(row)
    for k in kinds:
        print(f"{k}: mixed/base {best[k]['mixed'] / best[k]['base']:.2f}, "
              f"same/base {best[k]['same'] / best[k]['base']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
