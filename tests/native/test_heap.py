"""The heap thresholds api.load sets: large blocks come from the heap and stay there."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from graftlm.native.heap import hold_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# In a fresh process (the thresholds are process-wide): a 48 MiB block from malloc, freed, and the
# next one of that size. With glibc's defaults the block is a mapping of its own, above the heap's
# break (where the next lands depends on the kernel); with the thresholds raised both come from
# the heap, the second at the first's address.
PROBE = """
import ctypes, sys
from graftlm.native.heap import hold_freed_memory
held = sys.argv[1] == "1" and hold_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.argtypes = [ctypes.c_long]
a = libc.malloc(48 << 20)
in_heap = a < libc.sbrk(0)
libc.free(a)
b = libc.malloc(48 << 20)
print(held, in_heap, a == b)
"""


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_large_blocks_come_from_the_heap_and_are_reused() -> None:
    def probe(hold: str) -> str:
        out = subprocess.run([sys.executable, "-c", PROBE, hold], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    held, in_heap, _ = probe("0").split()
    assert (held, in_heap) == ("False", "False")
    assert probe("1") == "True True True"


@pytest.mark.skipif(GLIBC, reason="off glibc the thresholds are left alone")
def test_other_c_libraries_are_left_alone() -> None:
    assert hold_freed_memory() is False
