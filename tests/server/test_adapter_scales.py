"""The adapter registry's refusals of scales whose deltas leave float16's range (adapter_entries.py
`scale_overflow`, `together_overflow`): a global scale alone, global scales together, a request's
own scales, `--lora-scaled` at start, an embedding adapter's bound. The other refusals:
test_adapter_entries.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from registry_helpers import BASE, tiny_registry
from server_fixtures import SPEC
from tiny_models import write_tiny_adapter

from graftlm.errors import AdapterError, RequestError
from graftlm.lora.adapter import F16_MAX
from graftlm.lora.prepare import AdapterFacts
from graftlm.lora.scales import together_overflow
from graftlm.runtime.service import EngineService
from graftlm.server.adapter_entries import AdapterEntry
from graftlm.server.registry import AdapterRegistry


def test_a_global_scale_that_overflows_every_request_is_refused(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """POST /lora-adapters with a scale of 1e30 was taken, and every request at the global
    scales then got a 400 'logits not finite' until they were reset. A scale at which the
    adapter's delta on an input of +-1 values leaves float16's range is a 400 naming the adapter
    and the largest magnitude it takes; scales short of that (4, -1) are taken as before."""

    async def go() -> None:
        reg = tiny_registry(svc, tiny_files)
        entry = await reg.load("fresh-alpha", str(tiny_files["alpha"]))
        assert entry.id is not None and entry.facts is not None and entry.facts.reach > 0
        for huge in (1e30, -1e30):
            with pytest.raises(RequestError) as exc:
                await reg.set_scales({entry.id: huge})
            assert exc.value.code == "invalid_scale"
            assert f"adapter {entry.id} (fresh-alpha): scale {huge:g}" in str(exc.value)
            assert "a bound for one input of +-1 values, not a guarantee" in str(exc.value)
            assert reg.adapters.scales().get(entry.id, 0.0) == 0.0
        for fine in (4.0, -1.0, 0.0):
            await reg.set_scales({entry.id: fine})
            assert reg.adapters.scales().get(entry.id, 0.0) == fine
        await reg.unload("fresh-alpha")
        with pytest.raises(AdapterError, match=r"--lora-scaled .*alpha.gguf: scale 1e\+30 takes"):
            reg.preload(str(tiny_files["alpha"]), 1e30)  # (it was attached at 1e30)
        assert len(reg.by_id) == 0

    asyncio.run(go())


async def _near_their_limits(
    reg: AdapterRegistry, paths: dict[str, Path]
) -> tuple[dict[str, AdapterEntry], dict[str, int], dict[str, float]]:
    """The adapters loaded by name, their ids, and 90% of the largest global scale each takes
    alone (its delta's reach on a +-1 input times the scale: F16_MAX)."""
    entries = {name: await reg.load(name, str(path)) for name, path in paths.items()}
    ids, near = {}, {}
    for name, e in entries.items():
        assert e.id is not None and e.facts is not None and e.facts.reach > 0
        ids[name], near[name] = e.id, 0.9 * F16_MAX / e.facts.reach
    return entries, ids, near


def test_adapters_whose_global_scales_overflow_only_together_are_refused(
    svc: EngineService, tmp_path: Path
) -> None:
    """Two adapters on one attn_q, each at 90% of the largest global scale it takes alone: each
    scale was checked alone and both were taken, and every request at the global scales could
    then overflow where their deltas add up. POST /lora-adapters refuses the pair (a 400
    naming both adapters and scales, the scales left as they were), as --lora-scaled does at
    start (next test); one on another layer's attn_q beside it (deltas that never add up) is
    taken, as are the two at half those scales."""
    shape = (SPEC.n_embd, SPEC.n_head * SPEC.head_dim)
    paths = {
        "q1": write_tiny_adapter(tmp_path / "q1.gguf", SPEC, {"blk.0.attn_q": shape}, seed=3),
        "q2": write_tiny_adapter(tmp_path / "q2.gguf", SPEC, {"blk.0.attn_q": shape}, seed=4),
        "other": write_tiny_adapter(tmp_path / "o.gguf", SPEC, {"blk.1.attn_q": shape}, seed=5),
    }

    async def go() -> None:
        reg = AdapterRegistry(svc)
        entries, ids, near = await _near_their_limits(reg, paths)
        for name in entries:
            await reg.set_scales({ids[name]: near[name]})  # each alone: taken
        q1, q2 = (entries[n].facts for n in ("q1", "q2"))
        assert q1 is not None and q2 is not None
        (site,) = q1.reaches  # blk.0's attn_q (in the model's fused projection)
        assert near["q1"] * q1.reaches[site] + near["q2"] * q2.reaches[site] > F16_MAX
        await reg.set_scales({ids["q1"]: near["q1"], ids["other"]: -near["other"]})
        with pytest.raises(RequestError) as exc:
            await reg.set_scales({ids["q1"]: near["q1"], ids["q2"]: -near["q2"]})
        assert exc.value.code == "invalid_scale"
        words = str(exc.value)
        assert f"adapter {ids['q1']} (q1) at scale {near['q1']:g}, " in words
        assert f"adapter {ids['q2']} (q2) at scale {-near['q2']:g}: " in words
        assert q1.rows[site] == q2.rows[site] and "other" not in words
        lo, hi = q1.rows[site]
        assert f"together their deltas on rows [{lo}, {hi}) of {site} reach" in words
        assert dict(reg.adapters.scales()) == {ids["q1"]: near["q1"], ids["other"]: -near["other"]}
        await reg.set_scales({ids["q1"]: near["q1"] / 2, ids["q2"]: near["q2"] / 2})

    asyncio.run(go())


def test_adapters_on_disjoint_rows_of_a_fused_projection_do_not_add_up(
    svc: EngineService, tmp_path: Path
) -> None:
    """A Q-only and a V-only adapter on blk.0 (one fused QKV projection in the model), each at
    90% of the largest global scale it takes alone: their reaches were summed on the fused
    projection (up to twice the true bound) and the pair refused, though their deltas reach
    disjoint rows (Q's, V's) and never add up. The pair is taken; Q-only beside a Q-and-V
    adapter (rows shared) is still refused."""
    hd = SPEC.head_dim
    n_q, n_kv = SPEC.n_head * hd, SPEC.n_head_kv * hd
    on_q = {"blk.0.attn_q": (SPEC.n_embd, n_q)}
    on_v = {"blk.0.attn_v": (SPEC.n_embd, n_kv)}
    paths = {
        "q": write_tiny_adapter(tmp_path / "q.gguf", SPEC, on_q, seed=3),
        "v": write_tiny_adapter(tmp_path / "v.gguf", SPEC, on_v, seed=4),
        "qv": write_tiny_adapter(tmp_path / "qv.gguf", SPEC, {**on_q, **on_v}, seed=5),
    }

    async def go() -> None:
        reg = AdapterRegistry(svc)
        entries, ids, near = await _near_their_limits(reg, paths)
        q, v, qv = (entries[n].facts for n in ("q", "v", "qv"))
        assert q is not None and v is not None and qv is not None
        (site,) = q.reaches
        assert set(v.reaches) == {site} and near["q"] * q.reach + near["v"] * v.reach > F16_MAX
        assert q.rows[site] == (0, n_q) and v.rows[site] == (n_q + n_kv, n_q + 2 * n_kv)
        await reg.set_scales({ids["q"]: near["q"], ids["v"]: -near["v"]})  # (refused before)
        assert dict(reg.adapters.scales()) == {ids["q"]: near["q"], ids["v"]: -near["v"]}
        assert qv.rows[site] == (0, n_q + 2 * n_kv)
        with pytest.raises(RequestError) as exc:
            await reg.set_scales({ids["q"]: near["q"], ids["qv"]: near["qv"]})
        # (the rows where both reach: Q's)
        assert f"together their deltas on rows [0, {n_q}) of {site} reach" in str(exc.value)

    asyncio.run(go())


def test_a_requests_own_scales_that_overflow_together_are_refused(
    svc: EngineService, tmp_path: Path
) -> None:
    """A request's own adapters (`lora` by id or by name, an adapter named as the model at
    scale 1) replace the global scales for that request: they were not checked against
    float16's range at all, and two on one attn_q at 90% of their limits each ran until their
    logits overflowed. Checked together now, as the global scales are: a 400 invalid_scale
    naming the adapters, their scales and the rows, nothing held, the adapters still attached
    and the global scales as they were. The global scales never count beside a request's own
    (q1 at its global scale beside a request for q2 alone: served), deltas on other rows never
    add up (q1 and other), and one past its own limit alone is refused too."""
    shape = (SPEC.n_embd, SPEC.n_head * SPEC.head_dim)
    on_q, on_q1 = {"blk.0.attn_q": shape}, {"blk.1.attn_q": shape}
    paths = {
        "q1": write_tiny_adapter(tmp_path / "q1.gguf", SPEC, on_q, seed=3),
        "q2": write_tiny_adapter(tmp_path / "q2.gguf", SPEC, on_q, seed=4),
        "other": write_tiny_adapter(tmp_path / "o.gguf", SPEC, on_q1, seed=5),
    }
    # two at 60% of float16's range at scale 1 (alpha / r folded in): each fine as the model
    for name, seed in (("big1", 3), ("big2", 4)):
        reach = svc.prepare_adapter(str(paths[f"q{seed - 2}"])).facts.reach
        alpha = 8.0 * 0.6 * F16_MAX / reach  # (write_tiny_adapter's alpha is 8)
        paths[name] = write_tiny_adapter(tmp_path / f"{name}.gguf", SPEC, on_q, 4, alpha, seed)

    async def go() -> None:
        reg = AdapterRegistry(svc)
        entries, ids, near = await _near_their_limits(reg, paths)
        await reg.set_scales({ids["q1"]: near["q1"]})
        before = dict(reg.adapters.scales())
        for lora, by_name, model in (
            ({ids["q1"]: near["q1"], ids["q2"]: -near["q2"]}, None, None),
            ({ids["q1"]: near["q1"]}, {"q2": near["q2"]}, None),
            (None, {"q1": near["q1"], "q2": near["q2"]}, None),
            (None, {"big2": 1.0}, "big1"),
        ):
            with pytest.raises(RequestError) as exc:
                await reg.lease(model, lora, BASE, by_name)
            assert exc.value.code == "invalid_scale"
            words = str(exc.value)
            one, two = ("big1", "big2") if model else ("q1", "q2")
            assert f"adapter {ids[one]} ({one}) at scale " in words
            assert f"adapter {ids[two]} ({two}) at scale " in words
            (site,) = entries[one].facts.reaches  # type: ignore[union-attr]
            lo, hi = entries[one].facts.rows[site]  # type: ignore[union-attr]
            assert f"together their deltas on rows [{lo}, {hi}) of {site} reach" in words
            assert "this request would overflow, though each is within range alone" in words
            assert all(e.refs == 0 and e.resident for e in entries.values())
            assert dict(reg.adapters.scales()) == before
        with pytest.raises(RequestError) as exc:
            await reg.lease(None, {ids["q2"]: 1e30}, BASE)
        assert exc.value.code == "invalid_scale"
        assert f"adapter {ids['q2']} (q2): scale 1e+30 takes its delta to" in str(exc.value)
        assert "this request would overflow; on such an input" in str(exc.value)
        for model, lora, labels in (
            (None, {ids["q2"]: near["q2"]}, ["q2"]),  # (q1 at its global scale: not beside)
            (None, {ids["q1"]: near["q1"], ids["other"]: -near["other"]}, ["other", "q1"]),
            (None, {ids["q1"]: near["q1"] / 2, ids["q2"]: near["q2"] / 2}, ["q1", "q2"]),
            ("big1", None, ["big1"]),
            (None, None, ["q1"]),  # (the global scales)
        ):
            lease = await reg.lease(model, lora, BASE)
            assert lease.labels == labels
            reg.release(lease)

    asyncio.run(go())


def test_together_overflow_sums_the_deltas_that_share_a_row() -> None:
    """together_overflow on facts alone: deltas on disjoint row spans of one projection are not
    summed; one with no span recorded (its rows unknown: every row) is summed with each, and
    the message names only the adapters whose deltas reach the worst row, and those rows."""
    site = "blk.0.attn_qkv"

    def facts(reach: float, rows: tuple[int, int] | None = None) -> AdapterFacts:
        spans = {site: rows} if rows is not None else {}
        return AdapterFacts(
            "x", 0, 1, 1.0, "", "", 1, reach=reach, reaches={site: reach}, rows=spans
        )

    most = 0.6 * F16_MAX  # (each within range alone, two of them past it)
    q = ("q", facts(most, (0, 64)), 1.0)
    v = ("v", facts(most, (128, 160)), -1.0)
    anywhere = ("u", facts(most), 1.0)
    assert together_overflow([q, v]) is None
    words = together_overflow([q, v, anywhere])  # (q and u on row 0; v and u on row 128)
    assert words is not None and "v at scale" not in words
    assert words.startswith(
        "q at scale 1, u at scale 1: together their deltas on rows [0, 64) of "
        f"{site} reach 7.86e+04 on an input of +-1 values"
    )
    words = together_overflow([v, anywhere])
    assert words is not None
    assert words.startswith(
        f"v at scale -1, u at scale 1: together their deltas on rows [128, 160) of {site} reach"
    )
    words = together_overflow([anywhere, ("w", facts(most), 0.9), ("zero", facts(most), 0.0)])
    assert words is not None
    assert words.startswith(f"u at scale 1, w at scale 0.9: together their deltas on {site} reach")
    assert together_overflow([q, ("w", facts(most), 0.5)]) is None  # (0.9 of the range)
    assert together_overflow([q, ("w", facts(most, (64, 128)), 1.0)]) is None  # (adjacent)


def test_adapters_whose_lora_scaled_overflow_only_together_are_refused_at_start(
    svc: EngineService, tmp_path: Path
) -> None:
    """--lora-scaled a.gguf S --lora-scaled b.gguf S on the same projection, each within range
    alone: both were attached, every request at the global scales at risk. The second is
    refused at start, naming both adapters and their scales; at a third of S it is taken."""
    on_q = {"blk.0.attn_q": (SPEC.n_embd, SPEC.n_head * SPEC.head_dim)}
    a = write_tiny_adapter(tmp_path / "a.gguf", SPEC, targets=on_q, seed=3)
    b = write_tiny_adapter(tmp_path / "b.gguf", SPEC, targets=on_q, seed=3)  # (the same)
    reg = AdapterRegistry(svc)
    limit = F16_MAX / svc.prepare_adapter(str(a)).facts.reach
    first = reg.preload(str(a), 0.75 * limit)
    assert first.facts is not None
    with pytest.raises(AdapterError) as exc:
        reg.preload(str(b), -0.75 * limit)
    words = str(exc.value)
    assert f"--lora-scaled {a} at scale {0.75 * limit:g}, " in words
    assert f"--lora-scaled {b} at scale {-0.75 * limit:g}: " in words
    ((site, (lo, hi)),) = first.facts.rows.items()
    assert f"together their deltas on rows [{lo}, {hi}) of {site} reach" in words
    assert len(reg.by_id) == 1
    reg.preload(str(b), 0.25 * limit)
    assert len(reg.by_id) == 2


def test_an_embedding_adapters_scale_is_refused_only_past_its_rows_bound(
    svc: EngineService, tmp_path: Path
) -> None:
    """An embedding LoRA whose tokens each use one of its 4 columns (every row of its delta at
    most 3): its reach was bounded by 12 (every column's largest value, summed), and a global
    scale of F16_MAX / 6, rows at half of float16's range, was refused as past it. Bounded by
    3 now: that scale is taken; F16_MAX / 2, rows at 1.5 times the range, is still refused."""
    n_vocab = int(svc.adapters.model.seams.n_vocab)
    one_hot = np.zeros((n_vocab, 4), np.float32)  # (n_vocab, r): token t uses column t % 4
    one_hot[np.arange(n_vocab), np.arange(n_vocab) % 4] = 1.0
    factors = {"token_embd": (one_hot, np.full((SPEC.n_embd, 4), 3.0, np.float32))}
    path = write_tiny_adapter(
        tmp_path / "e.gguf",
        SPEC,
        {"token_embd": (n_vocab, SPEC.n_embd)},
        alpha=4.0,
        overrides=factors,
    )

    async def go() -> None:
        reg = AdapterRegistry(svc)
        entry = await reg.load("embed", str(path))
        assert entry.id is not None and entry.facts is not None
        await reg.set_scales({entry.id: F16_MAX / 6})  # (refused: "takes its delta to 1.31e+05")
        assert entry.facts.reach == pytest.approx(3.0)
        assert reg.adapters.scales() == {entry.id: F16_MAX / 6}
        with pytest.raises(RequestError, match=r"\(embed\): scale 32752 takes its delta to 9"):
            await reg.set_scales({entry.id: F16_MAX / 2})

    asyncio.run(go())
