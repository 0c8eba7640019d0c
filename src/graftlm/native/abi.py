"""The native library's ABI as Python sees it, declared once: ctypes mirrors of the structs of
``csrc/graftlm.h`` and the argument types of every function it exports.

The loader (build.py) checks both before it uses a library:

* layout: the library reports each struct's size and each field's offset as its compiler laid them
  out (``gl_abi_layout``); every one must be the mirror's, by name. A library built from other
  structs is refused, naming the field ("gl_layer.kv at offset 312, ctypes expects 320").
* signatures: the ``GL_API`` prototypes of ``graftlm.h`` (the file the library was built from: the
  build is keyed by its bytes) must take what ``SIGNATURES`` passes, argument by argument, and
  every exported function must be in both.
"""

from __future__ import annotations

import ctypes
import re
import weakref
from typing import ClassVar

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class Mirror(ctypes.Structure):
    """A ctypes mirror of the C struct named c_name, field for field and by the same names."""

    c_name: ClassVar[str]


class GlWeight(Mirror):
    c_name = "gl_weight"
    _fields_ = [("kind", _I64), ("half", _I64), ("sblk", _I64), ("small", _I64), ("n", _I64),
                ("k", _I64), ("q", _P), ("d", _P), ("m", _P)]  # fmt: skip


class GlLoraPart(Mirror):
    c_name = "gl_lora_part"
    _fields_ = [("b", _P), ("c0", _I64), ("r", _I64), ("lo", _I64), ("hi", _I64)]


class GlLoraSlot(Mirror):
    c_name = "gl_lora_slot"
    _fields_ = [("a", _P), ("aq", _P), ("a_scales", _P), ("parts", _P), ("id", _I64),
                ("r", _I64), ("a_half", _I64), ("n_parts", _I64)]  # fmt: skip


class GlLoraSite(Mirror):
    c_name = "gl_lora_site"
    _fields_ = [("slot", _P), ("scales", _P), ("n", _I64), ("bf", _I64), ("ld", _I64)]


class GlKv(Mirror):
    c_name = "gl_kv"
    _fields_ = [("k", _P), ("v", _P), ("tables", _P), ("n_blocks", _I64), ("n_slots", _I64),
                ("max_blocks", _I64), ("block", _I64), ("n_head_kv", _I64),
                ("type", _I64)]  # fmt: skip


class GlLayer(Mirror):
    c_name = "gl_layer"
    _fields_ = [
        ("qkv", GlWeight * 3), ("o", GlWeight), ("gate_up", GlWeight), ("down", GlWeight),
        ("l_qkv", GlLoraSite * 3), ("l_o", GlLoraSite), ("l_gate_up", GlLoraSite),
        ("l_down", GlLoraSite),
        ("attn_norm", _P), ("ffn_norm", _P),
        ("q_norm", _P), ("k_norm", _P), ("post_attn_norm", _P), ("post_ffw_norm", _P),
        ("q_bias", _P), ("k_bias", _P), ("v_bias", _P), ("o_bias", _P),
        ("kv", GlKv), ("cos_t", _P), ("sin_t", _P),
        ("n_qkv", _I64), ("n_embd", _I64), ("n_head", _I64), ("n_head_kv", _I64),
        ("head_dim", _I64), ("n_ff", _I64), ("n_ctx", _I64), ("rot", _I64), ("neox", _I64),
        ("window", _I64), ("act", _I64), ("eps", _F), ("scale", _F), ("softcap", _F),
        ("router", GlWeight), ("l_router", GlLoraSite), ("exp_gate_up", _P), ("exp_down", _P),
        ("n_expert", _I64), ("n_expert_used", _I64), ("sinks", _P), ("router_bias", _P),
        ("exp_gate_up_bias", _P), ("exp_down_bias", _P), ("gating", _I64),
        ("l_exp_gate_up", _P), ("l_exp_down", _P),
    ]  # fmt: skip


