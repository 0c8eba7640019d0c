"""Untrusted GGUF files: every malformed header is a ModelFileError naming the field or tensor,
found before anything is allocated from a declared size; and a seeded mutation fuzzer over a
tiny model and a tiny adapter finds nothing else (no other exception, no hang)."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValueType as V
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

import graftlm
from graftlm.errors import GraftError, ModelFileError
from graftlm.gguf import GGUFFile

F32 = 0  # GGMLQuantizationType.F32
N_MUTANTS = int(os.environ.get("FUZZ_CASES", "120"))  # offline: FUZZ_CASES=2000


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _u32(key: str, v: int) -> bytes:
    return _kv(key, V.UINT32, struct.pack("<I", v))


def _tensor(name: str, ne: tuple[int, ...], qtype: int, offset: int) -> bytes:
    dims = struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
    return _s(name) + dims + struct.pack("<I", qtype) + struct.pack("<Q", offset)


def _file(
    path: Path,
    kvs: list[bytes],
    tensors: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    n_kv: int | None = None,
    n_tensors: int | None = None,
    align: int = 32,
) -> Path:
    head = b"GGUF" + struct.pack("<I", 3)
    head += struct.pack("<Q", len(tensors) if n_tensors is None else n_tensors)
    head += struct.pack("<Q", len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(tensors)
    head += b"\0" * (-len(head) % align)
    path.write_bytes(head + data)
    return path


def _refused(path: Path, *needles: str) -> str:
    # (the CPU time of all the process's threads, torch's and the native kernels' too: the
    # pauses of a loaded machine do not count)
    t0 = time.process_time()
    with pytest.raises(ModelFileError) as info:
        GGUFFile(path)
    assert time.process_time() - t0 < 5  # found from the header, not after reading a made-up size
    msg = str(info.value)
    assert str(path) in msg
    for n in needles:
        assert n in msg, msg
    return msg


ARCH = _kv("general.architecture", V.STRING, _s("llama"))
TWO = [_tensor("a", (8,), F32, 0), _tensor("b", (8,), F32, 32)]
DATA = np.arange(16, dtype=np.float32).tobytes()


def test_a_well_formed_file_reads(tmp_path: Path) -> None:
    f = GGUFFile(_file(tmp_path / "ok.gguf", [ARCH], TWO, DATA))
    assert f.tensors["b"].data.tolist() == list(range(8, 16))


def test_a_huge_string_array_is_refused_before_it_is_read(tmp_path: Path) -> None:
    payload = struct.pack("<I", V.STRING) + struct.pack("<Q", 1_200_000_000) + _s("a") * 4
    p = _file(tmp_path / "x.gguf", [ARCH, _kv("tokenizer.ggml.tokens", V.ARRAY, payload)])
    _refused(p, "'tokenizer.ggml.tokens'", "1200000000 entries")


def test_a_sparse_file_cannot_make_a_huge_array_or_string(tmp_path: Path) -> None:
    """A sparse file holds any declared size on disk for free: 9e9 one-byte entries made a list
    that never finished. Arrays and strings are bounded by what a model can use."""
    from graftlm.gguf.parse import MAX_ARRAY, MAX_STRING

    n = MAX_ARRAY + 1
    payload = struct.pack("<I", V.UINT8) + struct.pack("<Q", n)
    p = _file(tmp_path / "a.gguf", [ARCH, _kv("x.big", V.ARRAY, payload)])
    with open(p, "r+b") as f:  # the declared bytes, as a hole
        f.truncate(p.stat().st_size + n)
    _refused(p, "'x.big'", f"{n} entries", "limit")
    words = struct.pack("<I", V.STRING) + struct.pack("<Q", 1) + struct.pack("<Q", MAX_STRING + 1)
    p = _file(tmp_path / "s.gguf", [ARCH, _kv("x.words", V.ARRAY, words)])
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size + MAX_STRING + 1)
    _refused(p, "'x.words'", "limit")
    one = _kv("x.text", V.STRING, struct.pack("<Q", MAX_STRING + 1))
    p = _file(tmp_path / "t.gguf", [ARCH, one])
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size + MAX_STRING + 1)
    _refused(p, "'x.text'", "limit")


def test_counts_past_the_file(tmp_path: Path) -> None:
    _refused(_file(tmp_path / "kv.gguf", [ARCH], n_kv=10**15), "metadata", "entries")
    _refused(_file(tmp_path / "t.gguf", [ARCH], n_tensors=10**12), "tensors")
    long = _s("general.name")[:0] + struct.pack("<Q", 10**12) + b"general"
    _refused(_file(tmp_path / "s.gguf", [long + b"\0" * 16]), "a metadata key")
    payload = struct.pack("<I", V.UINT32) + struct.pack("<Q", 2**40)
    _refused(_file(tmp_path / "n.gguf", [ARCH, _kv("x", V.ARRAY, payload)]), "'x'", "entries")


def test_deep_nesting_is_bounded(tmp_path: Path) -> None:
    payload = b""
    for _ in range(3000):
        payload += struct.pack("<I", V.ARRAY) + struct.pack("<Q", 1)
    payload += struct.pack("<I", V.UINT8) + struct.pack("<Q", 1) + b"\0"
    _refused(_file(tmp_path / "deep.gguf", [ARCH, _kv("x", V.ARRAY, payload)]), "nested deeper")


def test_unknown_value_and_tensor_types(tmp_path: Path) -> None:
    _refused(_file(tmp_path / "v.gguf", [ARCH, _kv("x", 99, b"\0" * 8)]), "'x'", "type 99")
    bad = [_tensor("w", (8,), 1234, 0)]
    _refused(_file(tmp_path / "t.gguf", [ARCH], bad, DATA), "'w'", "1234")


@pytest.mark.parametrize("align", [0, 3, -1])
def test_alignment_must_be_a_power_of_two(tmp_path: Path, align: int) -> None:
    kv = _kv("general.alignment", V.INT32, struct.pack("<i", align))
    _refused(_file(tmp_path / "a.gguf", [ARCH, kv], TWO, DATA), "general.alignment", "power of two")
    kv = _kv("general.alignment", V.STRING, _s("32"))
    _refused(_file(tmp_path / "s.gguf", [ARCH, kv], TWO, DATA), "general.alignment")


def test_duplicates_are_refused(tmp_path: Path) -> None:
    _refused(_file(tmp_path / "k.gguf", [ARCH, ARCH]), "'general.architecture'", "twice")
    two = [_tensor("a", (8,), F32, 0), _tensor("a", (8,), F32, 32)]
    _refused(_file(tmp_path / "t.gguf", [ARCH], two, DATA), "'a'", "twice")


def test_tensor_data_must_follow_the_layout(tmp_path: Path) -> None:
    overlap = [_tensor("a", (8,), F32, 0), _tensor("b", (8,), F32, 0)]
    _refused(_file(tmp_path / "o.gguf", [ARCH], overlap, DATA), "'b'", "offset 0, expected 32")
    data = np.zeros(128, dtype=np.float32).tobytes()
    smaller = [_tensor("a", (64,), 1, 0), _tensor("b", (64,), F32, 256)]  # F16: 128 bytes
    _refused(_file(tmp_path / "f16.gguf", [ARCH], smaller, data), "'b'", "expected 128")
    past = [_tensor("a", (8,), F32, 0), _tensor("b", (64,), F32, 32)]
    _refused(_file(tmp_path / "p.gguf", [ARCH], past, DATA), "'b'", "needs bytes")
    odd = [_tensor("a", (8,), 2, 0)]  # Q4_0: blocks of 32 values
    _refused(_file(tmp_path / "q.gguf", [ARCH], odd, DATA), "'a'", "blocks of 32", "ne[0] = 8")
    _refused(
        _file(tmp_path / "d.gguf", [ARCH], [_tensor("a", (1,) * 5, F32, 0)], DATA), "dimensions"
    )


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny.gguf", TinySpec())


def _with_meta(src: Path, dst: Path, **changes: object) -> Path:
    """A copy of src with metadata fields replaced (gguf's writer: real tensors, real layout)."""
    import gguf

    change: Any = changes.pop("_tensors", lambda name, a, t: (a, t))
    f = GGUFFile(src)
    w = gguf.GGUFWriter(str(dst), arch="llama")
    for key, value in f.metadata.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        if key not in changes:  # as stored (a key written as another type is refused at load)
            w.add_key_value(key, value, *f.value_types[key])
            continue
        value = changes.pop(key)
        if value is None:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_int64(key, value) if abs(value) >= 2**31 else w.add_int32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_array(key, value)  # type: ignore[arg-type]
    for key, value in changes.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_int64(key, value)  # type: ignore[arg-type]
    for name, e in f.tensors.items():
        arr, qtype = change(name, np.asarray(e.data), e.ggml_type)
        w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("llama.block_count", 30000, "expected 1..1024"),
        ("llama.block_count", 2**63 - 1, "expected 1..1024"),
        ("llama.block_count", 5, "tensors for blocks 0..1"),
        ("llama.attention.head_count", 0, "expected 1.."),
        ("llama.context_length", -4, "expected 1.."),
        ("llama.context_length", "4096", "must be a whole number"),
        ("llama.embedding_length", "wide", "must be a whole number"),
    ],
)
def test_model_fields_are_range_checked(
    tiny: Path, tmp_path: Path, field: str, value: object, needle: str
) -> None:
    bad = _with_meta(tiny, tmp_path / "bad.gguf", **{field: value})
    # (the CPU time of all the process's threads, torch's and the native kernels' too: the
    # pauses of a loaded machine do not count)
    t0 = time.process_time()
    with pytest.raises(ModelFileError) as info:
        graftlm.load(str(bad), ctx_size=64)
    assert time.process_time() - t0 < 10
    assert field in str(info.value) and needle in str(info.value), str(info.value)


