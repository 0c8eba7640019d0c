"""Our GGUF header parser against the gguf package's reader (the reference)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import TinySpec, write_tiny_adapter, write_tiny_model

from graftlm.gguf import GGUFFile


def _same_as_reader(path: Path) -> None:
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == meta.keys()
    for k, v in meta.items():
        if isinstance(v, float):
            assert ours.metadata[k] == pytest.approx(v)
        else:
            assert ours.metadata[k] == v, k
    for k, f in ref.fields.items():  # the value types, which copying a header needs
        if not k.startswith("GGUF."):
            assert ours.value_types[k] == (f.types[0], f.types[1] if len(f.types) > 1 else None), k
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        e = ours.tensors[t.name]
        assert e.ggml_type == t.tensor_type
        assert e.shape == tuple(reversed(t.shape.tolist()))
        assert e.data.dtype == t.data.dtype and e.data.shape == t.data.shape
        assert np.array_equal(np.asarray(e.data), np.asarray(t.data))


@pytest.mark.parametrize(
    "qtype",
    [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1],
)
def test_parser_matches_gguf_reader(tmp_path: Path, qtype: gguf.GGMLQuantizationType) -> None:
    spec = TinySpec(qtype=qtype, n_embd=256, n_ff=256, n_head=4, head_dim=64, tied=False)
    _same_as_reader(write_tiny_model(tmp_path / "m.gguf", spec))


def test_parser_matches_gguf_reader_on_adapter_and_arrays(tmp_path: Path) -> None:
    meta = {"adapter.lora.task_name": "t", "adapter.alora.invocation_tokens": [1, 2, 3]}
    _same_as_reader(write_tiny_adapter(tmp_path / "a.gguf", metadata=meta))
    _same_as_reader(write_tiny_model(tmp_path / "g.gguf", TinySpec(arch="gemma3", head_dim=32)))
