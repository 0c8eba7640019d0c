"""The prompt attention's error at depth, route by route (gl_attn_prefill: bfloat16 scores,
exact=2, against int8 scores, exact=0), relative to its float32 products (exact=1): per head,
||out - out_f32|| / ||out_f32|| over a chunk's queries.

Synthetic: Llama-1B's heads (32/8 of 64) over a random f16 cache, plain and with outlier key
channels (a few dims of every key carry a large shared offset and spread, as real models' keys
do, with the queries large in them too). Real: a model's own queries and cache (--model, e.g.
SmolLM2 or gemma-3 from graftlm.resources), a long text through it in 512-token chunks: every
chunk past --min-keys positions is run through all three routes (the model goes on with
float32's).

    PYTHONPATH=src python bench/prompt_attention_error.py [--depth 4096] [--model smollm2]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from graftlm.native import ops
from graftlm.step import Batch, KVCache
from graftlm.step.kv_cache import KV_TYPES

ROUTES = {"bf16": 2, "int8": 0}  # gl_attn_prefill's exact


def head_errors(run, h: int) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """Each route's relative error per head against float32's: run(exact) -> (B, T, H * D)."""
    ref = run(1).double()
    ref = ref.view(*ref.shape[:2], h, -1)
    errs = {}
    for name, mode in ROUTES.items():
        out = run(mode).double().view_as(ref)
        num = (out - ref).square().sum(dim=(0, 1, 3)).sqrt()
        errs[name] = (num / ref.square().sum(dim=(0, 1, 3)).sqrt()).tolist()
    return errs


def synthetic(depth: int, outliers: bool, kv: str = "f16") -> dict[str, list[float]]:
    h, hkv, d, t = 32, 8, 64, 512
    n = depth + t
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, n, hkv, d, generator=g)
    q = torch.randn(1, t, h, d, generator=g) * 2
    if outliers:  # dims 5, 17, 40 (and their RoPE partners' share): offsets 8-12, spread 3
        for dim, off in ((5, 10.0), (17, -8.0), (40, 12.0)):
            keys[..., dim] = off + 3 * keys[..., dim]
            q[..., dim] *= 3
    values = torch.randn(1, n, hkv, d, generator=g)
    cache = KVCache(1, 1, hkv, n, d, d, KV_TYPES[kv][0])
    cache.write(0, Batch(torch.zeros(1, n, dtype=torch.long), [0], [0], [n]), keys, values)
    index = Batch(torch.zeros(1, t, dtype=torch.long), [0], [depth], [t]).index()
    assert index is not None

    def run(mode: int) -> torch.Tensor:
        out = ops.attn_prefill(
            q, cache, 0, index, d**-0.5, 0, exact=mode == 1, bf16_scores=mode == 2
        )
        assert out is not None
        return out

    return head_errors(run, h)


def real(model_name: str, n_tokens: int, min_keys: int) -> dict[str, list[float]]:
    import graftlm
    from graftlm import resources
    from graftlm.models import primitives

    # the embedded SmolLM2-135M, gemma-3-270m, or a file
    path = (
        None
        if model_name == "smollm2"
        else resources.gemma3_path()
        if model_name == "gemma3"
        else model_name
    )
    model = graftlm.load(path, ctx_size=n_tokens + 64)
    root = Path(__file__).resolve().parents[1]
    text = "\n\n".join(p.read_text() for p in sorted((root / "src" / "graftlm").rglob("*.py")))
    ids = model.tokenize(text)[:n_tokens]
    errs: dict[str, list[float]] = {k: [] for k in ROUTES}
    real_prefill = ops.attn_prefill

    def spy(q, cache, layer, rows, scale, window=0, softcap=0.0, exact=False, sinks=None):  # type: ignore[no-untyped-def]
        def run(mode: int) -> torch.Tensor:
            return real_prefill(
                q, cache, layer, rows, scale, window, softcap, mode == 1, sinks, mode == 2
            )

        if rows.max_start + q.shape[1] >= min_keys and run(1) is not None:
            for k, v in head_errors(run, q.shape[2]).items():
                errs[k] += v
        return run(1)

    primitives.native_ops.attn_prefill = spy  # type: ignore[assignment]
    try:
        model.logits(ids)
    finally:
        primitives.native_ops.attn_prefill = real_prefill  # type: ignore[assignment]
    return errs


def report(name: str, errs: dict[str, list[float]]) -> None:
    parts = []
    for k, e in errs.items():
        if e:
            parts.append(f"{k} median {statistics.median(e):.2e} max {max(e):.2e}")
    n = len(next(iter(errs.values())))
    print(f"{name} ({n} heads): " + "; ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument(
        "--model", default=None, help="smollm2, gemma3 (graftlm.resources) or a GGUF file"
    )
    ap.add_argument("--tokens", type=int, default=4096, help="a real model's text length")
    ap.add_argument("--min-keys", type=int, default=1024)
    args = ap.parse_args()
    if args.model:
        report(
            f"{args.model}, chunks past {args.min_keys}",
            real(args.model, args.tokens, args.min_keys),
        )
        return
    for kv in ("f16", "q8_0"):
        report(f"random, depth {args.depth}, {kv}", synthetic(args.depth, False, kv))
        report(f"outlier key channels, depth {args.depth}, {kv}", synthetic(args.depth, True, kv))


if __name__ == "__main__":
    main()
