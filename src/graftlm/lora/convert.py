"""PEFT LoRA directories to llama.cpp GGUF adapters and back (`graftlm convert-lora`).

GGUF adapter layout (llama.cpp's `convert_lora_to_gguf.py` and `llama-adapter.cpp`): metadata
general.architecture, general.type = "adapter", adapter.type = "lora", adapter.lora.alpha (float32);
tensors `<base>.weight.lora_a` ne=[n_in, r] and `.lora_b` ne=[r, n_out] (torch (r, n_in) and
(n_out, r)); token_embd flipped: lora_a ne=[r, n_vocab] (torch (n_vocab, r), PEFT's A transposed)
and lora_b ne=[r, n_embd]. llama.cpp scales each tensor by alpha / r (r = lora_b's ne[0]), or by 1
when alpha is 0. A routed-expert tensor's pair stacks its experts (build_lora_mm_id):
`blk.N.ffn_{gate,up,down}_exps.weight.lora_a` ne=[n_in, r, n_expert], `.lora_b` ne=[r, n_out,
n_expert]; its PEFT layouts are convert_experts.py's.

Scaling across the two: PEFT's factor is per module (alpha / r, alpha / sqrt(r) with rsLoRA,
rank_pattern / alpha_pattern). When one alpha gives alpha / r_t == factor_t for every tensor, that
alpha is written and the tensors are copied as they are (what llama.cpp's own converter produces).
Otherwise each factor is folded into its lora_b and alpha = 0 is written, so llama.cpp applies
exactly PEFT's factor; the returned notes say which happened.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from graftlm.errors import AdapterError, GraftError, ModelFileError
from graftlm.gguf import GGUFFile, TensorEntry
from graftlm.lora.adapter import EMBEDDING
from graftlm.lora.arch_rules import ARCH_RULES, gguf_to_hf, unpermute_rows
from graftlm.lora.convert_experts import PeftExperts, peft_layout, stack_experts, stacked_problem
from graftlm.lora.gguf_adapter import lora_pairs
from graftlm.lora.peft import KEY_PREFIX, WEIGHTS_FILE, read_peft
from graftlm.lora.peft_base import BaseInfo, LoraPair
from graftlm.lora.peft_config import CONFIG_FILE
from graftlm.lora.targets import ROUTED
from graftlm.quant import dequantize_any

OUTTYPES: dict[str, gguf.GGMLQuantizationType] = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
_REL_TOL = 1e-6  # one alpha "fits" when alpha / r matches PEFT's factor to float32 rounding


def _open_base(path: str | os.PathLike[str]) -> GGUFFile:
    f = GGUFFile(path)
    if f.file_type == "adapter":
        raise ModelFileError(
            f"{f.path}: is a LoRA adapter, not a base model (--base wants the model)"
        )
    return f


def _single_alpha(pairs: list[LoraPair], preferred: float) -> float | None:
    """The alpha for which llama.cpp's alpha / r_t equals PEFT's factor on every tensor, if any."""
    for alpha in (preferred, pairs[0].scaling * pairs[0].b.shape[-1]):
        if all(abs(alpha / p.b.shape[-1] - p.scaling) <= _REL_TOL * p.scaling for p in pairs):
            return alpha
    return None


def check_output_folder(out_path: str | os.PathLike[str]) -> Path:
    """The output path, once its folder is known to exist: say so before any work is done, not
    with an OSError about a temporary file at the end."""
    out = Path(out_path)
    if not out.parent.is_dir():
        raise GraftError(f"cannot write {out}: the folder {out.parent} does not exist")
    return out


def peft_to_gguf(
    peft_dir: str | os.PathLike[str],
    base_gguf_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    outtype: str = "f32",
) -> list[str]:
    """Write the PEFT adapter in `peft_dir` as a llama.cpp GGUF adapter for the base model file.

    Every name, shape and the llama Q/K permutation are checked and applied against the base
    (no Hugging Face config needed). Returns notes for the user (alpha written or factors folded,
    tensors stored in another type than asked). Raises AdapterError listing every problem; nothing
    is written then."""
    if outtype not in OUTTYPES:
        raise AdapterError(f"outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    check_output_folder(out_path)
    base = BaseInfo.from_gguf(_open_base(base_gguf_path))
    adapter = read_peft(Path(peft_dir), base)
    if base.tied_head and any(p.base == "output" for p in adapter.pairs):
        raise AdapterError(
            f"{adapter.path / CONFIG_FILE}: ensure_weight_tying puts the embedding's LoRA on the "
            f"tied head too, which a llama.cpp adapter cannot express ({base.path} has no "
            "output.weight to attach it to); graftlm can load the PEFT directory itself"
        )
    pairs = stack_experts(adapter.pairs, base.n_expert)  # routed experts: 3-D, as llama.cpp's
    if not pairs:
        raise AdapterError(f"{adapter.path}: holds no LoRA tensors")
    notes = list(adapter.notes)
    alpha = _single_alpha(pairs, adapter.config.lora_alpha)
    if alpha is not None:
        notes.append(f"adapter.lora.alpha = {alpha:g}: llama.cpp's alpha / r is PEFT's factor")
    else:
        notes.append(
            "PEFT's per-tensor factors (rsLoRA / rank_pattern / alpha_pattern) fit no single "
            "alpha: each is folded into its lora_b and adapter.lora.alpha = 0 (llama.cpp then "
            "applies the user's scale alone)"
        )
    qtype = OUTTYPES[outtype]
    out = Path(out_path)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(tmp, base.arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_name(adapter.path.resolve().name.title())
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0 if alpha is None else alpha)
    if adapter.config.invocation_tokens:
        w.add_key_value(
            gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS,
            list(adapter.config.invocation_tokens),
            gguf.GGUFValueType.ARRAY,
            gguf.GGUFValueType.UINT32,
        )
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    fallback: list[str] = []
    for p in pairs:
        b = p.b if alpha is not None else p.b * p.scaling
        a = p.a.T if p.embedding else p.a  # token_embd: llama.cpp's flipped a (n_vocab, r)
        for suffix, t in (("lora_a", a), ("lora_b", b)):
            name = f"{p.base}.weight.{suffix}"
            data, used = _encode(t, qtype)
            if used != qtype:
                fallback.append(name)
            w.add_tensor(name, data, raw_dtype=used)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, out)  # never leave a half-written adapter under the real name
    if fallback:
        notes.append(
            f"{len(fallback)} tensors stored as f16, not q8_0: their rows "
            f"({', '.join(fallback[:3])}{', ...' if len(fallback) > 3 else ''}) "
            "are not a multiple of 32 values"
        )
    notes.append(f"wrote {out}: {len(pairs) * 2} tensors ({len(pairs)} pairs), {outtype}")
    return notes


def _encode(
    t: torch.Tensor, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """Tensor bytes in `qtype`; Q8_0 falls back to F16 for rows that are not whole blocks, as
    llama.cpp's converter does."""
    arr = t.detach().to(torch.float32).contiguous().numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return arr, qtype
    if qtype == gguf.GGMLQuantizationType.F16:
        return arr.astype(np.float16), qtype
    try:
        return gguf.quants.quantize(arr, qtype), qtype
    except gguf.QuantError:
        return arr.astype(np.float16), gguf.GGMLQuantizationType.F16


