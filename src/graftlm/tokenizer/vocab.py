"""The vocabulary as llama.cpp loads it from GGUF metadata: token texts, scores, attributes,
special ids, the end-of-generation set and the special-token partition of raw text.

Everything here mirrors `llama_vocab::impl::load` and `tokenizer_st_partition` in llama.cpp's
`src/llama-vocab.cpp` (build 0c1e570), because token ids must match llama.cpp's exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntFlag
from typing import Any

from graftlm.gguf.spec import type_refusal

# GGUF `tokenizer.ggml.token_type` values.
_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL = 1, 2, 3
_TYPE_USER_DEFINED, _TYPE_UNUSED, _TYPE_BYTE = 4, 5, 6


class TokenAttr(IntFlag):
    """llama.cpp's `llama_token_attr` bits (those that GGUF token types map to).

    llama.cpp's LSTRIP/RSTRIP bits are not modelled: it sets them only by model name (phi-3,
    jina, modern-bert), never from GGUF metadata."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# Attributes are kept as plain ints: IntFlag arithmetic is too slow for 262k-token vocabularies.
_NORMAL = int(TokenAttr.NORMAL)
_CONTROL = int(TokenAttr.CONTROL)
_USER_DEFINED = int(TokenAttr.USER_DEFINED)
_UNKNOWN = int(TokenAttr.UNKNOWN)
_UNUSED = int(TokenAttr.UNUSED)
_TYPE_TO_ATTR = {
    _TYPE_NORMAL: _NORMAL,
    _TYPE_UNKNOWN: _UNKNOWN,
    _TYPE_CONTROL: _CONTROL,
    _TYPE_USER_DEFINED: _USER_DEFINED,
    _TYPE_UNUSED: _UNUSED,
    _TYPE_BYTE: int(TokenAttr.BYTE),
}

