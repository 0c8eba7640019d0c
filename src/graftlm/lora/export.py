"""Merge LoRA adapters into a base model file (`graftlm export-lora`), as llama.cpp's export-lora.

For every tensor an adapter names, W' = W + sum_i s_i * f_i * B_i @ A_i, where s_i is the user's
scale and f_i the adapter's own factor (a GGUF adapter: alpha / r, or 1 when alpha is 0; a PEFT
directory: PEFT's per-module factor). The metadata and every other tensor are copied as they are.

Merged tensors are written as `outtype`: "f16" (llama.cpp's choice: float32 tensors stay float32,
the rest become F16), "f32", "q8_0", or "same" (the base tensor's own type where the gguf package
can quantize to it, else F16). On a tied base (no output.weight), an adapter on the embedding or
on the head unties them: the head is written out as its own output.weight, so the embedding's
LoRA changes the lookup only, as it does at runtime.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from graftlm.errors import AdapterError, ModelFileError
from graftlm.gguf import GGUFFile, TensorEntry
from graftlm.lora.adapter import EMBEDDING
from graftlm.lora.convert import check_output_folder
from graftlm.lora.convert_experts import stacked_problem
from graftlm.lora.gguf_adapter import lora_pairs
from graftlm.lora.peft import read_peft
from graftlm.lora.peft_base import BaseInfo
from graftlm.lora.targets import ROUTED
from graftlm.quant import dequantize_any

T = gguf.GGMLQuantizationType
MERGE_TYPES = ("f16", "f32", "q8_0", "same")
_FILE_TYPE = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
# (user scale * own factor, A (r, n_in), B (n_out, r), expert): the embedding's pair is PEFT's
# (r, n_vocab) and (n_embd, r), whose product is the transposed delta; a routed-expert tensor's
# is one expert's (expert: its index) or llama.cpp's stacked pair, A (n_expert, r, n_in) and
# B (n_expert, n_out, r) (expert None)
Term = tuple[float, torch.Tensor, torch.Tensor, int | None]


def export_lora(
    base_gguf_path: str | os.PathLike[str],
    adapters: Sequence[tuple[str | os.PathLike[str], float]],
    out_path: str | os.PathLike[str],
    outtype: str = "f16",
    progress: bool = False,
) -> list[str]:
    """Write `base` with every (adapter, scale) merged in; adapters are GGUF files or PEFT
    directories. Every adapter is checked before anything is written; AdapterError lists every
    problem of every adapter. Returns notes for the user."""
    if outtype not in MERGE_TYPES:
        raise AdapterError(f"outtype {outtype!r}: expected one of {', '.join(MERGE_TYPES)}")
    if not adapters:
        raise AdapterError("no adapter to merge")
    check_output_folder(out_path)
    f = GGUFFile(base_gguf_path)
    if f.file_type == "adapter":
        raise ModelFileError(f"{f.path}: is a LoRA adapter, not a base model")
    base = BaseInfo.from_gguf(f, tied_output=True)
    terms: dict[str, list[Term]] = {}
    errors: list[str] = []
    for path, scale in tqdm(adapters, desc="reading adapters", disable=not progress):
        try:
            pairs = _pairs(Path(path), base)
        except AdapterError as exc:
            errors.append(str(exc))
            continue
        for name, factor, a, b, expert in pairs:
            terms.setdefault(name, []).append((float(scale) * factor, a, b, expert))
    if errors:
        raise AdapterError("\n".join(errors))

    notes: list[str] = []
    untie = base.tied_head and (EMBEDDING in terms or "output" in terms)
    if untie:
        notes.append(
            "tied base: the head is written out as output.weight so that the embedding's and "
            "the head's adapters each change only their own side (as they do at runtime)"
        )
    merged: dict[str, tuple[np.ndarray, T]] = {}
    fallback: list[str] = []
    for name in tqdm(sorted(terms), desc="merging", disable=not progress):
        src = f.tensors[(EMBEDDING if name == "output" and untie else name) + ".weight"]
        data, qtype = _encode(_merged(src, name, terms[name]), src.ggml_type, outtype)
        if outtype in ("same", "q8_0") and qtype == T.F16 and src.ggml_type != T.F16:
            fallback.append(name + ".weight")
        merged[name + ".weight"] = (data, qtype)
    if fallback:
        notes.append(
            f"{len(fallback)} merged tensors written as F16 ({', '.join(fallback[:3])}"
            f"{', ...' if len(fallback) > 3 else ''}): the gguf package cannot quantize them "
            f"to {outtype}"
        )

    out = Path(out_path)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, base.arch)
    _copy_metadata(f, writer, outtype)
    for name, e in f.tensors.items():
        _add(writer, name, e, merged)
        if untie and name == EMBEDDING + ".weight":
            _add(writer, "output.weight", e, merged)  # the untouched head is the embedding's bytes
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
    finally:
        writer.close()
    os.replace(tmp, out)  # never leave a half-written model under the real name
    notes.append(
        f"wrote {out}: merged {len(merged)} tensors from {len(adapters)} adapters, "
        f"copied {len(f.tensors) - len(merged) + int(untie)}"
    )
    return notes


def _merged(src: TensorEntry, name: str, terms: list[Term]) -> torch.Tensor:
    """Base tensor `name` (its bytes `src`) in float32 with every term's delta added: torch
    (rows, cols), a routed-expert tensor's (n_expert, n_out, n_in)."""
    w = dequantize_any(src.data, src.ggml_type, src.shape).float()
    for s, a, b, expert in terms:
        d = b @ a  # (n_out, n_in) or (n_expert, n_out, n_in); the embedding's (n_embd, n_vocab)
        if expert is not None:
            w[expert] += s * d
        else:
            w += s * (d.T if name == EMBEDDING else d)
    return w


