"""What constrained decoding costs, on SmolLM2-135M's 49k vocabulary, on the CPU.

1. The two candidate engines side by side (llguidance, which graftlm uses, and xgrammar, if
   installed): building the tokenizer description from graftlm's vocabulary, compiling a JSON
   schema (no cache), and the mask time per token along one valid JSON document, for one row and
   for a batch of rows with different schemas (masks computed one row after another, as the
   sampler does).
2. The engine: aggregate tokens/s of a mixed batch (a quarter JSON schema, a quarter regex, a
   quarter free, a quarter tool calls, over the base and three adapters from ../shared/fixtures)
   against the same batch with no constraints, and the mask time per constrained token.

    PYTHONPATH=src python bench/constraints.py [--rows 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import graftlm
from graftlm.lora.settings import NO_ADAPTERS, AdapterSettings
from graftlm.runtime.constraints import Constraint, ConstraintCompiler
from graftlm.runtime.sampling import Sampler, SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.runtime.tools import tool_constraint

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"],
            },
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "role", "address", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "score": {"type": "number"},
            "ok": {"type": "boolean"},
        },
        "required": ["title", "score", "ok"],
    },
]
DOCS = [
    {
        "name": "Ada Lovelace",
        "age": 36,
        "role": "admin",
        "address": {"city": "London", "zip": "12345"},
        "tags": ["math", "engines", "poetry"],
    },
    {"title": "A short review of the analytical engine", "score": 4.5, "ok": True},
]


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.3f} ms"


def engines(m: graftlm.Model, rows: int) -> None:
    tok = m.tokenizer
    n_vocab = m.config.n_vocab
    eog = sorted(m.prompter.eog)
    docs = [json.dumps(d, separators=(",", ":")) for d in DOCS]
    seqs = [tok.encode(d, add_special=False) for d in docs]

    # -- llguidance --
    t0 = time.perf_counter()
    cc = ConstraintCompiler(tok, n_vocab, eog, maxsize=0)
    assert cc.lltokenizer.vocab_size == n_vocab
    t_tok = time.perf_counter() - t0
    compile_s = []
    for s in SCHEMAS:
        t0 = time.perf_counter()
        cc.compile(Constraint.json_schema(s, strict=False))
        compile_s.append(time.perf_counter() - t0)
    # the same token streams through one matcher per row; rows alternate between the schemas
    # (whitespace_flexible off in graftlm, so the compact documents are valid)
    grammars = [cc.compile(Constraint.json_schema(s, strict=False)) for s in SCHEMAS]
    matchers = [grammars[r % 2].matcher() for r in range(rows)]
    per_step: list[float] = []
    one_row: list[float] = []
    n_steps = min(len(s) for s in seqs)
    for i in range(n_steps):
        t0 = time.perf_counter()
        for r, mt in enumerate(matchers):
            t1 = time.perf_counter()
            ok = mt.allowed()
            if r == 0:
                one_row.append(time.perf_counter() - t1)
            assert bool(ok[seqs[r % 2][i]]), (r, i)
        per_step.append(time.perf_counter() - t0)
        for r, mt in enumerate(matchers):
            mt.advance(seqs[r % 2][i])
    print(
        f"llguidance: tokenizer {t_tok:.3f} s; compile {', '.join(f'{x * 1e3:.1f} ms' for x in compile_s)}"
    )
    print(f"  mask, one row: {_ms(one_row)}/token; {rows} rows: {_ms(per_step)}/step")

    # -- xgrammar --
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar: not installed (pip install xgrammar==0.2.8)")
        return
    t0 = time.perf_counter()
    vocab = [b"" if tok.is_special(i) else tok.token_to_piece(i) for i in range(tok.n_vocab)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n_vocab, stop_token_ids=eog)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t_tok = time.perf_counter() - t0
    compiled = []
    compile_s = []
    for s in SCHEMAS:
        t0 = time.perf_counter()
        compiled.append(
            compiler.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(",", ":"))
        )
        compile_s.append(time.perf_counter() - t0)
    xm = [xgr.GrammarMatcher(compiled[r % 2]) for r in range(rows)]
    bitmask = xgr.allocate_token_bitmask(rows, n_vocab)
    per_step, one_row = [], []
    for i in range(n_steps):
        t0 = time.perf_counter()
        for r, mt in enumerate(xm):
            t1 = time.perf_counter()
            mt.fill_next_token_bitmask(bitmask, r)
            bits = bitmask[r].numpy().view(np.uint8)
            okx = np.unpackbits(bits, bitorder="little")[:n_vocab]
            if r == 0:
                one_row.append(time.perf_counter() - t1)
            assert okx[seqs[r % 2][i]], (r, i)
        per_step.append(time.perf_counter() - t0)
        for r, mt in enumerate(xm):
            assert mt.accept_token(seqs[r % 2][i])
    print(
        f"xgrammar:   tokenizer {t_tok:.3f} s; compile {', '.join(f'{x * 1e3:.1f} ms' for x in compile_s)}"
    )
    print(f"  mask, one row: {_ms(one_row)}/token; {rows} rows: {_ms(per_step)}/step")


def engine_batch(m: graftlm.Model, rows: int, n_tokens: int, adapters: list[int]) -> None:
    """Aggregate tokens/s of the issue's mixed batch: a quarter JSON schema, a quarter regex, a
    quarter free, a quarter tool calls (the `required` grammar), row r on adapter r % 4 (0: the
    base), sampled; against the same batch with no constraint. Constrained rows may end early
    (their grammar completes): tokens/s counts what was generated."""
    ids = m.prompter.chat_prompt([{"role": "user", "content": "Describe a person as JSON."}])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS[1]}}]
    grammars = [
        m.prompter.compile(Constraint.json_schema(SCHEMAS[0])),
        m.prompter.compile(Constraint("regex", r"[A-Z][a-z]+( [a-z]+){3,12}\.")),
        None,
        m.prompter.compile(tool_constraint(tools, None, "hermes")),
    ]
    settings = [NO_ADAPTERS] + [AdapterSettings({a: 1.0}) for a in adapters]

    def run(constrained: bool) -> tuple[float, int, float, int]:
        reqs = []
        for r in range(rows):
            g = grammars[r % 4] if constrained else None
            p = SamplingParams(temperature=0.8, seed=r, max_tokens=n_tokens, grammar=g)
            lora = settings[(r // 4) % len(settings)]
            req = Request(list(ids), p, lora, eog=m.prompter.eog)
            req.sampler = Sampler(p)
            reqs.append(m.engine.submit(req))
        t0 = time.perf_counter()
        while any(not r.done for r in reqs):
            m.engine.step()
        wall = time.perf_counter() - t0
        n = sum(len(r.generated) for r in reqs)
        mask_s = sum(r.sampler.matcher.mask_s for r in reqs if r.sampler and r.sampler.matcher)
        n_masks = sum(r.sampler.matcher.n_masks for r in reqs if r.sampler and r.sampler.matcher)
        return wall, n, mask_s, n_masks

    run(False)  # warm-up
    free, cons = [], []
    for _ in range(3):  # alternated, medians
        free.append(run(False))
        cons.append(run(True))
    f_tps = statistics.median(n / w for w, n, _, _ in free)
    c_tps = statistics.median(n / w for w, n, _, _ in cons)
    mask = statistics.median(s / k for _, _, s, k in cons if k)
    print(
        f"engine, {rows} rows x {n_tokens} tokens, {len(settings)} adapter settings "
        f"(3/4 constrained): free {f_tps:.1f} tok/s, constrained {c_tps:.1f} tok/s, ratio "
        f"{c_tps / f_tps:.2f}x; mask {mask * 1e3:.3f} ms per constrained token"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = graftlm.load(None, ctx_size=512, n_seq=a.rows)
    engines(m, 8)
    fixtures = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "smollm2"
    files = [fixtures / f for f in ("pirate-f32.gguf", "caps-f32.gguf", "rand_all-f32.gguf")]
    adapters = [m.add_lora(f, scale=0.0) for f in files if f.exists()]
    engine_batch(m, a.rows, a.tokens, adapters)


if __name__ == "__main__":
    main()
