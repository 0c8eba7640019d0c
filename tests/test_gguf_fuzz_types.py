"""A seeded fuzzer over the types of a GGUF header's fields: every metadata key of the tiny
model and of the tiny adapter, in turn, re-typed (each integer width, float32/64, bool, string,
arrays of each of those, nested arrays, arrays that declare more entries than any model uses,
their bytes a hole in a sparse file). Each mutant either loads and serves (a model generates;
an adapter attaches and serves a request at scale 1) or is refused with a GraftError that names
the key; no other exception, none takes long. More cases: FUZZ_CASES=2000 (FUZZ_SEED=n)."""

from __future__ import annotations

import os
import random
import struct
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType as V
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

import graftlm
from graftlm.errors import GraftError
from graftlm.gguf.parse import MAX_ARRAY

N = int(os.environ.get("FUZZ_CASES", "0")) or 90  # model and adapter together
SEED = int(os.environ.get("FUZZ_SEED", "1"))
WALL = 10.0

_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I",
           V.INT32: "<i", V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q",
           V.FLOAT64: "<d"}  # fmt: skip
_INTS = [0, 1, 2, 3, 7, 32, 64, 255, 2**15, 2**31 - 1, 2**32 - 1, 2**63 - 1]


def _string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


@dataclass
class Header:
    """A GGUF file cut where its metadata is: the entries as raw bytes by key, the tensor
    infos after them, and the data (offsets relative to its start, so any header length that
    keeps the alignment keeps them right)."""

    version: bytes
    n_tensors: int
    entries: list[tuple[str, bytes]]  # key -> its type and value, as stored
    infos: bytes
    data: bytes

    @classmethod
    def read(cls, raw: bytes) -> Header:
        at = 24
        n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)

        def skip_value(vtype: int) -> None:
            nonlocal at
            if vtype == V.STRING:
                (n,) = struct.unpack_from("<Q", raw, at)
                at += 8 + n
            elif vtype == V.ARRAY:
                itype, n = struct.unpack_from("<IQ", raw, at)
                at += 12
                for _ in range(n):
                    skip_value(itype)
            else:
                at += struct.calcsize(_SCALAR[V(vtype)])

        entries = []
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", raw, at)
            key = raw[at + 8 : at + 8 + n].decode()
            at += 8 + n
            start = at
            (vtype,) = struct.unpack_from("<I", raw, at)
            at += 4
            skip_value(vtype)
            entries.append((key, raw[start:at]))
        start = at
        for _ in range(n_tensors):
            (n,) = struct.unpack_from("<Q", raw, at)
            at += 8 + n
            (dims,) = struct.unpack_from("<I", raw, at)
            at += 4 + 8 * dims + 4 + 8
        infos = raw[start:at]
        data_at = at + (-at % 32)
        return cls(raw[4:8], n_tensors, entries, infos, raw[data_at:])

    def write(self, path: Path, key: str, value: bytes, hole: int = 0) -> Path:
        """The file with `key`'s stored type and value replaced by `value`, followed by `hole`
        bytes that the file does not store (a sparse file)."""
        head = b"GGUF" + self.version + struct.pack("<QQ", self.n_tensors, len(self.entries))
        with open(path, "wb") as f:
            f.write(head)
            for k, v in self.entries:
                f.write(_string(k.encode()))
                if k != key:
                    f.write(v)
                    continue
                f.write(value)
                if hole:
                    f.seek(hole, os.SEEK_CUR)
            f.write(self.infos)
            f.write(b"\0" * (-f.tell() % 32))
            f.write(self.data)
        return path


def _scalar(rng: random.Random, vtype: V) -> bytes:
    fmt = _SCALAR[vtype]
    if vtype in (V.FLOAT32, V.FLOAT64):
        v: Any = rng.choice([0.0, 1.0, -1.0, 0.5, 1e30, float("nan"), float("inf"), 64.0])
    elif vtype == V.BOOL:
        v = rng.random() < 0.5
    else:
        bits = struct.calcsize(fmt) * 8
        lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if fmt.islower() else (0, 2**bits - 1)
        v = max(lo, min(hi, rng.choice(_INTS + [-1, lo, hi])))
    return struct.pack(fmt, v)


