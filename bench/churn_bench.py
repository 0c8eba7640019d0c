"""Many adapters registered, a few resident: traffic that churns adapters through the resident set.

Writes R small adapters (rank 4 on q and v of the default model, SmolLM2: 0.9 MB each in float32)
into a temporary folder, registers them all with one graftlm server (`--lora-modules`, with
`--max-loras S`: at most S attached at once, the least recently used evicted), and sends the same
traffic three times, in turn each round: U requests, C at a time, each N greedy tokens of its own
prompt,

    base    every request on the base model
    churn   request i on adapter i mod U (named as the request's `model`): U adapters churn
            through S slots, each attached on first use (read, checked and packed in a worker
            thread, one read at a time), evicted when the room is needed
    mixed   request i on the i mod S-th of the S adapters churn named last, resident after it:
            as many distinct adapters in a batch as churn has, none loaded (churn / mixed is
            what the loads themselves cost; mixed / base what a batch of distinct adapters does)

then asks again, one request at a time, for the answers of some churn requests: each must equal
what it was in the batch, and last, one request at a time on an idle server, for adapters the
traffic never named (cold attaches alone). Printed: each round's seconds and churn / base (each
churn round over the base round before it, and their median: the machine's load drifts less
within a pair), the cold-load time of an attach from the server's /metrics
(graftlm_lora_adapter_load_seconds: median and 95th percentile, interpolated within its
buckets) under the churn traffic and alone, apart from the time it waited for room or for the
reads ahead of it (graftlm_lora_adapter_wait_seconds), how many loads, and the server's resident
memory.

    .venv/bin/python bench/churn_bench.py                       # 1,000 registered, 64 used, 16 slots
    .venv/bin/python bench/churn_bench.py --registered 300 --used 64 --max-loras 16
    .venv/bin/python bench/churn_bench.py --src /tmp/old/src   # another revision's server

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from kv_capacity import rss_mib
from prometheus_client.parser import text_string_to_metric_families
from serve_bench import one_round, running

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import write_tiny_adapter  # noqa: E402

# SmolLM2-135M: 30 layers, n_embd 576, 3 KV heads of 64
LAYERS, N_EMBD, N_KV = 30, 576, 192


def write_adapters(folder: Path, n: int) -> list[Path]:
    targets = {}
    for i in range(LAYERS):
        targets[f"blk.{i}.attn_q"] = (N_EMBD, N_EMBD)
        targets[f"blk.{i}.attn_v"] = (N_EMBD, N_KV)
    return [
        write_tiny_adapter(folder / f"a{s}.gguf", targets=targets, rank=4, arch="llama", seed=s + 1)
        for s in range(n)
    ]


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile: linear within the bucket that holds the q-th value."""
    total = buckets[-1][1]
    if total == 0:
        return float("nan")
    want, lo, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= want:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (want - below) / max(count - below, 1e-9)
        lo, below = le, count
    return lo


