"""`Tokenizer`: GGUF tokenizer metadata in, llama.cpp-identical token ids and text out."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from graftlm.errors import ModelFileError
from graftlm.gguf import GGUFFile
from graftlm.tokenizer.bpe import PythonBPE, byte_decode, byte_encode, make_merger, parse_merges
from graftlm.tokenizer.pretok import NOT_SERVED, PRE_TOKENIZERS, PreTokenizer
from graftlm.tokenizer.spm import ESCAPED_SPACE, SPMEncoder
from graftlm.tokenizer.vocab import TokenAttr, Vocab

SUPPORTED_MODELS = ("gpt2", "llama")

_HIDDEN = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)
_VERBATIM = _HIDDEN | int(TokenAttr.USER_DEFINED)
_NORMAL = int(TokenAttr.NORMAL)
_BYTE = int(TokenAttr.BYTE)


class Tokenizer:
    """Encode and decode text exactly as llama.cpp does for the same GGUF file.

    Two model types are supported: "gpt2" (byte-level BPE with merges) and "llama"
    (SentencePiece-style BPE by score with byte fallback).
    """

    def __init__(
        self,
        vocab: Vocab,
        model: str,
        encode_text: Callable[[str], list[int]],
        *,
        clean_spaces: bool = False,
        backend: str = "python",
    ) -> None:
        """Use `from_metadata`; this assembles the parts it builds. `encode_text` turns one raw
        text fragment (special tokens already cut out) into ids."""
        self.vocab = vocab
        self.model = model  # "gpt2" or "llama", as tokenizer.ggml.model says
        self.backend = backend  # who runs the merges: "tokenizers" or "python"
        self.clean_spaces = clean_spaces  # llama.cpp's detokenizer clean-up, per pre-tokenizer
        self.n_vocab: int = vocab.n_vocab
        self.bos_id: int | None = vocab.bos_id
        self.eos_id: int | None = vocab.eos_id
        self.eot_id: int | None = vocab.eot_id
        self.eog_ids: frozenset[int] = vocab.eog_ids
        self.add_bos: bool = vocab.add_bos
        self.add_eos: bool = vocab.add_eos
        self.add_space_prefix: bool = vocab.add_space_prefix
        # gpt2 vocabularies of GPT-2 byte symbols (all but the Gemma 4 style's raw UTF-8)
        self.byte_level = model == "gpt2"
        self._encode_text = encode_text
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_file(cls, file: GGUFFile) -> Tokenizer:
        """from_metadata on a file's metadata; a malformed tokenizer (wrong value types, tables
        of different lengths, unknown token types) is a ModelFileError naming the file."""
        try:
            return cls.from_metadata(file.metadata)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ModelFileError(f"{file.path}: cannot build its tokenizer: {exc}"[:500]) from None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> python value, e.g. `{"tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [...], ...}`). Raises ValueError for tokenizer types other than
        "gpt2" and "llama", for unknown GPT-2 pre-tokenizers and for malformed vocabularies."""
        check_value_types(meta)
        model = meta.get("tokenizer.ggml.model")
        if model == "gpt2":
            return cls._from_bpe_metadata(meta)
        if model == "llama":
            return cls._from_spm_metadata(meta)
        raise ValueError(
            f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
            f"supported: {', '.join(SUPPORTED_MODELS)}"
        )

    @classmethod
    def _from_bpe_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        # without a name llama.cpp runs its "default" pre-tokenizer (and warns)
        pre = meta.get("tokenizer.ggml.pre") or "default"
        if pre in NOT_SERVED:
            raise ValueError(
                f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre) for the gpt2 tokenizer: "
                f"{NOT_SERVED[pre]}"
            )
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre) for the gpt2 tokenizer; "
                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        spec = PRE_TOKENIZERS[pre]
        merges_raw = meta.get("tokenizer.ggml.merges")
        if merges_raw is None and pre == "kimi-k2":
            merges_raw = []  # llama.cpp lets Kimi-K2 go without merges
        if merges_raw is None:
            raise ValueError("gpt2 tokenizer without tokenizer.ggml.merges")
        vocab = Vocab.from_metadata(
            meta,
            default_ids=(spec.bos_default, 11, None),
            add_bos=spec.add_bos,
            add_eos=False,
            add_space_prefix=False,
        )
        split = spec.split
        if spec.raw_utf8:
            return cls._raw_bpe(vocab, spec, parse_merges(merges_raw))
        merge_words, backend = make_merger(vocab.token_to_id, parse_merges(merges_raw))
        if spec.ignore_merges:
            merge_words = _whole_words_first(vocab.token_to_id, merge_words)

        def encode_text(text: str) -> list[int]:
            return merge_words([byte_encode(w) for w in split(text)])

        return cls(vocab, "gpt2", encode_text, clean_spaces=spec.clean_spaces, backend=backend)

    @classmethod
    def _raw_bpe(cls, vocab: Vocab, spec: PreTokenizer, merges: list[tuple[str, str]]) -> Tokenizer:
        """The Gemma 4 style BPE: the text's spaces escaped as U+2581, words of raw UTF-8."""
        bpe = PythonBPE(vocab.token_to_id, merges, raw=True)
        token_to_id = vocab.token_to_id

        def encode_text(text: str) -> list[int]:
            out: list[int] = []
            for word in spec.split(text.replace(" ", ESCAPED_SPACE)):
                tid = token_to_id.get(word) if spec.whole_newlines else None
                if tid is not None and not word.strip("\n"):
                    out.append(tid)
                else:
                    out += bpe.word_ids(word)
            return out

        tok = cls(vocab, "gpt2", encode_text, clean_spaces=spec.clean_spaces)
        tok.byte_level = False
        return tok

    @classmethod
    def _from_spm_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        vocab = Vocab.from_metadata(
            meta, default_ids=(1, 2, 0), add_bos=True, add_eos=False, add_space_prefix=True
        )
        spm = SPMEncoder(vocab.token_to_id, vocab.scores)

        def encode_text(text: str) -> list[int]:
            return spm.encode(text.replace(" ", ESCAPED_SPACE))

        return cls(vocab, "llama", encode_text)

    # -- encoding ---------------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        add_special: bool = True,
        parse_special: bool = False,
        space_prefix: bool = True,
    ) -> list[int]:
        """Token ids of `text`, as `llama_tokenize(text, add_special, parse_special)` returns them.

        `add_special` adds BOS/EOS where the model asks for them; `parse_special` lets control
        tokens written in the text (e.g. "<|im_start|>") become their ids. User-defined tokens
        are always matched. `space_prefix=False` encodes text that continues other text: no
        SentencePiece space prefix even where the vocabulary asks for one."""
        text = _valid_text(text)
        fragments = self.vocab.partition(text, parse_special)
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        spm = self.model == "llama"
        prev_special = True  # SPM's space prefix goes on text at the start or after a token
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if spm and space_prefix and self.add_space_prefix and prev_special:
                frag = " " + frag
            out += self._encode_text(frag)
            prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    # -- decoding ---------------------------------------------------------------------------------

    def token_to_piece(self, id: int, special: bool = True) -> bytes:
        """The bytes llama.cpp renders for one token (`llama_token_to_piece`): byte tokens as their
        byte, GPT-2 byte-level symbols mapped back, SentencePiece "▁" as a space, control and
        user-defined tokens as their text. With `special=False` control and unknown tokens
        render as nothing."""
        attr = self.vocab.attrs[self._check(id)]
        if not special and attr & _HIDDEN:
            return b""
        piece = self._pieces.get(id)
        if piece is None:
            piece = self._render(id, attr)
            self._pieces[id] = piece
        return piece

    def _render(self, id: int, attr: int) -> bytes:
        text = self.vocab.tokens[id]
        if attr & _VERBATIM:
            return text.encode("utf-8")
        if attr & _NORMAL:
            if self.byte_level:
                return byte_decode(text)
            return text.replace(ESCAPED_SPACE, " ").encode("utf-8")
        if attr & _BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused and undefined tokens render as nothing

    def decode_bytes(
        self, ids: Sequence[int], skip_special: bool = False, *, remove_special: bool = False
    ) -> bytes:
        """`llama_detokenize(ids, remove_special, unparse_special=not skip_special)`, as bytes
        (which may end inside a UTF-8 character)."""
        chunks: list[bytes] = []
        strip_space = self.add_space_prefix
        if remove_special:
            ids = list(ids)
            if self.add_bos and ids and ids[0] == self.bos_id:
                ids = ids[1:]
                strip_space = False  # llama.cpp keeps the space after a removed BOS
            if self.add_eos and ids and ids[-1] == self.eos_id:
                ids = ids[:-1]
        for tid in ids:
            piece = self.token_to_piece(tid, special=not skip_special)
            if strip_space and piece.startswith(b" "):
                piece = piece[1:]
            strip_space = False
            chunks.append(piece)
        data = b"".join(chunks)
        return clean_spaces(data) if self.clean_spaces else data

    def decode(
        self, ids: Sequence[int], skip_special: bool = False, *, remove_special: bool = False
    ) -> str:
        """Text of `ids` as llama.cpp's detokenizer produces it: control tokens (BOS included)
        appear as their text unless `skip_special`; invalid UTF-8 becomes U+FFFD.

        `remove_special` drops a leading BOS / trailing EOS that `encode(add_special=True)` would
        have added (llama.cpp's `remove_special`; the golden `detok` texts were made with it)."""
        data = self.decode_bytes(ids, skip_special, remove_special=remove_special)
        return data.decode("utf-8", errors="replace")

    # -- token facts ------------------------------------------------------------------------------

    def is_special(self, id: int) -> bool:
        """True for control and unknown tokens: those `decode(..., skip_special=True)` hides."""
        return bool(self.vocab.attrs[self._check(id)] & _HIDDEN)

    def token_text(self, id: int) -> str:
        """The vocabulary entry of `id`, unrendered."""
        return self.vocab.tokens[self._check(id)]

    def _check(self, id: int) -> int:
        if not 0 <= id < self.n_vocab:
            raise IndexError(f"token id {id} is outside the vocabulary (0..{self.n_vocab - 1})")
        return id

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, n_vocab={self.n_vocab}, backend={self.backend!r})"