# Texts llama.cpp recognises as special even when the GGUF does not say so (it matches on text
# because converters rarely record these roles). Order matters only for which id becomes "the"
# EOT token, which affects nothing but `eot_id`.
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = (
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
)
_FIM_SUF_TEXTS = (
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
)
_FIM_MID_TEXTS = (
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
# gpt-oss renders these even when special tokens are hidden.
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass
class Vocab:
    """Token table and special-token facts of one GGUF tokenizer, as llama.cpp derives them."""

    tokens: list[str]
    scores: Sequence[float]
    attrs: list[int]  # TokenAttr bits
    token_to_id: dict[str, int]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    unk_id: int | None
    pad_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    # Special tokens (control, user-defined, unknown), longest text first: the order in which
    # llama.cpp cuts them out of raw text.
    special_order: list[int] = field(default_factory=list)

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_metadata(
        cls,
        meta: Mapping[str, Any],
        *,
        default_ids: tuple[int | None, int | None, int | None],
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
    ) -> Vocab:
        """Build the table; `default_ids` are llama.cpp's (bos, eos, unk) for this model type and
        the flags are its defaults, each overridden by the GGUF keys when present."""
        tokens, token_to_id = _token_table(meta)
        n = len(tokens)
        scores = _number_list(meta.get("tokenizer.ggml.scores"), n, "tokenizer.ggml.scores")
        attrs = _token_attrs(meta.get("tokenizer.ggml.token_type"), n)
        ids = _SpecialIds.from_metadata(meta, n, default_ids)

        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", add_eos))
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        if add_bos and ids.bos is None:
            raise ValueError("tokenizer.ggml.add_bos_token is true, but there is no BOS token")
        if add_eos and ids.eos is None:
            raise ValueError("tokenizer.ggml.add_eos_token is true, but there is no EOS token")

        touched = ids.find_by_text(token_to_id, attrs)  # ids whose attributes the rules changed
        wanted = _CONTROL | _USER_DEFINED | _UNKNOWN
        special = [i for i, a in enumerate(attrs) if a & wanted]
        for i in special:
            if attrs[i] & _CONTROL and "unused" in tokens[i]:
                attrs[i] |= _UNUSED
        eog = _eog_ids(ids, tokens, token_to_id, attrs, touched)

        special = sorted(i for i in set(special) | touched if attrs[i] & wanted)
        # llama.cpp compares byte lengths; ties keep id order (std::sort leaves them unspecified).
        special.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
        # last, after the values (a list of strings for the scores is named as such): the
        # stored types, as llama.cpp checks them (a token id stored as INT32, a flag as UINT8)
        refusal = type_refusal(meta, [k for k in meta if k.startswith("tokenizer.")])
        if refusal:
            raise ValueError(refusal)

        return cls(
            tokens=tokens,
            scores=scores,
            attrs=attrs,
            token_to_id=token_to_id,
            bos_id=ids.bos,
            eos_id=ids.eos,
            eot_id=ids.eot,
            unk_id=ids.unk,
            pad_id=ids.pad,
            eog_ids=frozenset(eog),
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            special_order=special,
        )

    def partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of `text`: the result interleaves raw text fragments (str) and
        token ids (int). Without `parse_special` only user-defined tokens are cut, as llama.cpp
        (and HF tokenizers) do."""
        if not text:
            return []
        fragments: list[str | int] = [text]
        skip = _CONTROL | _UNKNOWN
        tokens, attrs = self.tokens, self.attrs
        for tid in self.special_order:
            if not parse_special and attrs[tid] & skip:
                continue
            piece = tokens[tid]
            # A token absent from the whole text is absent from every fragment of it.
            if piece not in text:
                continue
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or piece not in frag:
                    out.append(frag)
                    continue
                parts = frag.split(piece)
                for k, part in enumerate(parts):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            fragments = out
        return fragments


def _token_table(meta: Mapping[str, Any]) -> tuple[list[str], dict[str, int]]:
    """The token texts (an empty one renamed, as llama.cpp does, so every text is a distinct
    key) and each text's id; ValueError for a missing list or a duplicate text."""
    raw_tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(raw_tokens, Sequence) or isinstance(raw_tokens, str | bytes):
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens list")
    n = len(raw_tokens)
    tokens = list(raw_tokens)
    if "" in tokens:
        tokens = [t if t != "" else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    token_to_id = dict(zip(tokens, range(n), strict=True))
    if len(token_to_id) != n:
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise ValueError(f"duplicate token in vocabulary: {t!r} has ids {seen[t]} and {i}")
            seen[t] = i
    return tokens, token_to_id


def _token_attrs(types: Any, n: int) -> list[int]:
    """TokenAttr bits of each token from `tokenizer.ggml.token_type` (all normal without it)."""
    if types is None:
        return [_NORMAL] * n
    if len(types) < n:
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    table = _TYPE_TO_ATTR
    return [table.get(t, 0) for t in types[:n]]


# each role's `tokenizer.ggml.<key>_token_id` keys; a later one (the newer name) goes over an
# earlier one
_ROLE_KEYS = {
    "bos": ("bos",),
    "eos": ("eos",),
    "unk": ("unknown",),
    "pad": ("padding",),
    "eot": ("eot",),
    "eom": ("eom",),
    "fim_pre": ("fim_pre", "prefix"),
    "fim_suf": ("fim_suf", "suffix"),
    "fim_mid": ("fim_mid", "middle"),
    "fim_pad": ("fim_pad",),
    "fim_rep": ("fim_rep",),
    "fim_sep": ("fim_sep",),
}


@dataclass
class _SpecialIds:
    """The special roles' ids (None: no such token), from the metadata, then from the texts
    llama.cpp recognises where the metadata is silent."""

    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None
    eot: int | None
    eom: int | None
    fim_pre: int | None
    fim_suf: int | None
    fim_mid: int | None
    fim_pad: int | None
    fim_rep: int | None
    fim_sep: int | None

    @classmethod
    def from_metadata(
        cls,
        meta: Mapping[str, Any],
        n: int,
        default_ids: tuple[int | None, int | None, int | None],
    ) -> _SpecialIds:
        """Each role's `tokenizer.ggml.*_token_id` (an id outside the vocabulary: the default)."""

        def special_id(key: str, default: int | None) -> int | None:
            if default is not None and default >= n:
                default = None
            value = meta.get(key)
            if value is None:
                return default
            value = int(value)
            return value if 0 <= value < n else default

        found = dict(zip(("bos", "eos", "unk"), default_ids, strict=True))
        for role, keys in _ROLE_KEYS.items():
            for key in keys:
                found[role] = special_id(f"tokenizer.ggml.{key}_token_id", found.get(role))
        return cls(**found)

    def find_by_text(self, token_to_id: dict[str, int], attrs: list[int]) -> set[int]:
        """The roles the metadata left empty, found by their usual texts; each found token
        becomes a control token. Returns the ids whose attributes changed."""
        touched: set[int] = set()

        def find(texts: tuple[str, ...]) -> int | None:
            for t in texts:
                i = token_to_id.get(t)
                if i is not None:
                    attrs[i] |= _CONTROL
                    touched.add(i)
                    return i
            return None

        if self.eot is None:
            self.eot = find(_EOT_TEXTS)
        if self.eom is None:
            self.eom = find(_EOM_TEXTS)
        # The FIM roles matter here only for the control bit the detection sets.
        for found, texts in (
            (self.fim_pre, _FIM_PRE_TEXTS),
            (self.fim_suf, _FIM_SUF_TEXTS),
            (self.fim_mid, _FIM_MID_TEXTS),
        ):
            if found is None:
                find(texts)
        if self.fim_pad is None:
            self.fim_pad = find(_FIM_PAD_TEXTS)
        if self.fim_rep is None:
            self.fim_rep = find(_FIM_REP_TEXTS)
        if self.fim_sep is None:
            self.fim_sep = find(_FIM_SEP_TEXTS)
        return touched


def _eog_ids(
    ids: _SpecialIds,
    tokens: list[str],
    token_to_id: dict[str, int],
    attrs: list[int],
    touched: set[int],
) -> set[int]:
    """The end-of-generation set: the FIM pad / repo / separator, every token of an EOG text
    (made control), EOS, EOT and EOM, less llama.cpp's exceptions; gpt-oss's always-rendered
    tokens made user-defined. Adds the ids whose attributes changed to `touched`."""
    eog = {i for i in (ids.fim_pad, ids.fim_rep, ids.fim_sep) if i is not None}
    for t in _EOG_TEXTS:
        eog_id = token_to_id.get(t)
        if eog_id is not None:
            eog.add(eog_id)
            attrs[eog_id] |= _CONTROL
            touched.add(eog_id)
    for t in _ALWAYS_RENDERED:
        shown = token_to_id.get(t)
        if shown is not None:
            attrs[shown] = _USER_DEFINED
            touched.add(shown)
    eog.update(i for i in (ids.eos, ids.eot, ids.eom) if i is not None)
    touched |= _apply_eog_workarounds(tokens, attrs, eog)
    return eog


def _apply_eog_workarounds(tokens: list[str], attrs: list[int], eog: set[int]) -> set[int]:
    """llama.cpp's exceptions to its text rules, for vocabularies that reuse EOG-looking texts.
    Returns the ids whose attributes changed."""
    changed: set[int] = set()
    texts = {tokens[i]: i for i in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        end = texts["<|end|>"]
        eog.discard(end)
        attrs[end] = _USER_DEFINED
        changed.add(end)
    # gemma4 and plamo2 have a normal "</s>" (unlike paddleocr, which the "</s>" rule is for).
    if ("<|tool_response>" in texts or "<|plamo:eos|>" in texts) and "</s>" in texts:
        s = texts["</s>"]
        eog.discard(s)
        attrs[s] = _NORMAL
        changed.add(s)
    return changed


def _number_list(value: Any, n: int, key: str) -> Sequence[float]:
    if value is None:
        return [0.0] * n
    if not isinstance(value, list):
        raise ValueError(f"{key} is a {type(value).__name__}, not an array of numbers")
    if len(value) < n:
        raise ValueError(f"{key} has {len(value)} entries for {n} tokens")
    bad = next(
        (
            i
            for i, v in enumerate(value[:n])
            if isinstance(v, bool) or not isinstance(v, (int, float))
        ),
        None,
    )
    if bad is not None:
        raise ValueError(f"{key}[{bad}] is a {type(value[bad]).__name__}, not a number")
    return value
