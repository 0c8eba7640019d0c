"""Compile ``csrc/graftlm.c`` (one translation unit: it includes the other files of ``csrc/``)
once per machine with the system C compiler and load it with ctypes.

The library is cached under ``$GRAFTLM_CACHE/native`` (default ``~/.cache/graftlm/native``), keyed
by every file of ``csrc/``, the flags, the compiler and the CPU, so a rebuild happens only when one
of them changes; it is written to a temporary name and renamed, so a half-written file is never loaded.
Each source version and variant leaves its own file, so after a compile (never on a cache hit:
that stays a stat and a dlopen) the cache is pruned (`_prune`): libraries not used for
``PRUNE_DAYS`` days and the ``.so.partial`` files of compiles killed more than a day ago are
removed. A cache hit refreshes its file's mtime (at most once a day), so a library being looked up
and loaded is not taken between the two (one loaded more than PRUNE_DAYS ago may be unlinked: its
mapping stays); one pruned by another process between the look and the dlopen is built anew.
It links the OpenMP runtime torch has already loaded (same soname), so both share one thread pool.
Before its first use, the library's struct layout and the prototypes of ``csrc/graftlm.h`` are
checked against ``abi.py``, the one Python description of the ABI: a library that disagrees is
not used, and ``unavailable_reason()`` names the field or the function.

``GRAFTLM_NATIVE_ISA=avx2`` builds without AVX-512, VNNI and GFNI even where the CPU has them
(``-mno-avx512f -mno-avxvnni -mno-gfni``, as on Zen 2 and 3): the AVX2 variants of the kernels,
testable on any machine.
``GRAFTLM_NATIVE_ISA=ymm`` keeps what the CPU has but the 256-bit kernels where 512-bit VNNI ones
exist (``-DGL_NO_ZMM``): their twins, tested on the machines that have both. ``isa()`` says which
variant is loaded. ``GRAFTLM_PAIR_ROWS=N`` sets from how many rows of x the 512-bit kernels serve
a product (``pair_rows()`` picks it by the CPU otherwise). Where the compiler targets a CPU with AMX
and Linux grants the tiles' state, products of ``GRAFTLM_AMX_ROWS`` rows or more (default 24; 0:
never) run on the tiles in bfloat16 (``amx()`` says whether they do). ``GRAFTLM_DYNAMIC=0`` keeps
the decode products' static split over the threads, the twin of the claims they take as they go
(``dynamic()``).

Native kernels are optional: without a C compiler, on a CPU without AVX2/FMA, off x86-64, or with
``GRAFTLM_NATIVE=0``, ``library()`` is None and the quantized weights use torch's own kernels.
``unavailable_reason()`` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from graftlm.native import abi

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "graftlm.c"  # the unit the compiler is given
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
# "ymm": what the CPU has, but the 256-bit kernels where 512-bit ones exist (their twins' tests);
# "nogfni": what the CPU has but GFNI (an AVX-512 CPU without it: Skylake-X, Cascade Lake)
ISA_FLAGS = {
    "native": [],
    "ymm": ["-DGL_NO_ZMM"],
    "nogfni": ["-mno-gfni"],
    "avx2": ["-mno-avx512f", "-mno-avxvnni", "-mno-gfni"],
}

PRUNE_DAYS = 30  # a cached library not used for this long is removed after a compile
PARTIAL_DAYS = 1  # a .so.partial this old is a killed compile's (one takes seconds to a minute)
DAY_S = 86400.0

_REASON: list[str] = []
_ENABLED = [True]
_AMX = [False]


def sources() -> list[Path]:
    """Every file the library is built from (the unit and what it includes)."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


def cache_dir() -> Path:
    root = Path(os.environ.get("GRAFTLM_CACHE", Path.home() / ".cache" / "graftlm"))
    return root / "native"


