"""The cases of test_dynamic_split.py, run in a subprocess per build variant (GRAFTLM_NATIVE_ISA):
every product and decode step under each way of splitting the work over the threads
(gl_set_dynamic: 0 the static split, 1 claims as the threads go, 2 and 3 the drills that make
threads steal), on 1 and 2 threads. Saves {case: [output under each way]}, the items stolen under
each way, and what the library is, to argv[1]."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # synth_tensors, made_families, shared_data

WAYS = (0, 1, 2, 3)
TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "F16", "MXFP4", "IQ2_XXS")  # weight kinds 0 to 6
SHAPE = (1064, 512)  # 34 tasks of 32 outputs, the last of 8
ROWS = ((1, 1), (4, 1), (2, 3))  # (B, T): one decode row, a few, prompt rows sharing scales


def ways(run, lib, out: dict, key: str, stolen: dict) -> None:  # type: ignore[no-untyped-def]
    """out[key]: run()'s output under each way of splitting; stolen[way] counts the steals."""
    got = []
    for way in WAYS:
        before = lib.gl_set_dynamic(way)
        start = lib.gl_stolen_items()
        try:
            got.append(run())
        finally:
            lib.gl_set_dynamic(before)
        stolen[way] = stolen.get(way, 0) + lib.gl_stolen_items() - start
    out[key] = got


def products(lib, out: dict, stolen: dict) -> None:  # type: ignore[no-untyped-def]
    """gl_proj: each weight kind's product alone and with two adapters (one row: the one-row
    delta; more rows: the many-row one), and gl_lora, the delta alone."""
    from gguf import GGMLQuantizationType as Q
    from synth_tensors import gguf_tensor

    from graftlm.lora.site import LoraSite
    from graftlm.models.seam import add_delta
    from graftlm.native import layer_calls
    from graftlm.native.abi import GlLoraSite
    from graftlm.quant import QWeight
    from graftlm.step.batch import LoraRows

    n, k = SHAPE
    g = torch.Generator().manual_seed(5)
    sites = {}
    for compact in (False, True):  # float32 A and B; Q8_0 A and bfloat16 B
        site = LoraSite(k, n, compact=compact)
        for slot in (0, 2):
            a, b = torch.randn(16, k, generator=g), torch.randn(n, 16, generator=g)
            b[:300, 3] = 0.0  # a column whose span starts past the first blocks
            if slot == 2:
                b[700:] = 0.0  # an adapter on part of the outputs (one target of a stack)
            site.put(slot, a, b)
        sites[compact] = site
    for name in TYPES:
        qt = Q[name]
        raw, _ = gguf_tensor(qt, SHAPE, seed=3)
        w = QWeight.from_gguf(raw, qt, SHAPE, name="w")
        assert str(w.kernel).startswith("native-"), (name, w.kernel)
        for bsz, t in ROWS:
            x = torch.randn(bsz, t, k, generator=g)
            scales = torch.rand(bsz, 3, generator=g)
            scales[:, 1] = 0.0
            if bsz > 2:
                scales[1, 0] = 0.0  # a row whose adapters differ from its neighbours'
            for lora in (None, False, True):

                def run(w=w, x=x, lora=lora, scales=scales):  # type: ignore[no-untyped-def]
                    y = torch.empty(x.shape[0], x.shape[1], n)
                    site = GlLoraSite() if lora is None else sites[lora].native().site(scales)
                    layer_calls.proj(w.native(), site, x, y)
                    return y

                ways(run, lib, out, f"proj:{name}:{bsz}x{t}:{lora}", stolen)
    for compact, site in sites.items():
        for bsz, t in ROWS:
            x = torch.randn(bsz, t, k, generator=g)
            rows = LoraRows(torch.rand(bsz, 3, generator=g), (0, 2))

            def delta(site=site, x=x, rows=rows):  # type: ignore[no-untyped-def]
                y = torch.zeros(x.shape[0], x.shape[1], n)
                return add_delta(site, y, x, rows, exact=False)

            ways(delta, lib, out, f"lora:{compact}:{bsz}x{t}", stolen)


