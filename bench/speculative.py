"""Speculative decoding with n-gram drafts, side by side with llama-server's `ngram-simple`.

Four servers on the same GGUF, one at a time, in alternating order each round: graftlm and
llama-server, each without and with n-gram speculation (`--spec-type ngram-simple`, each with its
own defaults otherwise; `-np 1 -c 4096 -t THREADS`). Each takes the same chat requests one after
the other (greedy, /v1/chat/completions), in three tasks:

    copy   repeat a ~300-token passage word for word
    edit   the passage again with one word replaced throughout
    chat   open-ended questions (nothing to copy: drafting must not cost)

Printed per task: each server's decode tokens per second (generated tokens over the servers' own
`timings.predicted_ms`, summed over the task's requests; best round), speculation's speed-up in
each server, graftlm / llama-server with speculation, the drafted and accepted token counts, and
whether each server's text is the same with and without speculation.

`--batch N` instead runs graftlm in-process: N requests at once, request i on adapter i mod A
(`--lora`, repeatable) or the base, half of them copy tasks and half chat, speculation off and on
alternated; the aggregate generated tokens per second of each.

    .venv/bin/python bench/speculative.py                      # SmolLM2 (embedded)
    .venv/bin/python bench/speculative.py --gemma3             # gemma-3-270m (cached file)
    .venv/bin/python bench/speculative.py --batch 16 -m DIR/llama-1b-q4_k_m.gguf \\
        --lora DIR/llama-1b-lora-r16.gguf --lora DIR/llama-1b-lora-r16-s2.gguf ...

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import ROOT, SHARED, llama_bin_copy, running  # noqa: E402

PASSAGES = [
    "The committee met on Tuesday morning to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the public library by ten percent, to "
    "repair the roads in the north district before the winter, and to hire two more teachers for "
    "the primary school on Mill Street. The treasurer warned that the town's reserves were lower "
    "than last year, because the new bridge had cost more than expected, and she asked the "
    "committee to delay the purchase of a second fire engine until the spring. Several residents "
    "spoke during the public session. One of them, a retired engineer, asked why the committee had "
    "not published the report on the water supply, which had been promised in June. The chair "
    "replied that the report was almost finished and that the committee would publish it next "
    "month, together with the minutes of every meeting since January. The meeting ended shortly "
    "after noon, and the committee will meet again on the first Tuesday of next month.",
    "Maria opened the bakery at six o'clock, as she had done every morning for twenty years. She "
    "lit the old oven, mixed the dough for the bread, and set out the trays of small cakes that "
    "the children from the school across the road liked to buy on their way to class. At seven, "
    "her first customer arrived: Mr. Okafor, who always asked for two loaves of rye bread and a "
    "cup of strong coffee, and who always told her about the weather in the village where he had "
    "grown up. Today he said that it had snowed there for the first time in ten years. Maria "
    "laughed and said that she had never seen snow in her life. When he left, she wrote the word "
    "snow on the small board behind the counter, where she kept the names of the places she "
    "wanted to visit one day. The list was long now, and the board was almost full, but she "
    "still believed that she would see every one of them before she closed the bakery for good.",
]
EDITS = [("committee", "council"), ("Maria", "Elena")]
QUESTIONS = [
    "Write a short story about a dragon who learns to cook.",
    "Explain why the sky is blue, in a few paragraphs.",
    "Give me five pieces of advice for someone learning to play the piano.",
    "What are the main differences between a lake and a sea?",
]
TASKS = ("copy", "edit", "chat")


def messages(task: str, i: int) -> list[dict[str, str]]:
    if task == "copy":
        text = "Repeat the following text exactly, word for word:\n\n" + PASSAGES[i]
    elif task == "edit":
        old, new = EDITS[i]
        text = (
            f"Rewrite the following text, replacing the word '{old}' with '{new}' everywhere. "
            f"Change nothing else:\n\n{PASSAGES[i]}"
        )
    else:
        text = QUESTIONS[i]
    return [{"role": "user", "content": text}]


def n_requests(task: str) -> int:
    return len(QUESTIONS) if task == "chat" else len(PASSAGES)


def server_cmd(kind: str, spec: bool, args: argparse.Namespace, server: Path, port: int) -> list:
    common = ["-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
              "-c", "4096", "-t", str(args.threads)]  # fmt: skip
    if spec:
        common += ["--spec-type", "ngram-simple"]
    if kind == "llama-server":
        return [str(server), *common]
    return [sys.executable, "-m", "graftlm", "serve", *common]


def run_server(
    kind: str, spec: bool, args: argparse.Namespace, server: Path, port: int
) -> dict[str, dict]:
    """One server through every task: per task, tokens, decode ms, drafted/accepted, texts."""
    log = Path(args.work) / f"{kind}-{spec}-{port}.log"
    out: dict[str, dict] = {}
    with running(server_cmd(kind, spec, args, server, port), port, log) as url:
        c = httpx.Client(base_url=url, timeout=1800)
        c.post("/v1/chat/completions", json={"messages": messages("chat", 0), "max_tokens": 4})
        for task in args.tasks:
            row = {"n": 0, "ms": 0.0, "draft": 0, "accepted": 0, "texts": []}
            for i in range(n_requests(task)):
                body = {
                    "messages": messages(task, i),
                    "max_tokens": args.tokens if task != "chat" else args.chat_tokens,
                    "temperature": 0,
                    "cache_prompt": False,
                }
                r = c.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{kind}: {r.status_code} {r.text[:300]}")
                j = r.json()
                t = j["timings"]
                row["n"] += int(t["predicted_n"])
                row["ms"] += float(t["predicted_ms"])
                row["draft"] += int(t.get("draft_n", 0))
                row["accepted"] += int(t.get("draft_n_accepted", 0))
                row["texts"].append(j["choices"][0]["message"]["content"])
            out[task] = row
            print(f"  {kind:12s} {'spec' if spec else 'plain':5s} {task:5s} "
                  f"{row['n'] / row['ms'] * 1000:7.1f} tok/s  ({row['n']} tokens, drafted "
                  f"{row['draft']}, accepted {row['accepted']})", flush=True)  # fmt: skip
    return out


def servers(args: argparse.Namespace) -> int:
    kinds = [(k, s) for k in args.only for s in (False, True)]
    results: dict[tuple[str, bool], list[dict[str, dict]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        args.work = tmp
        server = llama_bin_copy(args.llama_bin, Path(tmp) / "llama-bin")
        print(f"{Path(args.model).name}, {args.threads} threads, greedy, copy/edit "
              f"{args.tokens} tokens at most, chat {args.chat_tokens}", flush=True)  # fmt: skip
        for rnd in range(args.rounds):
            order = kinds if rnd % 2 == 0 else kinds[::-1]
            print(f"round {rnd + 1}", flush=True)
            for n, (kind, spec) in enumerate(order):
                port = 18700 + rnd * 10 + n
                results[(kind, spec)].append(run_server(kind, spec, args, server, port))

    def best(key: tuple[str, bool], task: str) -> float:
        return max(r[task]["n"] / r[task]["ms"] * 1000 for r in results[key])

    print()
    head = f"{'task':6s}" + "".join(f"{k + (' spec' if s else ''):>20s}" for k, s in kinds)
    print(
        head + "".join(f"{k + ' spec/plain':>26s}" for k in args.only) + "   graftlm/llama (spec)"
    )
    for task in args.tasks:
        row = f"{task:6s}" + "".join(f"{best(key, task):20.1f}" for key in kinds)
        for k in args.only:
            same = results[(k, True)][0][task]["texts"] == results[(k, False)][0][task]["texts"]
            ratio = best((k, True), task) / best((k, False), task)
            row += f"{ratio:17.2f}x (same {'yes' if same else 'NO '})"
        if len(args.only) == 2:
            row += f"   {best(('graftlm', True), task) / best(('llama-server', True), task):.2f}x"
        print(row)
    for k in args.only:
        r = results[(k, True)][0]
        print(f"{k}: drafted/accepted " + ", ".join(
            f"{t} {r[t]['draft']}/{r[t]['accepted']}" for t in args.tasks))  # fmt: skip
    return 0


def batch(args: argparse.Namespace) -> int:
    """N requests at once in-process, speculation off and on alternated: tokens per second."""
    sys.path.insert(0, str(ROOT / "src"))
    import graftlm
    from graftlm.runtime.sampling import SamplingParams
    from graftlm.runtime.scheduler import Request
    from graftlm.runtime.speculative import SpecConfig

    n = args.batch
    m = graftlm.load(args.model, threads=args.threads, ctx_size=1024, n_seq=n)
    ids = [m.add_lora(f, scale=0.0) for f in args.lora]
    m.engine.prefix_cache = False
    prompts = []
    for i in range(n):
        task = "copy" if i % 2 == 0 else "chat"
        k = (i // 2) % n_requests(task)
        prompts.append(m.prompter.prompt_ids(m.prompter.chat_prompt(messages(task, k))))
    params = SamplingParams(temperature=0.0, max_tokens=args.batch_tokens, ignore_eos=True)

    def once(spec: bool) -> tuple[float, int, int, int, list[list[int]]]:
        m.engine.speculative = SpecConfig() if spec else None
        reqs = []
        for i, p in enumerate(prompts):
            lora = m.adapters.settings([{"id": ids[i % len(ids)], "scale": 1.0}] if ids else None)
            reqs.append(Request(list(p), params, lora))
        for r in reqs:
            m.engine.submit(r)
        while any(r.n_prefilled < len(r.prompt) for r in reqs):  # prompts first, not timed
            m.engine.step()
        t0 = time.perf_counter()
        done0 = sum(len(r.generated) for r in reqs)
        while m.engine.busy:
            m.engine.step()
        wall = time.perf_counter() - t0
        got = sum(len(r.generated) for r in reqs) - done0
        drafted = sum(r.n_drafted for r in reqs)
        accepted = sum(r.n_draft_accepted for r in reqs)
        return got / wall, got, drafted, accepted, [r.generated for r in reqs]

    print(f"{Path(args.model).name}: {n} requests at once, {len(ids)} adapters, "
          f"{args.batch_tokens} tokens each, half copy half chat", flush=True)  # fmt: skip
    best = {False: 0.0, True: 0.0}
    outs: dict[bool, list[list[int]]] = {}
    for rnd in range(args.rounds):
        for spec in (False, True) if rnd % 2 == 0 else (True, False):
            tps, got, drafted, accepted, gen = once(spec)
            outs[spec] = gen
            best[spec] = max(best[spec], tps)
            print(f"  {'spec' if spec else 'plain':5s} {tps:7.1f} tok/s ({got} tokens, "
                  f"drafted {drafted}, accepted {accepted})", flush=True)  # fmt: skip
    print(f"spec/plain {best[True] / best[False]:.2f}x; same tokens: {outs[True] == outs[False]}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded SmolLM2)")
    p.add_argument("--gemma3", action="store_true", help="the gemma-3-270m file instead")
    p.add_argument("--tokens", type=int, default=400, help="most tokens of a copy or edit answer")
    p.add_argument("--chat-tokens", type=int, default=200)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama-bin", type=Path, default=SHARED / "llama.cpp" / "bin")
    p.add_argument("--only", choices=("graftlm", "llama-server"), action="append")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--batch", type=int, default=0, help="N requests at once, in-process")
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--lora", action="append", default=[], help="adapters for --batch")
    args = p.parse_args()
    args.only = args.only or ["graftlm", "llama-server"]
    if args.model is None:
        sys.path.insert(0, str(ROOT / "src"))
        from graftlm import resources

        args.model = str(resources.gemma3_path() if args.gemma3 else resources.default_model_path())
    return batch(args) if args.batch else servers(args)


if __name__ == "__main__":
    sys.exit(main())
