"""gpt-oss beyond the family tests (test_families.py holds it against transformers, PEFT and
q8_0): its pieces against transformers' own (the clamped SwiGLU, YaRN, the sinks), the native
attention with sinks that its steps take, MXFP4 experts, llama.cpp on the same file, and
the errors of a malformed file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    rewrite_gguf,
    spy_served,
)
from llama_reference import LLAMA_SERVER, llama_top_logprobs

from graftlm.errors import ModelFileError
from graftlm.gguf import GGUFFile
from graftlm.lora.arch_rules import gguf_to_hf, hf_to_gguf
from graftlm.models import build_model
from graftlm.models.gpt_oss import swiglu_oai
from graftlm.models.primitives import attention, yarn
from graftlm.native import ops as native_ops
from graftlm.quant import QWeight
from graftlm.step.batch import Batch
from graftlm.step.kv_cache import KVCache

FAMILY = "gpt-oss"
MXFP4 = gguf.GGMLQuantizationType.MXFP4
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


# -- the pieces against transformers' ------------------------------------------------------------
def test_swiglu_oai_is_transformers_clamped_gate() -> None:
    """Values past the clamps (+-7) on both sides, as transformers interleaves gate and up."""
    mod = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    cfg = mod.GptOssConfig(hidden_size=8, intermediate_size=64, num_local_experts=1)
    experts = mod.GptOssExperts(cfg)
    gate_up = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)) * 6
    assert (gate_up.abs() > 7).any()
    want = experts._apply_gate(gate_up)
    assert torch.equal(swiglu_oai(gate_up[:, ::2], gate_up[:, 1::2]), want)


@pytest.mark.parametrize(
    "dim,base,orig", [(64, 150000.0, 4096), (48, 150000.0, 4096), (128, 1e6, 32768)]
)
def test_yarn_is_transformers_truncated_yarn(dim: int, base: float, orig: int) -> None:
    """primitives.yarn's frequencies and cos/sin multiplier are transformers' YaRN with the
    correction range truncated to whole dimensions (ggml's; gpt-oss-20b's shape first)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": base, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": orig}  # fmt: skip
    cfg = transformers.GptOssConfig(head_dim=dim, rope_parameters=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    factors, mscale = yarn(dim, base, 32.0, orig)
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    torch.testing.assert_close((plain / factors).float(), inv_freq, rtol=1e-6, atol=0)
    assert mscale == pytest.approx(attention_factor, rel=1e-12)
    assert factors[0] == 1 and factors[-1] == pytest.approx(32.0)  # fast pairs kept, slow divided


def _written_out(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor,
    visible: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """transformers' eager gpt-oss attention, one row: q (T, H, D), keys/values (L, Hkv, D),
    visible (T, L) -> (T, H * D)."""
    rep = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, L, D)
    v = values.repeat_interleave(rep, dim=1).transpose(0, 1)
    s = (q.transpose(0, 1) @ k.transpose(1, 2)) * scale  # (H, T, L)
    s = s.masked_fill(~visible, float("-inf"))
    sink = sinks.view(-1, 1, 1).expand(-1, s.shape[1], 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return (p @ v).transpose(0, 1).flatten(1)


@pytest.mark.parametrize("window", [0, 5])
def test_sinks_through_the_paged_cache(window: int) -> None:
    """Two rows at their own slots and starts in one step (a prompt chunk after earlier ones,
    then a decode step of both): attention with sinks through the paged cache equals the
    written-out formula over each row's keys; sinks of -inf give the attention without them."""
    H, Hkv, D, scale = 4, 2, 16, 0.25
    g = torch.Generator().manual_seed(0)
    sinks = torch.randn(H, generator=g) * 3
    cache = KVCache(1, 2, Hkv, 64, D, D, dtype=torch.float32, block=8)
    # the two slots' blocks interleaved and out of order in the pool, as an allocator leaves them
    perm = torch.randperm(cache.n_blocks - 1, generator=g) + 1  # (block 0 is never handed out)
    cache.tables = perm.to(torch.int32).view(2, cache.max_blocks)
    keys = torch.randn(2, 30, Hkv, D, generator=g)
    values = torch.randn(2, 30, Hkv, D, generator=g)
    q_all = torch.randn(2, 30, H, D, generator=g)
    lengths = [(0, 12, 20), (0, 7, 9)]  # per row: chunk boundaries, then one decode token

    def step(starts: list[int], stops: list[int], s: torch.Tensor | None) -> torch.Tensor:
        T = max(b - a for a, b in zip(starts, stops, strict=True))
        pad = torch.zeros(2, T, dtype=torch.long)
        batch = Batch(pad, [0, 1], starts, [b - a for a, b in zip(starts, stops, strict=True)])
        q, k, v = (torch.zeros(2, T, *t.shape[2:]) for t in (q_all, keys, values))
        for r, (a, b) in enumerate(zip(starts, stops, strict=True)):
            q[r, : b - a], k[r, : b - a], v[r, : b - a] = (
                q_all[r, a:b],
                keys[r, a:b],
                values[r, a:b],
            )
        out = attention(q, k, v, 0, batch, cache, scale, window, sinks=s)
        return out.view(2, T, H, D).flatten(2)

    for i in range(2):  # two prompt chunks, each row its own length
        starts, stops = [lengths[0][i], lengths[1][i]], [lengths[0][i + 1], lengths[1][i + 1]]
        got = step(starts, stops, sinks)
        for r in range(2):
            a, b = starts[r], stops[r]
            pos = torch.arange(a, b).view(-1, 1)
            key = torch.arange(b).view(1, -1)
            visible = (key <= pos) & ((pos - key < window) if window else True)
            want = _written_out(q_all[r, a:b], keys[r, :b], values[r, :b], sinks, visible, scale)
            torch.testing.assert_close(got[r, : b - a], want, rtol=1e-5, atol=1e-6)
    # the decode step of both rows, then the same step again with the sinks at -inf
    starts = [lengths[0][2], lengths[1][2]]
    got = step(starts, [s + 1 for s in starts], sinks)
    for r in range(2):
        b = starts[r] + 1
        pos, key = torch.tensor([[b - 1]]), torch.arange(b).view(1, -1)
        visible = (key <= pos) & ((pos - key < window) if window else True)
        want = _written_out(q_all[r, b - 1 : b], keys[r, :b], values[r, :b], sinks, visible, scale)
        torch.testing.assert_close(got[r, :1], want, rtol=1e-5, atol=1e-6)
    none = step(starts, [s + 1 for s in starts], torch.full((H,), float("-inf")))
    plain = step(starts, [s + 1 for s in starts], None)
    torch.testing.assert_close(none, plain, rtol=1e-5, atol=1e-6)


# -- the path it takes -----------------------------------------------------------------------------
def test_every_step_takes_the_native_attention_with_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts and decode steps compute every layer's attention (its sinks, the window of the
    even layers) natively, through a float16 cache as served: spies count the calls served. The
    steps agree with one pass, and the one pass with the PyTorch twins (primitives.attention's
    written-out scores) where the native ops are refused."""
    served = spy_served(monkeypatch, "attn_prefill", "attn_decode")
    model = load(FAMILY)
    full = forward(model, IDS)
    n_layer = model.cfg.n_layer
    assert served["attn_prefill"] == [True] * n_layer
    model.allocate_cache(1, dtype=torch.float16)
    with torch.no_grad():
        steps = [model.forward(Batch.single(IDS[:30]), all_logits=True)]
        steps += [model.forward(Batch.single([IDS[i]], start=i)).unsqueeze(1)
                  for i in range(30, 40)]  # fmt: skip
    assert served["attn_prefill"] == [True] * 2 * n_layer
    assert served["attn_decode"] == [True] * 10 * n_layer
    assert rel_err(torch.cat(steps, dim=1), full) < 1e-3  # (keys and values in float16)
    for name in served:
        monkeypatch.setattr(native_ops, name, lambda *args, **kwargs: None)
    assert rel_err(full, forward(model, IDS)) < 1e-4  # float32 sums in another order


def test_batched_decode_steps_match_single_rows() -> None:
    """Two sequences prefilled apart, then decoded together past the window (16) in one step a
    token: each row's logits are its own sequence's."""
    model = load(FAMILY)
    seqs = [IDS, IDS[3:27]]
    want = [forward(model, s) for s in seqs]  # (1, T, n_vocab) each
    model.allocate_cache(2, dtype=torch.float32)
    with torch.no_grad():
        for slot, s in enumerate(seqs):
            model.forward(Batch(torch.tensor([s[:-5]]), [slot], [0], [len(s) - 5]))
        for j in range(5, 0, -1):
            rows = torch.tensor([[s[-j]] for s in seqs])
            got = model.forward(Batch(rows, [0, 1], [len(s) - j for s in seqs], [1, 1]))
            for r, s in enumerate(seqs):
                assert rel_err(got[r], want[r][0, len(s) - j]) < 1e-5


def test_decode_steps_past_the_window_in_one_native_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """On q8_0 (a native kernel for every weight) each decode step is one native call over every
    layer (sinks, the window of the even layers, q/k/v/o biases, experts with biases chosen and
    weighted by the softmax of their logits, the clamped SwiGLU): two sequences decoded together
    past the window (16), within 1e-4 of the composed blocks."""
    from spies import stack_calls

    from graftlm.models.base import Transformer

    model = load(FAMILY, "q8_0", prefer="fast")
    seqs = [IDS, IDS[3:27]]

    def run() -> list[torch.Tensor]:
        model.allocate_cache(2, dtype=torch.float32)
        out = []
        with torch.no_grad():
            for slot, s in enumerate(seqs):
                model.forward(Batch(torch.tensor([s[:-5]]), [slot], [0], [len(s) - 5]))
            for j in range(5, 0, -1):
                rows = torch.tensor([[s[-j]] for s in seqs])
                out.append(model.forward(Batch(rows, [0, 1], [len(s) - j for s in seqs], [1, 1])))
        return out

    served = stack_calls(monkeypatch)
    fused = run()
    assert served == [False, False] + [True] * 5  # (the prompts: not decode steps)
    monkeypatch.setattr(Transformer, "native_layers", lambda self, x, batch: None)
    monkeypatch.setattr(Transformer, "native_block", lambda self, i, x, batch: None)
    monkeypatch.setattr(Transformer, "native_routed_ffn", lambda self, i, h, batch: None)
    for ours, composed in zip(fused, run(), strict=True):
        torch.testing.assert_close(ours, composed, rtol=1e-4, atol=1e-4)


def test_peft_names_are_its_attention() -> None:
    for kind in ("attn_q", "attn_k", "attn_v", "attn_output"):
        hf = gguf_to_hf(FAMILY, f"blk.1.{kind}")
        assert hf is not None and hf_to_gguf(FAMILY, 2, hf) == f"blk.1.{kind}"
    assert gguf_to_hf(FAMILY, "blk.1.ffn_gate_inp") is None  # the router is no nn.Linear


def test_runs_from_the_command_line() -> None:
    from graftlm.cli import main

    path = family_dir(FAMILY) / "model-q8_0.gguf"
    assert main(["run", "-m", str(path), "-p", "Hello there", "-n", "4", "--temp", "0"]) == 0


# -- MXFP4 experts -------------------------------------------------------------------------------
def _mxfp4_blocks(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """gguf's own MXFP4 quantization of normal values, with every scale exponent and code the
    format has (E8M0 exponents 0..254 would overflow: the rows' scales span 2^-20..2^20)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(np.float32)
    a *= np.exp2(rng.integers(-20, 20, (shape[0], 1))).astype(np.float32)
    return np.asarray(gguf.quants.quantize(a, MXFP4))


@pytest.mark.parametrize("prefer", ["fast", "reference"])
def test_mxfp4_dequantizes_bit_exact_with_gguf(prefer: str) -> None:
    blocks = _mxfp4_blocks((96, 256))
    want = torch.from_numpy(gguf.quants.dequantize(blocks, MXFP4).reshape(96, 256).copy())
    w = QWeight.from_gguf(blocks, MXFP4, (96, 256), name="x", prefer=prefer)
    assert torch.equal(w.dequantize(), want)
    ids = torch.tensor([5, 0, 95, 17])
    assert torch.equal(w.rows(ids), want[ids])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(w.matmul(x, exact=True), x @ want.T, rtol=1e-5, atol=0)
    # the fast product (native-mx4 where it built) rounds x to int8 per 32 values, as ggml does
    xr = _int8_rounded(x) if w.kernel == "native-mx4" else x
    want_fast = (xr.double() @ want.double().T).float()
    torch.testing.assert_close(w.matmul(x), want_fast, rtol=0, atol=2e-5 * want_fast.abs().max())


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x (M, k) as the native integer products take it: per 32 values d = max|x| / 127 and
    round(x * 127 / max|x|) * d (round half to even)."""
    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax.clamp_min(1e-38), torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127)).view_as(x)


def _mxfp4_file(dst: Path) -> Path:
    """The f32 fixture with every expert weight in MXFP4 (gguf's quantizer), as llama.cpp's
    converter writes a released checkpoint's: biases, router and the rest as they were."""
    reader = gguf.GGUFReader(family_dir(FAMILY) / "model-f32.gguf")
    experts = {t.name: np.asarray(t.data) for t in reader.tensors if t.name.endswith(EXPERTS)}
    return rewrite_gguf(reader, dst, replace_as=(MXFP4, experts))


def test_mxfp4_experts_match_transformers_on_the_same_weights(tmp_path: Path) -> None:
    file = GGUFFile(_mxfp4_file(tmp_path / "mxfp4.gguf"))
    assert file.tensors["blk.0.ffn_down_exps.weight"].type_name == "MXFP4"
    ref = hf_model(FAMILY)
    with torch.no_grad():  # the experts round-tripped through MXFP4 along GGUF's rows (n_in)
        for layer in ref.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                a = p.detach().transpose(-1, -2).contiguous().numpy()
                back = gguf.quants.dequantize(gguf.quants.quantize(a, MXFP4), MXFP4)
                p.copy_(torch.from_numpy(back.reshape(a.shape)).transpose(-1, -2))
    want = hf_logits(ref, IDS)
    assert rel_err(want, hf_logits(hf_model(FAMILY), IDS)) > 1e-2  # MXFP4 does move the logits
    for prefer in ("fast", "reference"):  # the steps' exact products (Batch.exact)
        model = build_model(file, 64, prefer=prefer)
        model.allocate_cache(1, dtype=torch.float32)
        with torch.no_grad():
            exact = model.forward(Batch.single(IDS, exact=True), all_logits=True)
        assert rel_err(exact, want) < 1e-3
    # a fast step rounds the experts' x to int8 per 32 values (native-mx4, as ggml's Q8_0 x):
    # the bound of q8_0's fast steps in routed families (test_families), the same top tokens
    model = build_model(file, 64)
    assert model.blocks[0].ffn_down_exps[0].kernel in ("native-mx4", "blocks")
    fast = forward(model, IDS)
    assert rel_err(fast, want) < 0.5
    assert float((fast.argmax(-1) == want.argmax(-1)).float().mean()) > 0.6


# -- llama.cpp on the same files ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["f32", "mxfp4"])
def test_matches_llama_cpp_on_the_same_file(kind: str, tmp_path: Path) -> None:
    """Prompts of 5 to 200 tokens (past the window, YaRN at work): the next token's top-10
    log-probabilities of llama.cpp's own server within 1e-4 of graftlm's on the f32 file. On
    MXFP4 experts ggml rounds each product's x to Q8_0 blocks (MXFP4's vec_dot_type), which
    graftlm's exact kernel does not: within 0.05 there, the same top token."""
    if not LLAMA_SERVER.exists():
        pytest.skip(f"{LLAMA_SERVER} is not here")
    path = family_dir(FAMILY) / "model-f32.gguf"
    if kind == "mxfp4":
        path = _mxfp4_file(tmp_path / "mxfp4.gguf")
    ids = torch.randint(3, 1000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [ids[:n] for n in (5, 40, 200)]
    theirs = llama_top_logprobs(path, prompts)
    model = build_model(GGUFFile(path), 256, prefer="reference")
    for ids, top in zip(prompts, theirs, strict=True):
        model.allocate_cache(1, dtype=torch.float32)
        with torch.no_grad():
            ours = torch.log_softmax(model.forward(Batch.single(ids)), dim=-1)[0]
        bound = 1e-4 if kind == "f32" else 0.05
        assert max(abs(ours[t].item() - lp) for t, lp in top.items()) < bound
        assert ours.argmax().item() == max(top, key=top.__getitem__)


# -- malformed files -----------------------------------------------------------------------------
def _edited(
    dst: Path,
    drop: tuple[str, ...] = (),
    tensors: dict[str, np.ndarray] | None = None,
    meta: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
) -> Path:
    """The f32 fixture without `drop`, with `tensors` replaced (float32) and `meta` set."""
    reader = gguf.GGUFReader(family_dir(FAMILY) / "model-f32.gguf")
    w = gguf.GGUFWriter(str(dst), FAMILY)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in (meta or {}):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, vtype) in (meta or {}).items():
        w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if t.name in (tensors or {}):
            w.add_tensor(t.name, (tensors or {})[t.name])  # (its type from the array's dtype)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


U32 = gguf.GGUFValueType.UINT32
MALFORMED: dict[str, tuple[Callable[[Path], Path], str]] = {
    "no sinks": (lambda d: _edited(d, drop=("blk.1.attn_sinks.weight",)),
                 "missing tensor 'blk.1.attn_sinks.weight'"),
    "sinks of 3 heads": (lambda d: _edited(d, tensors={"blk.0.attn_sinks.weight": np.ones(3, np.float32)}),
                         "'blk.0.attn_sinks.weight' has shape [3], expected [4]"),
    "an expert short": (lambda d: _edited(d, tensors={"blk.1.ffn_down_exps.weight": np.ones((15, 128, 64), np.float32)}),
                        "'blk.1.ffn_down_exps.weight' has shape [15, 128, 64], expected [16, 128, 64]"),
    "expert bias transposed": (lambda d: _edited(d, tensors={"blk.0.ffn_up_exps.bias": np.ones((64, 16), np.float32)}),
                               "'blk.0.ffn_up_exps.bias' has shape [64, 16], expected [16, 64]"),
    "integer experts": (lambda d: _edited(d, tensors={"blk.0.ffn_gate_exps.weight": np.ones((16, 64, 128), np.int32)}),
                        "'blk.0.ffn_gate_exps.weight' is of type I32, which no kernel computes with"),
    "no router bias": (lambda d: _edited(d, drop=("blk.0.ffn_gate_inp.bias",)),
                       "missing tensor 'blk.0.ffn_gate_inp.bias'"),
    "no window": (lambda d: _edited(d, meta={"gpt-oss.attention.sliding_window": (0, U32)}),
                  "gpt-oss.attention.sliding_window"),
    "more used than experts": (lambda d: _edited(d, meta={"gpt-oss.expert_used_count": (17, U32)}),
                               "expert_used_count = 17 is more than gpt-oss.expert_count = 16"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_is_refused_naming_what(case: str, tmp_path: Path) -> None:
    make, message = MALFORMED[case]
    path = make(tmp_path / "bad.gguf")
    with pytest.raises(ModelFileError) as err:
        build_model(GGUFFile(path), 64)
    assert message in str(err.value) and str(path) in str(err.value)
