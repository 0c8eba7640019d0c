"""A random model of SmolLM2-135M's shape (Q4_1 projections, Q8_0 tied embedding, 30 layers of
576 / 1536, 9 heads over 3 KV heads) and a rank-8 adapter on all seven projections of every layer.

For measuring where the real files cannot go: a lent GPU machine receives the working tree and
at most 64 MiB beside it, and SmolLM2's file alone is 94 MB. The layers match SmolLM2's; the
vocabulary is the tiny test tokenizer's (a few hundred tokens), so the LM head costs almost
nothing here.

    python bench/device_model.py DIR  ->  DIR/model.gguf, DIR/lora.gguf
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model  # noqa: E402

SMOLLM2 = TinySpec(
    n_embd=576,
    n_head=9,
    n_head_kv=3,
    head_dim=64,
    n_ff=1536,
    n_layer=30,
    n_ctx=2048,
    qtype=gguf.GGMLQuantizationType.Q4_1,
    embd_type=gguf.GGMLQuantizationType.Q8_0,
)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "synth")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = write_tiny_model(out / "model.gguf", SMOLLM2)
    s = SMOLLM2
    d, q, kv = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    shapes = {"attn_q": (d, q), "attn_k": (d, kv), "attn_v": (d, kv), "attn_output": (q, d)}
    shapes |= {"ffn_gate": (d, s.n_ff), "ffn_up": (d, s.n_ff), "ffn_down": (s.n_ff, d)}
    targets = {f"blk.{i}.{n}": io for i in range(s.n_layer) for n, io in shapes.items()}
    lora = write_tiny_adapter(out / "lora.gguf", s, targets, rank=8, alpha=16.0)
    print(f"{model} ({model.stat().st_size / 2**20:.1f} MiB), {lora} "
          f"({lora.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
