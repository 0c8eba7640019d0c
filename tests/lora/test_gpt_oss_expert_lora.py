"""LoRA on gpt-oss's routed experts: a tiny gpt-oss from transformers (biases, the clamped
SwiGLU, gate_up_proj's gate and up columns interleaved) with a PEFT adapter on its experts' 3-D
parameters (`target_parameters`), and that adapter converted to llama.cpp's GGUF layout by
`convert-lora` (ffn_gate_exps / ffn_up_exps, as llama.cpp's converter splits the base weight).
llama.cpp's own `convert_lora_to_gguf.py` cannot convert it: its LoRA tensors transpose only 2-D
factors, and gpt-oss's experts are transposed 3-D parameters. PEFT is the oracle, and llama.cpp's
server applies the converted file.

Also here: convert-lora both ways and export-lora with expert adapters (gpt-oss and Qwen3-MoE),
and malformed expert adapters refused with the tensor and its dimensions.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from expert_made import expert_adapter, mxfp4_base
from llama_reference import LLAMA_SERVER, llama_top_logprobs
from made_families import made_dir
from safetensors.torch import load_file, save_file
from shared_data import TINY

import graftlm
from graftlm.errors import AdapterError
from graftlm.gguf import GGUFFile
from graftlm.lora.convert import gguf_to_peft, peft_to_gguf
from graftlm.lora.export import export_lora

IDS = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
R = 4
T = gguf.GGMLQuantizationType
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")

pytestmark = pytest.mark.usefixtures("one_thread")


def _logprobs(model: graftlm.Model, ids: list[int], lora: list[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([t["logprob"] for t in model.logprobs(ids, top=0, lora=lora)])


def _peft_logprobs(pm: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = pm(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def made(gpt_oss_made: dict[str, Any]) -> dict[str, Any]:
    """The tiny gpt-oss's expert adapter (conftest's gpt_oss_made)."""
    return gpt_oss_made


def test_converted_gguf_splits_gate_and_up(made: dict[str, Any]) -> None:
    """ffn_gate_exps's B is gate_up_proj's even rows of B, ffn_up_exps's the odd ones; both
    share gate_up_proj's A (ggml order: A ne=[n_in, r, n_expert], B ne=[r, n_out, n_expert])."""
    f = GGUFFile(made["tmp"] / "lora.gguf")
    n, n_ff = made["n_expert"], made["n_ff"]
    shapes = {name: list(e.shape) for name, e in f.tensors.items()}  # torch order
    assert shapes["blk.0.ffn_gate_exps.weight.lora_a"] == [n, R, 128]
    assert shapes["blk.0.ffn_up_exps.weight.lora_b"] == [n, n_ff, R]
    assert shapes["blk.1.ffn_down_exps.weight.lora_a"] == [n, R, n_ff]
    st = load_file(str(made["tmp"] / "params" / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_"
    a = st[key + "A.weight"].reshape(n, R, -1)
    b = st[key + "B.weight"].reshape(2 * n_ff, R, n).permute(2, 0, 1)  # (n_expert, 2 n_ff, r)
    got = {k: torch.from_numpy(np.array(e.data)) for k, e in f.tensors.items()}
    assert torch.equal(got["blk.0.ffn_gate_exps.weight.lora_a"], a)
    assert torch.equal(got["blk.0.ffn_up_exps.weight.lora_a"], a)
    assert torch.equal(got["blk.0.ffn_gate_exps.weight.lora_b"], b[:, 0::2])
    assert torch.equal(got["blk.0.ffn_up_exps.weight.lora_b"], b[:, 1::2])


@pytest.mark.parametrize("kind", ["params", "gguf"])
def test_matches_peft(made: dict[str, Any], kind: str) -> None:
    path = made["tmp"] / ("lora.gguf" if kind == "gguf" else kind)
    ours = graftlm.load(made["base"], ctx_size=64, reference=True)
    i = ours.add_lora(path, 0.0)
    got = _logprobs(ours, IDS, [{"id": i, "scale": 1.0}])
    base = _logprobs(ours, IDS, [])
    pm = made["pm"]
    ref = _peft_logprobs(pm, IDS)
    with pm.disable_adapter():
        ref_base = _peft_logprobs(pm, IDS)
    assert (base - ref_base).abs().max() < 1e-3
    assert (ref - ref_base).abs().mean() > 0.05, "the adapter should change PEFT's model"
    assert (got - ref).abs().max() < 1e-3
    assert torch.equal(_logprobs(ours, IDS, [{"id": i, "scale": 0.0}]), base)


LENS = (12, 7, 9, 5, 10, 8)


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


@pytest.mark.parametrize("quant", ["q8_0", "f32", "mxfp4"])
def test_native_decode_layer_adds_the_expert_delta(
    made: dict[str, Any], quant: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Decode steps of rows on different adapters and scales (one without) run in the one-call
    native layer with gpt-oss's biases and clamped SwiGLU (experts in Q8_0, F32 or MXFP4), the
    experts' deltas added there: within 1e-4 of the composed blocks (routed_ffn, the same packed
    factors); adapters at scale 0 bit-identical to none, and the row without an adapter the row
    of a step with none."""
    from spies import stack_calls

    from graftlm.models.base import Transformer
    from graftlm.step.batch import LoraRows

    n = len(LENS)
    path = made["folder"] / f"model-{quant}.gguf"
    if quant == "mxfp4":
        path = mxfp4_base(made["base"], tmp_path / "mxfp4.gguf")
    m = graftlm.load(path, ctx_size=64, n_seq=n, cache_type="f32")
    a = m.add_lora(made["tmp"] / "params", 0.0)
    b = m.add_lora(made["tmp"] / "lora.gguf", 0.0)
    model = m.model
    if model.fused_stack() is None:
        pytest.skip("no native decode layer here")
    served = stack_calls(monkeypatch)
    rows = m.engine.lora_rows([{a: 1.0}, {a: -0.5}, {b: -0.5}, {a: 0.5, b: 0.25}, {}, {b: 1.0}])
    fused = _decode_steps(model, rows)
    plain = _decode_steps(model, None)
    zero = _decode_steps(model, LoraRows(torch.zeros(n, b + 1), (a, b)))
    assert served == ([False] * n + [True] * 3) * 3  # the prefills in PyTorch, decode natively
    layers = [model.fused_layer(i) for i in range(m.config.n_layer)]
    assert all(f is not None and f.layer.l_exp_gate_up and f.layer.l_exp_down for f in layers)
    for f, p, z in zip(fused, plain, zero, strict=True):
        assert torch.equal(z, p)
        assert torch.equal(f[4], p[4])
    for r in (0, 1, 2, 3, 5):
        assert not torch.allclose(fused[-1][r], plain[-1][r], rtol=1e-2, atol=1e-2)
    monkeypatch.setattr(Transformer, "native_layers", lambda self, x, batch: None)
    monkeypatch.setattr(Transformer, "native_block", lambda self, i, x, batch: None)
    monkeypatch.setattr(Transformer, "native_routed_ffn", lambda self, i, h, batch: None)
    composed = _decode_steps(model, rows)
    for f, k in zip(fused, composed, strict=True):
        torch.testing.assert_close(f, k, rtol=1e-4, atol=1e-4)


def test_llama_cpp_applies_the_converted_adapter(made: dict[str, Any]) -> None:
    """llama-server with the converted file as --lora: the next token's top-10 log-probabilities
    after prompts of 5, 40 and 200 tokens within 1e-4 of graftlm's with the adapter (which moves
    them by ~1)."""
    if not LLAMA_SERVER.exists():
        pytest.skip(f"{LLAMA_SERVER} is not here")
    ids = torch.randint(3, 1000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [ids[:n] for n in (5, 40, 200)]
    theirs = llama_top_logprobs(made["base"], prompts, made["tmp"] / "lora.gguf")
    ours = graftlm.load(made["base"], ctx_size=256, reference=True)
    i = ours.add_lora(made["tmp"] / "lora.gguf", 0.0)
    for p, top in zip(prompts, theirs, strict=True):
        on = torch.log_softmax(ours.logits(p, lora=[{"id": i, "scale": 1.0}])[-1].float(), -1)
        off = torch.log_softmax(ours.logits(p, lora=[{"id": i, "scale": 0.0}])[-1].float(), -1)
        assert max(abs(on[t].item() - lp) for t, lp in top.items()) < 1e-4
        assert max(abs(off[t].item() - lp) for t, lp in top.items()) > 0.1


# -- convert-lora ------------------------------------------------------------------------------


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {k: np.asarray(e.data) for k, e in GGUFFile(path).tensors.items()}


def test_convert_round_trips_bit_equal(made: dict[str, Any], tmp_path: Path) -> None:
    """PEFT -> GGUF -> PEFT gives the same keys and factors, bit for bit, and the config's
    target_parameters; GGUF -> PEFT -> GGUF the same tensors. PEFT itself loads the written
    directory onto the transformers model and computes what the original adapter does."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    src, tmp = made["tmp"] / "params", made["tmp"]
    notes = gguf_to_peft(tmp / "lora.gguf", made["base"], tmp_path / "back")
    assert any("target_parameters" in n for n in notes)
    want = load_file(str(src / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    cfg = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (R, 8, ["q_proj"])
    peft_to_gguf(tmp_path / "back", made["base"], tmp_path / "again.gguf")
    first, again = _tensors(tmp / "lora.gguf"), _tensors(tmp_path / "again.gguf")
    assert sorted(first) == sorted(again)
    for k, v in first.items():
        assert np.array_equal(again[k], v), k
    model = transformers.AutoModelForCausalLM.from_pretrained(
        made["folder"] / "hf", dtype=torch.float32
    )
    loaded = peft.PeftModel.from_pretrained(model, tmp_path / "back")
    assert (_peft_logprobs(loaded, IDS) - _peft_logprobs(made["pm"], IDS)).abs().max() < 1e-5


# family -> its last expert's up projection as a per-expert module
LAST_UP = {"qwen3moe": "mlp.experts.15.up_proj", "mixtral": "block_sparse_moe.experts.7.w3"}


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_others_convert_both_ways(family: str, tmp_path: Path) -> None:
    """Qwen3-MoE's and Mixtral's expert adapters (target_parameters, gate_up_proj's rows [gate;
    up]) to GGUF, back to PEFT as per-expert modules (experts.N.gate_proj / experts.N.w1: the
    layout llama.cpp's converter reads, which holds any GGUF expert adapter), and to GGUF again
    bit for bit; all three serve the same log-probabilities."""
    folder = made_dir(family) if family == "qwen3moe" else TINY / family
    if folder is None or not (folder / "hf").is_dir():
        pytest.skip("no transformers, PEFT or llama.cpp converter here")
    expert_adapter(folder, tmp_path / "params")
    base = folder / "model-f32.gguf"
    peft_to_gguf(tmp_path / "params", base, tmp_path / "a.gguf")
    notes = gguf_to_peft(tmp_path / "a.gguf", base, tmp_path / "linear")
    assert any("per-expert modules" in n for n in notes)
    keys = load_file(str(tmp_path / "linear" / "adapter_model.safetensors"))
    assert f"base_model.model.model.layers.1.{LAST_UP[family]}.lora_B.weight" in keys
    peft_to_gguf(tmp_path / "linear", base, tmp_path / "b.gguf")
    first, again = _tensors(tmp_path / "a.gguf"), _tensors(tmp_path / "b.gguf")
    assert sorted(first) == sorted(again)
    for k, v in first.items():
        assert np.array_equal(again[k], v), k
    ours = graftlm.load(base, ctx_size=64, reference=True)
    got = [
        _logprobs(ours, IDS, [{"id": ours.add_lora(p, 0.0), "scale": 1.0}])
        for p in (tmp_path / "params", tmp_path / "a.gguf", tmp_path / "linear")
    ]
    assert (got[0] - _logprobs(ours, IDS, [])).abs().mean() > 0.05
    for g in got[1:]:
        assert (g - got[0]).abs().max() < 1e-5


# -- export-lora -------------------------------------------------------------------------------


def _runtime(base: Path, adapters: list[tuple[Path, float]]) -> torch.Tensor:
    model = graftlm.load(base, ctx_size=64, reference=True)
    lora = [{"id": model.add_lora(p, scale=0.0), "scale": s} for p, s in adapters]
    return torch.log_softmax(model.logits(IDS, lora=lora).float(), dim=-1)


def _merged(path: Path) -> torch.Tensor:
    model = graftlm.load(path, ctx_size=64, reference=True)
    return torch.log_softmax(model.logits(IDS).float(), dim=-1)


def test_export_merges_expert_adapters(made: dict[str, Any], tmp_path: Path) -> None:
    """The PEFT adapter at 1.5 and its GGUF conversion at -0.5 merged into the f32 base give
    what the runtime gives with both attached; on an MXFP4 base, outtype "same" requantizes the
    merged experts to MXFP4, costing no more than MXFP4 itself costs the adapted model."""
    adapters = [(made["tmp"] / "params", 1.5), (made["tmp"] / "lora.gguf", -0.5)]
    out = tmp_path / "merged.gguf"
    notes = export_lora(made["base"], adapters, out, outtype="f32")
    # q_proj, gate, up and down of both layers
    assert notes[-1].startswith(f"wrote {out}: merged 8 tensors from 2 adapters")
    ref = _runtime(made["base"], adapters)
    assert (_merged(out) - ref).abs().max() < 1e-3
    assert (_merged(made["base"]) - ref).abs().mean() > 0.05

    mx = mxfp4_base(made["base"], tmp_path / "mxfp4.gguf")
    export_lora(mx, adapters, tmp_path / "same.gguf", outtype="same")
    m = GGUFFile(tmp_path / "same.gguf")
    for name in EXPERTS:
        assert m.tensors[f"blk.0.{name}"].ggml_type == T.MXFP4
    assert m.tensors["blk.0.ffn_gate_exps.bias"].ggml_type == T.F32  # copied as it was
    ref_mx = _runtime(mx, adapters)
    mx_cost = (ref - ref_mx).abs().mean()
    assert (_merged(tmp_path / "same.gguf") - ref_mx).abs().mean() < 1.5 * mx_cost


# -- malformed expert adapters -----------------------------------------------------------------


def _rewritten(src: Path, dst: Path, change: Callable[[str, np.ndarray], np.ndarray]) -> Path:
    """gpt-oss GGUF adapter `src` (alpha 8) written to `dst`, each tensor (torch order) as
    change(name, tensor) gives it."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "gpt-oss")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 8.0)
    for t in reader.tensors:
        data = t.data.reshape([int(d) for d in reversed(t.shape)])
        w.add_tensor(t.name, change(t.name, data).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _first_ranks(name: str, data: np.ndarray, r: int) -> np.ndarray:
    """A factor's first r ranks: lora_a (.., r, n_in), lora_b (.., n_out, r)."""
    return data[..., :r, :] if name.endswith("lora_a") else data[..., :r]


def _one_expert_short(src: Path, dst: Path, victim: str) -> Path:
    """GGUF adapter `src` with tensor `victim` one expert short."""
    return _rewritten(src, dst, lambda name, data: data[:-1] if name == victim else data)


def test_wrong_expert_count_is_named(made: dict[str, Any], tmp_path: Path) -> None:
    """A GGUF expert adapter one expert short, and a target_parameters one made for fewer
    experts: attaching, merging and converting each refuse with the tensor (or module) and
    every dimension, and nothing is attached or written."""
    n, n_ff = made["n_expert"], made["n_ff"]
    victim = "blk.1.ffn_up_exps.weight.lora_a"
    bad = _one_expert_short(made["tmp"] / "lora.gguf", tmp_path / "bad.gguf", victim)
    ours = graftlm.load(made["base"], ctx_size=64, reference=True)
    logits = ours.logits(IDS)
    with pytest.raises(AdapterError) as exc:
        ours.add_lora(bad)
    assert "blk.1.ffn_up_exps.weight" in str(exc.value)
    assert f"ne=[128, {R}, {n - 1}]" in str(exc.value) and str(n) in str(exc.value)
    assert ours.loras == [] and torch.equal(ours.logits(IDS), logits)
    with pytest.raises(AdapterError) as exc:
        export_lora(made["base"], [(bad, 1.0)], tmp_path / "m.gguf")
    msg = str(exc.value)
    assert "tensor blk.1.ffn_up_exps.weight: routed-expert tensor" in msg
    assert f"ne=[128, {R}, {n - 1}]" in msg and f"the base has {n}" in msg
    with pytest.raises(AdapterError) as exc:
        gguf_to_peft(bad, made["base"], tmp_path / "p")
    msg = str(exc.value)
    assert "tensor blk.1.ffn_up_exps.weight" in msg and f"ne=[128, {R}, {n - 1}]" in msg
    assert f"lora_a has {n - 1} experts and lora_b {n}" in msg
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "p").exists()

    src, short = made["tmp"] / "params", tmp_path / "short"
    short.mkdir()
    shutil.copy(src / "adapter_config.json", short / "adapter_config.json")
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.experts.lora_A.weight"  # down_proj
    tensors[key] = tensors[key][:-R].clone()
    b_key = key.replace("lora_A", "lora_B")
    tensors[b_key] = tensors[b_key][:, :-R].clone()
    save_file(tensors, str(short / "adapter_model.safetensors"))
    for attempt in (
        lambda: ours.add_lora(short),
        lambda: peft_to_gguf(short, made["base"], tmp_path / "s.gguf"),
        lambda: export_lora(made["base"], [(short, 1.0)], tmp_path / "m.gguf"),
    ):
        with pytest.raises(AdapterError) as exc:
            attempt()
        msg = str(exc.value)
        assert "model.layers.1.mlp.experts" in msg, msg
        assert f"{R} * {n} = {R * n}" in msg and f"[{R * (n - 1)}, {n_ff}]" in msg, msg
    assert ours.loras == []
    assert sorted(p.name for p in tmp_path.glob("*.gguf*")) == ["bad.gguf"]


def test_stacking_keeps_every_experts_delta() -> None:
    """Per-expert pairs of different ranks and factors, one expert left out, stacked into
    llama.cpp's one pair: each expert's delta (factor * B @ A) is the one its pair gave, the
    left-out expert's zero."""
    from graftlm.lora.convert_experts import stack_experts
    from graftlm.lora.peft_base import LoraPair

    g = torch.Generator().manual_seed(3)
    pairs = [
        LoraPair("m", "blk.0.ffn_down_exps", torch.randn(r, 6, generator=g),
                 torch.randn(5, r, generator=g), s, r, 1.0, e)
        for e, r, s in ((0, 2, 0.5), (2, 4, 2.0), (3, 4, 0.5))
    ]  # fmt: skip
    dense = LoraPair("q", "blk.0.attn_q", torch.ones(2, 6), torch.ones(6, 2), 1.0, 2, 2.0)
    out = stack_experts([dense, *pairs], 4)
    assert out[0] is dense and len(out) == 2
    st = out[1]
    assert st.expert is None and st.a.shape == (4, 4, 6) and st.b.shape == (4, 5, 4)
    got = st.scaling * st.b @ st.a  # (n_expert, n_out, n_in)
    assert torch.equal(got[1], torch.zeros(5, 6))
    for p in pairs:
        assert p.expert is not None
        torch.testing.assert_close(got[p.expert], p.scaling * p.b @ p.a)


def test_rank_one_converts_both_ways(made: dict[str, Any], tmp_path: Path) -> None:
    """A rank-1 adapter (every factor's first rank of the converted file): GGUF -> PEFT writes
    target_parameters factors whose B is a strided view before it is copied, and -> GGUF gives
    the rank-1 file back bit for bit."""
    one = _rewritten(
        made["tmp"] / "lora.gguf", tmp_path / "r1.gguf", lambda n, d: _first_ranks(n, d, 1)
    )
    gguf_to_peft(one, made["base"], tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    assert cfg["r"] == 1 and cfg["target_parameters"]
    peft_to_gguf(tmp_path / "p", made["base"], tmp_path / "again.gguf")
    first, again = _tensors(one), _tensors(tmp_path / "again.gguf")
    assert sorted(first) == sorted(again)
    for k, v in first.items():
        assert np.array_equal(again[k], v), k


def test_target_parameters_need_the_base(made: dict[str, Any], tmp_path: Path) -> None:
    """GGUF -> PEFT of gpt-oss's expert tensors without the base model file is refused (PEFT's
    target_parameters hold every layer, and the file's names bound no layer count); nothing is
    written."""
    with pytest.raises(AdapterError) as exc:
        gguf_to_peft(made["tmp"] / "lora.gguf", None, tmp_path / "p")
    assert "target_parameters" in str(exc.value) and "base model file" in str(exc.value)
    assert not (tmp_path / "p").exists()


def test_target_parameters_of_differing_ranks_name_the_tensors(
    made: dict[str, Any], tmp_path: Path
) -> None:
    """One layer's down_proj tensors cut to rank 2: GGUF -> PEFT refuses (target_parameters
    have one rank) naming the tensors of each rank."""
    cut = _rewritten(
        made["tmp"] / "lora.gguf",
        tmp_path / "cut.gguf",
        lambda n, d: _first_ranks(n, d, 2) if n.startswith("blk.1.ffn_down_exps") else d,
    )
    with pytest.raises(AdapterError) as exc:
        gguf_to_peft(cut, made["base"], tmp_path / "p")
    msg = str(exc.value)
    assert str(cut) in msg and "rank 2: blk.1.ffn_down_exps.weight;" in msg
    assert f"rank {R}: blk.0.ffn_down_exps.weight" in msg
    assert not (tmp_path / "p").exists()