def gguf_to_peft(
    adapter_gguf: str | os.PathLike[str],
    base_gguf_path: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
) -> list[str]:
    """Write a llama.cpp GGUF LoRA adapter as a PEFT directory (adapter_config.json +
    adapter_model.safetensors) that PEFT loads onto the Hugging Face model.

    The base model file supplies the head counts that undo the llama Q/K permutation and the
    shapes to check against; it may be None for architectures without the permutation (or an
    adapter without Q/K tensors). Per-tensor ranks that differ become rank_pattern entries (and
    alpha_pattern ones when alpha is 0). Returns notes; raises AdapterError listing every
    problem."""
    check_output_folder(out_dir)
    f, arch = _open_lora_gguf(adapter_gguf)
    base = BaseInfo.from_gguf(_open_base(base_gguf_path)) if base_gguf_path is not None else None
    problems: list[str] = []
    if base is not None and base.arch != arch:
        problems.append(f"the adapter is for {arch!r} but the base {base.path} is {base.arch!r}")
    alpha_v = f.metadata.get(gguf.Keys.Adapter.LORA_ALPHA, 0.0)
    alpha = float(alpha_v) if isinstance(alpha_v, (int, float)) else 0.0

    pairs = {name: (_read(a_e), _read(b_e)) for name, (a_e, b_e) in lora_pairs(f, problems).items()}

    n_layer = base.n_layer if base is not None else None
    tensors, ranks, experts = _peft_tensors(pairs, arch, base, problems)
    if not problems and not tensors:
        problems.append("holds no LoRA tensors")
    if problems:
        raise AdapterError(f"{f.path}: cannot convert to PEFT:\n  - " + "\n  - ".join(problems))

    r_params = experts.rank if experts is not None else None
    config, notes = _peft_config(ranks, alpha, n_layer, r_params)
    if experts is not None:
        if experts.params:
            config["target_parameters"] = experts.target_parameters
        notes.append(experts.note())
    invocation = f.metadata.get("adapter.alora.invocation_tokens")
    if isinstance(invocation, list) and invocation:  # activated LoRA: PEFT's name for them
        config["alora_invocation_tokens"] = [int(t) for t in invocation]
        notes.append(f"activated LoRA: invocation tokens {config['alora_invocation_tokens']}")
    out = Path(out_dir)
    _write_peft(out, tensors, config)
    n_modules = len(ranks) + (len(experts.params) if experts is not None else 0)
    notes.append(f"wrote {out}: {len(tensors)} tensors ({n_modules} modules), r = {config['r']}")
    return notes


