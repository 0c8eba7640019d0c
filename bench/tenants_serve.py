"""Many tenants in one batch, served: K distinct adapters among R registered, base beside them,
llama-server beside graftlm on the same traffic.

For each model shape (a GGUF `DIR/{shape}-{mix}.gguf`, as bench/real_shapes.py writes it), one
graftlm server runs throughout, with R adapters registered by name (`--lora-modules`): the
shape's rank-16 adapters on all seven projections (`DIR/{shape}-lora-r16[-sN].gguf`, written with
real_shapes.write_adapter where missing), t0 ... t{K-1}, as many as the largest K, and idle
ones making up the rest (rank 4 on q and v, `DIR/tenants-idle/{shape}/`, written where missing)
that the traffic never names. `--max-loras` holds every adapter the traffic names, so after a
warm-up that attaches them no request waits for an attach. For each K (`--distinct`) and each
client count C (`--clients`), N requests (C, or the smallest multiple of C that names all K
adapters: 64 at C=16, K=64), C at a time, each TOKENS greedy tokens of its own prompt (the end
token ignored):

    base    every request on the base model
    mixed   request i on adapter i mod K (graftlm: named as its `model`; llama-server: its `lora`
            field, id i mod K at scale 1): a step holds min(C, K) distinct adapters

llama-server loads every adapter it serves at start (`--lora-scaled FILE:0`, a request's `lora`
picks), so it is started once per K with only the K adapters of that row. Each round runs the
four (graftlm base, graftlm mixed, llama-server base, llama-server mixed) in one order and the
next round in the reverse (alternated). Then, untimed, graftlm's first batch of the cell (base,
then mixed) again with each token's log-probability (`n_probs`), and `--check` of its mixed
requests alone, one at a time: each must choose the same tokens as in the batch (greedy; the
largest log-probability difference printed), and the mixed batch must differ from the base's
(the adapters act: the first token's largest log-probability change printed).

Printed: a markdown table per model, tokens per second generated (all requests together) of each
server on each traffic, the best or median round (`--stat`), graftlm's mixed/base and graftlm
mixed / llama-server mixed (the issue's targets: mixed/base >= 0.85 at 16 distinct, >= 0.75 at
64; mixed >= 3x llama-server's mixed).

    .venv/bin/python bench/tenants_serve.py --dir DIR              # Llama-1B and Qwen2.5-1.5B, the issue's matrix
    .venv/bin/python bench/tenants_serve.py --dir DIR --write-only # only write the missing adapters
    .venv/bin/python bench/tenants_serve.py --dir DIR --shape llama-1b --distinct 1 4 --clients 4 \\
        --tokens 8 --rounds 1 --registered 16                       # a smoke run

Run it on a quiet machine: the issue's matrix at the defaults takes about two hours (estimated
from the issue's figures; --tokens 32 --rounds 1 about half an hour). The exit status is 1 where
an answer alone differed from the batch's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from kv_capacity import rss_mib
from prometheus_client.parser import text_string_to_metric_families
from real_shapes import SHAPES, write_adapter
from serve_bench import SHARED, body, llama_bin_copy, one_round, running, server_cmd
from tiny_models import write_tiny_adapter  # real_shapes put tests/ on the path

SERVERS = ("graftlm", "llama-server")
TRAFFIC = ("base", "mixed")
Cell = tuple[int, int]  # (clients, distinct)


def active_adapters(folder: Path, shape: str, n: int) -> list[Path]:
    """The shape's first n rank-16 adapters on every projection, written where missing."""
    out = []
    for seed in range(1, n + 1):
        path = folder / f"{shape}-lora-r16{'' if seed == 1 else f'-s{seed}'}.gguf"
        if not path.exists():
            t0 = time.perf_counter()
            write_adapter(folder, shape, seed=seed)
            print(f"  wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
        out.append(path)
    return out


def idle_adapters(folder: Path, shape: str, n: int) -> list[Path]:
    """n small adapters of the shape (rank 4 on q and v, float32), written where missing."""
    s = SHAPES[shape]
    targets = {}
    for i in range(s.n_layer):
        targets[f"blk.{i}.attn_q"] = (s.d, s.n_head * s.head_dim)
        targets[f"blk.{i}.attn_v"] = (s.d, s.n_head_kv * s.head_dim)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(n):
        path = folder / f"idle-r4-{k}.gguf"
        if not path.exists():
            write_tiny_adapter(path, targets=targets, rank=4, arch=s.arch, seed=1000 + k)
        out.append(path)
    return out


def steps(reply: dict[str, Any]) -> list[tuple[int, float]]:
    """The tokens of a /completion answer asked with n_probs, each with its log-probability."""
    return [(int(p["id"]), float(p["logprob"])) for p in reply["completion_probabilities"]]


def gauge(url: str, name: str) -> float:
    """A gauge of the server's /metrics."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name == name:
            return float(family.samples[0].value)
    return float("nan")


def cpu_flags() -> str:
    words = Path("/proc/cpuinfo").read_text().split()
    return " ".join(sorted({w for w in words if w.startswith(("avx512", "amx"))})) or "none"


class Matrix:
    """One model's runs: tok/s by (server, traffic, cell), one figure a round."""

    def __init__(
        self, args: Namespace, model: Path, active: list[Path], idle: list[Path], port: int
    ) -> None:
        self.args, self.model, self.active, self.idle = args, model, active, idle
        self.port = port  # graftlm's; llama-server's the next ones
        self.tps: dict[tuple[str, str, Cell], list[float]] = {}
        # (cell, request, same tokens alone as in the batch, largest log-probability difference)
        self.checks: list[tuple[Cell, int, bool, float]] = []
        # the probe batch's answers unlike the base's, of how many, the first token's largest
        # log-probability change from the base's
        self.effect: dict[Cell, tuple[int, int, float]] = {}

    @staticmethod
    def requests(clients: int, k: int) -> int:
        """The cell's requests: one batch of C, or as many whole batches as name all K."""
        return clients * -(-k // clients)

    def traffic(self, kind: str, traffic: str, clients: int, k: int) -> list[dict[str, object]]:
        out = []
        for i in range(self.requests(clients, k)):
            b = body(i, self.args.tokens)
            if traffic == "mixed" and kind == "graftlm":
                b["model"] = f"t{i % k}"
            elif traffic == "mixed":
                b["lora"] = [{"id": i % k, "scale": 1.0}]
            out.append(b)
        return out

    def cmd(self, kind: str, server: Path, port: int, lora: list[Path]) -> list[str]:
        a = self.args
        ns = Namespace(model=str(self.model), clients=max(a.clients), ctx=a.ctx,
                       threads=a.threads, lora=[str(p) for p in lora])  # fmt: skip
        return server_cmd(kind, ns, server, port)

    def run(self, server: Path, work: Path) -> None:
        a = self.args
        names = [f"t{i}={p}" for i, p in enumerate(self.active)]
        names += [f"idle{i}={p}" for i, p in enumerate(self.idle)]
        cmd = self.cmd("graftlm", server, self.port, [])
        cmd += ["--max-loras", str(a.max_loras), "--lora-modules", *names]
        pid_file = work / "graftlm.pid"
        with running(
            cmd, self.port, work / f"graftlm-{self.model.stem}.log", pid_file=pid_file
        ) as g:
            pid = int(pid_file.read_text())
            warm = [body(i, 4) for i in range(max(a.clients))]
            asyncio.run(one_round(g, warm))  # the first full-width batch is several times slower
            print(f"graftlm up, {rss_mib(pid):.0f} MiB resident", flush=True)
            for k in a.distinct:
                t0 = time.perf_counter()
                attach = [dict(body(i, 1), model=f"t{i}") for i in range(k)]
                asyncio.run(one_round(g, attach, max(a.clients)))
                held = gauge(g, "graftlm_lora_adapter_bytes") / 2**20
                print(f"distinct {k}: t0..t{k - 1} attached (graftlm, {time.perf_counter() - t0:.1f} s "
                      f"for the new ones), {rss_mib(pid):.0f} MiB resident, {held:.0f} MiB of "
                      f"them the adapters' (/metrics)", flush=True)  # fmt: skip
                if a.no_llama_server:
                    self.rounds(k, {"graftlm": g})
                    continue
                port = self.port + 1 + k
                cmd = self.cmd("llama-server", server, port, self.active[:k])
                with running(cmd, port, work / f"llama-{self.model.stem}-{k}.log") as ls:
                    warm = self.traffic("llama-server", "mixed", max(a.clients), k)
                    asyncio.run(one_round(ls, [dict(b, n_predict=2) for b in warm]))
                    self.rounds(k, {"graftlm": g, "llama-server": ls})

    def rounds(self, k: int, urls: dict[str, str]) -> None:
        a = self.args
        runs = [(kind, t) for kind in urls for t in TRAFFIC]
        for rnd in range(a.rounds):
            for clients in a.clients:
                for kind, t in runs if rnd % 2 == 0 else runs[::-1]:
                    bodies = self.traffic(kind, t, clients, k)
                    r = asyncio.run(one_round(urls[kind], bodies, clients))
                    self.tps.setdefault((kind, t, (clients, k)), []).append(r.tokens / r.wall)
                    print(f"  round {rnd + 1} C={clients:<3d} K={k:<3d} {kind:12s} {t:5s} "
                          f"{r.tokens / r.wall:8.1f} tok/s ({r.tokens} tokens, {r.wall:.1f} s)",
                          flush=True)  # fmt: skip
        for clients in a.clients:
            self.check((clients, k), urls["graftlm"])

    def check(self, cell: Cell, url: str) -> None:
        """Untimed: graftlm's first batch of the cell's traffic (base, then mixed) again with
        each token's log-probability, and `--check` of its mixed requests (spread over the
        adapters) alone: each must choose the same tokens as in the batch."""
        clients, k = cell

        def probe(t: str) -> list[list[tuple[int, float]]]:
            batch = [dict(b, n_probs=1) for b in self.traffic("graftlm", t, clients, k)[:clients]]
            return [steps(r) for r in asyncio.run(one_round(url, batch)).replies]

        base, mixed = probe("base"), probe("mixed")
        shift = max(abs(m[0][1] - b[0][1]) for b, m in zip(base, mixed, strict=True))
        changed = sum(
            [t for t, _ in b] != [t for t, _ in m] for b, m in zip(base, mixed, strict=True)
        )
        self.effect[cell] = (changed, len(mixed), shift)
        bodies = self.traffic("graftlm", "mixed", clients, k)
        for i in sorted({j * clients // self.args.check for j in range(self.args.check)}):
            alone = steps(asyncio.run(one_round(url, [dict(bodies[i], n_probs=1)])).replies[0])
            same = [t for t, _ in alone] == [t for t, _ in mixed[i]]
            diff = max(abs(x - y) for (_, x), (_, y) in zip(alone, mixed[i], strict=False))
            self.checks.append((cell, i, same, diff))
            if not same:
                print(f"  MISMATCH C={clients} K={k} request {i} (t{i % k}): tokens in the batch "
                      f"{[t for t, _ in mixed[i]]}, alone {[t for t, _ in alone]}", flush=True)  # fmt: skip

    def table(self, stat: Callable[[list[float]], float]) -> list[str]:
        a = self.args
        both = not a.no_llama_server
        head = ["clients", "distinct", "requests", "graftlm base", "graftlm mixed", "mixed/base"]
        if both:
            head += ["llama-server base", "llama-server mixed", "graftlm / llama-server mixed"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for clients in a.clients:
            for k in a.distinct:
                f = {(s, t): stat(self.tps[(s, t, (clients, k))]) for s in (SERVERS[: 1 + both])
                     for t in TRAFFIC}  # fmt: skip
                row = [str(clients), str(k), str(self.requests(clients, k)),
                       f"{f['graftlm', 'base']:.1f}", f"{f['graftlm', 'mixed']:.1f}",
                       f"{f['graftlm', 'mixed'] / f['graftlm', 'base']:.2f}"]  # fmt: skip
                if both:
                    ls = f["llama-server", "mixed"]
                    row += [f"{f['llama-server', 'base']:.1f}", f"{ls:.1f}",
                            f"{f['graftlm', 'mixed'] / ls:.2f}x"]  # fmt: skip
                lines.append("| " + " | ".join(row) + " |")
        return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", action="append", choices=sorted(SHAPES),
                   help="model shape, repeatable (default: llama-1b and qwen2.5-1.5b)")  # fmt: skip
    p.add_argument("--mix", default="q4_k_m", help="the model file's quant mix")
    p.add_argument("--dir", type=Path, required=True,
                   help="where the models and adapters are (bench/real_shapes.py's folder; "
                        "missing adapters written here)")  # fmt: skip
    p.add_argument("--registered", type=int, default=256, help="adapters registered by name")
    p.add_argument("--distinct", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--clients", type=int, nargs="+", default=[16, 32])
    p.add_argument("--max-loras", type=int, default=None,
                   help="graftlm's resident bound (default: the largest --distinct)")  # fmt: skip
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--ctx", type=int, default=256, help="context per client")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stat", choices=("best", "median"), default="best",
                   help="which round's tok/s is reported")  # fmt: skip
    p.add_argument("--check", type=int, default=2, help="mixed answers asked again alone, a cell")
    p.add_argument("--llama-bin", type=Path, default=SHARED / "llama.cpp" / "bin")
    p.add_argument("--no-llama-server", action="store_true", help="graftlm's columns only")
    p.add_argument("--write-only", action="store_true", help="write the missing adapters, stop")
    p.add_argument("--port", type=int, default=18800)
    args = p.parse_args()
    shapes = args.shape or ["llama-1b", "qwen2.5-1.5b"]
    most = max(args.distinct)
    args.max_loras = args.max_loras or most
    if args.registered < most:
        p.error(f"--registered {args.registered}: fewer than --distinct {most}")
    models = {s: args.dir / f"{s}-{args.mix}.gguf" for s in shapes}
    missing = [str(m) for m in models.values() if not m.exists()]
    if missing:
        print(f"missing models {missing}: bench/real_shapes.py {args.dir} --shape SHAPE "
              f"--mix {args.mix} writes one", file=sys.stderr)  # fmt: skip
        return 1
    adapters = {}
    for s in shapes:
        t0 = time.perf_counter()
        active = active_adapters(args.dir, s, most)
        idle = idle_adapters(args.dir / "tenants-idle" / s, s, args.registered - most)
        adapters[s] = (active, idle)
        mib = [f.stat().st_size / 2**20 for f in (active[0], *idle[:1])]
        print(f"{s}: {len(active)} rank-16 adapters on every projection ({mib[0]:.0f} MiB each) "
              f"and {len(idle)} idle rank-4 ones on q and v ({mib[-1]:.1f} MiB each) ready in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    if args.write_only:
        return 0
    stat = max if args.stat == "best" else statistics.median
    print(f"CPU: {cpu_flags()}; {args.threads} threads; {args.tokens} tokens a request; "
          f"{args.rounds} rounds, alternated, the {args.stat} reported; graftlm: {args.registered} "
          f"registered, --max-loras {args.max_loras} (every adapter the traffic names stays "
          f"resident; a step holds min(clients, distinct)); llama-server: only the row's K "
          f"adapters loaded (--lora-scaled FILE:0, a request's lora field picks)", flush=True)  # fmt: skip
    tables = []
    ok = checks = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = llama_bin_copy(args.llama_bin, work / "llama-bin")
        for j, s in enumerate(shapes):
            print(f"\n## {models[s].name}", flush=True)
            m = Matrix(args, models[s], *adapters[s], port=args.port + 200 * j)
            try:
                m.run(server, work)
            except (RuntimeError, httpx.HTTPError):
                for log in sorted(work.glob("*.log")):  # the servers' last words
                    print(f"--- {log.name}", *log.read_text().splitlines()[-15:], sep="\n")
                raise
            tables.append((models[s].name, m))
    for name, m in tables:
        print(f"\n### {name}: {args.registered} registered, tok/s ({args.stat} of {args.rounds} "
              f"rounds), {args.tokens} tokens a request\n")  # fmt: skip
        print("\n".join(m.table(stat)))
        acts = ", ".join(f"C={c} K={k}: {d}/{n}, {x:.3f}" for (c, k), (d, n, x) in m.effect.items())
        print(f"\nthe adapters act (graftlm's mixed batch against its base batch: answers that "
              f"differ, the first token's largest log-probability change): {acts}")  # fmt: skip
        ok += sum(same for _, _, same, _ in m.checks)
        checks += len(m.checks)
        worst = max((d for *_, d in m.checks), default=float("nan"))
        print(f"graftlm mixed answers asked again alone: {sum(c[2] for c in m.checks)} of "
              f"{len(m.checks)} the same tokens as in the batch, log-probabilities within "
              f"{worst:.1e}")  # fmt: skip
    return 0 if ok == checks else 1


if __name__ == "__main__":
    sys.exit(main())
