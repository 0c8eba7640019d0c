"""llama.cpp's GGUF LoRA adapter format, read and checked against a base.

Tensors are `<base>.weight.lora_a` / `.lora_b`; in GGML order A is ne=[n_in, r] and B is
ne=[r, n_out], i.e. torch (r, n_in) and (n_out, r). token_embd adapters are stored flipped: A is
ne=[r, n_vocab] (torch (n_vocab, r), a row gathered per token) and B is ne=[r, n_embd].
Scale rule (llama.cpp): s = user_scale * alpha / r with r the rank of each tensor, when alpha != 0.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from graftlm.errors import AdapterError, ModelFileError
from graftlm.gguf import GGUFFile, TensorEntry
from graftlm.lora.adapter import EMBEDDING, Delta, ResolvedAdapter, hidden_size, refusal
from graftlm.lora.convert_experts import stacked_problem
from graftlm.lora.peft_base import BaseInfo
from graftlm.lora.scales import FLOAT32_MAX
from graftlm.lora.targets import Base, Target, resolve_target
from graftlm.quant import dequantize_any

ADAPTER_TYPES = {
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0,
}


def _meta(
    f: GGUFFile, key: str, kind: type | tuple[type, ...], problems: list[str], default: Any
) -> Any:
    if key not in f.metadata:
        return default
    v = f.metadata[key]
    if isinstance(v, bool) or not isinstance(v, kind):
        problems.append(
            f"metadata {key!r} is {type(v).__name__} {v!r}, expected {_kind_name(kind)}"
        )
        return default
    return v


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def check_base(path: str | Path, base: GGUFFile) -> None:
    """Before a base loads: AdapterError when the GGUF adapter at `path` is for another
    architecture (a PEFT directory, or a file that is not an adapter, is checked when it attaches)."""
    p = Path(path)
    if p.is_dir() or not p.is_file():
        return
    try:
        f = GGUFFile(p)
    except ModelFileError:
        return  # the full check says what is wrong with it
    arch, base_arch = f.architecture, base.architecture
    if f.file_type != "adapter" or arch is None or arch == base_arch:
        return
    width = hidden_size({n: e.shape for n, e in f.tensors.items() if n.endswith(".lora_a")})
    base_width = base.get(f"{base_arch}.embedding_length")
    raise AdapterError(
        f"{p}: general.architecture is {arch!r}"
        + (f" (hidden size {width})" if width else "")
        + f" but the base model {base.path.name} is {base_arch!r}"
        + (f" (hidden size {base_width})" if base_width else "")
        + "; cannot attach"
    )


def read_gguf_adapter(path: str | Path, model: Base, base_tensors: set[str]) -> ResolvedAdapter:
    """Read, check and resolve a GGUF adapter for `model`. Raises AdapterError listing every problem."""
    f = _open_lora(path)
    arch = f.architecture
    head = f"{f.path}: cannot attach adapter to {model.cfg.arch} base:"
    if arch != model.cfg.arch:
        # the headline: every tensor would be a problem of its own
        width = hidden_size({n: e.shape for n, e in f.tensors.items() if n.endswith(".lora_a")})
        made_for = f"{arch!r}" + (f" (hidden size {width})" if width else "")
        head = (
            f"{f.path}: general.architecture is {made_for} but the base model is "
            f"{model.cfg.arch!r} (hidden size {model.cfg.n_embd}); cannot attach:"
        )
    problems: list[str] = []
    alpha, task_name, prompt_prefix, invocation = _lora_metadata(f, problems)
    if not f.tensors:  # (as PEFT directories and `graftlm convert`: it would change nothing)
        problems.append("holds no LoRA tensors")
    # each piece in file order; a dense pair's delta is its index among `dense` until every pair
    # is checked, then all are read together (_read_dense)
    placed: list[tuple[str, slice, slice, Delta | int]] = []
    dense: list[tuple[str, TensorEntry, TensorEntry]] = []
    for base, (a_e, b_e) in sorted(lora_pairs(f, problems).items()):
        got = _resolve_pair(base, a_e, b_e, alpha, model, base_tensors, problems)
        if isinstance(got, tuple):
            targets, a_e, b_e = got
            placed += [(t.projection, t.rows, t.at, len(dense)) for t in targets]
            dense.append((base, a_e, b_e))
        else:
            placed += [(projection, rows, at, d) for projection, (rows, at, d) in got]

    if problems or arch != model.cfg.arch:
        raise refusal(head, problems)
    read = _read_dense(dense, alpha)
    deltas: dict[str, list[tuple[slice, slice, Delta]]] = {}
    for projection, rows, at, d in placed:
        deltas.setdefault(projection, []).append((rows, at, read[d] if isinstance(d, int) else d))
    return ResolvedAdapter(
        path=str(f.path),
        alpha=alpha,
        deltas=combine_all(deltas, model),
        n_tensors=len(f.tensors),
        task_name=task_name,
        prompt_prefix=prompt_prefix,
        invocation_tokens=list(invocation),
        source="gguf",
    )


def _open_lora(path: str | Path) -> GGUFFile:
    """The GGUF file at `path`, once it is a LoRA adapter (AdapterError otherwise)."""
    try:
        f = GGUFFile(path)
    except ModelFileError as exc:
        raise AdapterError(f"cannot load adapter: {exc}") from None
    kind = f.metadata.get("general.type")
    if kind != "adapter":
        hint = " (a model file, not an adapter)" if kind in (None, "model") else ""
        raise AdapterError(f"{f.path}: general.type is {kind!r}, expected 'adapter'{hint}")
    atype = f.metadata.get("adapter.type")
    if atype != "lora":
        raise AdapterError(
            f"{f.path}: adapter.type is {atype!r}; only 'lora' adapters are supported"
        )
    return f


def _lora_metadata(f: GGUFFile, problems: list[str]) -> tuple[float, str, str, list[int]]:
    """alpha, task name, prompt prefix and activated LoRA's invocation tokens, each checked."""
    alpha = float(_meta(f, "adapter.lora.alpha", (int, float), problems, 0.0))
    if not math.isfinite(alpha) or abs(alpha) > FLOAT32_MAX:
        problems.append(f"metadata 'adapter.lora.alpha' is {alpha!r}: not a finite float32")
        alpha = 0.0
    task_name = _meta(f, "adapter.lora.task_name", str, problems, "")
    prompt_prefix = _meta(f, "adapter.lora.prompt_prefix", str, problems, "")
    invocation = _meta(f, "adapter.alora.invocation_tokens", list, problems, [])
    if any(isinstance(t, bool) or not isinstance(t, int) for t in invocation):
        problems.append(
            f"metadata 'adapter.alora.invocation_tokens' must be a list of token ids, got {invocation!r}"
        )
        invocation = []
    return alpha, task_name, prompt_prefix, invocation