def histogram(url: str, name: str) -> list[tuple[float, float]]:
    """A histogram of the server's /metrics: its cumulative buckets (upper bound, count)."""
    page = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(page):
        if family.name == name:
            return [(float(s.labels["le"]), s.value) for s in family.samples
                    if s.name == name + "_bucket"]  # fmt: skip
    return [(float("inf"), 0.0)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--registered", type=int, default=1000)
    p.add_argument("--used", type=int, default=64, help="adapters the churn traffic names")
    p.add_argument("--max-loras", type=int, default=16)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--check", type=int, default=8, help="churn answers asked again, alone")
    p.add_argument("--alone", type=int, default=16, help="cold attaches alone, on an idle server")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=18700)
    p.add_argument("--log", type=Path, help="the server's output (default: nowhere)")
    p.add_argument("--src", type=Path, help="the graftlm sources the server runs (default: this "
                   "checkout's src/): another revision's for an A/B, e.g. from "
                   "`git archive REV src | tar -x -C DIR` (then DIR/src)")  # fmt: skip
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        paths = write_adapters(folder, args.registered)
        size = paths[0].stat().st_size / 2**20
        print(f"{args.registered} adapters of {size:.2f} MiB written in "
              f"{time.perf_counter() - t0:.0f} s; {args.used} used, {args.max_loras} slots, "
              f"{args.clients} clients x {args.tokens} tokens")  # fmt: skip
        modules = [f"a{i}={p}" for i, p in enumerate(paths)]
        pid_file = folder / "pid"
        # (env: running() points PYTHONPATH at this checkout's src/; `env` execs, same process)
        src = [] if args.src is None else ["env", f"PYTHONPATH={args.src.resolve()}"]
        cmd = [*src, sys.executable, "-m", "graftlm", "serve", "--host", "127.0.0.1",
               "--port", str(args.port), "-np", str(args.clients), "-t", str(args.threads),
               "-c", str(args.clients * 256), "--max-loras", str(args.max_loras),
               "--lora-modules", *modules]  # fmt: skip
        rng = np.random.default_rng(0)
        words = ["sea", "ship", "storm", "island", "sail", "map", "gold", "wind", "star", "crew"]

        def body(i: int, model: str | None) -> dict[str, object]:
            prompt = " ".join(rng.choice(words, 6)) + f" ({i})"
            b: dict[str, object] = {"prompt": prompt, "n_predict": args.tokens,
                                    "temperature": 0, "ignore_eos": True, "cache_prompt": False}  # fmt: skip
            if model is not None:
                b["model"] = model
            return b

        base = [body(i, None) for i in range(args.used)]
        churn = [dict(b, model=f"a{i % args.used}") for i, b in enumerate(base)]
        # the last adapters the churn traffic named, resident after it: distinct adapters in
        # every batch as in churn, none loaded
        last = range(max(args.used - args.max_loras, 0), args.used)
        mixed = [dict(b, model=f"a{last[i % len(last)]}") for i, b in enumerate(base)]
        with running(cmd, args.port, args.log, pid_file=pid_file) as url:
            pid = int(pid_file.read_text())
            print(f"server up: {rss_mib(pid):.0f} MiB resident")
            # warm: a whole batch (the first one at full width is several times slower)
            asyncio.run(one_round(url, base[: args.clients], args.clients))
            times: dict[str, list[float]] = {"base": [], "churn": [], "mixed": []}
            texts: list[str] = []
            for rnd in range(args.rounds):
                for name, bodies in (("base", base), ("churn", churn), ("mixed", mixed)):
                    t0 = time.perf_counter()
                    got = asyncio.run(one_round(url, bodies, args.clients)).texts
                    times[name].append(time.perf_counter() - t0)
                    if name == "churn" and rnd == 0:
                        texts = got
                    print(f"  round {rnd + 1} {name:5s} {times[name][-1]:6.1f} s", flush=True)
            buckets = histogram(url, "graftlm_lora_adapter_load_seconds")  # (mixed: none)
            waits = histogram(url, "graftlm_lora_adapter_wait_seconds")
            alone = [asyncio.run(one_round(url, [churn[i]], 1)).texts[0] for i in range(args.check)]
            same = sum(a == b for a, b in zip(alone, texts, strict=False))
            before = histogram(url, "graftlm_lora_adapter_load_seconds")
            fresh = range(args.used, min(args.used + args.alone, args.registered))
            for i in fresh:
                asyncio.run(one_round(url, [dict(base[0], model=f"a{i}", n_predict=1)], 1))
            after = histogram(url, "graftlm_lora_adapter_load_seconds")
            idle = [(le, n - m) for (le, n), (_, m) in zip(after, before, strict=True)]
            rss = rss_mib(pid)
        b, c = min(times["base"]), min(times["churn"])
        pairs = [c / b for b, c in zip(times["base"], times["churn"], strict=True)]
        print(f"base {b:.1f} s, churn {c:.1f} s: churn / base {c / b:.2f} (best round each); "
              f"per pair {', '.join(f'{r:.2f}' for r in pairs)}: median "
              f"{float(np.median(pairs)):.2f}")  # fmt: skip
        mix = [c / m for m, c in zip(times["mixed"], times["churn"], strict=True)]
        print(f"mixed (the last {len(last)} adapters, resident) / base: median "
              f"{float(np.median([m / b for b, m in zip(times['base'], times['mixed'], strict=True)])):.2f}; "
              f"churn / mixed per round {', '.join(f'{r:.2f}' for r in mix)}: median "
              f"{float(np.median(mix)):.2f} (what the loads themselves cost)")  # fmt: skip
        print(f"cold loads under the churn traffic: {buckets[-1][1]:.0f}, each read, packed and "
              f"attached in a median {quantile(buckets, 0.5) * 1000:.0f} ms "
              f"(p95 {quantile(buckets, 0.95) * 1000:.0f}), after waiting for room a median "
              f"{quantile(waits, 0.5) * 1000:.0f} ms (p95 {quantile(waits, 0.95) * 1000:.0f})")  # fmt: skip
        print(f"cold loads alone (idle server): {idle[-1][1]:.0f}, a median "
              f"{quantile(idle, 0.5) * 1000:.0f} ms (p95 {quantile(idle, 0.95) * 1000:.0f}); "
              f"resident memory {rss:.0f} MiB")  # fmt: skip
        print(f"answers asked again alone: {same} of {len(alone)} equal to the batch's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