def _read(e: TensorEntry) -> torch.Tensor:
    return dequantize_any(e.data, e.ggml_type, e.shape)


def _peft_tensors(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    arch: str,
    base: BaseInfo | None,
    problems: list[str],
) -> tuple[dict[str, torch.Tensor], dict[str, int], PeftExperts | None]:
    """The GGUF pairs as PEFT's safetensors keys; the rank of each module but the
    target_parameters ones, whose rank (the config's r) and parameters the PeftExperts hold (None
    without routed-expert tensors). What does not fit goes to `problems`."""
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # routed experts' 3-D pairs
    for gname, pair in pairs.items():
        if ROUTED.fullmatch(gname):
            bad = stacked_problem(gname, pair[0].shape, pair[1].shape, base)
            if bad is None:
                stacked[gname] = pair
            else:
                problems.append(bad)
            continue
        found = _peft_pair(gname, pair, arch, base, problems)
        if found is None:
            continue
        module, a, b = found
        keys = (
            (".lora_embedding_A", ".lora_embedding_B")
            if gname == EMBEDDING
            else (".lora_A.weight", ".lora_B.weight")
        )
        tensors[KEY_PREFIX + module + keys[0]] = a.contiguous()
        tensors[KEY_PREFIX + module + keys[1]] = b.contiguous()
        ranks[module] = int(b.shape[1])
    if not stacked:
        return tensors, ranks, None
    experts = peft_layout(arch, stacked, base.n_layer if base is not None else None, problems)
    for module, (a, b) in experts.linear.items():
        tensors[KEY_PREFIX + module + ".lora_A.weight"] = a.contiguous()
        tensors[KEY_PREFIX + module + ".lora_B.weight"] = b.contiguous()
        ranks[module] = int(b.shape[1])
    for module, (a, b) in experts.params.items():
        tensors[KEY_PREFIX + module + ".lora_A.weight"] = a
        tensors[KEY_PREFIX + module + ".lora_B.weight"] = b
    r_others = Counter(ranks.values()).most_common(1)[0][0] if ranks else None
    if experts.rank is not None and r_others not in (None, experts.rank):
        problems.append(
            f"the routed-expert tensors have rank {experts.rank} and the others mostly "
            f"{r_others}: PEFT's target_parameters take the config's r"
        )
    return tensors, ranks, experts


def _open_lora_gguf(path: str | os.PathLike[str]) -> tuple[GGUFFile, str]:
    """A llama.cpp LoRA adapter of an architecture whose PEFT names are known, and that name."""
    f = GGUFFile(path)
    if f.file_type != "adapter" or f.metadata.get("adapter.type") != "lora":
        raise AdapterError(f"{f.path}: not a llama.cpp LoRA adapter (general.type / adapter.type)")
    arch = f.architecture or ""
    if arch not in ARCH_RULES:
        raise AdapterError(
            f"{f.path}: architecture {arch!r} has no PEFT name mapping here "
            f"(known: {', '.join(sorted(ARCH_RULES))})"
        )
    return f, arch


def _peft_pair(
    gname: str,
    pair: tuple[torch.Tensor, torch.Tensor],
    arch: str,
    base: BaseInfo | None,
    problems: list[str],
) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """One GGUF pair as PEFT holds it: (Hugging Face module, A, B), A of the embedding back to
    (r, n_vocab), B's Q/K rows back to Hugging Face's order; None, with the reason in `problems`,
    where it cannot be."""
    where = f"tensor {gname}.weight"
    module = gguf_to_hf(arch, gname)
    if module is None:
        problems.append(f"{where}: no Hugging Face module is known for it on {arch}")
        return None
    a, b = pair
    if gname == EMBEDDING:
        a = a.T  # back to PEFT's lora_embedding_A (r, n_vocab)
    if a.shape[0] != b.shape[1]:
        problems.append(f"{where}: ranks differ: lora_a {list(a.shape)}, lora_b {list(b.shape)}")
        return None
    if base is not None:
        shape = base.lookup(gname)
        if isinstance(shape, str):
            problems.append(f"{where}: {shape}")
            return None
        if (a.shape[1], b.shape[0]) != shape:
            problems.append(
                f"{where}: (n_in, n_out) = ({a.shape[1]}, {b.shape[0]}) does not fit the "
                f"base's {shape}"
            )
            return None
    kind = gname.rsplit(".", 1)[-1]
    if ARCH_RULES[arch].rope_permuted and kind in ("attn_q", "attn_k"):
        if base is None:
            problems.append(
                f"{where}: its rows were permuted for RoPE over the base's heads; give "
                "the base model file to undo that"
            )
            return None
        b = unpermute_rows(b, base.n_head if kind == "attn_q" else base.n_head_kv)
    return module, a, b


