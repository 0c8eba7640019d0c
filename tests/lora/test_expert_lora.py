"""LoRA on routed experts (llama.cpp's build_lora_mm_id, vLLM's MoE LoRA): a tiny Qwen3-MoE from
transformers with a PEFT adapter on its experts' 3-D parameters (`target_parameters`), the same
adapter written as per-expert nn.Linear modules (the layout before transformers 5) and that
converted by llama.cpp's own `convert_lora_to_gguf.py` (3-D expert tensors). PEFT is the oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import save_file
from shared_data import TINY

import graftlm
from graftlm.errors import AdapterError

IDS = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
R = 4

pytestmark = pytest.mark.usefixtures("one_thread")


def _logprobs(model: graftlm.Model, ids: list[int], lora: list[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([t["logprob"] for t in model.logprobs(ids, top=0, lora=lora)])


def _peft_logprobs(pm: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = pm(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def made(expert_made: dict[str, Any]) -> dict[str, Any]:
    """The tiny Qwen3-MoE's and Mixtral's expert adapters (conftest's expert_made)."""
    return expert_made


def test_converted_gguf_stacks_the_experts(made: dict[str, Any]) -> None:
    r = gguf.GGUFReader(made["tmp"] / "lora.gguf")
    shapes = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    # ggml order: A ne=[n_in, r, n_expert], B ne=[r, n_out, n_expert]
    assert shapes["blk.0.ffn_gate_exps.weight.lora_a"] == [128, R, made["n_expert"]]
    assert shapes["blk.0.ffn_gate_exps.weight.lora_b"] == [R, made["n_ff"], made["n_expert"]]
    assert shapes["blk.1.ffn_down_exps.weight.lora_a"] == [made["n_ff"], R, made["n_expert"]]


@pytest.mark.parametrize("kind", ["params", "linear", "gguf"])
def test_rank_floor_from_the_header_is_the_rank(made: dict[str, Any], kind: str) -> None:
    """--max-lora-rank's check before the read: the header's floor of every form of expert
    adapter is its rank (PEFT's second target parameter saves its stacked A under
    `experts.base_layer.lora_A`: its (r n_expert, n_in) read as a rank of r n_expert refused a
    rank-R adapter under a limit above R)."""
    from graftlm.lora.prepare import rank_floor

    floor, tensor = rank_floor(made["tmp"] / ("lora.gguf" if kind == "gguf" else kind))
    assert floor == R, tensor


@pytest.mark.parametrize("kind", ["params", "linear", "gguf"])
def test_matches_peft(made: dict[str, Any], kind: str) -> None:
    path = made["tmp"] / ("lora.gguf" if kind == "gguf" else kind)
    ours = graftlm.load(made["base"], ctx_size=64, reference=True)
    i = ours.add_lora(path)
    got = _logprobs(ours, IDS, [{"id": i, "scale": 1.0}])
    base = _logprobs(ours, IDS, [])
    pm = made["pm"]
    ref = _peft_logprobs(pm, IDS)
    with pm.disable_adapter():
        ref_base = _peft_logprobs(pm, IDS)
    assert (base - ref_base).abs().max() < 1e-3
    assert (ref - ref_base).abs().mean() > 0.05, "the adapter should change PEFT's model"
    assert (got - ref).abs().max() < 1e-3


def test_zero_scale_and_mixed_rows(made: dict[str, Any]) -> None:
    """A zero scale is bit-identical to no adapter; rows of one batch on different adapters (and
    at different scales) that pick the same experts equal each row served alone (to the base's
    own rounding between batch sizes)."""
    from graftlm.runtime.engine import lora_rows
    from graftlm.step.batch import Batch

    ours = graftlm.load(made["base"], ctx_size=64, reference=True)
    a = ours.add_lora(made["tmp"] / "params")
    b = ours.add_lora(made["tmp"] / "lora.gguf")
    base = _logprobs(ours, IDS, [])
    assert torch.equal(_logprobs(ours, IDS, [{"id": a, "scale": 0.0}]), base)
    assert (_logprobs(ours, IDS, [{"id": a, "scale": 1.0}]) - base).abs().mean() > 0.05
    settings = [{}, {a: 1.0}, {b: -0.5}, {a: 0.5, b: 0.25}, {a: 0.0}]
    ours.engine = type(ours.engine)(ours.model, n_slots=len(settings))
    m, dev = ours.model, ours.model.device
    with torch.inference_mode():
        alone = [
            m.forward(Batch.single(IDS, 0, 0, lora_rows([s], dev), dev, exact=True), True)[0]
            for s in settings
        ]
        n = len(settings)
        batch = Batch(torch.tensor([IDS] * n), list(range(n)), [0] * n, [len(IDS)] * n,
                      lora_rows(settings, dev), exact=True)  # fmt: skip
        together = m.forward(batch, True)
    # a batch's expert groups differ in size from a row's alone, and the base's own products
    # round differently with the size (the base alone: ~1.4e-6 here); an adapter on the wrong
    # row would move the logits by ~1
    for row, want in zip(together, alone, strict=True):
        torch.testing.assert_close(row, want, rtol=0, atol=2e-5)
    assert not torch.equal(alone[0], alone[1]) and torch.equal(alone[0], alone[4])


LENS = (12, 7, 9, 5, 10, 8)  # (no prompt as long as the batch: the spy below tells them apart)


def _decode_steps(model: Any, rows: Any) -> list[torch.Tensor]:
    """Each of len(LENS) rows prefilled (no adapter) to its length, then three decode steps of
    all of them together at `rows`' scales: the steps' logits."""
    from graftlm.step.batch import Batch

    n = len(LENS)
    out = []
    with torch.inference_mode():
        for s, length in enumerate(LENS):
            model.forward(Batch.single([(7 * s + j) % 50 + 3 for j in range(length)], s, 0))
        for step in range(3):
            tokens = torch.tensor([[20 + step + 9 * s] for s in range(n)])
            batch = Batch(tokens, list(range(n)), [k + step for k in LENS], [1] * n, rows)
            out.append(model.forward(batch))
    return out


def _without_expert_0(src: Path, out: Path) -> Path:
    """The per-expert nn.Linear adapter `src` with no factors for expert 0 (its other experts'
    and q_proj's as they were): expert 0's sites then have none of it."""
    from safetensors.torch import load_file

    out.mkdir()
    (out / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".experts.0." not in k},
              str(out / "adapter_model.safetensors"))  # fmt: skip
    return out


