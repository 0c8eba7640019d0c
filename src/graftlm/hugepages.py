"""Transparent huge pages for the large buffers the hot loops stream (the KV cache's blocks, the
native kernels' repacked weights): madvise(MADV_HUGEPAGE) on a fresh anonymous buffer's 2 MiB
aligned interior before its first touch, so the kernel backs it with 2 MiB pages where THP is in
"madvise" (or "always") mode; fewer TLB misses when a decode step streams hundreds of MiB.

Linux only, and never an error: where libc's madvise or MADV_HUGEPAGE is missing, or the call
fails, the buffer keeps its 4 KiB pages. GRAFTLM_HUGEPAGES=0 turns it off (for A/B timings).
This module imports nothing of graftlm's, so any layer can use it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Callable

import torch

HUGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
MIN_BYTES = 2 * HUGE  # smaller buffers hold at most one whole huge page: not worth a call
# ... of their own: empty's buffers of POOL_MIN bytes up to MIN_BYTES are carved one after another
# from shared mappings of POOL_CHUNK bytes in huge pages (_pooled). A routed expert's repacked
# weights are such buffers (Qwen3-30B-A3B's [gate; up] 1.8 MB, down 0.9 MB, each packed alone):
# in 4 KiB pages, 8 experts of 128 a token streamed at 20.3 GB/s on a Zen 4 core, in 2 MiB pages
# at 26.3 (the layer's order of products, one thread).
POOL_MIN = 256 << 10
POOL_CHUNK = 32 * HUGE  # a chunk wastes at most the rest of its last huge page: 2 MiB of 64


class _Pool:
    """The chunk being carved (_pooled): its part not handed out yet; None: none (the next
    buffer maps a new chunk)."""

    lock = threading.Lock()
    rest: torch.Tensor | None = None


def libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise(addr, length, advice) -> 0 or -1, or None off Linux / where it is missing."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = libc_madvise()
_ADVICE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def enabled() -> bool:
    """Whether huge pages are asked for: not when GRAFTLM_HUGEPAGES=0 (read at each call)."""
    return os.environ.get("GRAFTLM_HUGEPAGES", "1").strip() not in {"0", "off", "no", "false"}


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under a CPU tensor's whole 2 MiB pages; whether the advice was taken.

    Call it on a fresh torch.empty before anything writes it: pages already faulted in stay
    small until khugepaged collapses them (if ever). Never raises."""
    if _MADVISE is None or _ADVICE is None or not enabled():
        return False
    if t.device.type != "cpu" or not t.is_contiguous():
        return False
    nbytes = t.numel() * t.element_size()
    if nbytes < MIN_BYTES:
        return False
    start = -(-t.data_ptr() // HUGE) * HUGE
    stop = (t.data_ptr() + nbytes) // HUGE * HUGE
    if stop <= start:
        return False
    try:
        return _MADVISE(start, stop - start, _ADVICE) == 0
    except (OSError, ctypes.ArgumentError):
        return False


def _mapped(nbytes: int) -> torch.Tensor | None:
    """nbytes of a fresh anonymous mapping (zeros, nothing touched), starting at a 2 MiB
    boundary and advised to huge pages; None where that cannot be had.

    Its own mapping rather than torch's allocator: malloc may hand back heap memory an earlier
    tensor already touched (4 KiB pages, whatever the advice), and its chunks are not aligned.
    The tensor holds the mapping; it is unmapped when the last view of it is gone."""
    if _MADVISE is None or _ADVICE is None or nbytes < MIN_BYTES or not enabled():
        return None
    try:
        m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):
        return None
    whole = torch.frombuffer(m, dtype=torch.uint8)
    base = whole.data_ptr()
    off = -base % HUGE
    stop = (base + nbytes + HUGE) // HUGE * HUGE
    try:
        if _MADVISE(base + off, stop - base - off, _ADVICE) != 0:
            return None
    except (OSError, ctypes.ArgumentError):
        return None
    return whole[off : off + nbytes]


def _pooled(nbytes: int) -> torch.Tensor | None:
    """nbytes (POOL_MIN <= nbytes < MIN_BYTES) of a shared chunk of _mapped memory, 4 KiB aligned,
    never handed out before (so zeros, untouched); None where that cannot be had. A chunk lives
    while a tensor carved from it does: for weights, which live as long as their model."""
    if nbytes < POOL_MIN or nbytes >= MIN_BYTES or not enabled():
        return None
    with _Pool.lock:
        rest = _Pool.rest
        if rest is None or rest.numel() < nbytes:
            rest = _mapped(POOL_CHUNK)
            if rest is None:
                return None
        _Pool.rest = rest[-(-nbytes // 4096) * 4096 :]  # (the next piece 4 KiB aligned)
        return rest[:nbytes]


def end_pool() -> None:
    """Carve no further from the chunk being carved: a model's loader calls it when the model's
    weights are packed, so no chunk holds two models' buffers (and the last chunk is unmapped
    with the last of its model's buffers, not kept for the next load)."""
    with _Pool.lock:
        _Pool.rest = None


def _huge(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, pool: bool = False
) -> torch.Tensor | None:
    """A tensor of shape over _mapped memory (pool: a smaller one over _pooled memory), or None
    (not the CPU, too small, turned off)."""
    if torch.device(device).type != "cpu":
        return None
    n = torch.empty(0, dtype=dtype).element_size()
    for s in shape:
        n *= s
    t = _mapped(n) if n >= MIN_BYTES or not pool else _pooled(n)
    return None if t is None else t.view(dtype).view(shape)


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty, in huge pages where it is a large CPU tensor (see _mapped), or one of a few
    hundred KiB (see _pooled)."""
    t = _huge(shape, dtype, device, pool=True)
    return torch.empty(*shape, dtype=dtype, device=device) if t is None else t


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros, in huge pages as empty's: a fresh mapping is zeros already, and its pages are
    only faulted in (so resident) when something writes them, as calloc's are."""
    t = _huge(shape, dtype, device)
    return torch.zeros(*shape, dtype=dtype, device=device) if t is None else t
