"""`--device`: the model, its adapters, its cache and every tensor a step makes, on one device.

No GPU here: the device tests run on `meta` (tensors with shapes and no data). Meta alone misses
some mixing (a matmul of a meta and a CPU tensor passes), so every step runs under `DeviceGuard`,
which fails any op whose tensor arguments sit on different devices. What meta cannot run at all
(host reads such as `.tolist()`: the MoE router's grouping, the CPU sampler) is noted where it
matters. The numbers of the device path are checked on the CPU through its kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from shared_data import TINY
from tiny_models import TinySpec, write_tiny_adapter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import graftlm
from graftlm.cli import main
from graftlm.errors import GraftError
from graftlm.gguf import GGUFFile
from graftlm.lora.settings import AdapterSettings
from graftlm.quant import QWeight
from graftlm.quant.torch_kernels import DeviceDenseKernel
from graftlm.runtime.device import resolve_device
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.step.batch import Batch, LoraRows

META = torch.device("meta")
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "mixtral"]


class DeviceGuard(TorchDispatchMode):
    """Fails every op whose tensor arguments are not all on one device. Exempt: 0-dim CPU
    tensors (PyTorch takes them as scalars on any device) and `_to_copy`, the move itself."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.aten._to_copy.default:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            devices = {t.device for t in tensors if not (t.dim() == 0 and t.device.type == "cpu")}
            if len(devices) > 1:
                shapes = [(tuple(t.shape), str(t.device)) for t in tensors]
                raise AssertionError(f"{func} mixes devices: {shapes}")
        return func(*args, **kwargs)


def test_guard_catches_what_meta_alone_misses() -> None:
    x, w = torch.empty(3, 4, device="meta"), torch.zeros(5, 4)
    assert F.linear(x, w).device == META  # meta's own checks let this through
    with pytest.raises(RuntimeError, match="expected device"):
        _ = x + torch.zeros(3, 4)  # ... and catch this
    with DeviceGuard(), pytest.raises(AssertionError, match="mixes devices"):
        F.linear(x, w)
    with DeviceGuard():  # a CPU scalar on another device is fine, as it is on CUDA
        assert (x * torch.tensor(2.0)).device == META


# -- models on meta ----------------------------------------------------------------------------
def _family(family: str, quant: str = "f32") -> Path:
    path = TINY / family / f"model-{quant}.gguf"
    if not path.exists():
        pytest.skip(f"fixture {path} is not available")
    return path