def _text(rng: random.Random) -> bytes:
    return rng.choice([b"", b"x", b"4096", b"llama", b"9" * 100, b"\xff\xfe", "é".encode(),
                       b"a" * 5000, b"1e309", b"-1"])  # fmt: skip


def _element(rng: random.Random, itype: V, depth: int) -> bytes:
    if itype == V.STRING:
        return _string(_text(rng))
    if itype == V.ARRAY:
        return _array(rng, depth + 1)
    return _scalar(rng, itype)


def _array(rng: random.Random, depth: int = 0) -> bytes:
    itype = rng.choice([*_SCALAR, V.STRING] + ([V.ARRAY] if depth < 3 else []))
    n = rng.choice([0, 1, 2, 3, 8, 262])
    items = b"".join(_element(rng, V(itype), depth) for _ in range(n))
    return struct.pack("<IQ", itype, n) + items


def _retyped(rng: random.Random, stored: bytes) -> tuple[bytes, int, str]:
    """A stored type and value, the bytes of a hole after it, and what it is: a third of them
    another value of the key's own stored type where that is a number or a string (often near
    its own, so that some serve: a number of another type is refused, as llama.cpp refuses it)."""
    (own,) = struct.unpack_from("<I", stored)
    if rng.random() < 1 / 3 and (own in _SCALAR or own == V.STRING):
        if own == V.STRING:
            return struct.pack("<I", V.STRING) + _string(_text(rng)), 0, "STRING"
        fmt = _SCALAR[V(own)]
        (v,) = struct.unpack_from(fmt, stored, 4)
        if rng.random() < 0.5 or own == V.BOOL:
            return struct.pack("<I", own) + _scalar(rng, V(own)), 0, V(own).name
        try:
            near = struct.pack(fmt, rng.choice([v * 2, v + 1, v - 1]))
        except struct.error:  # (out of the type's range)
            near = struct.pack(fmt, v)
        return struct.pack("<I", own) + near, 0, f"{V(own).name} near {v}"
    r = rng.random()
    if r < 0.08:  # more entries than any model uses, or than the file holds
        itype, n = rng.choice(
            [(V.UINT8, MAX_ARRAY + 1), (V.UINT8, 9 * 10**9), (V.STRING, MAX_ARRAY),
             (V.UINT64, 2**40), (V.INT32, 2**63), (V.STRING, 2**62), (V.FLOAT32, MAX_ARRAY)]
        )  # fmt: skip
        size = {V.UINT8: 1, V.STRING: 8, V.FLOAT32: 4}.get(itype, 0) * n
        hole = size if size <= 64 << 30 else 0
        return struct.pack("<IIQ", V.ARRAY, itype, n), hole, f"array of {n} {itype.name}"
    if r < 0.5:
        vtype = rng.choice(list(_SCALAR))
        return struct.pack("<I", vtype) + _scalar(rng, vtype), 0, vtype.name
    if r < 0.65:
        return struct.pack("<I", V.STRING) + _string(_text(rng)), 0, "STRING"
    if r < 0.7:  # a string that declares more than the file holds
        return struct.pack("<IQ", V.STRING, rng.choice([2**26 + 1, 2**40, 2**64 - 1])), 0, "long"
    value = _array(rng)
    return struct.pack("<I", V.ARRAY) + value, 0, "ARRAY"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("types")
    spec = TinySpec()
    base = write_tiny_model(d / "base.gguf", spec)
    adapter = write_tiny_adapter(d / "adapter.gguf", spec)
    return {"dir": d, "base": base, "model": graftlm.load(str(base), ctx_size=32),
            "headers": {"model": Header.read(base.read_bytes()),
                        "adapter": Header.read(adapter.read_bytes())}}  # fmt: skip