def lora_pairs(f: GGUFFile, problems: list[str]) -> dict[str, tuple[TensorEntry, TensorEntry]]:
    """The file's (lora_a, lora_b) tensors by base name, in the file's order: the one reading of
    the names `<base>.weight.lora_a` / `.lora_b`. A tensor named otherwise, and a half without
    its other half, is a problem."""
    halves: dict[str, dict[str, TensorEntry]] = {}
    for name, entry in f.tensors.items():
        stem, _, part = name.rpartition(".")
        if part not in ("lora_a", "lora_b") or not stem.endswith(".weight"):
            problems.append(
                f"tensor {name!r}: not a LoRA tensor (expected '<base>.weight.lora_a' or '.lora_b')"
            )
            continue
        halves.setdefault(stem[: -len(".weight")], {})[part] = entry
    pairs: dict[str, tuple[TensorEntry, TensorEntry]] = {}
    for base, pair in halves.items():
        if len(pair) == 2:
            pairs[base] = (pair["lora_a"], pair["lora_b"])
        else:
            problems.append(
                f"tensor {base}.weight: has no {'lora_b' if 'lora_a' in pair else 'lora_a'}"
            )
    return pairs


def _resolve_pair(
    base: str,
    a_e: TensorEntry,
    b_e: TensorEntry,
    alpha: float,
    model: Base,
    base_tensors: set[str],
    problems: list[str],
) -> list[tuple[str, tuple[slice, slice, Delta]]] | tuple[list[Target], TensorEntry, TensorEntry]:
    """One base weight's pair checked (types, target, shapes): a dense pair's targets and
    tensors, to be read with the others (_read_dense); a routed-expert pair read, scaled by
    alpha / r, as the pieces of the projections it lands in; none, with the reasons in
    `problems`, when it does not fit."""
    bad_type = [e for e in (a_e, b_e) if e.ggml_type not in ADAPTER_TYPES]
    for e in bad_type:
        problems.append(
            f"tensor {e.name!r}: type {e.type_name} (adapters must be F32, F16, BF16 or Q8_0)"
        )
    if bad_type:
        return []
    targets = resolve_target(model, base)
    if isinstance(targets, str):
        problems.append(f"tensor {base}.weight: {targets}")
        return []
    if base + ".weight" not in base_tensors and base != "output":
        problems.append(f"tensor {base}.weight: not in the base model")
        return []
    if targets[0].expert is not None:
        return _resolve_experts(base, a_e, b_e, alpha, model, targets, problems)
    if len(a_e.shape) != 2 or len(b_e.shape) != 2:
        problems.append(
            f"tensor {base}.weight: lora_a {_ne(a_e)} and lora_b {_ne(b_e)} must both be 2-D"
        )
        return []
    t0 = targets[0]
    embd = base == EMBEDDING
    # torch shapes: projection A (r, n_in), B (n_out, r); embedding A (n_vocab, r), B (n_embd, r)
    ra, n_in = (a_e.shape[1], a_e.shape[0]) if embd else (a_e.shape[0], a_e.shape[1])
    n_out, rb = b_e.shape
    shape_problems = _fit(a_e, b_e, t0, (n_in, n_out, ra, rb), embd)
    if shape_problems:
        problems.append(f"tensor {base}.weight: " + "; ".join(shape_problems))
        return []
    return targets, a_e, b_e


