"""The native library is in use wherever it can be: a stale or broken build must fail the suite,
not skip the native tests (they skip when `library()` is None)."""

from __future__ import annotations

import os
import platform
import re

import pytest

from graftlm.native import build, library, unavailable_reason


def test_the_source_and_the_loader_agree_on_the_abi() -> None:
    m = re.search(r"int gl_abi_version\(void\) \{ return (\d+); \}", build.SOURCE.read_text())
    assert m is not None, "gl_abi_version not found in csrc/graftlm.c"
    assert int(m.group(1)) == build.ABI_VERSION


def test_the_library_builds_and_loads_where_it_can() -> None:
    if os.environ.get("GRAFTLM_NATIVE", "1").strip().lower() in ("0", "no", "off", "false"):
        pytest.skip("native kernels disabled by GRAFTLM_NATIVE")
    flags = build._cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or " avx2" not in flags or " fma" not in flags:
        pytest.skip("not an x86-64 CPU with AVX2 and FMA")
    if build._compiler() is None:
        pytest.skip("no C compiler")
    assert library() is not None, unavailable_reason()
