"""graftlm against llama.cpp's own llama-bench on the same file, alternated, in one run:

    python bench/vs_llama_cpp.py --llama-bench <llama.cpp>/bin/llama-bench -m MODEL.gguf \
        --rounds 2 -p 512 -n 128 -r 3

Each round runs `llama-bench -t 2` and `graftlm bench -t 2 --no-llama-cpp` one after the other
(the order flips every round); the table gives the median tokens per second of each over the
rounds and graftlm / llama.cpp. A model of a realistic size: `python bench/vs_llama_cpp.py
--write-1b DIR` writes a random-weight Llama-3.2-1B-shaped Q4_0 file with the tests' writer.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROW = re.compile(r"^\| [^|]+ \| \d+ \| \d+ \| (?P<test>\w+) \|\s+(?P<tps>[\d.]+)")


def llama_cpp(bench: Path, model: str, p: int, n: int, r: int) -> dict[str, float]:
    done = subprocess.run(
        [str(bench), "-m", model, "-p", str(p), "-n", str(n), "-r", str(r), "-t", "2", "-o", "csv"],
        capture_output=True,
        text=True,
        check=True,
    )
    out = {}
    for row in csv.DictReader(io.StringIO(done.stdout)):
        test = f"pp{row['n_prompt']}" if row["n_prompt"] != "0" else f"tg{row['n_gen']}"
        out[test] = float(row["avg_ts"])
    return out


def graftlm(model: str, p: int, n: int, r: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "graftlm", "bench", "--no-llama-cpp", "-t", "2", "-m", model]
    cmd += ["-p", str(p), "-n", str(n), "-r", str(r)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ)
    return {
        m["test"]: float(m["tps"]) for line in done.stdout.splitlines() if (m := ROW.match(line))
    }


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
    ap.add_argument("-m", "--model")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write-1b", type=Path, metavar="DIR")
    args = ap.parse_args()
    if args.write_1b:
        print(write_1b(args.write_1b))
        return
    runs: dict[str, list[dict[str, float]]] = {"llama.cpp": [], "graftlm": []}
    for i in range(args.rounds):
        for who in ("llama.cpp", "graftlm") if i % 2 == 0 else ("graftlm", "llama.cpp"):
            if who == "llama.cpp":
                runs[who].append(llama_cpp(args.llama_bench, args.model, args.p, args.n, args.r))
            else:
                runs[who].append(graftlm(args.model, args.p, args.n, args.r))
    print(f"{Path(args.model).name}, 2 threads, {args.rounds} rounds alternated, median t/s\n")
    print("| test | llama.cpp | graftlm | graftlm / llama.cpp |")
    print("| --- | --- | --- | --- |")
    for test in runs["graftlm"][0]:
        a = statistics.median(r[test] for r in runs["llama.cpp"])
        b = statistics.median(r[test] for r in runs["graftlm"])
        print(f"| {test} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
