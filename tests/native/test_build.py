"""The native library is in use wherever it can be: a stale or broken build must fail the suite,
not skip the native tests (they skip when `library()` is None)."""

from __future__ import annotations

import ctypes
import os
import platform

import pytest

from graftlm.native import abi, build, library, unavailable_reason


def _buildable() -> None:
    if os.environ.get("GRAFTLM_NATIVE", "1").strip().lower() in ("0", "no", "off", "false"):
        pytest.skip("native kernels disabled by GRAFTLM_NATIVE")
    flags = build._cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or " avx2" not in flags or " fma" not in flags:
        pytest.skip("not an x86-64 CPU with AVX2 and FMA")
    if build._compiler() is None:
        pytest.skip("no C compiler")


def test_the_library_builds_and_loads_where_it_can() -> None:
    _buildable()
    assert library() is not None, unavailable_reason()


def test_the_library_and_the_mirrors_agree_on_the_abi() -> None:
    """Every struct's size and field offsets as the library reports them are the ctypes
    mirrors'; every GL_API prototype is in SIGNATURES with the same types, and back."""
    _buildable()
    lib = build.loaded_library()
    assert lib is not None, unavailable_reason()
    have = abi.library_layout(lib)
    assert (
        have == abi.layout()
        and "gl_layer.kv" in have
        and "gl_kv.tables" in have
        and "gl_lora_site" in have
    )
    header = (build.CSRC / "graftlm.h").read_text()
    assert abi.signature_problems(header) == []
    assert set(abi.prototypes(header)) == set(abi.SIGNATURES)


def _drifted_layer() -> type[abi.Mirror]:
    """gl_layer's mirror with one more field before kv: a mirror edited without the C struct."""
    fields = []
    for name, t in abi.GlLayer._fields_:
        if name == "kv":
            fields.append(("extra", ctypes.c_int64))
        fields.append((name, t))
    return type("Drifted", (abi.Mirror,), {"c_name": "gl_layer", "_fields_": fields})


def test_a_stale_layout_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    _buildable()
    lib = build.loaded_library()
    assert lib is not None, unavailable_reason()
    kc, drifted = abi.GlLayer.kv.offset, _drifted_layer()
    structs = tuple(drifted if s is abi.GlLayer else s for s in abi.STRUCTS)
    problems = abi.layout_problems(lib, structs)
    assert f"gl_layer.kv at offset {kc}, ctypes expects {kc + 8}" in problems
    assert (
        "ctypes expects gl_layer.extra at offset " + str(kc) + ", the library has no such field"
        in problems
    )
    assert len(problems) == 2  # the fields after kv, moved with it, go unsaid
    assert abi.layout_problems(lib, abi.STRUCTS[:-1]) == [
        f"{abi.STRUCTS[-1].c_name} is described by the library alone"
    ]
    build.loaded_library.cache_clear()
    try:
        monkeypatch.setattr(abi, "STRUCTS", structs)
        assert library() is None
        assert f"stale native library: gl_layer.kv at offset {kc}, ctypes expects {kc + 8}" in (
            unavailable_reason() or ""
        )
    finally:
        monkeypatch.undo()
        build.loaded_library.cache_clear()
    assert library() is not None


def test_a_changed_prototype_is_refused_naming_the_function() -> None:
    header = (build.CSRC / "graftlm.h").read_text()
    changed = header.replace(
        "GL_API void gl_gated(const float *gu, int64_t B,",
        "GL_API void gl_gated(const float *gu, int B,",
    )
    assert changed != header
    (problem,) = abi.signature_problems(changed)
    assert problem.startswith("gl_gated: graftlm.h (pointer, int, int64_t")
    gone = header.replace("GL_API void gl_gated(", "void gl_gated(")
    assert abi.signature_problems(gone) == [
        "gl_gated is in abi.py, not declared GL_API in graftlm.h"
    ]
