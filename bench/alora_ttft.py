"""Activated LoRA's point, measured: a long conversation the base computed, then an adapter on it.
Time to the first adapted token with the aLoRA (which reuses the base's cached blocks before its
invocation) against the plain LoRA of the same weights (which must compute every position again).

The aLoRA is the SmolLM2 pirate fixture written again with `adapter.alora.invocation_tokens` (the
tokens of "<|im_start|>assistant"). Each trial uses a fresh conversation of `--tokens` tokens
that the base computes first (as a chat the base held), then times one adapter on it plus the
invocation; aLoRA and plain LoRA trials alternate.

    .venv/bin/python bench/alora_ttft.py --tokens 1500 --trials 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
PIRATE = ROOT.parent / "shared" / "fixtures" / "smollm2" / "pirate-f32.gguf"


def with_invocation(src: Path, dst: Path, tokens: list[int]) -> Path:
    """A copy of a GGUF adapter with activated-LoRA invocation tokens in its metadata."""
    r = gguf.GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, vtype)
    w.add_array("adapter.alora.invocation_tokens", tokens)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def main() -> int:
    import graftlm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    m = graftlm.load(threads=args.threads, ctx_size=args.tokens + 64)
    invocation = m.tokenize("<|im_start|>assistant", parse_special=True)
    with tempfile.TemporaryDirectory() as d:
        al = m.add_lora(with_invocation(PIRATE, Path(d) / "alora.gguf", invocation), scale=0.0)
        pl = m.add_lora(PIRATE, scale=0.0)  # (global scales 0: a call without lora= is the base)
    rng = random.Random(0)
    vocab = m.config.n_vocab
    times: dict[str, list[float]] = {"aLoRA": [], "plain LoRA": []}
    cached: dict[str, list[int]] = {"aLoRA": [], "plain LoRA": []}
    for trial in range(2 * args.trials):
        kind = ("aLoRA", "plain LoRA")[trial % 2]
        conversation = [rng.randrange(100, vocab - 100) for _ in range(args.tokens)]
        m.generate(conversation, max_tokens=1, temperature=0)  # the base holds the conversation
        prompt = conversation + invocation + m.tokenize("\n")
        lora = [{"id": al if kind == "aLoRA" else pl, "scale": 1.0}]
        t0 = time.perf_counter()
        m.generate(prompt, max_tokens=1, temperature=0, lora=lora)
        times[kind].append(time.perf_counter() - t0)
        cached[kind].append(m.last_timings.n_cached)
    print(f"SmolLM2 Q4_1, {args.threads} threads, a {args.tokens}-token base conversation, "
          f"{args.trials} trials each, alternated")  # fmt: skip
    for kind, ts in times.items():
        print(f"{kind:>11}: time to first token median {statistics.median(ts) * 1000:.1f} ms "
              f"(tokens served by the cache: {cached[kind]})")  # fmt: skip
    ratio = statistics.median(times["plain LoRA"]) / statistics.median(times["aLoRA"])
    print(f"plain LoRA / aLoRA: {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
