"""The GGUF value type of every metadata key graftlm reads, as llama.cpp reads it.

llama.cpp's loader is strict (`GGUFMeta::GKV::get_kv`: "key %s has wrong type %s but expected
type %s"): a hyperparameter read as uint32_t must be stored as UINT32, a float as FLOAT32, a flag
as BOOL. Python values lose the difference (a UINT8, an INT64 and a FLOAT32 of 4096.0 all read
as numbers), so a file llama.cpp refuses would load here; the parser records each key's stored
type (`Metadata.types`) and `type_problems` compares it with this table.

Where llama.cpp accepts more than one type, so does the table: the per-layer keys read with
`get_key_or_arr` (a UINT32, or an array of INT32 or UINT32 with one entry a layer: gguf-py
writes a list of Python ints as INT32), and the activated LoRA's invocation tokens (UINT32 in
llama.cpp's adapter loader; INT32 too, which gguf-py's `add_array` writes for Python ints and
`get_arr` reads as the same integers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import gguf

V = gguf.GGUFValueType

# (the scalar types a key may have, the element types of an array it may be)
Expected = tuple[frozenset[V], frozenset[V]]

_U32: Expected = (frozenset({V.UINT32}), frozenset())
_F32: Expected = (frozenset({V.FLOAT32}), frozenset())
_BOOL: Expected = (frozenset({V.BOOL}), frozenset())
_STR: Expected = (frozenset({V.STRING}), frozenset())
_PER_LAYER: Expected = (frozenset({V.UINT32}), frozenset({V.UINT32, V.INT32}))
_IDS: Expected = (frozenset(), frozenset({V.UINT32, V.INT32}))


def _array(element: V) -> Expected:
    return (frozenset(), frozenset({element}))


GENERAL: dict[str, Expected] = {
    "general.architecture": _STR,
    "general.type": _STR,
    "general.name": _STR,
    "general.alignment": _U32,
}

# under `<general.architecture>.`
ARCH: dict[str, Expected] = {
    "context_length": _U32,
    "embedding_length": _U32,
    "block_count": _U32,
    "feed_forward_length": _PER_LAYER,
    "expert_feed_forward_length": _U32,
    "expert_count": _U32,
    "expert_used_count": _U32,
    "vocab_size": _U32,
    "attention.head_count": _PER_LAYER,
    "attention.head_count_kv": _PER_LAYER,
    "attention.key_length": _U32,
    "attention.value_length": _U32,
    "attention.layer_norm_rms_epsilon": _F32,
    "attention.sliding_window": _U32,
    "attn_logit_softcapping": _F32,
    "final_logit_softcapping": _F32,
    "rope.dimension_count": _U32,
    "rope.freq_base": _F32,
    "rope.freq_base_swa": _F32,
    "rope.scaling.type": _STR,
    "rope.scaling.factor": _F32,
    "rope.scaling.attn_factor": _F32,
    "rope.scaling.original_context_length": _U32,
    "rope.scaling.yarn_ext_factor": _F32,
    "rope.scaling.yarn_attn_factor": _F32,
    "rope.scaling.yarn_beta_fast": _F32,
    "rope.scaling.yarn_beta_slow": _F32,
}

# every `tokenizer.ggml.*_token_id` is a UINT32 besides these
TOKENIZER: dict[str, Expected] = {
    "tokenizer.ggml.model": _STR,
    "tokenizer.ggml.pre": _STR,
    "tokenizer.ggml.tokens": _array(V.STRING),
    "tokenizer.ggml.merges": _array(V.STRING),
    "tokenizer.ggml.scores": _array(V.FLOAT32),
    "tokenizer.ggml.token_type": _array(V.INT32),
    "tokenizer.ggml.add_bos_token": _BOOL,
    "tokenizer.ggml.add_eos_token": _BOOL,
    "tokenizer.ggml.add_space_prefix": _BOOL,
    "tokenizer.chat_template": _STR,
}

ADAPTER: dict[str, Expected] = {
    "adapter.type": _STR,
    "adapter.lora.alpha": _F32,
    "adapter.lora.task_name": _STR,
    "adapter.lora.prompt_prefix": _STR,
    "adapter.alora.invocation_tokens": _IDS,
}


def expected_type(key: str, arch: str | None) -> Expected | None:
    """The types `key` may be stored as, or None for a key graftlm does not read."""
    if key in GENERAL:
        return GENERAL[key]
    if key in TOKENIZER:
        return TOKENIZER[key]
    if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
        return _U32
    if key in ADAPTER:
        return ADAPTER[key]
    if arch and key.startswith(arch + "."):
        return ARCH.get(key[len(arch) + 1 :])
    return None


def type_name(vtype: V, element: V | None = None) -> str:
    """llama.cpp's `gguf_type_name` spelling, in upper case ("UINT32", "array of INT32")."""
    return f"array of {element.name}" if vtype == V.ARRAY and element is not None else vtype.name


