"""Packed prefill (Batch.packed): several prompts' chunks in one step, only their real tokens
computed. Every sequence of a packed step must come out as that chunk prefilled alone: the
row-wise work (projections and adapters' deltas, norms, RoPE) is per token, and attention runs
each sequence's tokens as its own (1, n) row, so the logits are bit for bit those of the chunk
alone, on the PyTorch products and on the native ones alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

import graftlm
from graftlm.gguf import GGUFFile
from graftlm.lora.settings import AdapterSettings
from graftlm.models import Transformer
from graftlm.runtime.engine import Engine, lora_rows
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request
from graftlm.step.batch import Batch

# (prompt length, tokens of it already in the cache, adapter settings by adapter index)
ROWS = [
    (5, 0, {0: 1.0}),
    (17, 0, {1: 0.5}),
    (1, 0, {}),
    (9, 0, {0: 0.0}),  # a zero scale: the base's bits
    (12, 0, {0: -1.0, 1: 2.0}),
    (20, 16, {1: 1.0}),  # a prompt whose first block is in the cache
    (7, 0, {2: 1.0}),  # the embedding's and the head's adapters too
    (11, 0, {2: 0.5, 0: 1.0}),
]


def _ids(n: int, seed: int, vocab: int = 250) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=["F32", "Q4_1", "Q8_0", "Q5_0"])
def files(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Path]]:
    """A tiny llama of the param's projection type and three adapters for it, the third on
    every kind of site (the embedding, the head, stacked and plain projections)."""
    qtype = Q[request.param]
    spec = TinySpec(
        qtype=qtype,
        embd_type=Q.F32 if qtype == Q.F32 else Q.Q8_0,
        n_embd=64,
        n_ff=96,
    )
    d = tmp_path_factory.mktemp("packed")
    adapters = [write_tiny_adapter(d / f"a{i}.gguf", spec, seed=5 + i) for i in range(2)]
    model = write_tiny_model(d / "m.gguf", spec)
    n_vocab, e, hd = GGUFFile(model).tensors["token_embd.weight"].shape[0], 64, spec.head_dim
    targets = {"token_embd": (n_vocab, e), "output": (e, n_vocab)}
    for i in range(spec.n_layer):
        targets |= {f"blk.{i}.attn_k": (e, spec.n_head_kv * hd), f"blk.{i}.ffn_gate": (e, 96)}
        targets |= {f"blk.{i}.ffn_up": (e, 96), f"blk.{i}.attn_output": (spec.n_head * hd, e)}
    adapters.append(write_tiny_adapter(d / "a2.gguf", spec, targets, seed=7))
    return model, adapters


def _load(files: tuple[Path, list[Path]], **kw: object) -> tuple[graftlm.Model, list[int]]:
    """The model with its adapters attached (at scale 1; requests set their own)."""
    m = graftlm.load(str(files[0]), ctx_size=64, n_seq=len(ROWS), **kw)  # type: ignore[arg-type]
    return m, [m.add_lora(str(a)) for a in files[1]]


def _prefill_alone(model: Transformer, ids: list[int], cached: int, lora: dict[int, float]):
    """The logits of the chunk ids[cached:] prefilled alone in slot 0 of a fresh cache, after
    ids[:cached] (with the same settings)."""
    model.allocate_cache(1)
    rows = lora_rows([lora], model.device)
    if cached:
        model.forward(Batch.single(ids[:cached], 0, 0, rows))
    return model.forward(Batch.single(ids[cached:], 0, cached, rows))[0]


def _packed_forward(make: Callable[..., Batch], model: Transformer, prompts, settings):
    """Each row's cached tokens prefilled in its own slot, then every chunk in one batch."""
    model.allocate_cache(len(prompts))
    for slot, ((_, cached, _), ids, lora) in enumerate(zip(ROWS, prompts, settings, strict=True)):
        if cached:
            model.forward(Batch.single(ids[:cached], slot, 0, lora_rows([lora], model.device)))
    chunks = [ids[c:] for (_, c, _), ids in zip(ROWS, prompts, strict=True)]
    rows = lora_rows(settings, model.device)
    batch = make(chunks, list(range(len(chunks))), [c for _, c, _ in ROWS], rows, model.device)
    return model.forward(batch)


