"""Tokenizer behaviour on small hand-made vocabularies: error handling, the SentencePiece merge
order, special-token partitioning, EOG detection, the GPT-2 pre-tokenizer and clean-up pass."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from graftlm.errors import RequestError
from graftlm.tokenizer import SUPPORTED_MODELS, Tokenizer
from graftlm.tokenizer.bpe import (
    PythonBPE,
    byte_encode,
    parse_merges,
    pre_tokenize,
    split_digits,
    split_gpt2,
)
from graftlm.tokenizer.spm import SPMEncoder
from graftlm.tokenizer.tokenizer import clean_spaces

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MakeTok = Callable[..., Tokenizer]
MakeMeta = Callable[..., dict[str, Any]]


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", None])
def test_unknown_model_type_is_rejected(spm_meta: MakeMeta, model: str | None) -> None:
    meta = spm_meta({"a": 0.0})
    meta["tokenizer.ggml.model"] = model
    with pytest.raises(ValueError, match=repr(model)) as info:
        Tokenizer.from_metadata(meta)
    assert all(m in str(info.value) for m in SUPPORTED_MODELS)


def test_unknown_pre_tokenizer_is_rejected(gpt2_meta: MakeMeta) -> None:
    # a name llama.cpp refuses too ("deepseek-llm", the name used here before, is served now)
    with pytest.raises(ValueError, match="'no-such-pre-tokenizer'.*smollm"):
        Tokenizer.from_metadata(gpt2_meta([], pre="no-such-pre-tokenizer"))


def test_malformed_vocabularies_are_rejected(spm_meta: MakeMeta, gpt2_meta: MakeMeta) -> None:
    meta = spm_meta({"a": 0.0})
    del meta["tokenizer.ggml.tokens"]
    with pytest.raises(ValueError, match="tokens"):
        Tokenizer.from_metadata(meta)
    with pytest.raises(ValueError, match="duplicate token"):
        Tokenizer.from_metadata(spm_meta({"a": 0.0}, extra=[("a", NORMAL)]))
    meta = gpt2_meta([])
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(ValueError, match="merges"):
        Tokenizer.from_metadata(meta)
    # Without a BOS id, llama.cpp's default for gpt2 vocabularies (11) is used.
    tok = Tokenizer.from_metadata(gpt2_meta([], add_bos_token=True))
    assert tok.bos_id == 11 and tok.encode("a")[0] == 11


# -- SentencePiece --------------------------------------------------------------------------------


def test_spm_merges_highest_score_first(make_spm: MakeTok) -> None:
    tok = make_spm(
        {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -2.0, "bc": -1.0, "abc": -5.0},
        add_space_prefix=False,
        add_bos_token=False,
    )
    ids = tok.encode("abc")
    # "bc" outscores "ab"; "a"+"bc" then merges into "abc" since "abc" is an entry.
    assert [tok.token_text(i) for i in ids] == ["abc"]
    tok = make_spm(
        {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -2.0, "bc": -1.0},
        add_space_prefix=False,
        add_bos_token=False,
    )
    assert [tok.token_text(i) for i in tok.encode("abc")] == ["a", "bc"]
    # Equal scores: the leftmost pair wins.
    tok = make_spm({"a": 0.0, "ab": -1.0, "ba": -1.0}, add_space_prefix=False, add_bos_token=False)
    assert [tok.token_text(i) for i in tok.encode("aba")] == ["ab", "a"]


def test_spm_space_prefix_byte_fallback_and_bos(make_spm: MakeTok) -> None:
    tok = make_spm({"▁": -1.0, "x": -1.0, "▁x": -0.5}, extra=[("<ctl>", CONTROL)])
    assert tok.add_bos and tok.add_space_prefix  # llama.cpp's defaults for "llama" vocabularies
    ids = tok.encode("x€")
    assert ids[0] == tok.bos_id
    assert [tok.token_text(i) for i in ids[1:]] == ["▁x", "<0xE2>", "<0x82>", "<0xAC>"]
    assert tok.decode(ids[1:]) == "x€"  # the prefix space is dropped again
    assert tok.decode(ids) == "<s> x€"
    # llama.cpp keeps the space when it removes the BOS itself (remove_special).
    assert tok.decode(ids, remove_special=True) == " x€"
    # After a special token, the next text fragment gets its own prefix space.
    ids = tok.encode("x<ctl>x", add_special=False, parse_special=True)
    assert [tok.token_text(i) for i in ids] == ["▁x", "<ctl>", "▁x"]
    assert tok.encode("", add_special=True) == [tok.bos_id]
    assert tok.encode("", add_special=False) == []


def test_spm_add_eos(make_spm: MakeTok) -> None:
    tok = make_spm({"a": 0.0}, add_eos_token=True, add_space_prefix=False)
    assert tok.encode("a") == [tok.bos_id, tok.vocab.token_to_id["a"], tok.eos_id]
    assert tok.encode("a", add_special=False) == [tok.vocab.token_to_id["a"]]


# -- special tokens ---------------------------------------------------------------------------


def test_special_partition_rules(make_spm: MakeTok) -> None:
    tok = make_spm(
        {"a": 0.0, "<": 0.0, ">": 0.0, "c": 0.0, "t": 0.0, "l": 0.0, "u": 0.0, "d": 0.0},
        extra=[("<ctl>", CONTROL), ("<u>", USER_DEFINED), ("<u><u>", USER_DEFINED)],
        add_space_prefix=False,
        add_bos_token=False,
    )
    ctl, u, uu = (tok.vocab.token_to_id[t] for t in ("<ctl>", "<u>", "<u><u>"))
    # Control tokens only with parse_special; user-defined ones always.
    assert ctl in tok.encode("a<ctl>a", parse_special=True)
    assert ctl not in tok.encode("a<ctl>a", parse_special=False)
    assert u in tok.encode("a<u>a", parse_special=False)
    # The longest special text is cut first.
    assert tok.encode("<u><u><u>") == [uu, u]
    assert tok.decode(tok.encode("a<ctl><u>a", parse_special=True)) == "a<ctl><u>a"
    assert tok.decode(tok.encode("a<ctl><u>a", parse_special=True), skip_special=True) == "a<u>a"
    assert tok.is_special(ctl) and not tok.is_special(u)


def test_eog_detection_follows_llama_cpp_text_rules(make_spm: MakeTok) -> None:
    tok = make_spm(
        {"a": 0.0},
        extra=[("<|im_end|>", NORMAL), ("<|endoftext|>", NORMAL), ("<unused9>", CONTROL)],
    )
    im_end = tok.vocab.token_to_id["<|im_end|>"]
    # Texts llama.cpp knows end a turn become EOG and control, whatever the file says.
    assert tok.eog_ids == {tok.eos_id, im_end, tok.vocab.token_to_id["<|endoftext|>"]}
    assert tok.is_special(im_end)
    assert tok.eot_id == im_end
    # gpt-oss style vocabularies: "<|end|>" is not EOG next to "<|return|>" and "<|call|>".
    tok = make_spm(
        {"a": 0.0}, extra=[("<|end|>", CONTROL), ("<|return|>", CONTROL), ("<|call|>", CONTROL)]
    )
    end = tok.vocab.token_to_id["<|end|>"]
    assert end not in tok.eog_ids and not tok.is_special(end)
    assert tok.vocab.token_to_id["<|return|>"] in tok.eog_ids


def test_unused_and_undefined_tokens_render_empty(make_spm: MakeTok) -> None:
    tok = make_spm({"a": 0.0}, extra=[("<junk>", UNUSED), ("<undef>", 0)])
    assert tok.token_to_piece(tok.vocab.token_to_id["<junk>"]) == b""
    assert tok.token_to_piece(tok.vocab.token_to_id["<undef>"]) == b""


# -- GPT-2 byte-level BPE ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, pieces",
    [
        ("Hello world", ["Hello", " world"]),
        ("a  b", ["a", " ", " b"]),
        ("a   ", ["a", "   "]),
        ("\n\n\t  x", ["\n\n\t ", " x"]),
        ("x\ny", ["x", "\n", "y"]),
        ("don't I'M it's", ["don", "'t", " I", "'", "M", " it", "'s"]),
        ("x  !!  ?", ["x", " ", " !!", " ", " ?"]),
        ("naïve café", ["naïve", " café"]),
        ("e\u0301!", ["e", "\u0301!"]),
        ("a\u00a0b", ["a", "\u00a0", "b"]),
        ("\U000e0001x", ["\U000e0001", "x"]),
        (" ", [" "]),
        ("", []),
    ],
)
def test_gpt2_pre_tokenizer(text: str, pieces: list[str]) -> None:
    assert split_gpt2([text] if text else []) == pieces


def test_digit_pass_isolates_every_number_codepoint() -> None:
    assert split_digits(["ab12 3.5x²"]) == ["ab", "1", "2", " ", "3", ".", "5", "x", "²"]
    assert split_gpt2(split_digits(["v 12"])) == ["v", " ", "1", "2"]


def test_gpt2_pre_tokenizer_agrees_with_a_regex_engine() -> None:
    """On text without llama.cpp's corner cases (unassigned codepoints), its hand-written matcher
    equals the GPT-2 regex with a trailing `\\s+` alternative, run by HF tokenizers' engine."""
    tokenizers = pytest.importorskip("tokenizers")
    pattern = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), "isolated")
    alphabet = list("ab Z9'stmdrvel \n\t\r.,!?-_()日本語éß😀\u0301\u3000\u00a0") + ["  ", "'"]
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        expected = [piece for piece, _ in split.pre_tokenize_str(text)]
        assert split_gpt2([text]) == expected, repr(text)