def test_the_header_round_trips(files: dict[str, Any], tmp_path: Path) -> None:
    h: Header = files["headers"]["model"]
    key, value = h.entries[3]
    p = h.write(tmp_path / "same.gguf", key, value)
    assert p.read_bytes() == files["base"].read_bytes()


def _kind(stored: bytes) -> str:
    """A stored value's class in the GGUF spec's terms: a number (any width, integer or float),
    a bool, a string, or an array of one of these (nested arrays: "array of array"; an array
    of numbers is a number per layer, as GGUF allows for head counts). A mutant
    of the same class as the original is another value (a different model: its refusal may name
    what does not fit, a tensor); one of another class is a field of the wrong type, and its
    refusal must name the field."""
    (vtype,) = struct.unpack_from("<I", stored)
    if vtype == V.ARRAY:
        itype, n = struct.unpack_from("<IQ", stored, 4)
        if itype in _SCALAR and itype != V.BOOL:  # (a number per layer: GGUF's head counts)
            return "number"
        if itype == V.ARRAY:  # (an element array has no type of its own before it)
            return "array of " + (_kind(struct.pack("<I", V.ARRAY) + stored[16:]) if n else "array")
        return "array of " + _kind(struct.pack("<I", itype))
    if vtype in (V.BOOL, V.STRING):
        return V(vtype).name.lower()
    return "number"


def _serve(model: graftlm.Model, which: str, p: Path) -> None:
    if which == "model":
        graftlm.load(str(p), ctx_size=32).generate("hi the", max_tokens=2, temperature=0)
        return
    aid = model.add_lora(p)
    try:
        model.generate("hi", max_tokens=2, temperature=0, lora=[{"id": aid, "scale": 1.0}])
    finally:
        model.remove_lora(aid)


