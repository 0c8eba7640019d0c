"""Two source trees of graftlm side by side: `graftlm bench` from each in turn (A B B A ...), the
median tokens per second of every test and the ratio B / A. For checking that a change keeps
its speed ("unchanged within noise"), against the commit before it:

    git worktree add --detach ../before HEAD~1
    python bench/ab_revisions.py ../before/src src --rounds 4 -- -p 512 -n 128 -r 2

Everything after `--` goes to `graftlm bench` (model, adapters, lengths). Each tree compiles
its own native library (the cache is keyed by the source). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROW = re.compile(
    r"^\| (?P<model>[^|]+) \| (?P<ad>\d+) \| \d+ \| (?P<test>\w+(?: @ d\d+)?) \|\s+(?P<tps>[\d.]+)"
)


def run(src: Path, bench_args: list[str]) -> dict[tuple[str, str, str], float]:
    env = {**os.environ, "PYTHONPATH": str(src.resolve())}
    done = subprocess.run(
        [sys.executable, "-m", "graftlm", "bench", "--no-llama-cpp", *bench_args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    out = {}
    for line in done.stdout.splitlines():
        m = ROW.match(line)
        if m:
            out[(m["model"].strip(), m["ad"], m["test"])] = float(m["tps"])
    if not out:
        raise SystemExit(f"no results from {src}:\n{done.stdout}\n{done.stderr}")
    return out


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="the src/ folder of the first tree (the baseline)")
    ap.add_argument("b", type=Path, help="the src/ folder of the second tree")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[tuple[str, str, str], float]]] = {"a": [], "b": []}
    for i in range(args.rounds):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        for which in order:
            runs[which].append(run(getattr(args, which), rest))
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    print(f"A = {args.a}, B = {args.b}, {args.rounds} rounds alternated; median t/s\n")
    print("| model | adapters | test | A t/s | B t/s | B / A |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key in runs["a"][0]:
        a = statistics.median(r[key] for r in runs["a"])
        b = statistics.median(r[key] for r in runs["b"])
        print(f"| {key[0]} | {key[1]} | {key[2]} | {a:.1f} | {b:.1f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