def _cpuinfo_line(key: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with key, whole, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    return _cpuinfo_line("flags") or platform.processor()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def isa() -> str:
    """The kernel variant asked for: "native" (what the CPU has), "ymm" (the same without the
    512-bit kernels), "nogfni" (the same without GFNI) or "avx2" (GRAFTLM_NATIVE_ISA)."""
    name = os.environ.get("GRAFTLM_NATIVE_ISA", "native").strip().lower() or "native"
    if name not in ISA_FLAGS:
        raise ValueError(f"GRAFTLM_NATIVE_ISA={name!r}: expected one of {', '.join(ISA_FLAGS)}")
    return name


def _build(cc: str, extra: tuple[str, ...] = ()) -> Path:
    """The library built with FLAGS and `extra` (tests: -DGL_COUNT_ALLOC), from the cache if there."""
    flags = [*FLAGS, *ISA_FLAGS[isa()], *extra]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for path in sources():
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (
        " ".join(flags).encode(),
        version.encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
    out_dir = cache_dir()
    target = out_dir / f"graftlm-{key.hexdigest()[:16]}.so"
    if _cached(target):
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.partial")
    os.close(fd)
    # the one wait a first run has without a word otherwise (a few seconds)
    from tqdm import tqdm  # above a loading bar, if one is drawn

    tqdm.write("compiling native kernels (once)...", file=sys.stderr)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{cc} could not build {SOURCE.name}: {done.stderr.strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _prune(out_dir, target)
    return target


def _open(cc: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The library (built with `extra`, as `_build`) built or found in the cache, and loaded;
    looked up and loaded once more where the dlopen fails (another process may have pruned the
    file between `_build`'s look and the dlopen, and another built it again meanwhile)."""
    try:
        return ctypes.CDLL(str(_build(cc, extra)))
    except OSError:
        return ctypes.CDLL(str(_build(cc, extra)))


def _cached(target: Path) -> bool:
    """Whether the library is in the cache; its mtime refreshed when a day old, so that `_prune`
    (of libraries unused for PRUNE_DAYS) never takes one in use. A cache that cannot be
    written (a shared, read-only one) is used as it is."""
    try:
        age = time.time() - target.stat().st_mtime
    except OSError:
        return False
    if age > DAY_S:
        with contextlib.suppress(OSError):
            os.utime(target)
    return True


def _prune(out_dir: Path, keep: Path) -> None:
    """Remove the cached libraries (`graftlm-*.so`) not used for PRUNE_DAYS days (their mtime,
    refreshed by `_cached`) and `*.so.partial` files older than PARTIAL_DAYS (a killed compile's;
    one being written now is younger), all but `keep`. Errors are ignored: another process may
    be pruning the same files."""
    now = time.time()
    for pattern, days in (("graftlm-*.so", PRUNE_DAYS), ("*.so.partial", PARTIAL_DAYS)):
        for path in out_dir.glob(pattern):
            with contextlib.suppress(OSError):
                if path != keep and now - path.stat().st_mtime > days * DAY_S:
                    path.unlink()


def library() -> ctypes.CDLL | None:
    """The loaded native library, or None when it cannot be used here (see unavailable_reason)."""
    return loaded_library() if _ENABLED[0] else None


@contextmanager
def disabled() -> Iterator[None]:
    """Run without native code (weights loaded inside keep torch kernels): for twins and tests."""
    old = _ENABLED[0]
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = old


def switched_off(name: str) -> bool:
    """Whether the environment turns the switch `name` off: 0, off, no or false, any case (unset
    or any other value: on), as GRAFTLM_NATIVE and GRAFTLM_NATIVE_MOE_PROMPT read."""
    return os.environ.get(name, "1").strip().lower() in ("0", "off", "no", "false")


@functools.cache
def loaded_library() -> ctypes.CDLL | None:
    """The library, built and loaded once, whatever ``disabled()`` says: weights repacked for
    it keep using it."""
    import torch  # noqa: F401  (loads torch's OpenMP runtime first, so the library shares it)

    if switched_off("GRAFTLM_NATIVE"):
        _REASON.append("disabled by GRAFTLM_NATIVE")
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _REASON.append(f"no native kernels for {platform.machine()}")
        return None
    flags = _cpu_flags()
    if " avx2" not in flags or " fma" not in flags:
        _REASON.append("the CPU lacks AVX2/FMA")
        return None
    try:
        isa()
    except ValueError as exc:
        _REASON.append(str(exc))
        return None
    cc = _compiler()
    if cc is None:
        _REASON.append("no C compiler (cc, gcc or clang) on PATH")
        return None
    try:
        lib = _open(cc)
    except OSError as exc:
        _REASON.append(str(exc))
        return None
    problem = abi_problem(lib)
    if problem is not None:
        _REASON.append(problem)
        return None
    abi.bind(lib)
    try:
        lib.gl_set_pair_rows(pair_rows())
        lib.gl_set_dynamic(int(dynamic()))
        rows = amx_rows()
    except ValueError as exc:
        _REASON.append(str(exc))
        return None
    _AMX[0] = rows > 0 and lib.gl_set_amx_rows(rows) >= 0
    return lib


def _cpu_vendor() -> str:
    return (_cpuinfo_line("vendor_id") or "").partition(":")[2].strip()


def pair_rows() -> int:
    """From how many rows of x the 512-bit VNNI kernels (two groups of outputs a pass) serve a
    product, where the library has them: GRAFTLM_PAIR_ROWS, else by the CPU's maker. A decode row
    streams faster through them on Intel's AVX-512 Xeons (Llama-1B Q4_K_M: 26 t/s against 21
    through the 256-bit kernels) and slower on AMD's Zen 5 (50-54 t/s through the 256-bit kernels,
    38-41 through them), so 1 on Intel and 2 elsewhere."""
    raw = os.environ.get("GRAFTLM_PAIR_ROWS", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"GRAFTLM_PAIR_ROWS={raw!r}: expected a whole number of rows >= 1")
        return int(raw)
    return 1 if _cpu_vendor() == "GenuineIntel" else 2


def dynamic() -> bool:
    """Whether the decode products' threads claim their tasks as they go (csrc/graftlm.h's
    share_take: each its static share first, then the rest of another's), or keep the static split
    (GRAFTLM_DYNAMIC=0, read when the library loads): the same bits either way. On a VM that
    deschedules a vCPU for milliseconds, the static split holds the step until that thread is back
    and has done the rest of its half."""
    raw = os.environ.get("GRAFTLM_DYNAMIC", "").strip().lower()
    if raw in ("", "1", "on", "yes", "true"):
        return True
    if raw in ("0", "off", "no", "false"):
        return False
    raise ValueError(f"GRAFTLM_DYNAMIC={raw!r}: expected 0 or 1")


def amx_rows() -> int:
    """From how many rows of x a product runs on AMX tiles, in bfloat16, where the library has them
    and Linux grants their state: GRAFTLM_AMX_ROWS (0: never), else 24. Fewer rows keep the VNNI
    kernels: each product dequantizes its weight once for all its rows, which a prompt's rows
    repay and a decode step's do not (Q4_K 8192 x 2048 on 2 threads of an Intel Xeon: 1.1 ms on
    the tiles from 4 rows to 32; on the VNNI kernels 0.8 ms at 16 rows, 1.2 at 24, 1.6 at 32)."""
    raw = os.environ.get("GRAFTLM_AMX_ROWS", "").strip()
    if raw:
        if not raw.isdigit():
            raise ValueError(
                f"GRAFTLM_AMX_ROWS={raw!r}: expected a whole number of rows (0: never)"
            )
        return int(raw)
    return 24


def amx() -> bool:
    """Whether prompts' products run on AMX tiles (the library has them, GRAFTLM_AMX_ROWS is not
    0, and Linux granted the tiles' state)."""
    return loaded_library() is not None and _AMX[0]


def abi_problem(lib: ctypes.CDLL) -> str | None:
    """Why the library and abi.py disagree (the structs' layout, then the functions), or None."""
    layout = abi.layout_problems(lib)
    if layout:
        return "stale native library: " + "; ".join(layout)
    header = (CSRC / "graftlm.h").read_text()
    missing = [n for n in abi.SIGNATURES if not hasattr(lib, n)]
    calls = abi.signature_problems(header) + [f"the library has no {n}" for n in missing]
    if calls:
        return "native functions and abi.py disagree: " + "; ".join(calls)
    return None


FEATURES = (
    "avx512f",
    "avx512bw+vl",
    "vnni",
    "avx512bf16",
    "zmm-vnni",
    "amx",
    "attn-bf16",
    "attn-i8",
    "iq-tiles",  # IQ2_XXS and IQ3_XXS regrouped into tiles at load (AVX-512 VBMI: csrc/iquant.c)
)


def features() -> list[str]:
    """The instruction sets the loaded library was compiled to use (empty: AVX2 + FMA only, or no
    library)."""
    lib = loaded_library()
    bits = int(lib.gl_features()) if lib is not None else 0
    return [name for i, name in enumerate(FEATURES) if bits >> i & 1]


def bf16_dots() -> bool:
    """Whether BF16 weights' products with many rows of x (prompts) round x to bfloat16 and sum by
    VDPBF16PS, as llama.cpp's do (csrc/float.c): AVX512-BF16 in the 512-bit build, unless
    GRAFTLM_BF16_DOTS=0 (the library reads it once)."""
    off = os.environ.get("GRAFTLM_BF16_DOTS", "").startswith("0")
    return "avx512bf16" in features() and isa() == "native" and not off


def threads() -> int:
    """The threads every native call runs on: torch's (its OpenMP pool, which the library shares)."""
    import torch

    return max(1, torch.get_num_threads())


def release_threads() -> bool:
    """Give back the calling thread's OpenMP workers (`gl_release_threads`): done by a thread that
    hands the model's steps to another (the engine service's starter), so that only the stepping
    thread's pool counts against the CPUs. True when given back."""
    lib = loaded_library()
    return lib is not None and int(lib.gl_release_threads()) == 0


def unavailable_reason() -> str | None:
    """Why ``library()`` is None, or None when the native kernels are in use."""
    if not _ENABLED[0]:
        return "disabled in this process (graftlm.native.disabled)"
    return None if library() is not None else (_REASON[-1] if _REASON else "unknown")