def test_retyped_fields_load_and_serve_or_are_refused_by_name(
    files: dict[str, Any], tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    model: graftlm.Model = files["model"]
    outcomes: dict[str, int] = {}
    unnamed: list[str] = []
    original = {w: dict(h.entries) for w, h in files["headers"].items()}
    for i in range(N):
        which = "adapter" if i % 3 == 2 else "model"
        h: Header = files["headers"][which]
        key = h.entries[(i // 3 if which == "adapter" else i) % len(h.entries)][0]
        value, hole, kind = _retyped(rng, original[which][key])
        p = h.write(tmp_path / f"{which}{i}.gguf", key, value, hole)
        what = f"case {i}: {which} {key} as {kind}"
        # (the CPU time of all the process's threads, torch's and the native kernels' too: the
        # pauses of a loaded machine do not count)
        t0 = time.process_time()
        try:
            _serve(model, which, p)
            outcome = "served"
        except GraftError as exc:
            outcome = "refused"
            if _kind(value) != _kind(original[which][key]) and key not in str(exc):
                unnamed.append(f"{what}: {str(exc)[:300]}")
        assert time.process_time() - t0 < WALL, (what, time.process_time() - t0)
        assert model.loras == [], what
        outcomes[f"{which} {outcome}"] = outcomes.get(f"{which} {outcome}", 0) + 1
        p.unlink()
    print(f"\n{N} mutants: {dict(sorted(outcomes.items()))}")
    assert not unnamed, "\n".join(unnamed[:20])
    assert outcomes.get("model refused", 0) > 5 and outcomes.get("model served", 0) > 5
    assert outcomes.get("adapter refused", 0) > 5


def _array_of(itype: V, items: list[Any]) -> bytes:
    body = b"".join(_string(str(v).encode()) if itype == V.STRING else
                    struct.pack(_SCALAR[itype], v) for v in items)  # fmt: skip
    return struct.pack("<IIQ", V.ARRAY, itype, len(items)) + body


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("tokenizer.ggml.eos_token_id", _array_of(V.UINT32, [2]), "is a list, not a token id"),
        ("tokenizer.ggml.bos_token_id", struct.pack("<I", V.STRING) + _string(b""), "is a str"),
        ("tokenizer.ggml.pre", _array_of(V.STRING, ["smollm"]), "is a list, not a string"),
        ("tokenizer.ggml.tokens", _array_of(V.INT32, list(range(262))), "[0] is a int"),
        ("tokenizer.ggml.merges", _array_of(V.FLOAT32, [1.0]), "[0] is a float"),
        ("tokenizer.ggml.tokens", struct.pack("<IIQ", V.ARRAY, V.ARRAY, 0), "is empty"),
    ],
    ids=["eos-array", "bos-string", "pre-array", "tokens-ints", "merges-floats", "no-tokens"],
)
def test_tokenizer_fields_of_the_wrong_type_are_named(
    files: dict[str, Any], tmp_path: Path, key: str, value: bytes, words: str
) -> None:
    """Found by the fuzzer: a token id stored as an array or a string, the pre-tokenizer as an
    array, the tokens as numbers were refused in Python's words (`int() argument must be ...`,
    `unhashable type: 'list'`, a duplicate token `32`), naming no key; an empty token list
    loaded, and every request failed on an empty prompt."""
    p = files["headers"]["model"].write(tmp_path / "bad.gguf", key, value)
    with pytest.raises(GraftError) as info:
        graftlm.load(str(p), ctx_size=32)
    assert key in str(info.value) and words in str(info.value), str(info.value)


def test_millions_of_strings_in_a_sparse_header_are_refused_at_once(
    files: dict[str, Any], tmp_path: Path
) -> None:
    """Found by the fuzzer: 16M empty strings (their lengths a hole in a sparse file, within
    the limit on one array's entries) took 12 s to read, a Python string each."""
    n = MAX_ARRAY
    value = struct.pack("<IIQ", V.ARRAY, V.STRING, n)
    p = files["headers"]["model"].write(tmp_path / "many.gguf", "general.name", value, 8 * n)
    # (the CPU time of all the process's threads, torch's and the native kernels' too: the
    # pauses of a loaded machine do not count)
    t0 = time.process_time()
    with pytest.raises(GraftError) as info:
        graftlm.load(str(p), ctx_size=32)
    assert time.process_time() - t0 < 3
    from graftlm.gguf.parse import MAX_ITEMS

    assert "general.name" in str(info.value) and f"limit of {MAX_ITEMS}" in str(info.value)


def test_a_per_layer_array_of_arrays_is_refused_by_name(
    files: dict[str, Any], tmp_path: Path
) -> None:
    """Found by the fuzzer (2,000 cases): `llama.feed_forward_length` as an array of arrays
    raised TypeError (unhashable list) out of `graftlm.load`, no GraftError."""
    inner = struct.pack("<IQ", V.INT32, 2) + struct.pack("<ii", 127, 1)
    value = struct.pack("<IIQ", V.ARRAY, V.ARRAY, 2) + inner + inner
    p = files["headers"]["model"].write(
        tmp_path / "nested.gguf", "llama.feed_forward_length", value
    )
    with pytest.raises(GraftError, match="llama.feed_forward_length"):
        graftlm.load(str(p), ctx_size=32)


def _typed(vtype: V, value: Any) -> bytes:
    return struct.pack("<I", vtype) + struct.pack(_SCALAR[vtype], value)


_WRONG_TYPES = [
    # (a float for a whole number was refused before, by its value: named in those words)
    ("model", "llama.context_length", _typed(V.FLOAT32, 256.0), None, None),
    ("model", "llama.context_length", _typed(V.INT64, 256), "INT64", "UINT32"),
    ("model", "llama.block_count", _typed(V.UINT8, 2), "UINT8", "UINT32"),
    ("model", "llama.rope.freq_base", _typed(V.UINT32, 10000), "UINT32", "FLOAT32"),
    ("model", "llama.attention.layer_norm_rms_epsilon", _typed(V.FLOAT64, 1e-6), "FLOAT64",
     "FLOAT32"),
    ("model", "llama.attention.head_count", _array_of(V.FLOAT32, [4.0, 4.0]), None, None),
    ("model", "llama.attention.head_count", _array_of(V.INT64, [4, 4]), "array of INT64",
     "UINT32 or array of UINT32 or array of INT32"),
    ("model", "tokenizer.ggml.add_bos_token", _typed(V.UINT8, 0), "UINT8", "BOOL"),
    ("model", "tokenizer.ggml.bos_token_id", _typed(V.INT32, 1), "INT32", "UINT32"),
    ("model", "tokenizer.ggml.token_type", _array_of(V.UINT8, [1] * 262), "array of UINT8",
     "array of INT32"),
    ("model", "tokenizer.ggml.add_bos_token", struct.pack("<I", V.STRING) + _string(b"no"),
     "STRING", "BOOL"),
    ("model", "llama.rope.scaling.attn_factor", struct.pack("<I", V.STRING) + _string(b"x"),
     None, None),
    ("model", "general.alignment", _typed(V.INT32, 32), "INT32", "UINT32"),
    ("adapter", "adapter.lora.alpha", _typed(V.FLOAT64, 8.0), "FLOAT64", "FLOAT32"),
    ("adapter", "adapter.lora.alpha", _typed(V.INT32, 8), "INT32", "FLOAT32"),
    ("adapter", "adapter.alora.invocation_tokens", _array_of(V.INT64, [5, 6]),
     "array of INT64", "array of UINT32 or array of INT32"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("which", "key", "value", "stored", "expected"),
    _WRONG_TYPES,
    ids=[f"{k}-{s or 'value'}" for _, k, _, s, _ in _WRONG_TYPES],
)
def test_numbers_stored_as_another_type_are_refused_as_llama_cpp_refuses_them(
    files: dict[str, Any],
    tmp_path: Path,
    which: str,
    key: str,
    value: bytes,
    stored: str | None,
    expected: str | None,
) -> None:
    """A key stored as another type than the spec's (llama.cpp's loader: "key %s has wrong type
    %s but expected type %s") loaded and served: a context length as FLOAT32 or INT64, a RoPE
    base as UINT32, a flag as UINT8, a token id as INT32, an adapter's alpha as FLOAT64 (a
    Python value hides the difference); a flag stored as a string read as true, and a YaRN
    attention factor as a string raised ValueError from float()."""
    h: Header = files["headers"][which]
    if key not in dict(h.entries):  # (a key the tiny files do not write)
        h = replace(h, entries=[*h.entries, (key, value)])
    p = h.write(tmp_path / "typed.gguf", key, value)
    with pytest.raises(GraftError) as info:
        _serve(files["model"], which, p)
    message = str(info.value)
    assert key in message and "typed.gguf" in message, message
    if stored is not None:
        assert f"has wrong type {stored} but expected type {expected}" in message, message
    assert files["model"].loras == []


@pytest.mark.parametrize(
    ("which", "key", "value"),
    [
        ("model", "llama.attention.head_count", _array_of(V.INT32, [4, 4])),
        ("model", "llama.feed_forward_length", _array_of(V.UINT32, [96, 96])),
        ("adapter", "adapter.alora.invocation_tokens", _array_of(V.UINT32, [5, 6])),
        ("adapter", "adapter.alora.invocation_tokens", _array_of(V.INT32, [5, 6])),
    ],
)
def test_what_llama_cpp_reads_in_more_than_one_type_serves(
    files: dict[str, Any], tmp_path: Path, which: str, key: str, value: bytes
) -> None:
    """llama.cpp's `get_key_or_arr` reads a head count or a feed-forward width as a UINT32 or
    as an INT32 or UINT32 array, one entry a layer (gguf-py writes a list of ints as INT32);
    invocation tokens written by gguf-py's `add_array` are INT32."""
    h: Header = files["headers"][which]
    if key not in dict(h.entries):
        h = replace(h, entries=[*h.entries, (key, value)])
    _serve(files["model"], which, h.write(tmp_path / "ok.gguf", key, value))