class GlAttn(Mirror):
    c_name = "gl_attn"
    _fields_ = [("kv", GlKv), ("cos_t", _P), ("sin_t", _P), ("n_head", _I64),
                ("n_head_kv", _I64), ("head_dim", _I64), ("v_dim", _I64), ("n_ctx", _I64),
                ("rot", _I64), ("neox", _I64), ("window", _I64), ("scale", _F),
                ("softcap", _F), ("sinks", _P)]  # fmt: skip


class GlScratch(Mirror):
    c_name = "gl_scratch"
    _fields_ = [("base", _P), ("cap", _I64), ("used", _I64), ("busy", _I64)]


STRUCTS: tuple[type[Mirror], ...] = (
    GlWeight,
    GlLoraPart,
    GlLoraSlot,
    GlLoraSite,
    GlKv,
    GlLayer,
    GlAttn,
    GlScratch,
)

# name -> (return type, argument types); pointers of every kind as c_void_p
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "gl_abi_layout": (_I64, [_P, _P, _I64]),
    "gl_scratch_free": (None, [_P]),
    "gl_alloc_count": (_I64, []),
    "gl_features": (_I64, []),
    "gl_set_pair_rows": (_I64, [_I64]),
    "gl_set_moe_jobs": (_I64, [_I64]),
    "gl_set_dynamic": (_I64, [_I64]),
    "gl_stolen_items": (_I64, []),
    "gl_release_threads": (_I64, []),
    "gl_set_amx_rows": (_I64, [_I64]),
    "gl_pack_u4": (_INT, [_INT, _P, _I64, _I64, _I64, _P, _P, _P, _INT, _INT]),
    "gl_pack_s8": (_INT, [_INT, _P, _I64, _I64, _I64, _P, _P, _INT, _INT]),
    "gl_pack_q8_0_f32": (None, [_P, _I64, _I64, _P, _P]),
    "gl_deq_u4": (None, [_P, _P, _P, _INT, _INT, _INT, _I64, _P, _I64, _I64, _P, _INT]),
    "gl_deq_s8": (None, [_P, _P, _INT, _INT, _I64, _I64, _P, _I64, _I64, _P, _INT]),
    "gl_mm_u4": (None, [_P, _I64, _I64, _P, _P, _P, _INT, _INT, _I64, _P, _INT]),
    "gl_mm_s8": (None, [_P, _I64, _I64, _P, _P, _INT, _INT, _INT, _I64, _P, _INT]),
    "gl_mm_f": (None, [_P, _I64, _I64, _P, _INT, _I64, _P, _INT]),
    "gl_pack_mx4": (_INT, [_P, _I64, _I64, _I64, _P, _INT]),  # raw, rowbytes, n, k, q, threads
    "gl_deq_mx4": (None, [_P, _I64, _P, _I64, _I64, _P, _INT]),  # q, k, ids, row0, nrows, out
    "gl_mm_mx4": (None, [_P, _I64, _I64, _P, _I64, _P, _INT]),  # x, M, k, q, n, y, threads
    "gl_pack_k4": (_INT, [_INT, _P, _I64, _I64, _I64, _P, _P, _INT]),
    "gl_deq_k4": (None, [_P, _P, _INT, _I64, _P, _I64, _I64, _P, _INT]),
    "gl_mm_k4": (None, [_P, _I64, _I64, _P, _P, _INT, _I64, _P, _INT]),
    "gl_pack_k6": (_INT, [_INT, _P, _I64, _I64, _I64, _P, _P, _INT]),
    "gl_deq_k6": (None, [_P, _P, _INT, _I64, _P, _I64, _I64, _P, _INT]),
    "gl_mm_k6": (None, [_P, _I64, _I64, _P, _P, _INT, _I64, _P, _INT]),
    "gl_deq_iq": (None, [_P, _INT, _I64, _P, _I64, _I64, _P, _INT]),
    "gl_mm_iq": (None, [_P, _I64, _I64, _P, _INT, _I64, _P, _INT]),
    "gl_iq_tiles": (_INT, []),  # 1 where the build takes gl_pack_iq's tiles
    "gl_pack_iq": (_INT, [_INT, _P, _I64, _I64, _P, _INT]),  # v, raw, n, k, out, threads
    "gl_deq_iq_tiles": (None, [_P, _INT, _I64, _P, _I64, _I64, _P, _INT]),
    "gl_mm_iq_tiles": (None, [_P, _I64, _I64, _P, _INT, _I64, _P, _INT]),
    "gl_rms_norm": (None, [_P, _I64, _I64, _P, _F, _P, _INT]),
    # x, N, rs, H, D, pos, cos, sin, n_pos, rot, neox, out, threads
    "gl_rope": (_INT, [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _INT, _P, _INT]),
    # attn, q, q_rs, k, k_rs, v, v_rs, slots, pos, B, out, threads
    "gl_attn_decode": (None, [_P, _P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _P, _INT]),
    # attn, q, slots, starts, B, T, out, threads
    "gl_attn_prefill": (None, [_P, _P, _P, _P, _I64, _I64, _P, _I64, _INT]),
    "gl_gated": (None, [_P, _I64, _I64, _I64, _P, _INT]),
    # kv, which, x, rs, slots, starts, B, T, D, threads
    "gl_kv_write": (None, [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _INT]),
    "gl_proj": (None, [_P, _P, _P, _I64, _I64, _P, _INT]),  # weight, lora site, x, M, T, y, threads
    "gl_lora": (None, [_P, _I64, _I64, _P, _I64, _I64, _P, _INT]),  # site, n_in, n_out, x, M, T, y
    # layer, x, B, slots, pos, scratch, threads
    "gl_layer_decode": (None, [_P, _P, _I64, _P, _P, _P, _INT]),
    # layers, n, x, B, slots, pos, scratch, threads
    "gl_layers_decode": (None, [_P, _I64, _P, _I64, _P, _P, _P, _INT]),
    "gl_moe_ffn": (None, [_P, _P, _I64, _P, _P, _INT]),  # layer, h, B, o, scratch, threads
    "gl_moe_bytes": (_I64, [_P, _I64]),  # layer, B
}


