"""graftlm against llama.cpp's own llama-bench on the same file, alternated, in one run:

    python bench/vs_llama_cpp.py --llama-bench <llama.cpp>/bin/llama-bench -m MODEL.gguf \
        --rounds 2 -p 512 -n 128 -r 3

Each round runs `llama-bench -t 2` and `graftlm bench -t 2 --no-llama-cpp` one after the other
(the order flips every round); the table gives the median tokens per second of each over the
rounds and graftlm / llama.cpp. `-m` may be given several times (one table row per model and
test). Models of realistic sizes: `bench/real_shapes.py` (random weights, real shapes, llama.cpp's
quant mixes); `--write-1b DIR` writes the older Llama-3.2-1B-shaped Q4_0 file.

`--lora FILE` (once per `-m`, in their order; `-` for none) times that model with the adapter at
scale 1 on both sides: llama.cpp through `llama-server --lora FILE` (llama-bench takes no
adapters, and the llama-batched-bench of the build here ignores --lora: with a missing file it runs
at the rate of none; the server sits beside llama-bench in the same folder), graftlm through
`graftlm bench --lora FILE`.

`-d D [D ...]` runs every test again after D tokens of context (llama-bench's -d; llama.cpp with
flash attention on, its fast path at depth), `--cache-type` sets both sides' KV cache (-ctk/-ctv).

`--bandwidth` also measures the machine's read bandwidth (`bench/read_bandwidth.c`: 2 threads
streaming through 1 GiB, the best of 5) before every run and after the last, and, for each
decode test, the share of it each engine reaches: tokens/s x the bytes a token reads (every
tensor of the file except an untied embedding, of which a token reads one row, of a routed
tensor the experts a token uses, and with `--lora` the adapter's factors likewise; at a depth, plus
the keys and values of every position before it, the average over the test's steps) / the higher of
the two probes around that run; the median over the rounds, and their range.

Each `graftlm bench` builds the native library from the sources it imports, afresh whenever a
file there changed: to edit `src/` while a comparison runs, run it from a worktree of a commit
(`git worktree add --detach DIR REV`, then `PYTHONPATH=DIR/src python DIR/bench/vs_llama_cpp.py`),
or its runs measure a mix of revisions.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROW = re.compile(r"^\| [^|]+ \| \d+ \| \d+ \| (?P<test>\w+(?: @ d\d+)?) \|\s+(?P<tps>[\d.]+)")


def llama_cpp(
    bench: Path, model: str, p: int, n: int, r: int, depths: list[int], cache: str
) -> dict[str, float]:
    cmd = [
        str(bench),
        "-m",
        model,
        "-p",
        str(p),
        "-n",
        str(n),
        "-r",
        str(r),
        "-t",
        "2",
        "-o",
        "csv",
    ]
    if depths != [0] or cache != "f16":  # flash attention: llama.cpp's fast path at depth
        cmd += ["-d", ",".join(map(str, depths)), "-ctk", cache, "-ctv", cache, "-fa", "on"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = {}
    for row in csv.DictReader(io.StringIO(done.stdout)):
        test = f"pp{row['n_prompt']}" if row["n_prompt"] != "0" else f"tg{row['n_gen']}"
        depth = int(row.get("n_depth") or 0)
        out[test + (f" @ d{depth}" if depth else "")] = float(row["avg_ts"])
    return out


def llama_cpp_lora(bench: Path, model: str, lora: str, p: int, n: int, r: int) -> dict[str, float]:
    """llama-server's prompt and generation rates (one sequence, 2 threads, as llama-bench -t 2)
    with the adapter at scale 1, the prompt cache off: pp as p random token ids in one batch
    (prompt_n / prompt_ms, llama-bench's pp), tg as n tokens after a one-token prompt (the n - 1
    decodes its predicted_ms times, as llama-bench's tg at depth ~0); each the median of r
    requests after one that warms. llama-bench takes no adapters, and the llama-batched-bench of
    the build in /work/shared ignores --lora (a missing file runs, at the rate of no adapter)."""
    tool = bench.with_name("llama-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [str(tool), "-m", model, "--lora", lora, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", str(p + n + 16), "-np", "1", "-t", "2", "-tb", "2"]
    with tempfile.TemporaryFile("w+") as log:  # (a pipe left unread would block the server)
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
        try:
            _wait_healthy(server, url, cmd, log)
            rng = random.Random(0)
            pp: list[float] = []
            tg: list[float] = []
            for i in range(r + 1):
                t = _complete(url, [rng.randint(100, 20000) for _ in range(p)], 1)
                if t["prompt_n"] != p:
                    raise RuntimeError(
                        f"llama-server computed {t['prompt_n']} of {p} prompt tokens"
                    )
                u = _complete(url, [rng.randint(100, 20000)], n)
                if i > 0:  # (the first warms)
                    pp.append(1e3 * t["prompt_n"] / t["prompt_ms"])
                    tg.append(1e3 * (u["predicted_n"] - 1) / u["predicted_ms"])
            return {f"pp{p}": statistics.median(pp), f"tg{n}": statistics.median(tg)}
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _wait_healthy(server: subprocess.Popen[str], url: str, cmd: list[str], log: Any) -> None:
    """Until llama-server answers /health (its model loaded), or a RuntimeError with its log."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            break
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    log.seek(0)
    state = "exited" if server.poll() is not None else "not healthy after 300 s"
    raise RuntimeError(f"{' '.join(cmd)}: {state}:\n{log.read()[-2000:]}")


def _complete(url: str, prompt: list[int], n: int) -> dict[str, Any]:
    """One /completion of n tokens after `prompt` (token ids), greedy, no prompt cache: its timings."""
    body = {"prompt": prompt, "n_predict": n, "cache_prompt": False, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as r:
        return dict(json.load(r)["timings"])


def graftlm(
    model: str,
    p: int,
    n: int,
    r: int,
    lora: str | None = None,
    depths: list[int] | None = None,
    cache: str = "f16",
) -> dict[str, float]:
    cmd = [sys.executable, "-m", "graftlm", "bench", "--no-llama-cpp", "-t", "2", "-m", model]
    cmd += ["-p", str(p), "-n", str(n), "-r", str(r), "-ctk", cache]
    cmd += ["-d", *map(str, depths or [0])]
    if lora is not None:
        cmd += ["--lora", lora]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {
        m["test"]: float(m["tps"]) for line in done.stdout.splitlines() if (m := ROW.match(line))
    }


class Bandwidth:
    """Read bandwidth in bytes/s: bench/read_bandwidth.c (2 threads streaming through 1 GiB as
    64-bit words, vectorised for this CPU), built once with the system's C compiler; each
    measure() is the best of 5 passes."""

    def __init__(self, folder: Path) -> None:
        source = Path(__file__).resolve().with_name("read_bandwidth.c")
        self.exe = folder / "read_bandwidth"
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O3", "-march=native", "-pthread", str(source), "-o", str(self.exe)],
                       check=True)  # fmt: skip

    def measure(self) -> float:
        done = subprocess.run([str(self.exe), "2", "1024", "5"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{self.exe} failed ({done.returncode}): {done.stderr[-500:]}")
        return float(done.stdout.strip())


def token_bytes(model: str, lora: str | None = None) -> int:
    """The bytes one decode token reads: every tensor but an untied token embedding, and of a
    mixture of experts' routed tensors (`*_exps`) the share of the experts a token uses; with an
    adapter, its factors too, as the file holds them (float32 from bench/real_shapes.py, what
    llama.cpp reads; graftlm packs A as Q8_0 and B as bfloat16 on quantized projections, so it
    reads about half of that), a routed tensor's (`blk.N.ffn_*_exps.weight.lora_a`, stacked over
    the experts) at the same share."""
    from graftlm.gguf import GGUFFile

    f = GGUFFile(model)
    n_expert = f.get(f"{f.architecture}.expert_count", 0)
    share = f.get(f"{f.architecture}.expert_used_count", 0) / n_expert if n_expert else 1.0
    tied = "output.weight" not in f.tensors
    files = [(f, tied)] + ([(GGUFFile(lora), True)] if lora is not None else [])
    total = sum(
        e.nbytes * (share if "_exps." in name else 1.0)
        for g, keep_embd in files
        for name, e in g.tensors.items()
        if keep_embd or name != "token_embd.weight"
    )
    return int(total)


def kv_bytes(model: str, depth: int, n: int, cache: str) -> int:
    """The cache bytes one decode token of a tg`n` test at `depth` reads, on average over its n
    steps: keys and values of every layer at every position before it (the step at d + i reads
    d + i + 1). A sliding window is not counted (every layer is taken to read all positions)."""
    from graftlm.gguf import GGUFFile

    f = GGUFFile(model)
    arch = f.architecture
    n_layer, n_head = int(f.get(f"{arch}.block_count")), int(f.get(f"{arch}.attention.head_count"))
    n_kv = int(f.get(f"{arch}.attention.head_count_kv", n_head))
    d_k = int(f.get(f"{arch}.attention.key_length", f.get(f"{arch}.embedding_length") // n_head))
    d_v = int(f.get(f"{arch}.attention.value_length", d_k))
    per_value = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}[cache]
    positions = depth + (n + 1) / 2
    return int(n_layer * n_kv * (d_k + d_v) * per_value * positions)


def write_1b(folder: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf import GGMLQuantizationType as Q
    from tiny_models import TinySpec, write_tiny_model

    spec = TinySpec(n_embd=2048, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192, n_layer=16,
                    n_ctx=2048, qtype=Q.Q4_0, embd_type=Q.Q4_0)  # fmt: skip
    return write_tiny_model(folder / "llama1b-q4_0.gguf", spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument("-m", "--model", action="append", required=False)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-d", type=int, nargs="+", default=[0], help="depths, as llama-bench's -d")
    ap.add_argument(
        "--cache-type",
        default="f16",
        choices=["f16", "bf16", "f32", "q8_0"],
        help="the KV cache type of both (-ctk/-ctv)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write-1b", type=Path, metavar="DIR")
    ap.add_argument("--bandwidth", action="store_true", help="measure read bandwidth too")
    ap.add_argument("--lora", action="append", help="an adapter per -m, in order ('-': none)")
    args = ap.parse_args()
    loras = args.lora or ["-"] * len(args.model or [])
    if len(loras) != len(args.model or []):
        ap.error(f"--lora given {len(loras)} times for {len(args.model or [])} models")
    if any(x != "-" for x in loras) and (args.d != [0] or args.cache_type != "f16"):
        ap.error("--lora times llama.cpp through llama-server at depth 0 with an f16 cache: "
                 "-d and --cache-type are not passed to it")  # fmt: skip
    if args.write_1b:
        print(write_1b(args.write_1b))
        return
    with tempfile.TemporaryDirectory() as tmp:
        probe = Bandwidth(Path(tmp)) if args.bandwidth else None
        rows, probes = compare(args, loras, probe)
    print(f"2 threads, {args.rounds} rounds alternated, median t/s")
    if probes:
        print(f"read bandwidth, {len(probes)} probes between the runs: "
              f"{min(probes) / 1e9:.1f} to {max(probes) / 1e9:.1f} GB/s")  # fmt: skip
    print()
    head = "| model | test | llama.cpp | graftlm | graftlm / llama.cpp |"
    print(head + (" bytes/token | llama.cpp % bw | graftlm % bw |" if probes else ""))
    print("|" + " --- |" * (8 if probes else 5))
    for name, test, a, b, nbytes, shares in rows:
        line = f"| {name} | {test} | {a:.1f} | {b:.1f} | {b / a:.2f} |"
        if probes:
            if test.startswith("tg"):
                line += f" {nbytes / 2**20:.0f} MiB | {shares[0]} | {shares[1]} |"
            else:
                line += " | | |"
        print(line)


def compare(
    args: argparse.Namespace, loras: list[str], probe: Bandwidth | None
) -> tuple[list[tuple[str, str, float, float, int, tuple[str, ...]]], list[float]]:
    """Every model's rounds, alternated; with a probe, the read bandwidth measured before every
    run and after the last. Each run's share of the bandwidth is taken against the higher of the
    two probes around it (the machine's bandwidth drifts by a fifth within minutes here), and a
    row gives the median share over the rounds and their range."""
    probes: list[float] = [probe.measure()] if probe else []
    rows = []
    for model, lora_arg in zip(args.model, loras, strict=True):
        lora = None if lora_arg == "-" else lora_arg
        runs: dict[str, list[dict[str, float]]] = {"llama.cpp": [], "graftlm": []}
        bw: dict[str, list[float]] = {"llama.cpp": [], "graftlm": []}  # each run's bandwidth
        for i in range(args.rounds):
            for who in ("llama.cpp", "graftlm") if i % 2 == 0 else ("graftlm", "llama.cpp"):
                if who == "graftlm":
                    runs[who].append(graftlm(model, args.p, args.n, args.r, lora, args.d,
                                             args.cache_type))  # fmt: skip
                elif lora is None:
                    runs[who].append(llama_cpp(args.llama_bench, model, args.p, args.n, args.r,
                                               args.d, args.cache_type))  # fmt: skip
                else:
                    runs[who].append(
                        llama_cpp_lora(args.llama_bench, model, lora, args.p, args.n, args.r)
                    )
                if probe:
                    probes.append(probe.measure())
                    bw[who].append(max(probes[-2:]))
        name = Path(model).name + ("" if lora is None else f" + {Path(lora).name}")
        weights = token_bytes(model, lora)
        for test in runs["graftlm"][0]:
            a = statistics.median(r[test] for r in runs["llama.cpp"])
            b = statistics.median(r[test] for r in runs["graftlm"])
            depth = int(test.split(" @ d")[1]) if " @ d" in test else 0
            nbytes = weights + kv_bytes(model, depth, args.n, args.cache_type)
            shares = tuple(
                _share([r[test] * nbytes / w for r, w in zip(runs[who], bw[who], strict=True)])
                if probe
                else ""
                for who in ("llama.cpp", "graftlm")
            )
            rows.append((name, test, a, b, nbytes, shares))
    return rows, probes


def _share(xs: list[float]) -> str:
    """The runs' median share of the bandwidth and, over several runs, their range, in percent."""
    mid = f"{100 * statistics.median(xs):.0f}%"
    return mid if len(xs) < 2 else f"{mid} ({100 * min(xs):.0f}-{100 * max(xs):.0f})"


if __name__ == "__main__":
    main()
