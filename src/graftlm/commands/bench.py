"""`graftlm bench`: prompt processing and generation speed, in the manner of llama-bench.

The llama.cpp columns come from llama-cpp-python run side by side with graftlm in this same
run, where it is installed (and not turned off with --no-llama-cpp); otherwise they are empty.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graftlm.errors import GraftError


def _stats(xs: list[float]) -> str:
    mean = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{mean:8.1f} ± {sd:5.1f}"


def _timed(fn: Callable[[], int], reps: int, warm: bool = True) -> list[float]:
    if warm:
        fn()  # warm-up: first-call allocations and kernel selection are not the steady state
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        n = fn()
        out.append(n / (time.perf_counter() - t0))
    return out


def _paired(
    a: Callable[[], int], b: Callable[[], int], reps: int
) -> tuple[list[float], list[float]]:
    """Both timed in alternation (a, b, a, b, ...): on a machine whose speed drifts by minutes,
    each pair sees the same conditions, so the median of the pairs' ratios is the fair ratio."""
    a()
    b()
    xs: list[float] = []
    ys: list[float] = []
    for _ in range(reps):
        xs += _timed(a, 1, warm=False)
        ys += _timed(b, 1, warm=False)
    return xs, ys


def _pair_ratio(xs: list[float], ys: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(xs, ys, strict=True))


def _sync(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (a GPU runs ahead of Python), so a clock read after it
    counts the work; nothing to wait for on the CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _ours(
    model: Any, test: str, n: int, lora: list[dict[str, Any]] | None, depth: int = 0
) -> tuple[Callable[[], int], Callable[[], None]]:
    """One test as a callable returning the tokens it timed, and what ends it. At a depth,
    `depth` random tokens precede the test's: a prompt runs in a slot whose first `depth`
    positions were computed once, before the timing; a generation's prompt is those tokens plus
    one, served from the prefix cache after the first call (a depth of whole blocks: every later
    call computes one token)."""
    from graftlm.step.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.n_vocab - 100, (n,), generator=g).tolist()
    before = torch.randint(100, model.config.n_vocab - 100, (depth,), generator=g).tolist()
    settings = model.adapters.settings(lora)
    engine = model.engine
    device = model.model.device
    sync = _sync(device)

    def run(slot: int, tokens: list[int], start: int) -> None:
        with torch.inference_mode():
            for i in range(0, len(tokens), engine.chunk):
                piece = tokens[i : i + engine.chunk]
                rows = engine.lora_rows([settings])
                model.model.forward(Batch.single(piece, slot, start + i, rows, device))

    if test == "pp":
        held: list[int] = []  # at a depth: the slot holding its context, first call to end()

        def pp() -> int:
            # a borrowed slot with blocks of its own: the prompt is computed in full every time
            # (the prefix cache does not see it)
            if not depth:
                slot = engine.slots.borrow(n)
                try:
                    run(slot, ids, 0)
                    sync()
                finally:
                    engine.slots.give_back(slot)
                return n
            if not held:
                held.append(engine.slots.borrow(depth + n))
                run(held[0], before, 0)
                sync()
            run(held[0], ids, depth)
            sync()
            return n

        def end() -> None:
            for slot in held:
                engine.slots.give_back(slot)
            held.clear()

        return pp, end

    prompt = before + ids[:1]

    def tg() -> int:
        model.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True, lora=lora)
        sync()
        return n - 1 if n > 1 else 1  # tokens after the first, as llama-bench counts decode steps

    return tg, lambda: None