def _resolve_experts(
    base: str,
    a_e: TensorEntry,
    b_e: TensorEntry,
    alpha: float,
    model: Base,
    targets: list[Target],
    problems: list[str],
) -> list[tuple[str, tuple[slice, slice, Delta]]]:
    """A routed-expert pair (convert_lora_to_gguf.py stacks the experts' factors, as the base's
    weights): A ne=[n_in, r, n_expert], B ne=[r, n_out, n_expert], checked as convert-lora and
    export-lora check it; each expert's (A[e], B[e]) lands in that expert's projection
    (llama.cpp's build_lora_mm_id)."""
    bad = stacked_problem(base, a_e.shape, b_e.shape, BaseInfo.from_model(model))
    if bad is not None:
        problems.append(bad)
        return []
    # (n_expert, r, n_in), (n_expert, n_out, r)
    a, b = _values(a_e), _scaled(_values(b_e), alpha, b_e.shape[2])
    return [
        (t.projection, (t.rows, t.at, Delta(a[e], b[e], sources=(f"{base}.weight[{e}]",))))
        for e, t in enumerate(targets)
    ]


def _fit(
    a_e: TensorEntry,
    b_e: TensorEntry,
    t0: Target,
    sizes: tuple[int, int, int, int],
    embd: bool,
) -> list[str]:
    """How a pair of sizes (n_in, n_out, rank of A, rank of B) does not fit its target: a
    dense projection's or embedding's pair."""
    n_in, n_out, ra, rb = sizes
    bad = []
    if n_in != t0.n_in:
        what = "n_vocab" if embd else "input size"
        bad.append(f"lora_a {_ne(a_e)} does not fit the base's {what} {t0.n_in}")
    if n_out != t0.n_out:
        what = "n_embd" if embd else "output size"
        bad.append(f"lora_b {_ne(b_e)} does not fit the base's {what} {t0.n_out}")
    if ra != rb:
        bad.append(
            f"ranks differ: lora_a {_ne(a_e)} has rank {ra}, lora_b {_ne(b_e)} has rank {rb}"
        )
    elif ra == 0:  # (its scale alpha / r would divide by zero)
        bad.append(f"rank 0: lora_a {_ne(a_e)} and lora_b {_ne(b_e)} hold no values")
    return bad


def _scaled(b: torch.Tensor, alpha: float, r: int) -> torch.Tensor:
    """B scaled by alpha / r (alpha 0: unscaled); b itself when that is 1 (b * 1.0 is b, bit
    for bit)."""
    factor = alpha / r if alpha != 0 else 1.0
    return b if factor == 1.0 else b * factor


_FLOATS = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


def _values(e: TensorEntry) -> torch.Tensor:
    """A factor as float32, a fresh tensor: dequantize_any's values, F32 and F16 read in one copy
    out of the memory map (an adapter is read off the engine's thread, where every call waits
    for the interpreter's lock under traffic)."""
    kind = _FLOATS.get(e.ggml_type)
    if kind is not None and e.data.dtype == kind and e.data.size == math.prod(e.shape):
        return torch.from_numpy(np.array(e.data, dtype=np.float32)).view(e.shape)
    return dequantize_any(e.data, e.ggml_type, e.shape)


