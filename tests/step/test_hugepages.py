"""Huge pages under the KV cache and the repacked weights (graftlm.hugepages): the advice is taken
where the kernel has THP in madvise/always mode, and the mapping shows AnonHugePages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from graftlm import hugepages
from graftlm.step.kv_cache import KVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed mode of THP ("always", "madvise", "never"), or None where there is none."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() not in {"always", "madvise"},
    reason="transparent huge pages unavailable or off",
)


def anon_huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of the /proc/self/smaps mappings that overlap t's memory."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 1)[0]
        if "-" in head and ":" not in head:
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < hi and lo < b
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_small_and_non_cpu_buffers_are_left_alone() -> None:
    assert not hugepages.advise(torch.empty(1 << 20, dtype=torch.uint8))
    assert not hugepages.advise(torch.empty(16 << 20, dtype=torch.uint8)[::2])
    z = hugepages.zeros(3, 5, dtype=torch.float16)
    assert z.shape == (3, 5) and not z.any()


def test_env_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAFTLM_HUGEPAGES", "0")
    assert not hugepages.enabled()
    assert not hugepages.advise(torch.empty(16 << 20, dtype=torch.uint8))
    monkeypatch.setenv("GRAFTLM_HUGEPAGES", "1")
    assert hugepages.enabled()


def test_never_raises_without_madvise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "_MADVISE", None)
    assert not hugepages.advise(torch.empty(16 << 20, dtype=torch.uint8))
    monkeypatch.setattr(hugepages, "_MADVISE", lambda a, n, adv: -1)  # madvise failing: EINVAL
    assert not hugepages.advise(torch.empty(16 << 20, dtype=torch.uint8))


@needs_thp
def test_kv_cache_gets_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAFTLM_HUGEPAGES", raising=False)
    # 2 layers x 8 MiB of keys and of values, zeros until the steps write them
    cache = KVCache(2, 1, 8, 4096, 64, 64, dtype=torch.float32)
    assert cache.k[0].numel() * cache.k[0].element_size() >= 8 << 20
    assert not cache.k[0].any() and not cache.v[1].any()
    for t in cache.k + cache.v:
        t.fill_(1.0)
    assert all(anon_huge_kib(t) > 0 for t in cache.k + cache.v)


@needs_thp
def test_weight_buffer_gets_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAFTLM_HUGEPAGES", raising=False)
    t = hugepages.empty(16 << 20, dtype=torch.uint8)
    t.fill_(7)  # the first touch, as a native repack's
    assert anon_huge_kib(t) > 0


@needs_thp
def test_smaller_weight_buffers_share_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A routed expert's repacked weights (under MIN_BYTES each) are carved from shared chunks."""
    monkeypatch.delenv("GRAFTLM_HUGEPAGES", raising=False)
    a = hugepages.empty(900_001, dtype=torch.uint8)
    b = hugepages.empty(3, 600_000, dtype=torch.uint8)
    for t, v in ((a, 5), (b, 9)):
        assert not t.any()  # memory never handed out before
        t.fill_(v)  # the first touch, as a native repack's
    lo, hi = sorted((a, b), key=lambda t: t.data_ptr())
    assert lo.data_ptr() + lo.numel() <= hi.data_ptr()  # apart
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert int(a.sum()) == 5 * 900_001 and int(b.sum()) == 9 * 1_800_000
    assert anon_huge_kib(a) > 0 and anon_huge_kib(b) > 0
    chunk = a.untyped_storage().data_ptr()
    assert b.untyped_storage().data_ptr() == chunk  # one mapping under both
    small = hugepages.empty(1000, dtype=torch.uint8)  # under POOL_MIN: torch's own
    assert small.shape == (1000,) and small.untyped_storage().data_ptr() != chunk
    assert small.untyped_storage().nbytes() == 1000
    z = hugepages.zeros(1 << 20, dtype=torch.uint8)  # zeros (the KV cache's) are not carved
    assert not z.any() and z.untyped_storage().data_ptr() != chunk


@needs_thp
def test_a_loaded_model_ends_its_chunk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No chunk holds two models' buffers: build_model ends the chunk being carved, so the next
    buffer starts a chunk of its own (and the last chunk goes with its model)."""
    from graftlm.gguf import GGUFFile
    from graftlm.models import build_model

    monkeypatch.delenv("GRAFTLM_HUGEPAGES", raising=False)
    a = hugepages.empty(300_000, dtype=torch.uint8)
    assert hugepages.empty(300_000, dtype=torch.uint8).untyped_storage().data_ptr() == (
        a.untyped_storage().data_ptr()
    )
    hugepages.end_pool()
    b = hugepages.empty(300_000, dtype=torch.uint8)
    assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    from tiny_models import write_tiny_model

    build_model(GGUFFile(write_tiny_model(tmp_path / "m.gguf")), 64)
    assert hugepages._Pool.rest is None  # ended by the loader, whatever it carved
    c = hugepages.empty(300_000, dtype=torch.uint8)
    assert c.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_mapped_tensors_are_zeros_of_their_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAFTLM_HUGEPAGES", raising=False)
    z = hugepages.zeros(3, 1 << 20, 2, dtype=torch.float16)
    assert z.shape == (3, 1 << 20, 2) and z.dtype == torch.float16 and z.is_contiguous()
    assert not z.any()
    e = hugepages.empty(5 << 20, dtype=torch.uint8)
    e.fill_(3)
    assert int(e.sum()) == 3 * (5 << 20)
    if hugepages._MADVISE is not None and hugepages._ADVICE is not None:
        assert z.data_ptr() % hugepages.HUGE == 0  # its own aligned mapping
    monkeypatch.setattr(hugepages, "_ADVICE", None)  # no MADV_HUGEPAGE: torch's own tensor
    t = hugepages.zeros(5 << 20, dtype=torch.uint8)
    assert t.shape == (5 << 20,) and not t.any()


@needs_thp
def test_off_means_small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of the test above: it can fail (GRAFTLM_HUGEPAGES=0 leaves 4 KiB pages)."""
    monkeypatch.setenv("GRAFTLM_HUGEPAGES", "0")
    t = hugepages.zeros(64 << 20, dtype=torch.uint8)  # above malloc's mmap threshold: fresh
    t.fill_(1)
    assert anon_huge_kib(t) == 0 or thp_mode() == "always"