def _llama_cpp(
    path: Path, threads: int, test: str, n: int, lora: list[tuple[str, float]]
) -> Callable[[], int] | None:
    """llama.cpp on the same model and adapter, or None where it cannot run the same thing
    (not installed; more than one adapter, or a PEFT directory: llama-cpp-python takes one file)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    extra: dict[str, Any] = {}
    if lora:
        if len(lora) != 1 or not lora[0][0].endswith(".gguf"):
            return None
        extra = {"lora_path": lora[0][0], "lora_scale": lora[0][1]}
    llm = llama_cpp.Llama(
        str(path), n_threads=threads, n_ctx=max(n + 8, 512), n_batch=512, verbose=False, **extra
    )
    ids = list(range(100, 100 + n))

    if test == "pp":

        def pp() -> int:
            llm.reset()
            llm.eval(ids)
            return n

        return pp

    def tg() -> int:
        llm.reset()
        llm.eval(ids[:1])
        for i in range(n - 1):
            llm.eval([ids[1 + i % (n - 1)]])
        return n - 1

    return tg


def bench(args: argparse.Namespace) -> int:
    import graftlm
    from graftlm.commands.llama_flags import cache_type
    from graftlm.commands.lora_args import lora_specs

    threads = args.threads or torch.get_num_threads()
    depths = sorted(set(args.n_depth))
    if min(depths) < 0:
        raise GraftError(f"-d {min(depths)}: a depth is a count of tokens, 0 or more")
    n_ctx = max(depths) + max(args.n_prompt + args.n_gen) + 16
    specs = lora_specs(args.lora, args.lora_scaled)
    model = graftlm.load(
        args.model,
        threads=threads,
        ctx_size=n_ctx,
        device=args.device,
        cache_type=cache_type(args),
        n_seq=2 if specs and max(depths) else 1,  # with and without the adapters, each its depth
    )
    on_cpu = model.model.device.type == "cpu"
    lora = None
    for spec in specs:
        model.add_lora(spec.path, spec.scale)
    if model.loras:
        lora = [{"id": a["id"], "scale": a["scale"]} for a in model.loras]
    name = model.path.name
    if not on_cpu:
        print(f"device: {model.model.device} (bfloat16 weights); llama.cpp is not compared\n")
    tests = [("pp", n) for n in args.n_prompt if n > 0] + [("tg", n) for n in args.n_gen if n > 0]
    rows = [(test, n, d) for test, n in tests for d in depths]
    print("| model | adapters | threads | test | graftlm t/s | llama.cpp t/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    self_ratios: list[str] = []
    for test, n, depth in rows:
        label = f"{test}{n}" + (f" @ d{depth}" if depth else "")  # llama-bench's names
        ours_fn, end = _ours(model, test, n, lora, depth)
        theirs_fn = (
            None
            if args.no_llama_cpp or not on_cpu or depth
            else _llama_cpp(model.path, threads, test, n, [(s.path, s.scale) for s in specs])
        )
        try:
            if theirs_fn is not None:
                ours, theirs = _paired(ours_fn, theirs_fn, args.repetitions)
                their_s, ratio = _stats(theirs) + " (same run)", f"{_pair_ratio(ours, theirs):.2f}"
            else:
                ours = _timed(ours_fn, args.repetitions)
                their_s = ratio = "-"  # no llama.cpp in this run: nothing to set beside ours
            if lora:  # the adapters' cost to graftlm itself: the same test at scale 0, alternated
                off = [{"id": a["id"], "scale": 0.0} for a in lora]
                off_fn, off_end = _ours(model, test, n, off, depth)
                try:
                    on_s, off_s = _paired(ours_fn, off_fn, args.repetitions)
                finally:
                    off_end()
                self_ratios.append(
                    f"{label}: with adapters {statistics.fmean(on_s):.1f} t/s, without "
                    f"{statistics.fmean(off_s):.1f} t/s, ratio {_pair_ratio(on_s, off_s):.2f}"
                )
        finally:
            end()
        print(
            f"| {name} | {len(model.loras)} | {threads} | {label} | {_stats(ours)} | {their_s} | {ratio} |",
            flush=True,
        )
    for line in self_ratios:
        print(f"\ngraftlm {line} (median of alternated pairs)")
    print(
        f"\nresident: {model.resident_bytes / 2**20:.0f} MiB (file {model.path.stat().st_size / 2**20:.0f} MiB)"
    )
    return 0