def _mutants(data: bytes, n: int, seed: int) -> list[bytes]:
    """Seeded mutations where the header lives (the first bytes), plus a few truncations."""
    rng = np.random.default_rng(seed)
    end = min(len(data), 4096)
    out = []
    for i in range(n):
        b = bytearray(data)
        kind = i % 4
        if kind == 0:  # flip bytes
            for at in rng.integers(4, end, size=int(rng.integers(1, 4))):
                b[at] = int(rng.integers(0, 256))
        elif kind == 1:  # a field of 8 bytes set to a large or odd value
            at = int(rng.integers(4, end - 8))
            b[at : at + 8] = struct.pack("<Q", int(rng.choice([0, 1, 3, 2**31, 2**40, 2**63])))
        elif kind == 2:  # a 4-byte field (a type, a dimension count)
            at = int(rng.integers(4, end - 4))
            b[at : at + 4] = struct.pack("<I", int(rng.integers(0, 64)))
        else:  # truncated
            del b[int(rng.integers(8, len(b))) :]
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("which", ["model", "adapter"])
def test_mutated_files_load_or_fail_cleanly(tmp_path: Path, which: str) -> None:
    """Every mutant either loads and runs (a model generates; an adapter attaches to the tiny
    base and serves a request at scale 1) or raises a GraftError when it is read: no other
    exception escapes, none takes long, and none loads to fail on use. More cases:
    FUZZ_CASES=2000, FUZZ_SEED=n."""
    spec = TinySpec()
    base = write_tiny_model(tmp_path / "base.gguf", spec)
    model = graftlm.load(str(base), ctx_size=32)
    src = base if which == "model" else write_tiny_adapter(tmp_path / "src.gguf", spec)
    cases = _mutants(src.read_bytes(), N_MUTANTS, seed=int(os.environ.get("FUZZ_SEED", "7")))
    outcomes = {"ok": 0, "refused": 0}
    for i, data in enumerate(cases):
        p = tmp_path / f"m{i}.gguf"
        p.write_bytes(data)
        # (the CPU time of all the process's threads, torch's and the native kernels' too: the
        # pauses of a loaded machine do not count)
        t0 = time.process_time()
        loaded = False
        try:
            if which == "model":
                graftlm.load(str(p), ctx_size=32).generate("hi", max_tokens=2, temperature=0)
            else:
                aid = model.add_lora(p)
                loaded = True
                try:  # an adapter that loads must serve: a use-time failure is a finding
                    model.generate(
                        "hi", max_tokens=2, temperature=0, lora=[{"id": aid, "scale": 1.0}]
                    )
                finally:
                    model.remove_lora(aid)
            outcomes["ok"] += 1
        except GraftError as e:
            assert not loaded, f"mutant {i} loaded, then failed on use: {e}"
            outcomes["refused"] += 1
        assert time.process_time() - t0 < 10, f"mutant {i} took too long"
        p.unlink()
    assert outcomes["refused"] > 20  # the mutations reach the checks