def _names(expected: Expected) -> str:
    scalars, elements = expected
    return " or ".join(
        [t.name for t in sorted(scalars)] + [f"array of {t.name}" for t in sorted(elements)]
    )


def type_problem(key: str, stored: tuple[V, V | None], expected: Expected) -> str | None:
    """llama.cpp's refusal of a key stored as another type, or None when it is one it reads."""
    vtype, element = stored
    scalars, elements = expected
    if vtype in scalars or (vtype == V.ARRAY and element in elements):
        return None
    return (
        f"key {key} has wrong type {type_name(vtype, element)} but expected type {_names(expected)}"
    )


_NUMBERS = frozenset(V) - {V.STRING, V.ARRAY}  # (bool included: llama.cpp's BOOL is a byte)


def _numbers_for_numbers(stored: tuple[V, V | None], expected: Expected) -> bool:
    """A number or bool stored where another number or bool type is expected, alone or as an
    array's elements (what a Python value hides; a string for a number does not)."""
    (vtype, element), (scalars, elements) = stored, expected
    if vtype == V.ARRAY:
        return element in _NUMBERS and bool(elements & _NUMBERS)
    return vtype in _NUMBERS and bool(scalars & _NUMBERS)


class Metadata(dict[str, Any]):
    """A GGUF file's metadata (key -> Python value) that remembers how each key was stored:
    `types[key]` is its GGUF value type and, for an array, its element type (which a Python
    value loses: an int may have been a UINT8 or an INT64)."""

    def __init__(self) -> None:
        super().__init__()
        self.types: dict[str, tuple[V, V | None]] = {}

    def type_problems(self, keys: Iterable[str], numbers_only: bool = False) -> list[str]:
        """Each of `keys` present whose stored type is not the one llama.cpp reads it as, in
        llama.cpp's words (`numbers_only`: only numbers and bools stored as another number or
        bool type, where a reader names the rest in its own words)."""
        arch = self.get("general.architecture")
        arch = arch if isinstance(arch, str) else None
        out = []
        for key in keys:
            expected = expected_type(key, arch)
            if key not in self.types or expected is None:
                continue
            stored = self.types[key]
            if numbers_only and not _numbers_for_numbers(stored, expected):
                continue
            problem = type_problem(key, stored, expected)
            if problem:
                out.append(problem)
        return out

    def type_refusal(self, keys: Iterable[str], numbers_only: bool = False) -> str | None:
        """type_problems as one message (the first three, then how many more), or None."""
        problems = self.type_problems(keys, numbers_only)
        if not problems:
            return None
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        return "; ".join(problems[:3]) + more


def type_refusal(meta: Mapping[str, Any], keys: Iterable[str]) -> str | None:
    """Metadata.type_refusal where `meta` was read from a file; a plain dict has no stored
    types: nothing to compare."""
    return meta.type_refusal(keys) if isinstance(meta, Metadata) else None
