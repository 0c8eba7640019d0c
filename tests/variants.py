"""The native library built with a switch (-DGL_NO_...), for the tests that check here the path
another CPU takes: bound, and served in place of this CPU's.

A variant is built into the library's own cache (build.cache_dir()), keyed as the library's own
build is (every file of csrc/, the flags, the compiler, the CPU): each variant is compiled once for
a version of the sources, whichever tests ask for it and in however many runs (36 s of CPU a
compile here), as the AVX2, ymm and nogfni variants the subprocess tests load already are. Until
they were, each test compiled its variant into its own folder, -DGL_NO_BF16_ATTN twice a run."""

from __future__ import annotations

import ctypes

import pytest

from graftlm.native import abi, build, ops


def variant_open(*flags: str) -> ctypes.CDLL:
    """The library built with `flags` (from the cache if there), loaded (`build._open`)."""
    cc = build._compiler()
    assert cc is not None
    return build._open(cc, flags)


def variant_library(monkeypatch: pytest.MonkeyPatch, *flags: str) -> ctypes.CDLL:
    """The library built with `flags`, which `ops` serves until the test ends."""
    lib = variant_open(*flags)
    abi.bind(lib)
    monkeypatch.setattr(ops, "library", lambda: lib)
    return lib