@torch.inference_mode()
def test_every_packed_row_equals_its_chunk_alone(files: tuple[Path, list[Path]]) -> None:
    """Mixed adapters (two at once, a zero scale, none), a partly cached prompt, one of a single
    token: each packed row's logits are the bits of that chunk prefilled alone, and equal the
    padded batch's to float32 rounding (its products see other row counts)."""
    m, adapter = _load(files)
    model = m.engine.model
    prompts = [_ids(n, seed=i) for i, (n, _, _) in enumerate(ROWS)]
    settings = [{adapter[k]: v for k, v in s.items()} for _, _, s in ROWS]
    packed = _packed_forward(Batch.packed, model, prompts, settings)
    padded = _packed_forward(Batch.padded, model, prompts, settings)
    for i, ((_, cached, _), ids, lora) in enumerate(zip(ROWS, prompts, settings, strict=True)):
        alone = _prefill_alone(model, ids, cached, lora)
        assert torch.equal(packed[i], alone), f"row {i}: {(packed[i] - alone).abs().max()}"
        torch.testing.assert_close(padded[i], alone, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_a_packed_batch_writes_no_padding(files: tuple[Path, list[Path]]) -> None:
    """Nothing past a sequence's last real position is written: the cache's blocks past it are
    as they were."""
    model = _load(files)[0].engine.model
    cache = model.allocate_cache(2)
    for layer in range(len(cache.k)):
        cache.k[layer].fill_(7.0)
        cache.v[layer].fill_(7.0)
    model.forward(Batch.packed([_ids(3, 1), _ids(20, 2)], [0, 1], [0, 0], None, model.device))
    block = cache.block
    for layer in range(len(cache.k)):
        k = cache.key_rows(layer)  # (n_blocks, Hkv, block, D)
        first0 = int(cache.tables[0, 0])
        assert bool((k[first0, :, 3:] == 7.0).all()) and not bool((k[first0, :, :3] == 7.0).all())
        second1 = int(cache.tables[1, 1])
        assert bool((k[second1, :, 20 - block :] == 7.0).all())
        assert bool((cache.v[layer][int(cache.tables[0, 1])] == 7.0).all())


class _Recorder:
    """A greedy sampler that keeps every row of logits it was given."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, window: object = None) -> int:
        self.logits.append(logits.clone())
        return int(logits.argmax())


def _request(prompt: list[int], lora: dict[int, float], n: int = 6) -> Request:
    req = Request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                  AdapterSettings(lora))  # fmt: skip
    req.sampler = _Recorder()
    return req


def _steps(eng: Engine, reqs: list[Request]) -> dict[int, list[tuple[int, int]]]:
    """Run the engine until these requests end; each one's prefill pieces (start, end)."""
    pieces: dict[int, list[tuple[int, int]]] = {r.id: [] for r in reqs}
    while eng.busy:
        plan = eng.step()
        assert plan.computed == sum(c.length for c in plan.prefill) <= eng.chunk
        for c in plan.prefill:
            pieces[c.seq.id].append((c.start, c.end))
    return pieces


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix", "no-prefix"])
def test_served_requests_together_equal_each_alone(
    files: tuple[Path, list[Path]], prefix_cache: bool
) -> None:
    """Through the engine: a long prompt prefilled in chunks beside short ones, packed, with mixed
    adapters and (prefix) a prompt whose first block is cached: each request's tokens are those
    it gets alone; its first token's logits (its prefill's) bit for bit where its prompt was cut
    into the same pieces, else to float32 rounding (attention's sums run over other splits), as
    are the decode steps' (rows batched with others)."""
    m, adapter = _load(files, prefix_cache=prefix_cache)
    eng = m.engine
    eng.chunk = 24
    assert eng.scheduler.packed
    prompts = [_ids(n, seed=i) for i, (n, _, _) in enumerate(ROWS)]
    prompts[1] = _ids(50, seed=99)  # past the chunk: prefilled in three pieces beside the others
    settings = [{adapter[k]: v for k, v in s.items()} for _, _, s in ROWS]
    alone, cut_alone = [], {}
    for p, s in zip(prompts, settings, strict=True):
        alone.append(eng.submit(_request(p, s)))
        cut_alone.update(_steps(eng, alone[-1:]))
    together = [eng.submit(_request(p, s)) for p, s in zip(prompts, settings, strict=True)]
    cut = _steps(eng, together)
    assert sum(len(v) for v in cut.values()) > len(together)  # some prompt was cut: the long one
    same = 0
    for a, t in zip(alone, together, strict=True):
        assert t.generated == a.generated
        ra, rt = a.sampler, t.sampler
        assert isinstance(ra, _Recorder) and isinstance(rt, _Recorder)
        if cut[t.id] == cut_alone[a.id]:
            assert torch.equal(rt.logits[0], ra.logits[0]), f"a prompt of {len(a.prompt)}"
            same += 1
        for x, y in zip(rt.logits, ra.logits, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert same >= 3


def test_the_padded_plan_is_kept_for_comparison(tmp_path: Path) -> None:
    """GRAFTLM_PADDED_PREFILL=1's plan (Scheduler.packed off): `chunk` counts padding, and a step
    computes its rows padded to the longest."""
    m = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", TinySpec())), ctx_size=64, n_seq=4)
    eng = m.engine
    eng.chunk = 24
    for packed, first in ((False, [3, 11]), (True, [3, 11, 6])):
        eng.scheduler.packed = packed
        reqs = [eng.submit(_request(_ids(n, seed=n + 40 * packed), {}, 1)) for n in (3, 11, 6)]
        plan = eng.step()
        assert [c.length for c in plan.prefill] == first
        assert plan.computed == (sum(first) if packed else 2 * 11)
        while eng.busy:
            eng.step()
        assert all(len(r.generated) == 1 for r in reqs)
