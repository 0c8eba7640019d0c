"""The native library built with a switch (-DGL_NO_...), for the tests that check here the path
another CPU takes: built into the test's own cache, bound, and served in place of this CPU's."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from graftlm.native import abi, build, ops


def variant_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> ctypes.CDLL:
    """The library built with `flags`, which `ops` serves until the test ends."""
    cc = build._compiler()
    assert cc is not None
    monkeypatch.setenv("GRAFTLM_CACHE", str(tmp_path))
    lib = ctypes.CDLL(str(build._build(cc, flags)))
    abi.bind(lib)
    monkeypatch.setattr(ops, "library", lambda: lib)
    return lib
