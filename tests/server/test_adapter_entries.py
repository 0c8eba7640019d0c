"""The adapter registry's refusals of what can never fit (adapter_entries.py): more adapters
than --max-loras, more bytes than --max-lora-memory, a rank above --max-lora-rank (from the
header, before the read), names against the runtime rule, and global scales whose deltas leave
float16's range alone or together. Waiting for room: test_adapter_room.py; the rest of the
registry: test_server_adapters.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from registry_helpers import BASE, tiny_registry
from server_fixtures import FIXTURES, SPEC
from tiny_models import write_tiny_adapter

from graftlm.errors import AdapterError, RequestError
from graftlm.lora.adapter import F16_MAX
from graftlm.lora.prepare import AdapterFacts, bytes_floor
from graftlm.runtime.service import EngineService
from graftlm.server.adapter_entries import AdapterEntry, together_overflow
from graftlm.server.registry import AdapterRegistry


def test_a_request_for_more_adapters_than_max_loras_is_refused_at_once(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """A request naming more adapters at once than --max-loras holds (counting the pinned ones
    it does not use) can never run: it is refused at once, nothing attached or held, where it
    held two adapters while it waited for the budget's room and then got a 503 'retry'."""

    async def go() -> None:
        reg = tiny_registry(svc, tiny_files, max_loras=2)
        for model, names in ((None, ["alpha", "beta", "gamma"]), ("alpha", ["beta", "gamma"])):
            with pytest.raises(RequestError) as exc:
                await reg.lease(model, None, BASE, {n: 0.5 for n in names})
            assert exc.value.code == "too_many_adapters"
            assert "uses 3 adapters at once (alpha, beta, gamma)" in str(exc.value)
            assert "at most 2 can be attached (--max-loras 2)" in str(exc.value)
            assert not reg.by_id and all(e.refs == 0 for e in reg.names.values())
        reg.release(await reg.lease("alpha", None, BASE, {"beta": 0.5}))  # two: served
        pinned = reg.preload(str(tiny_files["delta"]), 0.0, "delta")
        with pytest.raises(RequestError) as exc:  # (delta holds one place for good)
            await reg.lease(None, None, BASE, {"alpha": 0.5, "beta": 0.5})
        assert (
            "at most 1 can be attached beside 1 pinned or at a global scale, never evicted "
            "(--max-loras 2)" in str(exc.value)
        )
        alpha_id, delta_id = reg.names["alpha"].id, pinned.id
        assert alpha_id is not None and delta_id is not None
        with pytest.raises(RequestError) as exc:  # by ids too: alpha and delta, and beta
            await reg.lease(None, {alpha_id: 1.0, delta_id: 1.0}, BASE, {"beta": 0.5})
        assert "uses 3 adapters at once (alpha, beta, delta)" in str(exc.value)
        lease = await reg.lease("alpha", {delta_id: 1.0}, BASE)  # alpha and delta: served
        assert lease.labels == ["alpha", "delta"]
        reg.release(lease)

    asyncio.run(go())


