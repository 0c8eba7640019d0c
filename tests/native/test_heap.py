"""The heap thresholds api.load sets: large blocks come from the heap and stay there."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

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


HUGE = """
import os, sys, torch
from graftlm.native.heap import use_huge_pages
print(use_huge_pages(), os.environ["THP_MEM_ALLOC_ENABLE"])
t = torch.empty(8 << 20, dtype=torch.uint8)
t.fill_(1)
print([line.split()[1] for line in open("/proc/self/smaps_rollup") if "AnonHuge" in line][0])
"""


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


def test_huge_pages_are_asked_for_unless_the_user_chose() -> None:
    def run(env: dict[str, str]) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
        out = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    on = run({})
    assert on[:2] == ["True", "1"]
    off = run({"THP_MEM_ALLOC_ENABLE": "0"})
    assert off[:2] == ["False", "0"]
    mode = _thp_mode()
    if mode in ("madvise", "always"):
        assert int(on[2]) > 0  # kB of the 8 MiB block in huge pages
    if mode == "madvise":  # (under "always" every block gets them, asked for or not)
        assert off[2] == "0"