_CLEAN_1 = re.compile(rb" (?=[?!.,])")
_CLEAN_2 = re.compile(rb" ' ")
_CLEAN_3 = re.compile(rb" '(?=[sm]|re|ve)")


def check_value_types(meta: Mapping[str, Any]) -> None:
    """ValueError naming the first tokenizer key whose value is not of the GGUF spec's type
    (found by a fuzzer: a token id stored as an array, the tokens as numbers, the pre-tokenizer
    as an array ended in Python's own words, naming no key)."""
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ValueError(f"{key} is a {type(meta[key]).__name__}, not a string")
    for key, kind in (
        ("tokenizer.ggml.tokens", str),
        ("tokenizer.ggml.merges", str),
        ("tokenizer.ggml.token_type", int),
    ):
        value = meta.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            raise ValueError(f"{key} is a {type(value).__name__}, not an array")
        if key == "tokenizer.ggml.tokens" and not value:  # (it loaded, to tokenize nothing)
            raise ValueError(f"{key} is empty")
        bad = next(
            (i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, kind)),
            None,
        )
        if bad is not None:
            raise ValueError(
                f"{key}[{bad}] is a {type(value[bad]).__name__}, not a {kind.__name__}"
            )
    for key, value in meta.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key} is a {type(value).__name__}, not a token id")