def test_gpt2_merges_and_decode(make_gpt2: MakeTok) -> None:
    tok = make_gpt2(["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o"])
    ids = tok.encode("hello wo")
    assert [tok.token_text(i) for i in ids] == ["hello", "Ġwo"]
    assert tok.decode(ids) == "hello wo"
    assert not tok.add_bos and tok.encode("") == []
    text = "ünï 😀\x00\x7f"
    assert tok.decode(tok.encode(text)) == text


def test_python_bpe_follows_rank_then_leftmost() -> None:
    merges = parse_merges(["a a", "aa a", "b c", "a b"])
    vocab = {t: i for i, t in enumerate(["a", "b", "c", "aa", "aaa", "bc", "ab"])}
    bpe = PythonBPE(vocab, merges)
    assert bpe.word_ids("aaaa") == [vocab["aa"], vocab["aa"]]
    assert bpe.word_ids("aaa") == [vocab["aaa"]]
    assert bpe.word_ids("abc") == [vocab["a"], vocab["bc"]]
    # A symbol outside the vocabulary falls back to one-byte entries; non-ASCII bytes vanish.
    assert bpe.word_ids("xa") == [vocab["a"]]


def _clean_spaces_reference(text: bytes) -> bytes:
    """llama.cpp's three in-place loops from `llama_vocab::impl::detokenize`, transcribed."""
    t = bytearray(text)
    total = len(t)
    n1, total = total, (1 if total else 0)
    for i in range(1, n1):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    n2, total = total, (1 if total else 0)
    i = 1
    while i < n2:
        x = t[i]
        if x == 0x27 and i + 1 < n2 and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    n3, total = total, (1 if total else 0)
    for i in range(1, n3):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n3:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif i + 2 < n3 and bytes(t[i + 1 : i + 3]) in (b"re", b"ve"):
                total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])