def test_only_regular_files_are_read_and_no_content_is_quoted(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    _refused(fifo, "not a regular file")  # (opening it would block for ever)
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret-hash:19000:0:99999:7:::\n")
    msg = _refused(secret, "not a GGUF file")
    rest = msg.replace(str(secret), "")
    assert "root" not in rest and "secret" not in rest and "$6$" not in rest


def _retyped(src: Path, dst: Path, change: Any) -> Path:
    """A copy of src with tensors changed by change(name, array, type) -> (array, type)."""
    return _with_meta(src, dst, _tensors=change)


def test_tensors_that_cannot_serve_are_named_at_load(tmp_path: Path) -> None:
    """A norm of the wrong length failed only at inference (a torch RuntimeError); an integer
    tensor as a weight was a NotImplementedError; a tokenizer of the wrong value types a raw
    TypeError."""
    import gguf

    src = write_tiny_model(tmp_path / "m.gguf", TinySpec())

    def short(name: str, a: np.ndarray, t: Any) -> tuple[np.ndarray, Any]:
        return (a[:-4].copy(), t) if name == "blk.0.attn_norm.weight" else (a, t)

    def as_i8(name: str, a: np.ndarray, t: Any) -> tuple[np.ndarray, Any]:
        if name == "blk.0.attn_q.weight":
            return np.zeros(a.shape, np.int8), gguf.GGMLQuantizationType.I8
        return a, t

    for change, words in (
        (short, ("'blk.0.attn_norm.weight'", "60 values", "expected 64")),
        (as_i8, ("'blk.0.attn_q.weight'", "I8")),
    ):
        bad = _retyped(src, tmp_path / "bad.gguf", change)
        with pytest.raises(ModelFileError) as info:
            graftlm.load(str(bad), ctx_size=32)
        assert all(w in str(info.value) for w in words), str(info.value)
    ints = _with_meta(src, tmp_path / "t.gguf", **{"tokenizer.ggml.tokens": list(range(10))})
    with pytest.raises(ModelFileError, match="cannot build its tokenizer"):
        graftlm.load(str(ints), ctx_size=32)


def test_an_adapter_alpha_past_float32_is_refused(tmp_path: Path) -> None:
    spec = TinySpec()
    model = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=32)
    src = write_tiny_adapter(tmp_path / "a.gguf", spec)
    data = src.read_bytes()
    key = b"adapter.lora.alpha"
    at = data.index(key) + len(key)
    vtype = struct.unpack("<I", data[at : at + 4])[0]
    assert vtype == V.FLOAT32
    bad = tmp_path / "big.gguf"
    bad.write_bytes(data[:at] + struct.pack("<If", vtype, float("inf")) + data[at + 8 :])
    with pytest.raises(GraftError, match="adapter.lora.alpha"):
        model.add_lora(bad)
    assert model.loras == []