def _write_peft(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write the pair into a fresh folder beside `out` (the other files of an existing `out`
    copied in), then swap it in: one rename where `out` does not exist, else an atomic exchange
    of the two folders (Linux's renameat2 RENAME_EXCHANGE) and the old one removed. A process
    killed at any moment leaves the old adapter or the new one under `out` (and at worst a
    hidden `.partial` folder beside it). Without the exchange, the old folder steps aside first
    (`.NAME.old`): a kill between the two renames leaves both, named, and the next write puts the
    old one back before it starts."""
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    old = parent / f".{out.name}.old"
    if not out.exists() and old.is_dir():  # a write killed between the two renames: put it back
        os.rename(old, out)
    if out.exists() and not out.is_dir():
        raise GraftError(f"{out}: exists and is not a folder")
    new = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(new, out.stat().st_mode & 0o777 if out.is_dir() else 0o777 & ~mask)
        if out.is_dir():
            for f in out.iterdir():
                if f.name not in (WEIGHTS_FILE, CONFIG_FILE) and f.is_file():
                    shutil.copy2(f, new / f.name)
        save_file(tensors, str(new / WEIGHTS_FILE), metadata={"format": "pt"})
        (new / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        # safetensors creates its file 0600: the pair gets the config's mode (the umask's)
        os.chmod(new / WEIGHTS_FILE, (new / CONFIG_FILE).stat().st_mode & 0o777)
        if not out.exists():
            os.rename(new, out)
        elif _exchange(new, out):
            shutil.rmtree(new)  # (the old adapter, now)
        else:
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
            os.rename(new, out)
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 with RENAME_EXCHANGE); False where it cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _peft_config(
    ranks: dict[str, int], alpha: float, n_layer: int | None, r_params: int | None = None
) -> tuple[dict, list[str]]:
    """adapter_config.json whose factors equal llama.cpp's: alpha / r_t, or 1 when alpha is 0;
    r_params: the rank of the target_parameters modules (the config's r), None when none."""
    notes: list[str] = []
    r = Counter(ranks.values()).most_common(1)[0][0] if ranks else r_params
    assert r is not None, "a config needs modules or target_parameters"
    rank_pattern = {m: rt for m, rt in ranks.items() if rt != r}
    lora_alpha = alpha if alpha != 0 else float(r)
    alpha_pattern = {m: float(rt) for m, rt in rank_pattern.items()} if alpha == 0 else {}
    if alpha == 0:
        notes.append("adapter.lora.alpha is 0 (scale 1): lora_alpha = r for every module")
    if rank_pattern:
        notes.append(f"{len(rank_pattern)} modules differ from r = {r}: listed in rank_pattern")
    target_modules, layers = _targets(sorted(ranks), n_layer)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": int(lora_alpha) if float(lora_alpha).is_integer() else lora_alpha,
        "lora_dropout": 0.0,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "target_modules": target_modules,
        "layers_to_transform": layers,
        "layers_pattern": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }
    return config, notes


def _targets(modules: list[str], n_layer: int | None) -> tuple[list[str], list[int] | None]:
    """target_modules (and layers_to_transform) that select exactly `modules` in PEFT: short names
    when every chosen layer has the same set, else the full names."""
    by_layer: dict[int, set[str]] = {}
    others: set[str] = set()
    for m in modules:
        parts = m.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit():
            by_layer.setdefault(int(parts[2]), set()).add(".".join(parts[3:]))
        else:
            others.add(m)
    sets = {frozenset(s) for s in by_layer.values()}
    shorts = {n.rsplit(".", 1)[-1] for s in sets for n in s}
    uniform = len(sets) <= 1 and len(shorts) == len(next(iter(sets), frozenset()))
    layers = sorted(by_layer)
    all_layers = n_layer is not None and layers == list(range(n_layer))
    if uniform and (all_layers or not by_layer):
        return sorted(shorts | {m.rsplit(".", 1)[-1] for m in others}), None
    if uniform and not others:
        return sorted(shorts), layers  # PEFT's layers_to_transform does not reach non-block modules
    return modules, None