def test_clean_spaces_equals_llama_cpp_loops() -> None:
    rng = random.Random(7)
    alphabet = b" '.,?!smrvetdlx"
    for _ in range(3000):
        text = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        assert clean_spaces(text) == _clean_spaces_reference(text), text


def test_clean_spaces_applies_only_where_llama_cpp_does(make_gpt2: MakeTok) -> None:
    assert make_gpt2([], pre="gpt-2").decode(make_gpt2([]).encode("a , b 's")) == "a, b's"
    smol = make_gpt2([], pre="smollm")
    assert smol.decode(smol.encode("a , b 's")) == "a , b 's"


# -- real vocabularies ------------------------------------------------------------------------


@pytest.mark.real
def test_python_merges_equal_rust_merges(
    smollm2_meta: dict[str, Any], smollm2_tok: Tokenizer
) -> None:
    assert smollm2_tok.backend == "tokenizers"
    merges = parse_merges(smollm2_meta["tokenizer.ggml.merges"])
    py = PythonBPE(smollm2_tok.vocab.token_to_id, merges)
    rng = random.Random(3)
    alphabet = list("the quick brown fox jumps over lazy dog THE 0123 \n\t'.,!?éß日本語😀Ж")
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        words = [byte_encode(w) for w in pre_tokenize(text, split_numbers=True)]
        expected = [i for w in words for i in py.word_ids(w)]
        assert smollm2_tok.encode(text, add_special=False) == expected, repr(text)


@pytest.mark.real
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_build_and_encode_speed(
    request: pytest.FixtureRequest, tokenizer_for: Callable[[str], Tokenizer], model: str
) -> None:
    meta = request.getfixturevalue(f"{model}_meta")
    # (the CPU time of all the process's threads, torch's and the native kernels' too: the
    # pauses of a loaded machine do not count)
    t0 = time.process_time()
    tok = Tokenizer.from_metadata(meta)
    built = time.process_time() - t0
    text = " ".join(["The lighthouse keeper climbed 112 steps, polishing the lens (again)."] * 60)
    text += " 日本語のテキスト 😀 naïve café\n\n\tdef f(x): return x**2"
    # (the CPU time of all the process's threads, torch's and the native kernels' too: the
    # pauses of a loaded machine do not count)
    t0 = time.process_time()
    ids = tok.encode(text, parse_special=True)
    encoded = time.process_time() - t0
    assert len(ids) > 900
    # Generous bounds for a loaded 2-core machine; typical figures are 5-10x lower.
    assert built < 3.0, f"building took {built:.2f}s"
    assert encoded < 1.0, f"encoding {len(ids)} tokens took {encoded:.2f}s"


def test_spm_without_a_byte_token_refuses_the_text_in_the_users_terms() -> None:
    """A SentencePiece vocabulary without byte tokens (llama.cpp aborts on `token_to_id.at`): text
    it cannot spell is a request error naming the character and the byte, not a ValueError."""
    enc = SPMEncoder({"a": 0, "▁": 1}, [0.0, 0.0])
    assert enc.encode("a▁a") == [0, 1, 0]
    with pytest.raises(RequestError, match=r"'€' needs byte 0xE2.*no <0xE2> token"):
        enc.encode("a€")
