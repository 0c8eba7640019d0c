"""PEFT LoRA directories, read with PEFT's own semantics and checked against a GGUF base.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors` with keys
`base_model.model.<module>.lora_A.weight` (r, n_in) / `.lora_B.weight` (n_out, r), and for an
embedding `base_model.model.<module>.lora_embedding_A` (r, n_vocab) / `.lora_embedding_B`
(n_embd, r). PEFT computes y += s * B @ (A @ x), and for the embedding e[t] += s * B @ A[:, t]
(times the model's embedding scale, like the base row), with s PEFT's per-module factor
(peft_config.py: alpha / r, rsLoRA, rank / alpha patterns).

Reading maps every Hugging Face module name to its GGUF base tensor (gguf's TensorNameMap) and
applies what llama.cpp's converter did to the base weights (arch_rules.py): on llama-architecture files the Q and
K rows are permuted for RoPE, so B of q_proj / k_proj is permuted the same way (A is not: it acts
on the input side). Routed experts' LoRA, per-expert linears or target_parameters, is read by
peft_experts.py; the base an adapter is checked against and the pairs it gives are peft_base.py's.
Every problem is collected into one AdapterError; nothing is skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from graftlm.errors import AdapterError
from graftlm.lora.adapter import EMBEDDING, Delta, ResolvedAdapter, hidden_size, refusal
from graftlm.lora.arch_rules import ARCH_RULES, PERMUTED_KINDS, arch_rules, hf_to_gguf, permute_rows
from graftlm.lora.gguf_adapter import combine
from graftlm.lora.peft_base import BaseInfo, LoraPair, dtype_problems, fit_problems
from graftlm.lora.peft_config import CONFIG_FILE, PeftConfig, parse_config
from graftlm.lora.peft_experts import read_experts, stacked_experts_module
from graftlm.lora.targets import resolve_target

if TYPE_CHECKING:
    from graftlm.lora.targets import Base

WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
KEY_PREFIX = "base_model.model."
_BASE_LAYER = ".base_layer.weight"
# PEFT key suffix -> (which factor, is the embedding layout)
_SUFFIXES = {
    ".lora_A.weight": ("a", False),
    ".lora_B.weight": ("b", False),
    ".lora_embedding_A": ("a", True),
    ".lora_embedding_B": ("b", True),
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# -- reading -------------------------------------------------------------------------------------


@dataclass
class PeftAdapter:
    """A PEFT directory checked against a base: its config and every LoRA pair, ready to use."""

    path: Path
    config: PeftConfig
    pairs: list[LoraPair]
    n_tensors: int
    notes: list[str] = field(default_factory=list)


def peft_files(d: Path) -> tuple[Path, Path]:
    """The files of PEFT directory `d` that reading it opens: its config, its weights."""
    return d / CONFIG_FILE, d / WEIGHTS_FILE


def read_peft(path: str | Path, base: BaseInfo) -> PeftAdapter:
    """Read and check a PEFT directory against `base`. Raises AdapterError listing every problem."""
    d = Path(path)
    cfg_path, st_path = peft_files(d)
    _check_files(d, cfg_path, st_path)
    problems: list[str] = []
    raw = _config_json(cfg_path)
    cfg = parse_config(raw, str(cfg_path), problems)
    if arch_rules(base.arch) is None:
        problems.append(
            f"base {base.path}: architecture {base.arch!r} has no PEFT name mapping here "
            f"(known: {', '.join(sorted(ARCH_RULES))})"
        )
    if cfg is None or arch_rules(base.arch) is None:
        raise AdapterError(f"{d}: cannot attach PEFT adapter:\n  - " + "\n  - ".join(problems))

    try:
        st = safe_open(str(st_path), "pt")
        keys = list(st.keys())
    except Exception as exc:  # a malformed file is a malformed file, whatever safetensors raises
        raise AdapterError(f"{st_path}: unreadable safetensors file ({exc})") from None
    halves, base_layers = _sort_keys(keys, problems)

    # ensure_weight_tying on a tied base: PEFT also gives lm_head the embedding's LoRA (saved as
    # lm_head.lora_A = lora_embedding_B.T, lora_B = lora_embedding_A.T) without listing it
    tie_head = (
        cfg.ensure_weight_tying
        and base.tied_head
        and any(p.get("a", ("", False))[1] for p in halves.values())
    )
    pairs = _read_pairs(st, halves, cfg, base, problems, tie_head)
    notes = _base_layer_notes(st, base_layers, halves, base, problems)
    if tie_head and not any(p.base == "output" for p in pairs):
        table = next((p for p in pairs if p.embedding), None)
        if table is not None:
            pairs.append(_tied_head(table, cfg))
    if tie_head:
        notes.append("ensure_weight_tying: the embedding's LoRA also applies to the tied head")
    if problems:
        raise refusal(_refusal_head(d, raw, st, keys, base), problems)
    return PeftAdapter(d, cfg, pairs, len(keys), notes)


def _check_files(d: Path, cfg_path: Path, st_path: Path) -> None:
    """AdapterError unless the directory holds both files (naming a pickled .bin's way out)."""
    missing = [p.name for p in (cfg_path, st_path) if not p.is_file()]
    if missing:
        hint = ""
        if not st_path.is_file() and (d / "adapter_model.bin").is_file():
            hint = (
                " (adapter_model.bin, PyTorch's pickle format, is not read: re-save the adapter "
                "with PEFT's save_pretrained(..., safe_serialization=True))"
            )
        raise AdapterError(
            f"{d}: not a PEFT adapter directory: missing {' and '.join(missing)}{hint}"
        )


def _config_json(cfg_path: Path) -> Any:
    """adapter_config.json's JSON, of a config's size at most."""
    try:
        if cfg_path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(
                f"{cfg_path}: {cfg_path.stat().st_size} bytes; a PEFT config is a few KB "
                f"(at most {MAX_CONFIG_BYTES} read)"
            )
        return json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{cfg_path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise AdapterError(f"{cfg_path}: JSON nested too deep to be a PEFT config") from None


def _sort_keys(
    keys: list[str], problems: list[str]
) -> tuple[dict[str, dict[str, tuple[str, bool]]], dict[str, str]]:
    """The weights file's keys by module: its LoRA halves ({"a"/"b": (key, embedding layout)})
    and the base layers PEFT saved; any other tensor is a problem."""
    halves: dict[str, dict[str, tuple[str, bool]]] = {}
    base_layers: dict[str, str] = {}
    for key in keys:
        module, part, embd = _split_key(key)
        if module is not None:
            halves.setdefault(module, {})[part] = (key, embd)
        elif key.startswith(KEY_PREFIX) and key.endswith(_BASE_LAYER):
            base_layers[key[len(KEY_PREFIX) : -len(_BASE_LAYER)]] = key
        else:
            problems.append(
                f"{WEIGHTS_FILE}: tensor {key!r}: a full saved layer or other non-LoRA tensor "
                "(only lora_A/B and lora_embedding_A/B are supported)"
            )
    if not halves and not problems:
        problems.append(f"{WEIGHTS_FILE}: holds no LoRA tensors")
    return halves, base_layers


def _read_pairs(
    st: Any,
    halves: dict[str, dict[str, tuple[str, bool]]],
    cfg: PeftConfig,
    base: BaseInfo,
    problems: list[str],
    tie_head: bool,
) -> list[LoraPair]:
    """Every module's pair that fits the base; what does not is a problem."""
    pairs: list[LoraPair] = []
    for module, parts in halves.items():
        if set(parts) != {"a", "b"}:
            have = "A" if "a" in parts else "B"
            problems.append(
                f"{WEIGHTS_FILE}: module {module!r} has lora_{have} "
                f"but no lora_{'B' if have == 'A' else 'A'}"
            )
            continue
        where = f"{WEIGHTS_FILE}: module {module!r}"
        experts = read_experts(st, module, parts, cfg, base, problems, where)
        if experts is not None:
            pairs += experts
            continue
        tied = tie_head and module.rsplit(".", 1)[-1] == "lm_head"
        pair = _read_pair(st, module, parts, cfg, base, problems, tied)
        if pair is not None:
            pairs.append(pair)
    return pairs


def _refusal_head(d: Path, raw: Any, st: Any, keys: list[str], base: BaseInfo) -> str:
    """What the adapter was made for (its config's base model, the width of its q_proj) beside
    what the base is: the first thing to read when an adapter meets another model."""
    shapes = {}
    for k in keys:
        if "q_proj.lora_A" in k:
            try:
                shapes[k] = tuple(st.get_slice(k).get_shape())
            except Exception:  # the problems already say what is wrong with the file
                pass
    width = hidden_size(shapes)
    trained = raw.get("base_model_name_or_path") if isinstance(raw, dict) else None
    made = [f"for {trained!r}" if isinstance(trained, str) and trained else ""]
    made.append(f"(hidden size {width})" if width else "")
    embd = base.lookup(EMBEDDING)
    base_width = f" (hidden size {embd[1]})" if isinstance(embd, tuple) else ""
    made_for = " ".join(m for m in made if m)
    return (
        f"{d}: cannot attach PEFT adapter{' ' + made_for if made_for else ''} to {base.arch} "
        f"base {base.path!r}{base_width}:"
    )


def a_factor_shapes(d: Path, experts: bool) -> list[tuple[str, list[int]]]:
    """The A factors of a PEFT directory's weights file, (key, shape), from its header alone
    (nothing read); the stacked-expert form of `target_parameters` (A of (r n_expert, n_in),
    under `...mlp.experts[.base_layer...]`) only with `experts`. Raises what the header's
    reader raises."""
    out = []
    with safe_open(str(peft_files(d)[1]), "pt") as st:
        for key in st.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            module, part, _ = _split_key(key)
            if module is None or part != "a":
                continue
            if experts or not stacked_experts_module(module):
                out.append((key, list(st.get_slice(key).get_shape())))
    return out


def _split_key(key: str) -> tuple[str | None, str, bool]:
    if not key.startswith(KEY_PREFIX):
        return None, "", False
    for suffix, (part, embd) in _SUFFIXES.items():
        if key.endswith(suffix):
            return key[len(KEY_PREFIX) : -len(suffix)], part, embd
    return None, "", False


def _read_pair(
    st: Any,
    module: str,
    parts: dict[str, tuple[str, bool]],
    cfg: PeftConfig,
    base: BaseInfo,
    problems: list[str],
    tied_head: bool = False,
) -> LoraPair | None:
    where = f"{WEIGHTS_FILE}: module {module!r}"
    gname = hf_to_gguf(base.arch, base.n_layer, module)
    if gname is None:
        m = _LAYER.search(module)
        if m and int(m.group(1)) >= base.n_layer:
            problems.append(f"{where}: layer {m.group(1)}, but the base has {base.n_layer} layers")
        else:
            problems.append(f"{where}: unknown module name for a {base.arch} model")
        return None
    if not (cfg.targets(module) or tied_head):
        problems.append(
            f"{where}: not selected by target_modules / layers_to_transform in {CONFIG_FILE}"
        )
        return None
    shape = base.lookup(gname)
    if isinstance(shape, str):
        problems.append(f"{where} -> {gname}.weight: {shape}")
        return None
    embd = gname == EMBEDDING
    if parts["a"][1] != embd or parts["b"][1] != embd:
        kind = "lora_embedding_A/B" if embd else "lora_A/B.weight"
        problems.append(f"{where} -> {gname}.weight: expected {kind} tensors for this module")
        return None
    # shapes from the header first: nothing is read (or allocated) for a tensor that cannot fit
    sa = list(st.get_slice(parts["a"][0]).get_shape())
    sb = list(st.get_slice(parts["b"][0]).get_shape())
    n_in, n_out = shape
    r_cfg, alpha = cfg.rank_alpha(module)
    bad = []
    if len(sa) != 2 or len(sb) != 2:
        bad.append(f"lora_A {sa} and lora_B {sb} must both be 2-D")
    else:
        names = ("n_vocab", "n_embd") if embd else ("input size", "output size")
        bad += fit_problems(sa, sb, n_in, n_out, r_cfg, names)
    bad += dtype_problems(st, parts["a"][0], parts["b"][0])
    if bad:
        problems.append(f"{where} -> {gname}.weight: " + "; ".join(bad))
        return None
    a = st.get_tensor(parts["a"][0]).float()
    b = st.get_tensor(parts["b"][0]).float()
    rules = ARCH_RULES[base.arch]
    kind = gname.rsplit(".", 1)[-1]
    if not bad and rules.rope_permuted and kind in PERMUTED_KINDS:
        n_head = getattr(base, PERMUTED_KINDS[kind])
        if n_head <= 0 or n_out % (2 * n_head):
            bad.append(f"{n_out} rows cannot be permuted over {n_head} heads")
        else:
            b = permute_rows(b, n_head)  # the base's rows were permuted the same way
    if bad:
        problems.append(f"{where} -> {gname}.weight: " + "; ".join(bad))
        return None
    return LoraPair(module, gname, a, b, cfg.scaling(module), r_cfg, alpha)


def _base_layer_notes(
    st: Any,
    base_layers: dict[str, str],
    halves: dict[str, dict[str, tuple[str, bool]]],
    base: BaseInfo,
    problems: list[str],
) -> list[str]:
    """PEFT saves a copy of an embedding (and a tied head) it put a LoRA on (save_embedding_layers,
    for resized vocabularies). With the base's own shape it is the base weight, which graftlm takes
    from the GGUF file instead; any other saved layer is refused."""
    notes = []
    for module, key in base_layers.items():
        gname = hf_to_gguf(base.arch, base.n_layer, module) if module in halves else None
        if gname not in (EMBEDDING, "output"):
            problems.append(f"{WEIGHTS_FILE}: tensor {key!r}: a full saved layer is not supported")
            continue
        shape = base.lookup(gname)
        saved = list(st.get_slice(key).get_shape())
        want = [shape[0], shape[1]] if not isinstance(shape, str) and gname == EMBEDDING else None
        if want is None and not isinstance(shape, str):
            want = [shape[1], shape[0]]
        if want is not None and saved != want:
            problems.append(
                f"{WEIGHTS_FILE}: tensor {key!r}: saved base layer {saved} differs from the "
                f"base's {want} (resized vocabulary? full saved layers are not supported)"
            )
            continue
        notes.append(
            f"{key}: PEFT's saved copy of the base layer is not applied; the GGUF base's own "
            "weights are used"
        )
    return notes


def _tied_head(embd: LoraPair, cfg: PeftConfig) -> LoraPair:
    # (r, n_embd) and (n_vocab, r): the head reads the embedding table transposed
    r, alpha = cfg.rank_alpha("lm_head")
    return LoraPair(
        "lm_head",
        "output",
        embd.b.T.contiguous(),
        embd.a.T.contiguous(),
        cfg.scaling("lm_head"),
        r,
        alpha,
    )


def read_peft_adapter(path: str | Path, model: Base) -> ResolvedAdapter:
    """Read, check and resolve a PEFT directory for `model`; PEFT's factor folded into B.

    Raises AdapterError listing every problem; nothing is attached either way."""
    base = BaseInfo.from_model(model, path=model.cfg.name or model.cfg.arch)
    adapter = read_peft(path, base)
    pieces: dict[str, list[tuple[slice, slice, Delta]]] = {}
    for p in adapter.pairs:
        if p.embedding:
            # graftlm's gather layout: a (n_vocab, r) looked up per token, b (n_embd, r)
            delta = Delta(p.a.T.contiguous(), p.b * p.scaling, sources=(p.module,))
        else:
            delta = Delta(p.a, p.b * p.scaling, sources=(p.module,))  # a (r, n_in), b (n_out, r)
        targets = resolve_target(model, p.base)
        assert not isinstance(targets, str), targets  # BaseInfo.lookup refused these already
        if p.expert is not None:
            targets = [targets[p.expert]]
        for t in targets:
            pieces.setdefault(t.projection, []).append((t.rows, t.at, delta))
    n_out = {name: p.n_out for name, p in model.projections().items()}
    n_out[EMBEDDING] = model.cfg.n_embd
    return ResolvedAdapter(
        path=str(adapter.path),
        alpha=adapter.config.lora_alpha,
        deltas={name: combine(parts, n_out[name]) for name, parts in pieces.items()},
        n_tensors=adapter.n_tensors,
        invocation_tokens=list(adapter.config.invocation_tokens),
        source="peft",
        notes=adapter.notes,
    )
