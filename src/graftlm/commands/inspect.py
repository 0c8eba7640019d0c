"""`graftlm inspect FILE`: what a GGUF file (model or adapter) or a PEFT directory holds.

Types are named (`general.file_type = 3 (MOSTLY_Q4_1)`, a count per tensor type), tensors are in
natural order (blk.2 before blk.10), and an adapter is summarised: rank, alpha, targets, layers,
invocation tokens.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from graftlm.errors import GraftError
from graftlm.gguf import GGUFFile

_LAYER = re.compile(r"^blk\.(\d+)\.|\.layers\.(\d+)\.")


def natural_key(name: str) -> list[Any]:
    """blk.2 before blk.10: runs of digits compare as numbers."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _short(v: Any, full: bool) -> str:
    if isinstance(v, list) and not full and len(v) > 8:
        head = ", ".join(repr(x) for x in v[:5])
        return f"[{head}, ...] ({len(v)} items)"
    s = repr(v)
    if not full and len(s) > 120:
        s = s[:117] + "..."
    return s


def _file_type_name(v: Any) -> str:
    try:
        return gguf.LlamaFileType(int(v)).name
    except (ValueError, TypeError):
        return "unknown"


def _layers(names: Iterable[str]) -> str:
    """'layers 0-29 (30)', or the list where it has gaps."""
    found = sorted({int(m.group(1) or m.group(2)) for n in names if (m := _LAYER.search(n))})
    if not found:
        return "no layers"
    if found == list(range(found[0], found[-1] + 1)):
        return f"layers {found[0]}-{found[-1]} ({len(found)})"
    return f"layers {', '.join(map(str, found))} ({len(found)})"


def _targets(names: Iterable[str]) -> str:
    return ", ".join(sorted({_LAYER.sub("", n).split(".weight")[0] for n in names}))


def _ranks(ranks: Iterable[int]) -> str:
    counts = Counter(ranks)
    return ", ".join(f"{r} ({n} tensors)" if len(counts) > 1 else str(r) for r, n in counts.items())


def _adapter_summary(f: GGUFFile) -> list[str]:
    a_names = [n for n in f.tensors if n.endswith(".lora_a")]
    # torch order: A is (r, n_in), except token_embd's (n_vocab, r)
    ranks = [
        f.tensors[n].shape[1 if n.startswith("token_embd.") else 0]
        for n in a_names
        if len(f.tensors[n].shape) == 2
    ]
    alpha = f.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):  # a fuzzed file's list
        shown = f"{type(alpha).__name__} {str(alpha)[:40]} (not a number: the adapter is refused)"
        alpha = 0.0
    else:
        shown = f"{alpha:g}"
    out = [
        f"  rank {_ranks(ranks) or '?'}, alpha {shown}"
        + (f" (scale alpha/r = {alpha / ranks[0]:g})" if ranks and alpha and len(set(ranks)) == 1 else ""),
        f"  targets: {_targets(n[: -len('.lora_a')] for n in a_names) or 'none'}; {_layers(a_names)}",
    ]  # fmt: skip
    for key, label in (
        ("adapter.lora.task_name", "task"),
        ("adapter.lora.prompt_prefix", "prompt prefix"),
        ("adapter.alora.invocation_tokens", "invocation tokens"),
    ):
        if f.get(key):
            out.append(f"  {label}: {_short(f.get(key), False)}")
    return out


def _inspect_gguf(path: str, full: bool) -> None:
    f = GGUFFile(path)
    print(
        f"{f.path}: {f.file_type}, architecture {f.architecture}, {len(f.tensors)} tensors, {f.size:,} bytes"
    )
    types = Counter(t.type_name for t in f.tensors.values())
    print("tensor types: " + ", ".join(f"{k} x{n}" for k, n in types.most_common()))
    if f.file_type == "adapter":
        print("adapter:")
        for line in _adapter_summary(f):
            print(line)
    print("\nmetadata:")
    for k, v in f.metadata.items():
        named = f" ({_file_type_name(v)})" if k == "general.file_type" else ""
        print(f"  {k} = {_short(v, full)}{named}")
    print("\ntensors:")
    width = max((len(n) for n in f.tensors), default=4)
    print(f"  {'name':<{width}}  {'type':<6}  shape (torch order)   ne (GGML order)")
    for name in sorted(f.tensors, key=natural_key):
        t = f.tensors[name]
        shape = "x".join(str(d) for d in t.shape)
        ne = ", ".join(str(d) for d in reversed(t.shape))
        print(f"  {t.name:<{width}}  {t.type_name:<6}  {shape:<20}  [{ne}]")


def _inspect_peft(d: Path, full: bool) -> None:
    from safetensors import safe_open

    from graftlm.lora.peft import WEIGHTS_FILE
    from graftlm.lora.peft_config import CONFIG_FILE

    cfg_path, st_path = d / CONFIG_FILE, d / WEIGHTS_FILE
    if not cfg_path.is_file():
        raise GraftError(f"{d}: a directory without {CONFIG_FILE}, so not a PEFT adapter")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise GraftError(f"{cfg_path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise GraftError(f"{cfg_path}: not a JSON object")
    shapes: dict[str, tuple[list[int], str]] = {}
    if st_path.is_file():
        try:
            with safe_open(str(st_path), "pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    shapes[k] = (list(sl.get_shape()), str(sl.get_dtype()))
        except Exception as exc:  # a malformed file is reported, whatever safetensors raises
            raise GraftError(f"{st_path}: unreadable safetensors file ({exc})") from None
    a_keys = [k for k in shapes if ".lora_A." in k or ".lora_embedding_A" in k]
    ranks = [shapes[k][0][0] for k in a_keys if shapes[k][0]]
    print(
        f"{d}: PEFT {cfg.get('peft_type', '?')} adapter, {len(shapes)} tensors"
        + ("" if st_path.is_file() else f" (no {WEIGHTS_FILE})")
    )
    print(f"  base model: {cfg.get('base_model_name_or_path') or '(not named)'}")
    alpha = cfg.get("lora_alpha")
    rs = " (rsLoRA: alpha/sqrt(r))" if cfg.get("use_rslora") else ""
    print(f"  rank {_ranks(ranks) or cfg.get('r', '?')}, alpha {alpha}{rs}")
    modules = [k.split(".lora_")[0] for k in a_keys]
    print(f"  targets: {_targets(m.split('.')[-1] for m in modules) or 'none'}; {_layers(modules)}")
    for key in ("target_modules", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            print(f"  {key}: {_short(cfg[key], full)}")
    if cfg.get("alora_invocation_tokens"):
        print(f"  invocation tokens: {_short(cfg['alora_invocation_tokens'], full)}")
    print("\ntensors:")
    width = max((len(n) for n in shapes), default=4)
    for name in sorted(shapes, key=natural_key):
        shape, dtype = shapes[name]
        print(f"  {name:<{width}}  {dtype.replace('torch.', ''):<8}  {list(shape)}")


def inspect(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if path.is_dir():
        _inspect_peft(path, args.all)
    else:
        _inspect_gguf(args.file, args.all)
    return 0
