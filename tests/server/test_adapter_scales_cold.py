"""A request's own scale that overflows on an adapter that is not resident (registered through
--lora-modules, or evicted under --max-loras): refused before it takes room, so nothing resident
is evicted for it, and, once the adapter's facts are known (its first read), before it is read
again. The refusals on resident adapters: test_adapter_scales.py."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from registry_helpers import BASE, settled, tiny_registry
from server_fixtures import SPEC
from tiny_models import write_tiny_adapter

from graftlm.errors import RequestError
from graftlm.lora.adapter import F16_MAX
from graftlm.lora.scales import together_overflow
from graftlm.runtime.service import EngineService
from graftlm.server.registry import AdapterRegistry


def _counted_reads(svc: EngineService, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The stems of the adapter files read from here on, in order."""
    reads: list[str] = []
    real = svc.prepare_adapter
    monkeypatch.setattr(svc, "prepare_adapter", lambda p: reads.append(Path(p).stem) or real(p))
    return reads


def _undisturbed(reg: AdapterRegistry, resident: dict[str, int | None]) -> None:
    """The resident set is `resident` (name -> id), and nothing is held, waited for or reserved."""
    assert {e.name: e.id for e in reg.by_id.values()} == resident
    assert all(e.refs == 0 and e.waiting == 0 for e in reg.names.values())
    assert all(e.loading is None and e.landing is None for e in reg.names.values())
    assert (reg._reserved, reg._reserved_bytes, reg.queued, reg.admitting) == (0, 0, 0, 0)


async def _alpha_and_beta_resident(
    svc: EngineService, tiny_files: dict[str, Path]
) -> tuple[AdapterRegistry, dict[str, int | None]]:
    """A registry of the tiny adapters under --max-loras 2 with alpha and beta resident (gamma
    registered, not read), and its resident set (name -> id)."""
    reg = tiny_registry(svc, tiny_files, max_loras=2)
    for name in ("alpha", "beta"):
        reg.release(await reg.lease(name, None, BASE))
    return reg, {e.name: e.id for e in reg.by_id.values()}


