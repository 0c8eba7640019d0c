"""The prompt attention's error at depth, route by route (gl_attn_prefill: bfloat16 scores,
exact=2, against int8 scores, exact=0: through a q8_0 cache "q8", the cache's own codes),
relative to its float32 products (exact=1): per head, ||out - out_f32|| / ||out_f32|| over a
chunk's queries. --logprobs: the real model's log-probabilities on each route, through an f16 and
a q8_0 cache (see logprobs).

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

ROUTES = {"bf16": 2, "int8": 0}  # gl_attn_prefill's exact (int8 through q8_0: "q8", its codes)


def routes(kv: str) -> dict[str, int]:
    """The routes through a cache of type kv: a q8_0 cache's int8 scores are its own codes'."""
    return {("q8" if kv == "q8_0" and k == "int8" else k): m for k, m in ROUTES.items()}


def prefill(mode: int):  # type: ignore[no-untyped-def]
    """ops.attn_prefill on route mode (1: float32, 2: bfloat16 scores, 0: int8 scores)."""

    def run(q, cache, layer, rows, scale, window=0, softcap=0.0, exact=False, sinks=None):  # type: ignore[no-untyped-def]
        saved = ops.I8_ATTN_SCORES
        ops.I8_ATTN_SCORES = mode == 0
        try:
            return _prefill(
                q, cache, layer, rows, scale, window, softcap, mode == 1, sinks, mode == 2
            )
        finally:
            ops.I8_ATTN_SCORES = saved

    return run


_prefill = ops.attn_prefill


def head_errors(run, h: int, kv: str) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """Each route's relative error per head against float32's: run(exact) -> (B, T, H * D)."""
    ref = run(1).double()
    ref = ref.view(*ref.shape[:2], h, -1)
    errs = {}
    for name, mode in routes(kv).items():
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
        out = prefill(mode)(q, cache, 0, index, d**-0.5)
        assert out is not None
        return out

    return head_errors(run, h, kv)


def _load(model_name: str, ctx: int, kv: str):  # type: ignore[no-untyped-def]
    import graftlm
    from graftlm import resources

    # the embedded SmolLM2-135M, gemma-3-270m, or a file
    path = {"smollm2": None, "gemma3": resources.gemma3_path()}.get(model_name, model_name)
    return graftlm.load(path, ctx_size=ctx, cache_type=kv)


def _text(source: bool) -> str:
    """The project's Python sources, or its README and docs (real prose)."""
    root = Path(__file__).resolve().parents[1]
    if source:
        files = sorted((root / "src" / "graftlm").rglob("*.py"))
    else:
        files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return "\n\n".join(p.read_text() for p in files)


def real(model_name: str, n_tokens: int, min_keys: int, kv: str) -> dict[str, list[float]]:
    from graftlm.models import primitives

    model = _load(model_name, n_tokens + 64, kv)
    ids = model.tokenize(_text(True))[:n_tokens]
    errs: dict[str, list[float]] = {k: [] for k in routes(kv)}

    def spy(q, cache, layer, rows, scale, window=0, softcap=0.0, exact=False, sinks=None):  # type: ignore[no-untyped-def]
        def run(mode: int) -> torch.Tensor:
            return prefill(mode)(q, cache, layer, rows, scale, window, softcap, False, sinks)

        if rows.max_start + q.shape[1] >= min_keys and run(1) is not None:
            for k, v in head_errors(run, q.shape[2], kv).items():
                errs[k] += v
        return run(1)

    primitives.native_ops.attn_prefill = spy  # type: ignore[assignment]
    try:
        model.logits(ids)
    finally:
        primitives.native_ops.attn_prefill = _prefill  # type: ignore[assignment]
    return errs