def clean_spaces(data: bytes) -> bytes:
    """llama.cpp's `clean_spaces` detokenizer pass: no space before ?!., ; " ' " -> "'" ;
    no space before 's 'm 're 've. (Its three in-place loops equal these three substitutions.)"""
    data = _CLEAN_1.sub(b"", data)
    data = _CLEAN_2.sub(b"'", data)
    return _CLEAN_3.sub(b"'", data)


def _whole_words_first(
    token_to_id: Mapping[str, int], merge_words: Callable[[list[str]], list[int]]
) -> Callable[[list[str]], list[int]]:
    """llama.cpp's `ignore_merges`: a word that is itself a vocabulary entry becomes that token
    without running the merges (which need not rebuild it); the other words merge as usual."""

    def merge(words: list[str]) -> list[int]:
        out: list[int] = []
        pending: list[str] = []
        for w in words:
            tid = token_to_id.get(w)
            if tid is None:
                pending.append(w)
                continue
            if pending:
                out += merge_words(pending)
                pending = []
            out.append(tid)
        if pending:
            out += merge_words(pending)
        return out

    return merge


def _valid_text(text: str) -> str:
    # Lone surrogates (only a Python str can hold them) have no UTF-8 form; they become U+FFFD,
    # which is what llama.cpp makes of input bytes it cannot decode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text