def _tiny_adapter(base: Path, tmp_path: Path) -> Path:
    """An adapter on the tiny llama reaching every kind of site: stacked parts (q, v, gate, up),
    plain projections (down), the tied head (output) and the embedding (a gathered table)."""
    spec = TinySpec()
    d, hd = spec.n_embd, spec.head_dim
    n_vocab = GGUFFile(base).tensors["token_embd.weight"].shape[0]
    targets = {"token_embd": (n_vocab, d), "output": (d, n_vocab)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        targets[p + "attn_q"] = (d, spec.n_head * hd)
        targets[p + "attn_v"] = (d, spec.n_head_kv * hd)
        targets[p + "ffn_gate"] = (d, spec.n_ff)
        targets[p + "ffn_up"] = (d, spec.n_ff)
        targets[p + "ffn_down"] = (spec.n_ff, d)
    return write_tiny_adapter(tmp_path / "all-sites.gguf", spec, targets)


# (model, adapter or None) for every family: the fixture's GGUF adapter, the tiny llama's
# adapter on every kind of site, a PEFT directory, a quantized base
CASES = {
    **{f: (f, "f32", "lora-f32.gguf") for f in FAMILIES if f != "mixtral"},
    "mixtral": ("mixtral", "f32", None),
    "llama-q8_0": ("llama", "q8_0", "lora-f32.gguf"),
    "llama-peft": ("llama", "f32", "peft"),
}


@pytest.fixture(params=[*CASES, "tiny-llama", "tiny-gemma3"])
def meta_model(request: pytest.FixtureRequest, tmp_path: Path) -> graftlm.Model:
    """A model loaded with device="meta", with its adapter (if any) attached at id 0."""
    if request.param == "tiny-llama":
        path = request.getfixturevalue("tiny_llama")
        adapter = _tiny_adapter(path, tmp_path)
    elif request.param == "tiny-gemma3":
        path, adapter = request.getfixturevalue("tiny_gemma3"), None
    else:
        family, quant, lora = CASES[request.param]
        path = _family(family, quant)
        adapter = None if lora is None else TINY / family / lora
    model = graftlm.load(path, ctx_size=64, n_seq=3, device="meta")
    if adapter is not None:
        assert model.add_lora(adapter) == 0
    return model


def _tensors(obj: Any, where: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from obj through attributes, slots, lists, tuples and dicts."""
    if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{where}[{i}]", seen)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{where}[{k!r}]", seen)
    elif type(obj).__module__.startswith("graftlm."):
        names = list(getattr(obj, "__dict__", {}))
        names += [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
        for n in names:
            if hasattr(obj, n):
                yield from _tensors(getattr(obj, n), f"{where}.{n}", seen)


def test_every_tensor_of_the_model_is_on_the_device(meta_model: graftlm.Model) -> None:
    m = meta_model.model
    assert m.device == META and meta_model.engine.device == META
    found = dict(_tensors(m, "model", set()))
    off = {name: t.device for name, t in found.items() if t.device != META}
    assert not off, f"left off the device: {off}"
    # the walk did see what it is meant to check
    assert m.cache is not None and all(t.device == META for t in m.cache.k + m.cache.v)
    assert any(".rope_of_layer" in n for n in found) and any("cache.k" in n for n in found)
    weights = [p.weight for p in m.projections().values()] + [m.token_embd]
    assert all(w.kernel == "device-bf16" and w.device == META for w in weights)
    if m.cfg.tied_head:
        assert m.output.weight is m.token_embd  # still one weight
    if meta_model.loras:
        sites = [p.lora for p in m.projections().values() if p.lora is not None]
        sites += [m.embd_lora] if m.embd_lora is not None else []
        assert sites and all(s.device == META for s in sites)
        assert all(t.device == META for s in sites for i in s.slot_ids for t in s.factors(i))
        assert any(".lora" in n for n in found)


def _meta_rows(scales: list[list[float]]) -> LoraRows:
    return LoraRows(torch.tensor(scales, device=META), (0,))


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_forward_on_meta(meta_model: graftlm.Model, with_adapter: bool) -> None:
    """Prompt chunks (one row; two padded rows) and a decode step of three rows, every op's
    tensors on one device, logits on meta in the right shape."""
    m = meta_model.model
    if m.cfg.n_expert:
        pytest.skip("the MoE router groups tokens with .unique().tolist(): a host read meta lacks")
    if with_adapter and not meta_model.loras:
        pytest.skip("no adapter for this model")
    n_vocab = m.cfg.n_vocab
    lora = (lambda s: _meta_rows(s)) if with_adapter else (lambda s: None)
    with torch.inference_mode(), DeviceGuard():
        one = m.forward(Batch.single([5, 6, 7, 8, 9], 0, 0, lora([[1.0]]), META), all_logits=True)
        assert one.device == META and one.shape == (1, 5, n_vocab)
        tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]], device=META)
        two = m.forward(Batch(tokens, [1, 2], [0, 3], [4, 2], lora([[0.5], [1.0]])))
        assert two.device == META and two.shape == (2, n_vocab)
        tokens = torch.tensor([[11], [12], [13]], device=META)
        step = m.forward(Batch(tokens, [0, 1, 2], [5, 4, 5], [1, 1, 1], lora([[1], [0], [2]])))
        assert step.device == META and step.shape == (3, n_vocab)


def test_engine_builds_its_batches_on_the_device(tiny_llama: Path, tmp_path: Path) -> None:
    """The engine's own prompt and decode batches (tokens, adapter scales) run on meta up to the
    logits' copy to the CPU sampler, which meta cannot make: that copy is where each step ends."""
    model = graftlm.load(tiny_llama, ctx_size=64, n_seq=2, device="meta")
    model.add_lora(_tiny_adapter(tiny_llama, tmp_path))
    rows = model.engine.lora_rows([{0: 1.0}, {}])
    assert rows is not None and rows.scales.device == META
    with DeviceGuard(), pytest.raises(NotImplementedError, match="meta"):
        model.generate([5, 6, 7], max_tokens=2, lora=[{"id": 0, "scale": 1.0}])
    greedy = SamplingParams(temperature=0, max_tokens=2)
    model.engine.chunk = 8  # both prompts in one padded prefill batch
    first = (Request([5, 6], greedy, AdapterSettings({0: 1.0})), Request([7, 8, 9], greedy))
    for r in first:
        model.engine.submit(r)
    with DeviceGuard(), pytest.raises(NotImplementedError, match="meta"):
        model.engine.step()
    for r in first:
        model.engine.stop(r)  # their slots back: slot 0 and slot 1 in that order
    reqs = [Request([5, 6], greedy, AdapterSettings({0: 1.0})), Request([7, 8, 9], greedy)]
    for slot, r in enumerate(reqs):  # as if prefilled, each with one sampled token
        model.engine.slots.admit(r)
        r.n_prefilled, r.generated = len(r.prompt), [10 + slot]
    with torch.inference_mode(), DeviceGuard(), pytest.raises(NotImplementedError, match="meta"):
        model.engine._decode(reqs)


def test_cpu_is_left_as_it_is(tiny_llama: Path) -> None:
    model = graftlm.load(tiny_llama, ctx_size=64)
    m = model.model
    before = {name: p.weight for name, p in m.projections().items()}
    assert m.to("cpu") is m and m.device == torch.device("cpu")
    assert {name: p.weight for name, p in m.projections().items()} == before
    batch = Batch.single([1, 2, 3])
    assert batch.positions.device.type == "cpu" and batch.device.type == "cpu"


# -- choosing the device -----------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_clear_error(tiny_llama: Path, device: str) -> None:
    with pytest.raises(GraftError, match=f"device '{device}'.*CUDA is not available"):
        graftlm.load(tiny_llama, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cli_names_the_device(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "-m", str(tiny_llama), "-p", "hi", "-n", "1", "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert "error: device 'cuda'" in err and "CUDA is not available" in err


@pytest.mark.parametrize(
    ("device", "message"),
    [("gpu", "'gpu' is not a device"), ("mps", "'mps' is not supported"), ("cuda:x", "'cuda:x'")],
)
def test_unknown_devices_are_refused(device: str, message: str) -> None:
    with pytest.raises(GraftError, match=message):
        resolve_device(device)


def test_reference_is_a_cpu_path(tiny_llama: Path) -> None:
    with pytest.raises(GraftError, match="reference=True.*'meta'"):
        graftlm.load(tiny_llama, reference=True, device="meta")


def test_device_flag_on_every_loading_command() -> None:
    from graftlm.cli import build_parser

    parser = build_parser()
    for cmd in (["run", "-p", "x"], ["serve"], ["bench"]):
        assert parser.parse_args(cmd).device == "cpu"
        assert parser.parse_args([*cmd, "--device", "cuda:1"]).device == "cuda:1"


def test_the_cli_refuses_meta(capsys: pytest.CaptureFixture[str]) -> None:
    """meta holds no data: the API takes it (placement tests), the commands refuse it up front
    instead of failing at the first sampled token."""
    with pytest.raises(SystemExit) as exc:
        main(["run", "-p", "hi", "--device", "meta"])
    assert exc.value.code == 2
    assert "'meta' holds no data" in capsys.readouterr().err


# -- the device kernel's numbers, on the CPU ---------------------------------------------------
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1"])
def test_device_dense_kernel_agrees_with_the_cpu_path(name: str) -> None:
    """What QWeight.to(device) builds (a bf16 copy of the dequantized weight behind
    DeviceDenseKernel), built on the CPU: its products equal bf16(x) @ bf16(W).T up to float32
    summation, and stay within bf16 rounding of the exact CPU product."""
    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(0)
    n_out, n_in = 96, 256
    w = (rng.standard_normal((n_out, n_in)) / 16).astype(np.float32)
    cpu = QWeight.from_gguf(gguf.quants.quantize(w, qtype), qtype, (n_out, n_in), name="w")
    w32 = cpu.dequantize()
    dev = QWeight(DeviceDenseKernel(w32.to(torch.bfloat16)), qtype, "w")
    assert dev.kernel == "device-bf16" and dev.shape == cpu.shape
    x = torch.randn(2, 5, n_in, generator=torch.Generator().manual_seed(1))
    y = dev.matmul(x)
    assert y.dtype == torch.float32 and y.shape == (2, 5, n_out)
    exact = x.double() @ w32.double().T
    rounded = x.bfloat16().double() @ w32.bfloat16().double().T
    # bf16 GEMMs round their output to bf16 (2^-8 relative) on top of the inputs' rounding
    torch.testing.assert_close(y.double(), rounded, rtol=2**-7, atol=1e-3)
    scale = exact.abs().max()
    assert float((y.double() - exact).abs().max() / scale) < 2e-2
    assert float((cpu.matmul(x).double() - exact).abs().max() / scale) < 2e-2  # the CPU twin
    ids = torch.tensor([0, 7, 95])
    torch.testing.assert_close(dev.rows(ids), w32[ids].bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(dev.dequantize(), w32.bfloat16().float(), rtol=0, atol=0)


def test_qweight_to_makes_the_device_kernel() -> None:
    w = torch.randn(8, 32)
    q = QWeight.from_gguf(w.numpy(), gguf.GGMLQuantizationType.F32, (8, 32), name="w")
    assert q.to("cpu") is q
    m = q.to("meta")
    assert m.kernel == "device-bf16" and m.device == META and m.shape == (8, 32)
    assert all(t.dtype == torch.bfloat16 for t in m._k.tensors())


# -- on a real GPU (skipped without one; `scripts/device_check.sh` runs them on a lent machine) ---
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _agree(cpu: torch.Tensor, dev: torch.Tensor, what: str) -> None:
    """Logits (..., V) from the CPU path and the device path: log-probabilities within what bf16
    weights and bf16 matrix products cost, and the same top token wherever the CPU's top two are
    apart by more than that."""
    a = torch.log_softmax(cpu.double(), dim=-1)
    b = torch.log_softmax(dev.cpu().double(), dim=-1)
    diff = (a - b).abs()
    assert float(diff.mean()) <= 0.03 and float(diff.max()) <= 0.3, (
        f"{what}: log-prob difference mean {float(diff.mean()):.4f}, max {float(diff.max()):.4f}"
    )
    top2 = a.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.1
    same = a.argmax(-1) == b.argmax(-1)
    assert bool(same[clear].all()), (
        f"{what}: top tokens differ at {(~same & clear).nonzero().tolist()}"
    )


@CUDA
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_scores_like_the_cpu(case: str) -> None:
    """Teacher-forced logits of one prompt, base and under the adapter at two scales."""
    family, quant, lora = CASES[case]
    path = _family(family, quant)
    models = [graftlm.load(path, ctx_size=64, device=d) for d in ("cpu", "cuda")]
    if lora is not None:
        assert all(m.add_lora(TINY / family / lora) == 0 for m in models)
    ids = [(7 * i + 3) % models[0].config.n_vocab for i in range(24)]
    settings: list[list[dict[str, Any]] | None] = [None]
    settings += [[{"id": 0, "scale": s}] for s in (1.0, -2.0)] if lora is not None else []
    for lo in settings:
        cpu, dev = (m.logits(ids, lora=lo) for m in models)
        assert dev.device.type == "cpu"  # handed back on the host
        _agree(cpu, dev, f"{case}, lora {lo}")


@CUDA
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_cuda_decodes_mixed_adapter_rows_like_the_cpu(family: str) -> None:
    """A decode step of three rows on the fixture adapter at scales 1, 0 and -1 (plus, on llama,
    its PEFT twin as a second adapter on the first row), after each row's prompt."""
    path = _family(family)
    outs = []
    for device in ("cpu", "cuda"):
        m = graftlm.load(path, ctx_size=64, n_seq=3, device=device)
        m.add_lora(TINY / family / "lora-f32.gguf")
        second = family == "llama" and m.add_lora(TINY / family / "peft") == 1
        dev = m.model.device
        with torch.inference_mode():
            for s in range(3):
                m.model.forward(Batch.single([5 + s, 9, 13, 17 + s], s, 0, None, dev))
            rows = [{0: 1.0, 1: 0.5} if second else {0: 1.0}, {}, {0: -1.0}]
            lora = m.engine.lora_rows(rows)
            tokens = torch.tensor([[21], [22], [23]], device=dev)
            outs.append(m.model.forward(Batch(tokens, [0, 1, 2], [4, 4, 4], [1, 1, 1], lora)))
    _agree(outs[0], outs[1], f"{family} decode step")


@CUDA
def test_cuda_engine_serves_requests_on_different_adapters(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The engine's own loop on the GPU: two requests on different adapter settings share its
    batches, each ends with its 6 tokens, and each first token is the CPU's greedy choice where
    the CPU's top two are clearly apart."""
    adapter = _tiny_adapter(tiny_llama, tmp_path)
    prompt, settings = [5, 6, 7], [{0: 1.0}, {}]
    runs, firsts = [], []
    for device in ("cpu", "cuda"):
        m = graftlm.load(tiny_llama, ctx_size=64, n_seq=2, device=device)
        m.add_lora(adapter)
        params = SamplingParams(temperature=0, max_tokens=6)
        reqs = [Request(prompt, params, AdapterSettings(lo)) for lo in settings]
        for r in reqs:
            m.engine.submit(r)
        while not all(r.done for r in reqs):
            m.engine.step()
        runs.append([list(r.generated) for r in reqs])
        lo_args = [[{"id": 0, "scale": 1.0}], None]
        firsts.append([m.logits(prompt, lora=lo)[-1] for lo in lo_args])
    assert all(len(g) == 6 for g in runs[1]), runs[1]
    for row in range(2):
        top2 = torch.log_softmax(firsts[0][row].double(), -1).topk(2).values
        if float(top2[0] - top2[1]) > 0.1:
            assert runs[1][row][0] == runs[0][row][0], (row, runs)