@pytest.mark.parametrize("quant", ["q8_0", "f32"])
def test_native_decode_layer_adds_the_expert_delta(
    made: dict[str, Any], quant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused decode layer adds the experts' delta itself (Q8_0 experts: A in integer dots, B
    in bfloat16; f32: float32 factors): decode steps of rows on different adapters and scales
    that pick the same experts, one row without, one on an adapter that leaves expert 0 out, run
    in one native call, bit-identical to one native call a layer and within 1e-4 of the composed
    blocks (moe.py, the same packed factors). Adapters at scale 0 are bit-identical to none, and
    the row without an adapter is the row of a step with none."""
    from spies import stack_calls

    from graftlm.models import moe
    from graftlm.models.base import Transformer
    from graftlm.step.batch import LoraRows

    n = len(LENS)
    m = graftlm.load(made["base"].parent / f"model-{quant}.gguf", ctx_size=64, n_seq=n,
                     cache_type="f32")  # fmt: skip
    a = m.add_lora(made["tmp"] / "params", 0.0)
    b = m.add_lora(made["tmp"] / "lora.gguf", 0.0)
    c = m.add_lora(_without_expert_0(made["tmp"] / "linear", tmp_path / "no0"), 0.0)
    model = m.model
    if model.fused_stack() is None:
        pytest.skip("no native decode layer here")
    served = stack_calls(monkeypatch)
    rows = m.engine.lora_rows([{a: 1.0}, {a: -0.5}, {b: -0.5}, {a: 0.5, b: 0.25}, {}, {c: 1.0}])
    fused = _decode_steps(model, rows)
    plain = _decode_steps(model, None)
    zero = _decode_steps(model, LoraRows(torch.zeros(n, c + 1), (a, b, c)))
    assert served == ([False] * n + [True] * 3) * 3  # the prefills in PyTorch, decode natively
    for f, p, z in zip(fused, plain, zero, strict=True):
        assert torch.equal(z, p)
        assert torch.equal(f[4], p[4])
    for r in (0, 1, 2, 3, 5):  # (an adapter on the wrong row, or left out, moves the logits by ~1)
        assert not torch.allclose(fused[-1][r], plain[-1][r], rtol=1e-2, atol=1e-2)
    monkeypatch.setattr(Transformer, "native_layers", lambda self, x, batch: None)
    one_by_one = _decode_steps(model, rows)
    monkeypatch.setattr(Transformer, "native_block", lambda self, i, x, batch: None)
    monkeypatch.setattr(Transformer, "native_routed_ffn", lambda self, i, h, batch: None)
    chosen: list[torch.Tensor] = []  # each composed routed FFN's experts of each row
    mix = moe.mix_experts

    def spy(x: torch.Tensor, picked: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        if picked.shape[0] == n:  # (a decode step's: one token a row)
            chosen.append(picked)
        return mix(x, picked, *args, **kw)

    monkeypatch.setattr(moe, "mix_experts", spy)
    composed = _decode_steps(model, rows)
    for f, o, k in zip(fused, one_by_one, composed, strict=True):
        torch.testing.assert_close(f, o, rtol=0, atol=0)
        torch.testing.assert_close(f, k, rtol=1e-4, atol=1e-4)
    # rows on different adapters (0 and 2) on one expert, two on the same (0 and 1: each block
    # of B read once for both), and the partial adapter's row on expert 0
    for r, q in ((0, 2), (0, 1)):
        assert any(set(p[r].tolist()) & set(p[q].tolist()) for p in chosen)
    assert any(0 in p[5].tolist() for p in chosen)


def test_one_row_on_two_threads_by_whole_experts_is_the_shared_steps(
    made: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row decoding on two threads with the expert adapter: the routed FFN's threads each
    take whole experts, each expert's pairs quantized, their dots of A, both products and the
    delta of B (gl_set_moe_jobs(1), the default), or share every step with barriers between (0,
    its twin): the same bits, with the adapter and without."""
    from spies import stack_calls

    from graftlm.native import library
    from graftlm.step.batch import Batch

    m = graftlm.load(made["base"].parent / "model-q8_0.gguf", ctx_size=64, n_seq=1,
                     cache_type="f32")  # fmt: skip
    a = m.add_lora(made["tmp"] / "lora.gguf", 0.0)
    model, lib = m.model, library()
    if model.fused_stack() is None or lib is None:
        pytest.skip("no native decode layer here")
    rows = m.engine.lora_rows([{a: 0.75}])

    def run(lora: Any) -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            model.forward(Batch.single([(7 * j) % 50 + 3 for j in range(10)], 0, 0))
            for step in range(3):
                tokens = torch.tensor([[20 + step]])
                out.append(model.forward(Batch(tokens, [0], [10 + step], [1], lora)))
        return out

    served = stack_calls(monkeypatch)
    torch.set_num_threads(2)  # (the module's fixture restores one)
    before = lib.gl_set_moe_jobs(1)
    try:
        jobs = run(rows) + run(None)
        lib.gl_set_moe_jobs(0)
        shared = run(rows) + run(None)
    finally:
        lib.gl_set_moe_jobs(before)
    assert served.count(True) == 12, served  # every decode step ran in the native layer
    for x, y in zip(jobs, shared, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.allclose(jobs[2], jobs[5], rtol=1e-3, atol=1e-3)  # the adapter counted


def test_native_decode_with_an_expert_adapter_follows_the_reference(made: dict[str, Any]) -> None:
    """Greedy decoding with an expert adapter, served by the native decode layer (Q8_0: its
    packed factors), picks the tokens of the reference model (float32 factors in PyTorch); at
    scale 0 the tokens of no adapter."""
    from graftlm.lora.settings import AdapterSettings
    from graftlm.runtime.sampling import SamplingParams
    from graftlm.runtime.scheduler import Request

    ours = graftlm.load(made["base"], ctx_size=64)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(settings: dict[int, float]) -> list[int]:
        r = ours.engine.submit(Request(IDS[:8], greedy, AdapterSettings(settings)))
        ours.engine.run(r)
        return list(r.generated)

    plain = run({})
    a = ours.add_lora(made["tmp"] / "lora.gguf")
    fused = [ours.model.fused_layer(i) for i in range(ours.config.n_layer)]
    if any(f is None for f in fused):
        pytest.skip("no native decode layer here")
    assert all(f.bind_lora() for f in fused if f is not None)
    assert all(f is not None and f.layer.l_exp_gate_up and f.layer.l_exp_down for f in fused)
    assert run({a: 0.0}) == plain
    ref = graftlm.load(made["base"], ctx_size=64, reference=True)
    ra = ref.add_lora(made["tmp"] / "lora.gguf")
    got = ours.generate(IDS[:8], max_tokens=6, temperature=0, lora=[{"id": a, "scale": 1.0}])
    want = ref.generate(IDS[:8], max_tokens=6, temperature=0, lora=[{"id": ra, "scale": 1.0}])
    assert got == want
    ours.remove_lora(a)
    assert all(f is not None and f.bind_lora() and not f.layer.l_exp_gate_up for f in fused)


def test_refusals_name_the_tensor_and_dimensions(made: dict[str, Any], tmp_path: Path) -> None:
    ours = graftlm.load(made["base"], ctx_size=64, reference=True)
    src = gguf.GGUFReader(made["tmp"] / "lora.gguf")
    arch = ours.config.arch  # (the adapter's own: llama for Mixtral)
    w = gguf.GGUFWriter(tmp_path / "bad.gguf", arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 8.0)
    for t in src.tensors:
        data = t.data.reshape([int(d) for d in reversed(t.shape)])
        if t.name == "blk.0.ffn_down_exps.weight.lora_a":
            data = data[:-1]  # one expert short
        w.add_tensor(t.name, data.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    before, logits = ours.loras, ours.logits(IDS)
    with pytest.raises(AdapterError) as exc:
        ours.add_lora(tmp_path / "bad.gguf")
    msg = str(exc.value)
    assert "general.architecture" not in msg  # only the one tensor is wrong
    assert "blk.0.ffn_down_exps.weight" in msg and str(made["n_expert"] - 1) in msg
    assert f"ne=[{made['n_ff']}, {R}, {made['n_expert'] - 1}]" in msg
    assert ours.loras == before
    assert not any(p.lora for p in ours.model.projections().values())  # nothing attached
    assert torch.equal(ours.logits(IDS), logits)


def test_peft_refusals_name_the_module_and_dimensions(made: dict[str, Any], tmp_path: Path) -> None:
    """A target_parameters adapter made for fewer experts, and a per-expert module past the
    base's experts: one error naming each module and every dimension; nothing attached."""
    from safetensors.torch import load_file

    ours = graftlm.load(made["base"], ctx_size=64, reference=True)
    logits = ours.logits(IDS)
    n = made["n_expert"]
    for kind in ("params", "linear"):
        src = made["tmp"] / kind
        bad = tmp_path / kind
        bad.mkdir()
        (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
        tensors = load_file(str(src / "adapter_model.safetensors"))
        if kind == "params":  # layer 1's down_proj as if for n - 1 experts
            key = "base_model.model.model.layers.1.mlp.experts.lora_A.weight"
            tensors[key] = tensors[key][:-R].clone()
            tensors[key.replace("lora_A", "lora_B")] = tensors[key.replace("lora_A", "lora_B")][
                :, :-R
            ].clone()
        else:  # one expert past the base's
            for k in [k for k in tensors if ".experts.0." in k and "layers.0." in k]:
                tensors[k.replace(".experts.0.", f".experts.{n}.")] = tensors[k].clone()
        save_file(tensors, str(bad / "adapter_model.safetensors"))
        with pytest.raises(AdapterError) as exc:
            ours.add_lora(bad)
        msg = str(exc.value)
        if kind == "params":
            assert "model.layers.1.mlp.experts" in msg
            assert f"{R} * {n} = {R * n}" in msg and f"[{R * (n - 1)}, " in msg
        else:
            assert f"experts.{n}." in msg and f"expert {n}, but the base has {n} experts" in msg
        assert ours.loras == []
        assert not any(p.lora for p in ours.model.projections().values())
        assert torch.equal(ours.logits(IDS), logits)


def test_peft_expert_factors_that_are_not_floating_point(
    made: dict[str, Any], tmp_path: Path
) -> None:
    """An integer expert factor (both forms: target_parameters and per-expert modules) is
    refused by its dtype, named with its tensor; it was read as float32 and attached."""
    from safetensors.torch import load_file

    ours = graftlm.load(made["base"], ctx_size=64, reference=True)
    logits = ours.logits(IDS)
    for kind, part in (("params", ".experts.lora_B"), ("linear", ".experts.0.")):
        src = made["tmp"] / kind
        bad = tmp_path / kind
        bad.mkdir()
        (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
        tensors = load_file(str(src / "adapter_model.safetensors"))
        key = next(k for k in tensors if part in k and "layers.1." in k and "lora_B" in k)
        tensors[key] = (tensors[key] * 100).to(torch.int16)
        save_file(tensors, str(bad / "adapter_model.safetensors"))
        with pytest.raises(AdapterError) as exc:
            ours.add_lora(bad)
        assert f"lora_B {key!r} has dtype I16; a factor must be one of F32" in str(exc.value)
        assert ours.loras == []
        assert torch.equal(ours.logits(IDS), logits)


def test_expert_adapter_on_a_dense_base_is_refused(made: dict[str, Any]) -> None:
    ours = graftlm.load(TINY / "qwen3" / "model-f32.gguf", ctx_size=64, reference=True)
    with pytest.raises(AdapterError) as exc:
        ours.add_lora(made["tmp"] / "params")
    assert "model.layers.0.mlp.experts': the base has no routed experts in layer 0" in str(
        exc.value
    )


# gpt-oss's expert adapters, served since (no longer refused): test_gpt_oss_expert_lora.py


def test_expert_adapters_are_held_once(made: dict[str, Any]) -> None:
    """Each routed expert's delta keeps only its packed form (Q8_0 experts: A as Q8_0 codes, B
    in bfloat16), the very object its seam's site holds; the listed bytes are those forms'."""
    m = graftlm.load(made["base"].parent / "model-q8_0.gguf", ctx_size=64)
    a = m.add_lora(made["tmp"] / "lora.gguf", 0.0)
    deltas = m.adapters.attached[a].adapter.deltas
    table = m.model.seams
    experts = [name for name in deltas if "_exps[" in name]
    assert len(experts) >= made["n_expert"]
    for name, d in deltas.items():
        site = table.projections[name].lora
        assert site is not None and d.packed is not None and d._a is None and d._b is None
        assert site._packed[a] is d.packed and not site._factors
        if name in experts:
            assert d.packed.half and d.packed.aq is not None
    (info,) = m.loras
    assert info["bytes"] == sum(d.packed.nbytes for d in deltas.values() if d.packed is not None)


@pytest.mark.parametrize("quant", ["q8_0", "f32"])
def test_prompt_expert_products_take_one_pass(
    made: dict[str, Any], quant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's expert products with their adapters' delta (the composed routed FFN, a fast
    step) run as one native pass each (gl_proj: x quantized once, the delta on every thread),
    bit-identical to the product and the delta as two calls, on one thread and two: rows of a
    batch on different adapters and scales picking the same experts, a row without, a row at
    scale 0 equal to no adapter."""
    from graftlm.models import moe, seam
    from graftlm.models.base import Transformer
    from graftlm.native import library
    from graftlm.step.batch import Batch, LoraRows

    # the composed routed FFN (a prompt's is native where its layer's struct serves it)
    monkeypatch.setattr(Transformer, "native_routed_ffn", lambda self, i, h, batch: None)
    settings = [{0: 1.0}, {0: -0.5}, {1: 0.25, 0: 0.5}, {}, {0: 0.0}]
    n = len(settings)
    m = graftlm.load(made["base"].parent / f"model-{quant}.gguf", ctx_size=64, n_seq=n)
    a = m.add_lora(made["tmp"] / "params", 0.0)
    b = m.add_lora(made["tmp"] / "lora.gguf", 0.0)
    rows = m.engine.lora_rows([{(a, b)[k]: v for k, v in s.items()} for s in settings])
    passes: list[bool] = []
    one_pass = seam.one_pass

    def spy(*args: Any) -> torch.Tensor | None:
        y = one_pass(*args)
        passes.append(y is not None)
        return y

    def run(lora: LoraRows | None) -> torch.Tensor:
        batch = Batch(torch.tensor([IDS] * n), list(range(n)), [0] * n, [len(IDS)] * n, lora)
        with torch.inference_mode():
            return m.model.forward(batch, True)

    def two_calls(*args: Any) -> None:  # (the product, then the delta: as before one_pass)
        return None

    lib = library()
    assert lib is not None
    amx_rows = lib.gl_set_amx_rows(0)  # (tiles would take B's delta in bfloat16: moe's doc)
    got: dict[tuple[bool, int], torch.Tensor] = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)  # (the module's fixture restores one)
            for two in (False, True):
                monkeypatch.setattr(moe, "one_pass", two_calls if two else spy)
                got[two, threads] = run(rows)
    finally:
        lib.gl_set_amx_rows(amx_rows)
    assert passes and all(passes), "every expert product with an adapter takes one pass"
    plain = run(None)
    zero = run(LoraRows(torch.zeros(n, b + 1), (a, b)))
    for key, out in got.items():
        assert torch.equal(out, got[False, 1]), key
    assert torch.equal(zero, plain)
    assert torch.equal(got[False, 1][3], plain[3]) and torch.equal(got[False, 1][4], plain[4])
    for r in range(3):  # (an adapter on the wrong row moves the logits by ~1)
        assert not torch.allclose(got[False, 1][r], plain[r], rtol=1e-2, atol=1e-2)
