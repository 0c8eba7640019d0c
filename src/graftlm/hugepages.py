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
from collections.abc import Callable

import torch

HUGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
MIN_BYTES = 2 * HUGE  # smaller buffers hold at most one whole huge page: not worth a call


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


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty, with huge pages asked for (advise) where it is a CPU tensor."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    advise(t)
    return t


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros, with huge pages asked for before the zeros touch the memory."""
    return empty(*shape, dtype=dtype, device=device).zero_()