class _Unpassable:
    """A C type in a GL_API prototype that SIGNATURES has no ctypes type for."""


_C_TYPES: dict[str, type] = {"int64_t": _I64, "int": _INT, "float": _F}
_PROTOTYPE = re.compile(r"\bGL_API\s+([\w\s]+?)\s*\b(gl_\w+)\s*\(([^)]*)\)\s*;")


def layout(structs: tuple[type[Mirror], ...] | None = None) -> dict[str, int]:
    """What the mirrors (STRUCTS) expect: "struct" -> its size, "struct.field" -> its offset."""
    out: dict[str, int] = {}
    for s in STRUCTS if structs is None else structs:
        name = s.c_name
        out[name] = ctypes.sizeof(s)
        for field, *_ in s._fields_:
            out[f"{name}.{field}"] = getattr(s, field).offset
    return out


def library_layout(lib: ctypes.CDLL) -> dict[str, int]:
    """The layout the library reports (gl_abi_layout)."""
    fn = lib.gl_abi_layout
    fn.restype, fn.argtypes = SIGNATURES["gl_abi_layout"][0], SIGNATURES["gl_abi_layout"][1]
    n = fn(None, None, 0)
    names, values = (ctypes.c_char_p * n)(), (ctypes.c_int64 * n)()
    fn(names, values, n)
    return {(k or b"").decode(): int(v) for k, v in zip(names, values, strict=True)}


