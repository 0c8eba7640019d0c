"""What a PEFT adapter is read against and into: a GGUF base seen from an adapter (`BaseInfo`) and
one module's LoRA laid out for that base (`LoraPair`). Shared by the reading of PEFT directories
(peft.py, peft_experts.py) and by converting and merging them (convert.py, export.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graftlm.lora.adapter import EMBEDDING
from graftlm.lora.peft_config import CONFIG_FILE
from graftlm.lora.targets import EXPERT_ADAPTER_ARCHS, ROUTED, resolve_target

if TYPE_CHECKING:
    from graftlm.gguf import GGUFFile
    from graftlm.lora.targets import Base

# -- the base an adapter is checked against ------------------------------------------------------


@dataclass(frozen=True)
class BaseInfo:
    """A GGUF base seen from an adapter: architecture, head counts, and for each base tensor name
    its (n_in, n_out), or the reason it cannot take a LoRA. The embedding is (n_vocab, n_embd)."""

    path: str
    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    tied_head: bool
    lookup: Callable[[str], tuple[int, int] | str]
    n_expert: int = 0  # routed experts a layer (0: a dense model)

    @classmethod
    def from_model(cls, model: Base, path: str = "") -> BaseInfo:
        cfg = model.cfg

        def lookup(base: str) -> tuple[int, int] | str:
            targets = resolve_target(model, base)
            if isinstance(targets, str):
                return targets
            if base + ".weight" not in model.base_tensor_names and base != "output":
                return "not in the base model"
            return targets[0].n_in, targets[0].n_out

        return cls(path, cfg.arch, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.tied_head, lookup,
                   cfg.n_expert or 0)  # fmt: skip

    @classmethod
    def from_gguf(cls, f: GGUFFile, tied_output: bool = False) -> BaseInfo:
        """From a base model file alone (no weights read): what `convert-lora` checks against.

        tied_output: a tied base's head takes an adapter (as (n_embd, n_vocab)); only a merge,
        which can write the head out, can honour that."""
        arch = f.architecture or ""
        n_head = _int_meta(f.metadata.get(f"{arch}.attention.head_count", 0))
        n_head_kv = _int_meta(f.metadata.get(f"{arch}.attention.head_count_kv", n_head))
        n_expert = _int_meta(f.metadata.get(f"{arch}.expert_count", 0))
        tied = "output.weight" not in f.tensors

        def lookup(base: str) -> tuple[int, int] | str:
            if base == "output" and tied and tied_output and EMBEDDING + ".weight" in f.tensors:
                n_vocab, n_embd = f.tensors[EMBEDDING + ".weight"].shape
                return n_embd, n_vocab
            if base == "output" and tied:
                return (
                    "the base has a tied head (no output.weight), and llama.cpp attaches adapters "
                    "only to tensors the file holds; graftlm can load the PEFT directory itself"
                )
            e = f.tensors.get(base + ".weight")
            if e is None:
                return "not in the base model"
            if len(e.shape) == 3 and ROUTED.fullmatch(base):
                return _expert_shape(arch, e.shape, n_expert)
            if len(e.shape) != 2 or "norm" in base:
                return f"not a matrix (shape {list(e.shape)}): LoRA applies to projections only"
            return (e.shape[1], e.shape[0]) if base != EMBEDDING else (e.shape[0], e.shape[1])

        n_layer = _int_meta(f.metadata.get(f"{arch}.block_count", 0))
        return cls(str(f.path), arch, n_layer, n_head, n_head_kv, tied, lookup, n_expert)


def _expert_shape(arch: str, shape: tuple[int, ...], n_expert: int) -> tuple[int, int] | str:
    """A routed-expert tensor's per-expert (n_in, n_out) (its torch shape (n_expert, n_out,
    n_in)), or why it takes no adapter."""
    if arch not in EXPERT_ADAPTER_ARCHS:
        return (
            "routed-expert tensor, but per-expert adapters apply to the experts of "
            f"{', '.join(sorted(EXPERT_ADAPTER_ARCHS))} models only"
        )
    if shape[0] != n_expert:
        return (
            f"routed-expert tensor of shape {list(shape)} (n_expert, n_out, n_in), but "
            f"{arch}.expert_count is {n_expert}"
        )
    return shape[2], shape[1]


def _int_meta(v: Any) -> int:
    # head counts may be per-layer arrays; the permutation needs one number
    return int(v[0]) if isinstance(v, list) else int(v)


# -- what reading gives ---------------------------------------------------------------------------


@dataclass
class LoraPair:
    """One module's LoRA, named and laid out for the GGUF base (Q/K rows of B permuted where the
    base's were), factor not folded. PEFT layout: a (r, n_in), b (n_out, r); for the embedding
    a (r, n_vocab), b (n_embd, r)."""

    module: str  # PEFT module name, e.g. "model.layers.0.self_attn.q_proj"
    base: str  # GGUF base tensor name without ".weight", e.g. "blk.0.attn_q"
    a: torch.Tensor
    b: torch.Tensor
    scaling: float  # PEFT's factor for this module
    rank: int
    alpha: float
    expert: int | None = None  # a routed expert's index in `base` ("blk.0.ffn_gate_exps")

    @property
    def embedding(self) -> bool:
        return self.base == EMBEDDING


# the safetensors dtypes a factor may have: floating point, read as float32
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2")


def dtype_problems(st: Any, a_key: str, b_key: str) -> list[str]:
    """How the factors' dtypes (from the header: nothing is read) fail to be floating point ([]
    where both are): an integer or boolean factor, as a quantized export or a mislabeled header
    has, would be taken for other numbers than it holds."""
    bad = []
    for half, key in (("lora_A", a_key), ("lora_B", b_key)):
        dtype = st.get_slice(key).get_dtype()
        if dtype not in FLOAT_DTYPES:
            bad.append(
                f"{half} {key!r} has dtype {dtype}; a factor must be one of {', '.join(FLOAT_DTYPES)}"
            )
    return bad


def fit_problems(
    sa: list[int],
    sb: list[int],
    n_in: int,
    n_out: int,
    r_cfg: int,
    names: tuple[str, str] = ("input size", "output size"),
) -> list[str]:
    """How 2-D factors lora_A (r, n_in) and lora_B (n_out, r) fail to fit a base projection of
    n_in -> n_out at the config's rank r_cfg ([] where they fit); `names` what n_in and n_out
    are called (an embedding's: n_vocab, n_embd)."""
    in_name, out_name = names
    bad = []
    if sa[1] != n_in:
        bad.append(f"lora_A {sa} (r, {in_name}) does not fit the base's {in_name} {n_in}")
    if sb[0] != n_out:
        bad.append(f"lora_B {sb} ({out_name}, r) does not fit the base's {out_name} {n_out}")
    if sa[0] != sb[1]:
        bad.append(f"ranks differ: lora_A {sa} has {sa[0]}, lora_B {sb} has {sb[1]}")
    elif sa[0] != r_cfg:
        bad.append(f"rank {sa[0]}, but {CONFIG_FILE} gives r = {r_cfg} for this module")
    return bad