def _add(
    w: gguf.GGUFWriter, name: str, e: TensorEntry, merged: dict[str, tuple[np.ndarray, T]]
) -> None:
    if name in merged:
        data, qtype = merged[name]
        w.add_tensor(name, data, raw_dtype=qtype)
    else:
        # the memory-mapped bytes as stored: (rows, bytes per row) for block types, from which
        # the writer recovers the shape
        w.add_tensor(name, e.data, raw_dtype=e.ggml_type)


def _pairs(
    path: Path, base: BaseInfo
) -> list[tuple[str, float, torch.Tensor, torch.Tensor, int | None]]:
    """(base tensor name, factor, A, B, expert) of one adapter, checked against the base."""
    if path.is_dir():
        adapter = read_peft(path, base)
        return [(p.base, p.scaling, p.a, p.b, p.expert) for p in adapter.pairs]
    f = GGUFFile(path)
    if f.file_type != "adapter" or f.metadata.get("adapter.type") != "lora":
        raise AdapterError(f"{f.path}: not a llama.cpp LoRA adapter (general.type / adapter.type)")
    problems: list[str] = []
    if f.architecture != base.arch:
        problems.append(f"general.architecture is {f.architecture!r}, the base is {base.arch!r}")
    alpha_v = f.metadata.get(gguf.Keys.Adapter.LORA_ALPHA, 0.0)
    alpha = float(alpha_v) if isinstance(alpha_v, (int, float)) else 0.0
    out: list[tuple[str, float, torch.Tensor, torch.Tensor, int | None]] = []
    for name, (a_e, b_e) in sorted(lora_pairs(f, problems).items()):
        # the header's shapes checked before anything is read
        bad = (
            stacked_problem(name, a_e.shape, b_e.shape, base)
            if ROUTED.fullmatch(name)
            else _misfit(name, a_e.shape, b_e.shape, base)
        )
        if bad:
            problems.append(bad)
            continue
        a = dequantize_any(a_e.data, a_e.ggml_type, a_e.shape)
        b = dequantize_any(b_e.data, b_e.ggml_type, b_e.shape)
        if name == EMBEDDING:
            a = a.T  # llama.cpp's flipped layout (n_vocab, r) back to (r, n_vocab)
        rank = int(b.shape[-1])
        out.append((name, alpha / rank if alpha else 1.0, a.float(), b.float(), None))
    if problems:
        raise AdapterError(
            f"{f.path}: cannot merge into {base.path}:\n  - " + "\n  - ".join(problems)
        )
    return out


def _misfit(
    name: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], base: BaseInfo
) -> str | None:
    """How a 2-D pair (torch order as the file holds it: A (r, n_in), B (n_out, r); the
    embedding's A flipped, (n_vocab, r)) fails to fit base tensor `name` (None where it fits)."""
    shape = base.lookup(name)
    if isinstance(shape, str):
        return f"tensor {name}.weight: {shape}"
    if name == EMBEDDING:
        a_shape = tuple(reversed(a_shape))  # as PEFT's (r, n_vocab)
    if (
        len(a_shape) != 2
        or len(b_shape) != 2
        or (a_shape[1], b_shape[0]) != shape
        or a_shape[0] != b_shape[1]
    ):
        return (
            f"tensor {name}.weight: lora_a {list(a_shape)} and lora_b {list(b_shape)} do not "
            f"fit the base's (n_in, n_out) = {shape}"
        )
    return None


def _encode(w: torch.Tensor, base_type: T, outtype: str) -> tuple[np.ndarray, T]:
    arr = w.contiguous().numpy()
    if outtype == "f32" or (outtype == "f16" and base_type == T.F32):
        return arr, T.F32
    want = {"f16": T.F16, "q8_0": T.Q8_0}.get(outtype, base_type)
    if want == T.F32:
        return arr, T.F32
    if want == T.F16:
        return arr.astype(np.float16), T.F16
    try:
        return gguf.quants.quantize(arr, want), want
    except (gguf.QuantError, NotImplementedError):  # rows not whole blocks, or no quantizer
        return arr.astype(np.float16), T.F16


def _copy_metadata(f: GGUFFile, w: gguf.GGUFWriter, outtype: str) -> None:
    """Every key of the base with its exact GGUF type (kept by graftlm's reader in
    `value_types`). general.file_type follows the merged tensors except with "same"."""
    for key, value in f.metadata.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer writes these
            continue
        if key == "general.alignment":
            w.add_custom_alignment(int(value))
        elif key == "general.file_type" and outtype in _FILE_TYPE:
            w.add_file_type(int(_FILE_TYPE[outtype]))
        else:
            vtype, element = f.value_types[key]
            w.add_key_value(key, value, vtype, element)