def test_pinned_adapters_past_max_loras_are_refused_at_start(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """More pinned adapters (--lora) than --max-loras: refused when the second is given, where
    the server started and then refused every request, a base one too, as too many adapters."""

    async def go() -> None:
        reg = tiny_registry(svc, tiny_files, max_loras=1)
        delta = reg.preload(str(tiny_files["delta"]), 0.0, "delta")
        with pytest.raises(AdapterError, match="more pinned adapters .* than --max-loras 1"):
            reg.preload(str(tiny_files["alpha"]), 0.0, "alpha-pinned")
        assert set(reg.by_id) == {delta.id} and "alpha-pinned" not in reg.names
        reg.release(await reg.lease(None, None, BASE))  # a base request: served
        lease = await reg.lease("delta", None, BASE)
        # delta unloaded while a request uses it: it holds its place only until that request
        # ends, so a request for alpha waits for it (it was refused as too many adapters)
        await reg.unload("delta")
        waiting = asyncio.ensure_future(reg.lease("alpha", None, BASE))
        await asyncio.sleep(0.05)
        reg.release(lease)
        got = await waiting
        assert got.labels == ["alpha"] and set(reg.by_id) == {reg.names["alpha"].id}
        reg.release(got)

    asyncio.run(go())


def test_lora_modules_names_follow_the_runtime_rule(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """--lora-modules names follow load_lora_adapter's rule (they were all registered)."""
    reg = AdapterRegistry(svc)
    path = str(tiny_files["alpha"])
    for name, words in (
        ("", "may not be empty"),
        ("bad\nname", "bidirectional characters (U+000A)"),
        ("a\u202eb", "bidirectional characters (U+202E)"),
        (" padded", "white space"),
        ("x" * 257, "at most 256 characters, got 257"),
    ):
        with pytest.raises(ValueError) as exc:
            reg.add_module(name, path)
        assert str(exc.value).startswith("--lora-modules ") and words in str(exc.value)
    assert not reg.names
    reg.add_module("org/名前-v1", path)
    assert list(reg.names) == ["org/名前-v1"]


def test_memory_budget_in_bytes(
    svc: EngineService, tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    async def go() -> None:
        probe = AdapterRegistry(svc)
        probe.add_module("alpha", str(tiny_files["alpha"]))
        lease = await probe.lease("alpha", None, BASE)
        nbytes = probe.resident_bytes
        probe.release(lease)
        await probe.unload("alpha")
        await asyncio.sleep(0.05)
        reg = tiny_registry(svc, tiny_files, max_bytes=int(nbytes * 2.5))
        for name in ("alpha", "beta", "gamma", "alpha", "beta"):
            reg.release(await reg.lease(name, None, BASE))
            assert reg.resident_bytes <= nbytes * 2.5 and len(reg.by_id) <= 2
        small = AdapterRegistry(svc, max_bytes=nbytes // 2)
        small.add_module("alpha", str(tiny_files["alpha"]))
        with pytest.raises(RequestError, match="budget") as exc:
            await small.lease("alpha", None, BASE)
        assert exc.value.code == "adapters_too_large"  # (a 400)

    asyncio.run(go())


def test_adapters_that_together_pass_the_memory_budget_are_refused_at_once(
    svc: EngineService, tiny_files: dict[str, Path]
) -> None:
    """Two adapters that each fit --max-lora-memory but not together: the request is a 400
    naming them, their sizes and the limit, nothing attached or held, where it held the first
    while it waited --lora-wait for room no request's end could make, then got a 503."""

    async def go() -> None:
        reg = tiny_registry(svc, tiny_files)
        reg.release(await reg.lease("alpha", None, BASE))
        nbytes = reg.resident_bytes
        reg = tiny_registry(svc, tiny_files, max_bytes=nbytes * 3 // 2)
        reg.room_wait_s = 30.0  # (it waited this long before)
        reg.release(await reg.lease("gamma", None, BASE))  # one alone fits
        with pytest.raises(RequestError) as exc:  # (before: a 503 after room_wait_s)
            await reg.lease("alpha", None, BASE, {"beta": 0.5})
        assert exc.value.code == "adapters_too_large"
        text = str(exc.value)
        assert (
            f"take {2 * nbytes} bytes at once (alpha: {nbytes} bytes, beta: {nbytes} bytes)" in text
        )
        assert f"the LoRA budget is {nbytes * 3 // 2} bytes (--max-lora-memory)" in text
        assert not reg.names["alpha"].resident and not reg.names["beta"].resident
        assert all(e.refs == 0 and e.loading is None for e in reg.names.values())
        reg.release(await reg.lease("beta", None, BASE))  # each alone: served

    asyncio.run(go())


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


def test_max_lora_rank(svc: EngineService, tmp_path: Path) -> None:
    big = write_tiny_adapter(tmp_path / "r8.gguf", SPEC, rank=8)

    async def go() -> None:
        reg = AdapterRegistry(svc, max_rank=4)
        reg.add_module("big", str(big))
        with pytest.raises(AdapterError, match="rank 8"):
            await reg.lease("big", None, BASE)
        assert not reg.by_id

    asyncio.run(go())


def test_max_lora_rank_refuses_from_the_header_before_reading(
    svc: EngineService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter above --max-lora-rank (GGUF or PEFT) is refused from its header: none of its
    factors is read, packed or held (they were, then refused); one at the limit loads."""
    big = write_tiny_adapter(tmp_path / "r8.gguf", SPEC, rank=8)
    peft = FIXTURES / "smollm2" / "caps"  # r = 4 (another base: refused before that is seen)
    reads: list[str] = []
    real = svc.prepare_adapter
    monkeypatch.setattr(svc, "prepare_adapter", lambda path: reads.append(str(path)) or real(path))

    async def go() -> None:
        reg = AdapterRegistry(svc, max_rank=3)
        reg.add_module("big", str(big))
        reg.add_module("peft", str(peft))
        for name, rank in (("big", 8), ("peft", 4)):
            with pytest.raises(AdapterError) as exc:
                await reg.lease(name, None, BASE)
            assert f"adapter {name!r}: " in str(exc.value)
            assert f"rank {rank} or more (its header) is above --max-lora-rank 3" in str(exc.value)
        with pytest.raises(AdapterError, match="rank 8 or more"):
            reg.preload(str(big), 0.0)
        assert reads == [] and not reg.by_id
        reg.max_rank = 8
        reg.release(await reg.lease("big", None, BASE))  # at the limit: read and attached
        assert reads == [str(big)]

    asyncio.run(go())


def test_max_lora_memory_refuses_from_the_header_before_reading(
    svc: EngineService, tiny_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter whose header already shows more bytes than --max-lora-memory (its A factors, a
    byte an element at least) is refused before its factors are read (they were read, checked
    and packed, then refused); one between that floor and its packed size is refused after."""
    path = str(tiny_files["gamma"])
    reads: list[str] = []
    real = svc.prepare_adapter
    monkeypatch.setattr(svc, "prepare_adapter", lambda p: reads.append(str(p)) or real(p))
    floor = bytes_floor(path)

    async def go() -> None:
        probe = AdapterRegistry(svc)
        probe.add_module("gamma", path)
        probe.release(await probe.lease("gamma", None, BASE))
        nbytes = probe.resident_bytes
        await probe.unload("gamma")
        assert 0 < floor <= nbytes, (floor, nbytes)
        reads.clear()
        reg = AdapterRegistry(svc, max_bytes=floor - 1)
        reg.add_module("gamma", path)
        with pytest.raises(RequestError) as exc:
            await reg.lease("gamma", None, BASE)
        assert exc.value.code == "adapters_too_large" and reads == []
        assert f"adapter 'gamma': {path}: {floor} bytes or more once read" in str(exc.value)
        assert f"LoRA budget of {floor - 1} bytes (--max-lora-memory)" in str(exc.value)
        reg.max_bytes = nbytes - 1  # (past the floor: read, then refused)
        with pytest.raises(RequestError, match="budget"):
            await reg.lease("gamma", None, BASE)
        assert reads == [path] and not reg.by_id

    asyncio.run(go())