def test_an_overflowing_scale_on_an_adapter_not_resident_evicts_nothing(
    svc: EngineService, tiny_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-loras 2, alpha and beta resident, gamma registered: a request for gamma at 1e30
    read gamma, evicted alpha (least recently used) to attach it, and only then got its 400.
    The 400 (invalid_scale, naming gamma and the scale) now comes with the resident set as it
    was and nothing held: after gamma's first read (its facts computed, then dropped), and with
    no read at all the next time. At a sane scale gamma is served (evicting alpha then); alpha,
    evicted, is refused at 1e30 without a read, alone or together with beta at scales each
    within range alone."""
    reads = _counted_reads(svc, monkeypatch)

    async def go() -> None:
        reg, resident = await _alpha_and_beta_resident(svc, tiny_files)
        assert set(resident) == {"alpha", "beta"}
        for seen in (["alpha", "beta", "gamma"], ["alpha", "beta", "gamma"]):  # (one read)
            with pytest.raises(RequestError) as exc:
                await reg.lease(None, None, BASE, {"gamma": 1e30})
            assert exc.value.code == "invalid_scale"
            words = str(exc.value)
            assert words.startswith("lora: adapter 'gamma': scale 1e+30 takes its delta to ")
            assert "this request would overflow; on such an input" in words
            assert reads == seen
            _undisturbed(reg, resident)
        await settled(svc, reg)
        lease = await reg.lease(None, None, BASE, {"gamma": 2.0})
        assert lease.labels == ["gamma"] and reads[-1] == "gamma" and len(reads) == 4
        reg.release(lease)
        alpha, beta = reg.names["alpha"], reg.names["beta"]
        assert not alpha.resident and alpha.facts is not None and beta.facts is not None
        resident = {e.name: e.id for e in reg.by_id.values()}
        with pytest.raises(RequestError) as exc:
            await reg.lease("alpha", {beta.id: 1.0}, BASE, {"alpha": -1e30})  # type: ignore[dict-item]
        assert str(exc.value).startswith("lora: adapter 'alpha': scale -1e+30 takes its delta")
        near = {e.name: 0.999 * F16_MAX / e.facts.reach for e in (alpha, beta) if e.facts}
        scaled = [(e.name, e.facts, near[e.name]) for e in (alpha, beta)]
        assert together_overflow(scaled) is not None  # (each within range alone)
        with pytest.raises(RequestError) as exc:
            await reg.lease(None, None, BASE, {"beta": near["beta"], "alpha": near["alpha"]})
        assert exc.value.code == "invalid_scale"
        words = str(exc.value)
        assert f"adapter 'alpha' at scale {near['alpha']:g}" in words
        assert f"adapter {beta.id} (beta) at scale {near['beta']:g}" in words
        assert "this request would overflow, though each is within range alone" in words
        assert len(reads) == 4
        _undisturbed(reg, resident)
        await settled(svc, reg)

    asyncio.run(go())


def test_a_scale_out_of_float32s_range_by_name_evicts_nothing(
    svc: EngineService, tiny_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lora` by name at 1e39 (valid JSON, past float32's range) on an adapter not resident read
    it and evicted alpha before the 400: it is refused before anything is read."""
    reads = _counted_reads(svc, monkeypatch)

    async def go() -> None:
        reg, resident = await _alpha_and_beta_resident(svc, tiny_files)
        for bad, why in ((1e39, "beyond float32's range"), (float("nan"), "not a finite number")):
            with pytest.raises(RequestError, match=f"lora: adapter 'gamma': scale .* {why}"):
                await reg.lease(None, None, BASE, {"gamma": bad})
        with pytest.raises(RequestError, match="adapter 'gamma': scale must be a number"):
            await reg.lease(None, None, BASE, {"gamma": "2"})  # type: ignore[dict-item]
        assert reads == ["alpha", "beta"]
        _undisturbed(reg, resident)
        await settled(svc, reg)

    asyncio.run(go())


def test_an_adapter_replaced_on_disk_is_checked_on_its_new_facts(
    svc: EngineService, tiny_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The facts kept for an evicted adapter speak for its file only while the file is the one
    read (`file_identity`): replaced by one of a tenth of the reach, of the same size and given
    the old mtime back (as `cp -p` or `rsync -a` would), the scale its old facts refused is read
    and served, not refused on what the file was; a scale past the new reach is refused after
    that read, still evicting nothing."""
    reads = _counted_reads(svc, monkeypatch)
    path = tmp_path / "x.gguf"
    shutil.copyfile(tiny_files["alpha"], path)

    async def go() -> None:
        reg = AdapterRegistry(svc, room_wait_s=0.3, max_loras=1)
        reg.add_module("x", str(path))
        reg.add_module("beta", str(tiny_files["beta"]))
        reg.release(await reg.lease("x", None, BASE))
        old = reg.names["x"].facts
        assert old is not None
        reg.release(await reg.lease("beta", None, BASE))  # (x evicted)
        scale = 2 * F16_MAX / old.reach
        with pytest.raises(RequestError, match="adapter 'x': scale"):
            await reg.lease(None, None, BASE, {"x": scale})
        tenth = write_tiny_adapter(tmp_path / "tenth.gguf", SPEC, alpha=0.8, seed=12)
        stat = path.stat()
        assert tenth.stat().st_size == stat.st_size
        os.replace(tenth, path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert reads == ["x", "beta"]
        lease = await reg.lease(None, None, BASE, {"x": scale})
        assert lease.labels == ["x"] and reads == ["x", "beta", "x"]
        reg.release(lease)
        new = reg.names["x"].facts
        assert new is not None and new.reach == pytest.approx(old.reach / 10)
        reg.release(await reg.lease("beta", None, BASE))  # (x evicted again)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
        resident = {e.name: e.id for e in reg.by_id.values()}
        with pytest.raises(RequestError, match="adapter 'x': scale"):
            await reg.lease(None, None, BASE, {"x": 20 * scale})
        assert reads == ["x", "beta", "x", "beta", "x"]  # (refused after a read of the new file)
        _undisturbed(reg, resident)
        await settled(svc, reg)

    asyncio.run(go())
