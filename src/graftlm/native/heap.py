"""How the process's memory serves the engine: a step's large activations kept in the heap for
the next, and PyTorch's large blocks (the packed weights) in transparent huge pages.

glibc's malloc serves a block above its mmap threshold (at most 32 MiB by its own dynamic rule)
with a fresh mapping and unmaps it when freed; free memory at the top of the heap past the trim
threshold goes back to the kernel. PyTorch's CPU tensors come from malloc, so a prompt's
activations (a Llama-1B 512-token chunk: 16 to 32 MiB a projection) were mapped, faulted in page
by page, zeroed by the kernel and unmapped again in every layer: 5% of that prompt's time in the
kernel's page clearing, and 10-15% of its speed. Raising both thresholds keeps those blocks in the
heap, where the next layer's tensors of the same sizes reuse them (llama.cpp allocates its compute
buffers once for the same reason).

The cost is resident memory: what a step freed stays with the process, up to the largest step's
activations plus the trim threshold, instead of going back to the kernel between steps.

Huge pages: PyTorch advises the kernel to back its CPU blocks of 2 MiB and more with transparent
huge pages when THP_MEM_ALLOC_ENABLE=1, read at each allocation. A decode step streams every
weight once; in 4 KiB pages it takes a TLB miss every 4 KiB. Llama-1B Q4_K_M on a Xeon: tg128
25.4-26.4 -> 27.1-27.2 t/s, and a Q4_K product from memory 18.4 -> 21.2 GB/s on 2 threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # blocks above it are still mapped on their own: a vocabulary's logits
TRIM_THRESHOLD = 512 << 20


@functools.cache
def hold_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); False where the C library
    is not glibc or refuses them, leaving its defaults."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def use_huge_pages() -> bool:
    """Have PyTorch's large CPU blocks advised to transparent huge pages from now on, unless
    THP_MEM_ALLOC_ENABLE is already set (the user's choice stands); whether they are on."""
    if platform.system() != "Linux":
        return False
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