def test_fields_of_the_wrong_type_are_named_not_tracebacks(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by the mutation fuzz: scores stored as strings broke tokenization later (unary minus
    on a str), an adapter's alpha stored as an array broke `inspect`'s format."""
    from tiny_models import write_tiny_adapter

    from graftlm.cli import main

    n = len(GGUFFile(tiny).metadata["tokenizer.ggml.tokens"])
    bad = _with_meta(tiny, tmp_path / "scores.gguf", **{"tokenizer.ggml.scores": ["x"] * n})
    with pytest.raises(ModelFileError, match=r"scores.gguf.*tokenizer.ggml.scores\[0\] is a str"):
        graftlm.load(str(bad), ctx_size=32)
    adapter = write_tiny_adapter(tmp_path / "a.gguf", TinySpec())
    arr = _with_meta(adapter, tmp_path / "alpha.gguf", **{"adapter.lora.alpha": [8.0]})
    assert main(["inspect", str(arr)]) == 0
    assert "alpha list [8.0] (not a number" in capsys.readouterr().out


def test_an_adapter_that_would_fail_every_use_is_refused_at_load(tmp_path: Path) -> None:
    """Found by the mutation fuzz: an adapter whose header declares `general.alignment = 1`
    while its writer padded the data to 32 bytes reads shifted bytes as its factors; it loaded,
    and every request on it then failed on non-finite logits. A factor with a nan, or one so
    large that the delta leaves float16's range, is the same."""
    import gguf

    spec = TinySpec()
    model = graftlm.load(str(write_tiny_model(tmp_path / "m.gguf", spec)), ctx_size=32)
    src = GGUFFile(write_tiny_adapter(tmp_path / "a.gguf", spec))

    def rewrite(
        dst: Path, alignment: int | None, poison: str | None, value: float = np.nan
    ) -> Path:
        w = gguf.GGUFWriter(str(dst), arch="llama")  # pads the data to 32 bytes whatever it says
        for key, meta in src.metadata.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
                continue
            w.add_float32(key, meta) if isinstance(meta, float) else w.add_string(key, meta)
        if alignment is not None:
            w.add_uint32("general.alignment", alignment)
        for name, e in src.tensors.items():
            arr = np.array(e.data, dtype=np.float32)
            if name == poison:
                arr.flat[3] = value
            w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=e.ggml_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return dst

    good = model.add_lora(rewrite(tmp_path / "good.gguf", None, None))
    model.generate("hi", max_tokens=2, temperature=0, lora=[{"id": good, "scale": 1.0}])
    model.remove_lora(good)
    name = next(n for n in src.tensors if n.endswith("lora_b"))
    for bad, needle in [
        (rewrite(tmp_path / "aligned1.gguf", 1, None), "values are inf or nan"),
        (
            rewrite(tmp_path / "nan.gguf", None, name),
            name.replace(".lora_b", "") + " (in blk.0.attn_qkv): 1 value is inf or nan",
        ),
        # mutant 668 of 2,000: one byte of an A made 1.9e9, which overflowed the float16 cache
        (
            rewrite(tmp_path / "big.gguf", None, name.replace("lora_b", "lora_a"), 1.9e9),
            "past float16",
        ),
    ]:
        with pytest.raises(GraftError, match="every use would overflow") as info:
            model.add_lora(bad)
        assert bad.name in str(info.value) and needle in str(info.value), str(info.value)
        assert model.loras == []
