"""Mixture of experts (Mixtral-style `llama`): adapters on attention work, routed-expert adapters
are refused by name, each expert's 2-D weight is exactly its slice of the 3-D file tensor, and
an exact batch's experts take the exact products."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from families import (
    IDS,
    family_dir,
    forward,
    hf_logits,
    hf_model,
    load,
    one_thread,  # noqa: F401 (an autouse fixture: tiny models run on one thread)
    rel_err,
    with_adapter,
)
from tiny_models import write_tiny_adapter

from graftlm.errors import AdapterError
from graftlm.gguf import GGUFFile
from graftlm.models.base import Weights
from graftlm.models.moe import Experts, GatedExperts

RANK, ALPHA = 4, 8.0


def _permute_rows(b: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order for llama Q/K rows (and so for the B of an adapter on them):
    each head's two halves interleaved, so RoPE can rotate adjacent pairs."""
    return (
        b.reshape(n_head, 2, b.shape[0] // n_head // 2, *b.shape[1:])
        .swapaxes(1, 2)
        .reshape(b.shape)
    )


def _peft_to_gguf(peft_model: torch.nn.Module, path: Path, n_head: int, n_head_kv: int) -> Path:
    """What llama.cpp's convert_lora_to_gguf.py writes for an attention-only llama adapter."""
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", ALPHA)
    for name, module in peft_model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        kind = name.rsplit(".", 1)[1]
        a = module.lora_A["default"].weight.detach().numpy()  # (r, n_in)
        b = module.lora_B["default"].weight.detach().numpy()  # (n_out, r)
        if kind in ("q_proj", "k_proj"):
            b = _permute_rows(b, n_head if kind == "q_proj" else n_head_kv)
        base = f"blk.{layer}.{names[kind]}.weight"
        w.add_tensor(base + ".lora_a", np.ascontiguousarray(a))
        w.add_tensor(base + ".lora_b", np.ascontiguousarray(b))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_attention_adapter_on_moe_matches_peft(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,  # random B too, so the adapter changes the output
    )
    hf = peft.get_peft_model(hf_model("mixtral"), config).eval()
    ref = hf_logits(hf, IDS)
    with hf.disable_adapter():
        base = hf_logits(hf, IDS)
    assert rel_err(base, ref) > 0.1
    model = load("mixtral")
    path = _peft_to_gguf(hf, tmp_path / "attn.gguf", model.cfg.n_head, model.cfg.n_head_kv)
    assert rel_err(forward(with_adapter(model, path), IDS, scale=1.0), ref) < 1e-3
    hf.save_pretrained(tmp_path / "peft")  # and the PEFT directory itself
    ours = forward(with_adapter(load("mixtral"), tmp_path / "peft"), IDS, scale=1.0)
    assert rel_err(ours, ref) < 1e-3


def test_routed_expert_adapter_is_refused_by_name(tmp_path: Path) -> None:
    model = load("mixtral")
    targets = {
        "blk.0.ffn_gate_exps": (128, 64),
        "blk.1.ffn_down_exps": (64, 128),
        "blk.0.attn_q": (128, 128),
    }
    path = write_tiny_adapter(tmp_path / "exps.gguf", targets=targets, arch="llama")
    with pytest.raises(AdapterError) as err:
        with_adapter(model, path)
    msg = str(err.value)
    # every refused tensor is named in the one error; the attention tensor is not a problem
    assert "blk.0.ffn_gate_exps.weight: routed-expert" in msg
    assert "blk.1.ffn_down_exps.weight: routed-expert" in msg
    assert "attn_q" not in msg
    assert not any(p.lora for p in model.projections().values())  # nothing attached


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_experts_are_slices_of_the_file_tensor(quant: str) -> None:
    file = GGUFFile(family_dir("mixtral") / f"model-{quant}.gguf")
    entry = file.tensors["blk.1.ffn_down_exps.weight"]
    whole = gguf.quants.dequantize(np.asarray(entry.data), entry.ggml_type).reshape(entry.shape)
    experts = Experts(Weights(file, "reference"), entry.name, (8, 128, 64))
    for e in range(8):
        rows = experts[e].rows(torch.arange(128))  # (n_out, n_in): every row of expert e
        assert torch.equal(rows, torch.from_numpy(np.ascontiguousarray(whole[e])))


def test_moe_nbytes_counts_the_experts() -> None:
    model = load("mixtral", "q8_0")
    experts = sum(
        getattr(b, n).nbytes for b in model.blocks for n in ("ffn_gate_up_exps", "ffn_down_exps")
    )
    assert experts > 0 and model.nbytes > experts


@pytest.mark.parametrize("mixed", [False, True])
def test_gated_experts_compute_silu_gate_times_up(mixed: bool) -> None:
    """An expert's stacked [gate; up] weight (the file's types agree) or its two weights (they
    differ: up from the q8_0 file, gate from the f32 one) give silu(gate_e(x)) * up_e(x)."""
    import torch.nn.functional as F

    file = GGUFFile(family_dir("mixtral") / "model-f32.gguf")
    gate, up = "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"
    if mixed:
        file.tensors[up] = GGUFFile(family_dir("mixtral") / "model-q8_0.gguf").tensors[up]
    shape = (8, 64, 128)  # (n_expert, n_ff, n_embd)
    pair = GatedExperts(Weights(file, "fast"), gate, up, shape)
    assert (pair.stacked is None) == mixed
    ref_gate, ref_up = (Experts(Weights(file, "fast"), n, shape) for n in (gate, up))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    for e in range(8):
        want = F.silu(ref_gate[e].matmul(x)) * ref_up[e].matmul(x)
        torch.testing.assert_close(pair(e, x), want, rtol=1e-5, atol=1e-6)


# -- exact batches (scoring) ---------------------------------------------------------------------
F32_TOL = 1e-5  # the exact products' bound against float32 dequantization (test_quant_matmul)


def _dequantized(file: GGUFFile, name: str) -> torch.Tensor:
    """A 3-D expert tensor dequantized as gguf does, in float64 (n_expert, n_out, n_in)."""
    entry = file.tensors[name]
    whole = gguf.quants.dequantize(np.asarray(entry.data), entry.ggml_type).reshape(entry.shape)
    return torch.from_numpy(np.ascontiguousarray(whole)).double()


def test_exact_moe_ffn_is_the_dequantized_product() -> None:
    """moe_ffn with exact (Batch.exact: scoring) takes the experts' exact products, as the dense
    projections do: the float64 product of the dequantized q8_0 experts within the exact bound;
    the fast one rounds the experts' x (to int8 per 32 values on the native kernels)."""
    import torch.nn.functional as F

    from graftlm.models.moe import moe_ffn

    file = GGUFFile(family_dir("mixtral") / "model-q8_0.gguf")
    w = Weights(file, "fast")
    n_expert, n_ff, n_embd, n_used = 8, 64, 128, 2
    gate_up = GatedExperts(
        w, "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", (n_expert, n_ff, n_embd)
    )
    down = Experts(w, "blk.0.ffn_down_exps.weight", (n_expert, n_embd, n_ff))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 5, n_embd, generator=g)
    logits = torch.randn(1, 5, n_expert, generator=g)
    gate, up, dn = (
        _dequantized(file, f"blk.0.ffn_{n}_exps.weight") for n in ("gate", "up", "down")
    )
    x, probs = h.double().view(5, n_embd), torch.softmax(logits.double().view(5, n_expert), -1)
    want = torch.zeros(5, n_embd, dtype=torch.float64)
    for t in range(5):
        p, chosen = probs[t].topk(n_used)
        for pe, e in zip((p / p.sum()).tolist(), chosen.tolist(), strict=True):
            want[t] += pe * (dn[e] @ (F.silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    exact = moe_ffn(h, logits, gate_up, down, n_used, exact=True).view(5, n_embd)
    assert rel_err(exact.double(), want) < F32_TOL
    fast = moe_ffn(h, logits, gate_up, down, n_used).view(5, n_embd)
    if down[0].kernel.startswith("native"):  # (the rounding the exact step leaves out)
        assert rel_err(fast.double(), want) > 10 * F32_TOL


def test_exact_step_of_a_moe_model_is_the_reference_step() -> None:
    """An exact batch through Mixtral's q8_0 file on the fast kernels gives the logits of the
    reference oracle (every weight dequantized to float32) within the exact bound, experts
    included."""
    from graftlm.step.batch import Batch

    logits = []
    for prefer in ("fast", "reference"):
        model = load("mixtral", "q8_0", prefer=prefer)
        with torch.no_grad():
            logits.append(model.forward(Batch.single(IDS, exact=True), all_logits=True))
    assert rel_err(*logits) < F32_TOL