def expert_adapter(path: Path, layers: int, experts: int, d: int, ff: int, q: int) -> Path:
    """A GGUF adapter on the routed experts' gate, up and down (3-D, one A and B an expert) and on
    attn_q, in llama.cpp's layout."""
    import gguf

    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 8.0)
    for i in range(layers):
        for name, n_in, n_out in (
            ("ffn_gate_exps", d, ff),
            ("ffn_up_exps", d, ff),
            ("ffn_down_exps", ff, d),
            ("attn_q", d, q),
        ):
            e = (experts,) if "exps" in name else ()
            a = rng.standard_normal((*e, 4, n_in)) / np.sqrt(n_in)
            b = rng.standard_normal((*e, n_out, 4)) * 0.2
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a", a.astype(np.float32))
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b", b.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def layers(lib, out: dict, stolen: dict, work: Path) -> None:  # type: ignore[no-untyped-def]
    """Decode steps through the native decoder layers: the tiny llama with its adapter (every
    projection's one-row and many-row delta), the tiny Qwen3-MoE with an adapter on its experts
    (whole jobs, and gl_set_moe_jobs(0)'s shared steps), one row and two."""
    from made_families import tiny_dir

    import graftlm
    from graftlm.step.batch import Batch

    models = {"llama": tiny_dir("llama"), "qwen3moe": tiny_dir("qwen3moe")}
    for family, d in models.items():
        if d is None:
            out[f"missing:{family}"] = []
            continue
        m = graftlm.load(d / "model-q8_0.gguf", ctx_size=64, n_seq=2, cache_type="f32")
        if family == "llama":
            adapter = d / "lora-f32.gguf"
        else:
            adapter = expert_adapter(work / "experts.gguf", 2, 16, 128, 64, 192)
        aid = m.add_lora(adapter, 0.0)
        model = m.model
        assert model.fused_stack() is not None, family
        for n_rows in (1, 2):
            for on in (True, False):
                rows = m.engine.lora_rows([{aid: 0.75}, {aid: -0.5}][:n_rows]) if on else None

                def run(model=model, n_rows=n_rows, rows=rows):  # type: ignore[no-untyped-def]
                    steps = []
                    with torch.inference_mode():
                        for s, n in enumerate((12, 5)[:n_rows]):
                            model.forward(
                                Batch.single([(7 * s + j) % 50 + 3 for j in range(n)], s, 0)
                            )
                        for step in range(3):
                            tokens = torch.tensor([[21 + step + 9 * s] for s in range(n_rows)])
                            at = [n + step for n in (12, 5)[:n_rows]]
                            batch = Batch(tokens, list(range(n_rows)), at, [1] * n_rows, rows)
                            steps.append(model.forward(batch))
                    return torch.stack(steps)

                for jobs in (1, 0) if family == "qwen3moe" else (1,):
                    before = lib.gl_set_moe_jobs(jobs)
                    try:
                        ways(run, lib, out, f"layer:{family}:{n_rows}:{on}:{jobs}", stolen)
                    finally:
                        lib.gl_set_moe_jobs(before)


def main() -> None:
    from graftlm.native import features, isa, library

    lib = library()
    assert lib is not None
    out: dict = {}
    stolen: dict = {}
    work = Path(sys.argv[1]).parent
    for threads in (1, 2):
        torch.set_num_threads(threads)
        per: dict = {}
        products(lib, per, stolen.setdefault(threads, {}))
        layers(lib, per, stolen[threads], work)
        out.update({f"{threads}:{key}": v for key, v in per.items()})
    torch.save({"isa": isa(), "features": features(), "cases": out, "stolen": stolen}, sys.argv[1])


if __name__ == "__main__":
    main()