def _read_dense(pairs: list[tuple[str, TensorEntry, TensorEntry]], alpha: float) -> list[Delta]:
    """Each dense pair's delta (A, B scaled by alpha / r, each as _values reads it), the pairs
    of one shape and type read as one stack: a copy each out of the memory map and one scaling,
    not a few tensor calls a pair (an adapter is read off the engine's thread, where each waits
    for the interpreter's lock under traffic). B * factor is elementwise: the same bits in a
    stack as alone."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, (_, a_e, b_e) in enumerate(pairs):
        groups.setdefault((a_e.ggml_type, a_e.shape, b_e.ggml_type, b_e.shape), []).append(i)
    out: list[Delta | None] = [None] * len(pairs)
    for idx in groups.values():
        a = _values_many([pairs[i][1] for i in idx])
        b_es = [pairs[i][2] for i in idx]
        b = _scaled(_values_many(b_es), alpha, b_es[0].shape[1])
        for g, i in enumerate(idx):
            out[i] = Delta(a[g], b[g], sources=(f"{pairs[i][0]}.weight",))
    return [d for d in out if d is not None]


def _values_many(entries: list[TensorEntry]) -> torch.Tensor:
    """_values of factors of one type and shape, stacked (G, *shape): F32 and F16 in one copy
    out of the memory map."""
    e0 = entries[0]
    kind = _FLOATS.get(e0.ggml_type)
    size = math.prod(e0.shape)
    if kind is not None and all(e.data.dtype == kind and e.data.size == size for e in entries):
        out = np.empty((len(entries), size), dtype=np.float32)
        np.stack([e.data.reshape(-1) for e in entries], out=out)
        return torch.from_numpy(out).view(len(entries), *e0.shape)
    return torch.stack([_values(e) for e in entries])


def _ne(e: TensorEntry) -> str:
    """A tensor's shape as llama.cpp prints it: ne=[...], GGML order."""
    return "ne=[" + ", ".join(str(d) for d in reversed(e.shape)) + "]"


def _n_out(model: Base, name: str) -> int:
    return model.cfg.n_embd if name == EMBEDDING else model.projections()[name].n_out


def combine(parts: list[tuple[slice, slice, Delta]], n_out: int) -> Delta:
    """One projection's delta from the pieces that land in it.

    A piece covers file rows `rows` of its B and sits at output rows `at` of the projection; pieces
    are stacked along the rank (B (A x) over stacked rows is the stacked B_i (A_i x)), each B
    zero outside its own rows."""
    if len(parts) == 1 and parts[0][0] == parts[0][1] == slice(0, n_out):
        return parts[0][2]
    a = torch.cat([d.a for _, _, d in parts], dim=0)
    bs = []
    for rows, at, d in parts:
        b = torch.zeros(n_out, d.width)
        b[at] = d.b[rows]
        bs.append(b)
    return Delta(
        a,
        torch.cat(bs, dim=1),
        tuple(r for _, _, d in parts for r in (d.parts or (d.width,))),
        sources=tuple(s for _, _, d in parts for s in d.sources),
    )


def combine_all(
    pieces: dict[str, list[tuple[slice, slice, Delta]]], model: Base
) -> dict[str, Delta]:
    """combine of every projection's pieces, the same values: the projections whose pieces are
    laid out alike (Q and V of every layer stacked into its QKV) combined as one stack, a few
    tensor operations for all of them rather than a few each (an adapter is read off the engine's
    thread, where each waits for the interpreter's lock under traffic)."""
    out: dict[str, Delta] = {}
    groups: dict[tuple[int, tuple[object, ...]], list[str]] = {}
    for name, parts in pieces.items():
        n_out = _n_out(model, name)
        if name == EMBEDDING or (len(parts) == 1 and parts[0][0] == parts[0][1] == slice(0, n_out)):
            out[name] = combine(parts, n_out)
            continue
        layout = tuple(
            (rows.start, rows.stop, rows.step, at.start, at.stop, at.step,
             *d.a.shape, *d.b.shape, d.parts or (d.width,))
            for rows, at, d in parts
        )  # fmt: skip
        groups.setdefault((n_out, layout), []).append(name)
    for (n_out, _), names in groups.items():
        if len(names) == 1:
            out[names[0]] = combine(pieces[names[0]], n_out)
            continue
        stacked = [pieces[n] for n in names]
        first = stacked[0]
        a = torch.cat([torch.stack([p[i][2].a for p in stacked]) for i in range(len(first))], dim=1)
        b = torch.zeros(len(names), n_out, a.shape[1])
        col = 0
        for i, (rows, at, d) in enumerate(first):
            b[:, at, col : col + d.width] = torch.stack([p[i][2].b for p in stacked])[:, rows]
            col += d.width
        for g, (name, parts) in enumerate(zip(names, stacked, strict=True)):
            out[name] = Delta(
                a[g],
                b[g],
                tuple(r for _, _, d in parts for r in (d.parts or (d.width,))),
                sources=tuple(s for _, _, d in parts for s in d.sources),
            )
    return {name: out[name] for name in pieces}