def layout_problems(lib: ctypes.CDLL, structs: tuple[type[Mirror], ...] | None = None) -> list[str]:
    """Where the library's struct layout and the mirrors' differ (empty: they agree): per struct,
    the first field at another offset (those after it follow), the fields only one side has, and
    the size when nothing else tells."""
    if not hasattr(lib, "gl_abi_layout"):
        return ["the library does not describe its structs (no gl_abi_layout)"]
    have, want = library_layout(lib), layout(structs)
    out = []
    for struct in dict.fromkeys(k.split(".")[0] for k in [*want, *have]):
        if struct not in want or struct not in have:
            side = "the library" if struct in have else "ctypes"
            out.append(f"{struct} is described by {side} alone")
            continue
        fields = [k for k in dict.fromkeys([*want, *have]) if k.startswith(struct + ".")]
        found = [
            f"ctypes expects {k} at offset {want[k]}, the library has no such field"
            for k in fields
            if k not in have
        ]
        found += [
            f"{k} at offset {have[k]}, ctypes has no such field" for k in fields if k not in want
        ]
        moved = [k for k in fields if k in have and k in want and have[k] != want[k]]
        if moved:
            found.insert(
                0, f"{moved[0]} at offset {have[moved[0]]}, ctypes expects {want[moved[0]]}"
            )
        if not found and have[struct] != want[struct]:
            found.append(f"{struct} is {have[struct]} bytes, ctypes expects {want[struct]}")
        out += found
    return out


def _type_name(t: type | None) -> str:
    names: dict[type | None, str] = {_P: "pointer", _I64: "int64_t", _INT: "int", _F: "float"}
    names[None] = "void"
    return names.get(t, "a type ctypes is not given")


def prototypes(header: str) -> dict[str, tuple[type | None, list[type]]]:
    """The GL_API prototypes of graftlm.h in SIGNATURES' terms."""
    out: dict[str, tuple[type | None, list[type]]] = {}
    for ret, name, params in _PROTOTYPE.findall(header):
        args: list[type] = []
        for p in params.split(","):
            p = p.strip()
            if not p or p == "void":
                continue
            words = p.replace("const", " ").split()
            args.append(_P if "*" in p else _C_TYPES.get(words[0], _Unpassable))
        ret = ret.replace("const", " ").strip()
        out[name] = (None if ret == "void" else _C_TYPES.get(ret, _Unpassable), args)
    return out


def signature_problems(header: str) -> list[str]:
    """Every function whose prototype in graftlm.h and entry in SIGNATURES differ, or that is in
    one and not the other (empty: they agree)."""
    declared, out = prototypes(header), []
    for name in [*SIGNATURES, *(n for n in declared if n not in SIGNATURES)]:
        if name not in declared:
            out.append(f"{name} is in abi.py, not declared GL_API in graftlm.h")
        elif name not in SIGNATURES:
            out.append(f"{name} is declared in graftlm.h, not in abi.py")
        elif declared[name] != SIGNATURES[name]:
            (cr, ca), (pr, pa) = declared[name], SIGNATURES[name]
            out.append(
                f"{name}: graftlm.h ({', '.join(map(_type_name, ca))}) -> {_type_name(cr)}, "
                f"abi.py ({', '.join(map(_type_name, pa))}) -> {_type_name(pr)}"
            )
    return out


def bind(lib: ctypes.CDLL) -> None:
    """Give every function of the library its argument and return types."""
    for name, (ret, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ret


class Scratch:
    """A gl_scratch: the memory native decode layers carve their buffers from, kept between steps
    and grown by the C side when a step needs more (more rows, an adapter of higher rank); freed
    with this object. One per FusedLayer and FusedStack, so models never share one (a call that
    finds it in use by another thread takes memory of its own)."""

    def __init__(self, lib: ctypes.CDLL | None) -> None:
        self.struct = GlScratch()
        self.ref = ctypes.byref(self.struct)  # what the calls pass
        if lib is not None:
            weakref.finalize(self, lib.gl_scratch_free, self.ref)

    @property
    def capacity(self) -> int:
        """The bytes it holds now."""
        return int(self.struct.cap)
