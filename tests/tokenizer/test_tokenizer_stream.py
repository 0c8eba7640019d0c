"""StreamDecoder: text released token by token never splits a UTF-8 character, and everything it
releases (plus `flush`) equals `Tokenizer.decode` of the same ids."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from graftlm.tokenizer import StreamDecoder, Tokenizer

MakeTok = Callable[..., Tokenizer]
USER_DEFINED = 4


def _stream(tok: Tokenizer, ids: Sequence[int], skip_special: bool = False) -> list[str]:
    dec = StreamDecoder(tok, skip_special=skip_special)
    return [dec.push(i) for i in ids] + [dec.flush()]


def _assert_whole_characters(tok: Tokenizer, ids: Sequence[int]) -> None:
    """Each push yields complete characters, never U+FFFD, and the pieces add up to decode."""
    pieces = _stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert pieces[-1] == ""  # nothing may stay held back once the text is complete
    assert "".join(pieces) == tok.decode(ids)


@pytest.mark.real
@pytest.mark.parametrize("text", ["𓀀𓀁 ꙮ", "\U0001fae8 mixed 中文 \U00020000", "𝔘𝔫𝔦 code"])
def test_gemma3_byte_fallback_characters_are_never_split(gemma3_tok: Tokenizer, text: str) -> None:
    tok = gemma3_tok
    ids = tok.encode(text, add_special=False)
    byte_ids = [i for i in ids if tok.token_text(i).startswith("<0x")]
    assert len(byte_ids) >= 3, "the text should exercise byte-fallback tokens"
    _assert_whole_characters(tok, ids)
    assert tok.decode(ids) == text
    # While a character is incomplete, pushing its bytes releases nothing.
    dec = StreamDecoder(tok)
    first = tok.encode("𓀀", add_special=False)
    assert [dec.push(i) for i in first] == ["", "", "", "𓀀"]


@pytest.mark.real
@pytest.mark.parametrize("text", ["日本語のテキストです。", "emoji 😀🎉👍🏽 and 🇫🇷", "Привет!"])
def test_smollm2_byte_level_characters_are_never_split(smollm2_tok: Tokenizer, text: str) -> None:
    tok = smollm2_tok
    ids = tok.encode(text)
    pieces = [tok.token_to_piece(i) for i in ids]
    assert any(_splits_character(p) for p in pieces), "the text should split characters"
    _assert_whole_characters(tok, ids)
    assert tok.decode(ids) == text


def _splits_character(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


@pytest.mark.real
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_random_id_streams_equal_decode(
    tokenizer_for: Callable[[str], Tokenizer], model: str
) -> None:
    tok = tokenizer_for(model)
    rng = random.Random(11)
    for _ in range(300):
        ids = [rng.randrange(tok.n_vocab) for _ in range(rng.randint(0, 16))]
        for skip in (False, True):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip), ids


def test_byte_tokens_stream(make_spm: MakeTok) -> None:
    tok = make_spm({"a": 0.0}, add_space_prefix=False, add_bos_token=False)
    byte = {b: tok.vocab.token_to_id[f"<0x{b:02X}>"] for b in range(256)}

    def ids_of(data: bytes) -> list[int]:
        return [byte[b] for b in data]

    text = "é😀中a"
    _assert_whole_characters(tok, ids_of(text.encode()))
    # Invalid input still streams to exactly what decode gives, replacement characters included.
    rng = random.Random(5)
    samples = [b"\xe2\x82a", b"\x80\x80", b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\xc0\xaf"]
    samples += [bytes(rng.randrange(256) for _ in range(rng.randint(1, 10))) for _ in range(500)]
    samples += [
        bytes(rng.choice(b"\xe2\x82\xac\xf0\x9f\x98\x80a\xc3\xa9") for _ in range(8))
        for _ in range(500)
    ]
    for data in samples:
        ids = ids_of(data)
        assert "".join(_stream(tok, ids)) == tok.decode(ids), data


def test_space_prefix_is_dropped_once(make_spm: MakeTok) -> None:
    tok = make_spm({"▁a": 0.0, "▁": 0.0, "a": 0.0})
    ids = tok.encode("a a", add_special=False)
    assert _stream(tok, ids) == ["a", " a", ""]
    dec = StreamDecoder(tok)
    assert dec.push(ids[0]) == "a"
    dec.reset()
    assert dec.push(ids[0]) == "a"


def test_clean_spaces_stream(make_gpt2: MakeTok) -> None:
    tok = make_gpt2(["Ġ ,", "Ġ '", "' s", "Ġ 's"], pre="gpt-2")
    assert tok.clean_spaces
    ids = tok.encode("a , b 's c ' d 're ")
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "a, b's c'd're "
    rng = random.Random(9)
    alphabet = [tok.vocab.token_to_id[t] for t in ("Ġ", ",", "'", "s", "r", "e", "a", "Ġ,", "Ġ'")]
    for _ in range(2000):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(0, 10))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids


def test_special_tokens_in_stream(make_spm: MakeTok) -> None:
    tok = make_spm({"a": 0.0}, extra=[("<u>", USER_DEFINED)], add_space_prefix=False)
    ids = [tok.bos_id, tok.vocab.token_to_id["a"], tok.vocab.token_to_id["<u>"]]
    assert "".join(_stream(tok, ids)) == "<s>a<u>"
    assert "".join(_stream(tok, ids, skip_special=True)) == "a<u>"
