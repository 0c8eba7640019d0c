"""One decode step on two builds of the native library in one process, swapped step by step.

On this VM whole processes timed one after the other move by 10-30% with the machine (two runs
of the same build differ more than most changes do); swapping the library under one loaded model
between steps cancels most of it. The layers' one native call and the head's product go to
library A or B; each measured step follows `--warm` unmeasured ones on the same build.

    python bench/step_ab.py --model DIR/llama-1b-q4_k_m.gguf --a A.so --b B.so --rows 16 \\
        --steps 60 --threads 2

A library is the .so a source tree builds (`python -c "from graftlm.native import build;
print(build.library()._name)"` with that tree's src first on PYTHONPATH). One thread: the thread's
CPU time; more: wall time (run those on a quiet machine). Only for models whose decode runs the
one-call layer (llama, qwen2/3, phi3, gemma, the MoE families).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from kernels import load_alike

import graftlm
import graftlm.native.layer_calls as layer_calls
from graftlm.native import abi
from graftlm.step.batch import Batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--a", required=True, help="library A (.so)")
    ap.add_argument("--b", required=True, help="library B (.so)")
    ap.add_argument("--rows", type=int, default=1, help="sequences a step")
    ap.add_argument("--steps", type=int, default=200, help="measured steps of each library")
    ap.add_argument("--warm", type=int, default=1, help="unmeasured steps before each measured")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    need = 32 + args.steps * 2 * (args.warm + 1)
    model = graftlm.load(args.model, ctx_size=max(256, need), n_seq=args.rows).model
    libs = {}
    for name, path in (("A", args.a), ("B", args.b)):
        libs[name] = load_alike(path)
        abi.bind(libs[name])  # (every entry point's types: the layers' call goes through them)
    head = model.output.weight._k
    fn_name = head._fn.__name__

    def use(lib: ctypes.CDLL) -> None:
        layer_calls.library = lambda: lib  # type: ignore[assignment]
        head._fn = getattr(lib, fn_name)

    rows, pos = list(range(args.rows)), [16]
    times: dict[str, list[float]] = {"A": [], "B": []}
    with torch.inference_mode():
        for s in rows:
            model.forward(Batch.single(list(range(100, 116)), s, 0))
        for r in range(args.steps):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                use(libs[name])
                for w in range(args.warm + 1):
                    i = pos[0]
                    pos[0] += 1
                    batch = Batch(torch.tensor([[5 + i]] * args.rows), rows, [i] * args.rows,
                                  [1] * args.rows)  # fmt: skip
                    t0 = clock()
                    model.forward(batch)
                    if w == args.warm:
                        times[name].append(clock() - t0)
    a, b = (statistics.median(times[k]) * 1e3 for k in "AB")
    print(f"{args.model}: {args.rows} rows, {args.threads} threads: A {a:.2f} ms, B {b:.2f} ms a "
          f"step, B / A {b / a:.3f} ({args.steps} steps each)")  # fmt: skip


if __name__ == "__main__":
    main()
