"""Token ids and detokenized text against llama.cpp's own output (build 0c1e570) for every
golden text of both real models, in all four add_special/parse_special combinations."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from graftlm.tokenizer import Tokenizer

GOLDEN = Path(__file__).resolve().parents[2] / ".." / "shared" / "golden"
MODELS = ("smollm2", "gemma3")
COMBOS = [(add, special) for add in (1, 0) for special in (1, 0)]

pytestmark = pytest.mark.real


def _cases() -> list[Any]:
    params = []
    for model in MODELS:
        path = GOLDEN / f"{model}_tokenize.json"
        if not path.exists():
            skip = pytest.mark.skip(reason=f"{path} is missing")
            params.append(pytest.param(model, None, marks=skip, id=f"{model}-missing"))
            continue
        cases = json.loads(path.read_text(encoding="utf-8"))
        params += [pytest.param(model, c, id=f"{model}-{i}") for i, c in enumerate(cases)]
    return params


CASES = _cases()


@pytest.mark.parametrize("add, special", COMBOS, ids=[f"add{a}-special{s}" for a, s in COMBOS])
@pytest.mark.parametrize("model, case", CASES)
def test_encode_matches_llama_cpp(
    tokenizer_for: Callable[[str], Tokenizer], model: str, case: Any, add: int, special: int
) -> None:
    tok = tokenizer_for(model)
    got = tok.encode(case["text"], add_special=bool(add), parse_special=bool(special))
    assert got == case[f"ids_add{add}_special{special}"]


@pytest.mark.parametrize("model, case", CASES)
def test_decode_matches_llama_cpp(
    tokenizer_for: Callable[[str], Tokenizer], model: str, case: Any
) -> None:
    tok = tokenizer_for(model)
    # The golden text was made with llama.cpp's remove_special=true, unparse_special=true.
    with_bos = case["ids_add1_special1"]
    assert tok.decode(with_bos, remove_special=True) == case["detok"]
    for key in ("ids_add0_special1", "ids_add0_special0"):
        assert tok.decode(case[key]) == case["detok"]
    # By default a BOS is rendered as its text, as with remove_special=false.
    prefix = tok.decode([tok.bos_id]) if tok.add_bos and tok.bos_id is not None else ""
    assert tok.decode(with_bos) == prefix + case["detok"]
    # Hiding control tokens drops the BOS; text that merely looks special stays.
    assert tok.decode(case["ids_add1_special0"], skip_special=True) == case["detok"]


@pytest.mark.parametrize("model", MODELS)
def test_generated_text_matches_llama_cpp(
    tokenizer_for: Callable[[str], Tokenizer], model: str
) -> None:
    """The generation goldens: prompt ids of the raw prompts, and generated ids -> text."""
    path = GOLDEN / f"{model}_generate.json"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    tok = tokenizer_for(model)
    for case in json.loads(path.read_text(encoding="utf-8"))["cases"]:
        if not case["chat"]:
            assert tok.encode(case["prompt_text"]) == case["prompt_ids"], case["name"]
        assert tok.decode(case["generated_ids"]) == case["generated_text"], case["name"]


def test_special_ids_and_eog(smollm2_tok: Tokenizer, gemma3_tok: Tokenizer) -> None:
    s = smollm2_tok
    assert (s.n_vocab, s.bos_id, s.eos_id, s.add_bos, s.add_eos) == (49152, 1, 2, False, False)
    # <|endoftext|>, <|im_end|>, and <reponame> (llama.cpp's FIM-repo rule makes it EOG)
    assert s.eog_ids == frozenset({0, 2, 4})
    assert s.is_special(1) and not s.is_special(504)
    g = gemma3_tok
    assert (g.n_vocab, g.bos_id, g.eos_id, g.add_bos, g.add_eos) == (262144, 2, 1, True, False)
    # <eos>, <end_of_turn>, and "</s>" (a user-defined token that llama.cpp's text rule turns EOG)
    assert g.eog_ids == frozenset({1, 106, 212})
    assert g.is_special(106) and g.is_special(212) and not g.is_special(108)


def test_token_to_piece(smollm2_tok: Tokenizer, gemma3_tok: Tokenizer) -> None:
    g = gemma3_tok
    assert g.token_to_piece(g.vocab.token_to_id["<0x0A>"]) == b"\n"
    assert g.token_to_piece(g.vocab.token_to_id["<0xF0>"]) == b"\xf0"
    assert g.token_to_piece(g.vocab.token_to_id["▁world"]) == b" world"
    assert g.token_to_piece(106) == b"<end_of_turn>"
    assert g.token_to_piece(106, special=False) == b""
    s = smollm2_tok
    assert s.token_to_piece(s.vocab.token_to_id["Ġworld"]) == b" world"
    assert s.token_to_piece(s.vocab.token_to_id["Ċ"]) == b"\n"
    assert s.token_to_piece(2) == b"<|im_end|>"
    with pytest.raises(IndexError):
        s.token_to_piece(s.n_vocab)