def logprobs(model_name: str, n_tokens: int, min_keys: int, top: int = 20) -> None:
    """The model's log-probabilities (scoring, exact everywhere but the prompt attention of
    chunks past min_keys positions, which takes each route) against the f16 cache's and each
    cache's own float32 attention: mean/max |d log-prob| over float32's top tokens and top-1
    agreement, over every position past min_keys and over the 512-token chunks' last ones."""
    from graftlm.models import primitives

    got: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}  # f16's float32 top tokens a position
    for kv in ("f16", "q8_0"):
        model = _load(model_name, n_tokens + 64, kv)
        ids = model.tokenize(_text(False) * 8)[:n_tokens]
        for name, mode in {"f32": 1, **routes(kv)}.items():
            if kv == "f16" and name == "int8":
                continue

            def spy(
                q,
                cache,
                layer,
                rows,
                scale,
                window=0,
                softcap=0.0,
                exact=False,
                sinks=None,
                mode=mode,
            ):  # type: ignore[no-untyped-def]
                far = rows.max_start + q.shape[1] >= min_keys
                return prefill(mode if far else 1)(
                    q, cache, layer, rows, scale, window, softcap, False, sinks
                )

            def keep(start: int, chunk: torch.Tensor) -> torch.Tensor:
                lp = torch.log_softmax(chunk.float(), -1)
                if not ref:  # the first run (f16, float32): its top tokens, then top-1
                    return torch.cat(
                        [lp.topk(top, -1).indices.float(), lp.argmax(-1, keepdim=True).float()], -1
                    )
                idx = ref["top"][start : start + chunk.shape[0]]
                return torch.cat([lp.gather(-1, idx), lp.argmax(-1, keepdim=True).float()], -1)

            primitives.native_ops.attn_prefill = spy  # type: ignore[assignment]
            try:
                lora = model.adapters.settings(None)
                out = model.engine.score(ids, lora, each=keep)
            finally:
                primitives.native_ops.attn_prefill = _prefill  # type: ignore[assignment]
            if not ref:
                ref["top"] = out[:, :top].long()
                out = model.engine.score(ids, lora, each=keep)
            got[f"{kv} {name}"] = out
            print(f"  ran {kv} {name}", flush=True)
    n = got["f16 f32"].shape[0]
    far = torch.arange(n) >= min_keys
    ends = torch.zeros(n, dtype=torch.bool)
    ends[torch.arange(511, n, 512)] = True
    ends &= far
    print(f"{model_name}: {n} tokens, {int(far.sum())} positions past {min_keys} keys "
          f"({int(ends.sum())} chunk ends); |d log-prob| over f32's top-{top}")  # fmt: skip
    pairs = [(f"{kv} {r}", f"{kv} f32") for kv in ("f16", "q8_0") for r in ("bf16", "q8", "int8")]
    pairs += [("q8_0 f32", "f16 f32"), ("q8_0 q8", "f16 f32"), ("q8_0 bf16", "f16 f32")]
    for a, b in pairs:
        if a not in got:
            continue
        for what, sel in (("past", far), ("ends", ends)):
            x, y = got[a][sel], got[b][sel]
            d = (x[:, :top] - y[:, :top]).abs()
            agree = float((x[:, top] == y[:, top]).float().mean())
            print(f"  {a:>9} vs {b:>8} ({what}): mean {float(d.mean()):.2e} max {float(d.max()):.2e} "
                  f"top-1 {agree:.3f}")  # fmt: skip


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
    ap.add_argument("--kv", default="f16", help="a real model's cache type")
    ap.add_argument(
        "--logprobs", action="store_true", help="the model's log-probabilities, f16 and q8_0"
    )
    args = ap.parse_args()
    if args.model and args.logprobs:
        logprobs(args.model, args.tokens, args.min_keys)
        return
    if args.model:
        report(
            f"{args.model}, {args.kv}, chunks past {args.min_keys}",
            real(args.model, args.tokens, args.min_keys, args.kv),
        )
        return
    for kv in ("f16", "q8_0"):
        report(f"random, depth {args.depth}, {kv}", synthetic(args.depth, False, kv))
        report(f"outlier key channels, depth {args.depth}, {kv}", synthetic(args.depth, True, kv))


if __name__ == "__main__":
    main()
