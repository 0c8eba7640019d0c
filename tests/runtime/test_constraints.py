"""Constrained decoding and logit bias: the sampler's mask and bias, the compile cache, and whole
generations on a tiny random model (whose unconstrained output is noise, so every valid answer is
the grammar's doing) and on SmolLM2 with sampling on."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import pytest
import torch

import graftlm
from graftlm.errors import RequestError
from graftlm.runtime.constraints import Constraint, ConstraintError
from graftlm.runtime.sampling import Sampler, SamplingError, SamplingParams
from graftlm.runtime.scheduler import Request

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tiny_llama: Path) -> graftlm.Model:
    return graftlm.load(tiny_llama, ctx_size=512)


# -- logit bias in the sampler --
def test_logit_bias_minus_100_bans_and_plus_100_forces() -> None:
    logits = torch.tensor([0.0, 50.0, 1.0, 2.0])
    banned = Sampler(SamplingParams(temperature=0, logit_bias=((1, -100),)))
    assert banned(logits) == 3
    forced = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias=((2, 100),)))
    assert {forced(logits) for _ in range(50)} == {2}
    assert logits.tolist() == [0.0, 50.0, 1.0, 2.0]  # the engine's row is untouched


@pytest.mark.parametrize("bias", [((1, 101.0),), ((1, math.nan),), (("x", 1.0),), ((-1, 1.0),)])
def test_sampling_params_refuse_a_bad_logit_bias(bias: tuple) -> None:
    with pytest.raises(SamplingError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_shapes(tiny: graftlm.Model) -> None:
    """OpenAI's {"id": bias}, llama-server's [[id, bias]], [["text", bias]] and false (a ban)."""
    p = tiny.prompter
    assert p.logit_bias({"5": 3.5, "7": -100}) == ((5, 3.5), (7, -100.0))
    assert p.logit_bias([[5, 1], [6, False]]) == ((5, 1.0), (6, -math.inf))
    the = p.tokenize(" the", add_special=False)
    assert p.logit_bias([[" the", -2]]) == tuple((t, -2.0) for t in the)
    for bad, words in [
        ({"99999": 1.0}, "outside the vocabulary"),
        ({"5": 1e9}, "[-100, 100]"),
        ({"5": math.inf}, "finite"),
        ({"5": "high"}, "number"),
        ([[5]], "pair"),
        ("5", "object"),
    ]:
        with pytest.raises(RequestError, match=re.escape(words)):
            p.logit_bias(bad)


def _greedy(m: graftlm.Model, n: int, bias: tuple = ()) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logit_bias=bias)
    req = m.engine.submit(Request(m.prompter.prompt_ids("the"), params))
    m.engine.run(req)
    return req.generated


def test_generate_logit_bias(tiny: graftlm.Model) -> None:
    free = _greedy(tiny, 6)
    banned = set(free)
    out = _greedy(tiny, 6, tuple((t, -100.0) for t in banned))
    assert not banned & set(out)
    forced = tiny.generate(
        "the", max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, logit_bias={"70": 100}
    )
    assert forced == tiny.detokenize([70] * 5)


# -- the compiler --
def test_compile_cache_and_errors(tiny: graftlm.Model) -> None:
    cc = tiny.prompter.constraints
    c = Constraint.json_schema(PERSON)
    g1 = tiny.prompter.compile(c)
    hits = cc.hits
    g2 = tiny.prompter.compile(Constraint.json_schema(json.loads(json.dumps(PERSON))))
    assert g2 is g1 and cc.hits == hits + 1
    for bad, words in [
        (Constraint("regex", "(ab", "guided_regex"), "guided_regex"),
        (Constraint("gbnf", "root ::= missing", "grammar"), "missing"),
        (Constraint("json_schema", '{"type": "nope"}', "response_format.json_schema"), "nope"),
        (Constraint("json_schema", "{not json", "guided_json"), "guided_json"),
    ]:
        with pytest.raises(ConstraintError, match=re.escape(words)):
            tiny.prompter.compile(bad)


# -- whole generations on noise --
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_model_follows_a_json_schema(tiny: graftlm.Model, seed: int) -> None:
    out = tiny.generate("the", max_tokens=400, temperature=1.0, seed=seed, json_schema=PERSON)
    jsonschema.validate(json.loads(str(out)), PERSON)


def test_tiny_model_follows_regex_choice_and_gbnf(tiny: graftlm.Model) -> None:
    out = tiny.generate("the", max_tokens=40, temperature=1.0, seed=1, regex=r"[0-9]{3}-[a-z]{2,4}")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", str(out)), out
    for seed in range(4):
        out = tiny.generate(
            "the", max_tokens=40, temperature=1.0, seed=seed, choice=["yes", "no", "a.b"]
        )
        assert out in ("yes", "no", "a.b")
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    out = tiny.generate("the", max_tokens=60, temperature=1.0, seed=5, grammar=gbnf)
    assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", str(out)), out


def test_forced_text_on_a_vocabulary_with_a_space_prefix(tiny_gemma3: Path) -> None:
    """SentencePiece vocabularies that prefix a space (Llama 2, Mistral, gpt-oss's tiny reference):
    the grammar's literal text is encoded as text that continues the answer, without the prefix,
    or llguidance refuses its own forced tokens ("token ' ' doesn't satisfy the grammar")."""
    m = graftlm.load(tiny_gemma3, ctx_size=256)
    m.tokenizer.add_space_prefix = True
    for seed in range(3):
        out = m.generate("the", max_tokens=20, temperature=1.0, seed=seed, choice=["yes", "a.b"])
        assert out in ("yes", "a.b")
    out = m.generate("the", max_tokens=20, temperature=1.0, seed=0, regex=r"the [0-9]{2}")
    assert re.fullmatch(r"the [0-9]{2}", str(out)), out


def test_unconstrained_text_is_unchanged_by_the_machinery(tiny: graftlm.Model) -> None:
    a = tiny.generate("the", max_tokens=12, temperature=0, ignore_eos=True)
    b = tiny.generate("the", max_tokens=12, temperature=0, ignore_eos=True, logit_bias={})
    assert a == b


def test_one_constraint_at_a_time(tiny: graftlm.Model) -> None:
    with pytest.raises(graftlm.GraftError, match="at most one"):
        tiny.generate("the", regex="a", choice=["a"])


# -- the real model, sampling on --
@pytest.mark.real
def test_smollm2_json_schema_valid_with_sampling(smollm2_file: Path) -> None:
    m = graftlm.load(smollm2_file, ctx_size=1024)
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in range(5):
        out = m.chat(msgs, max_tokens=200, temperature=0.9, seed=seed, json_schema=PERSON)
        jsonschema.validate(json.loads(str(out)), PERSON)


def test_compile_errors_are_in_the_users_terms(tiny: graftlm.Model) -> None:
    """A choice list past the limit is named; the compiler's panics (100,000 choices made one,
    with a backtrace in the 400) say what they mean, without internals."""
    from graftlm.runtime.constraints import MAX_CHOICES, _users_terms

    with pytest.raises(ConstraintError, match=f"{MAX_CHOICES + 1} choices, more than"):
        Constraint.choice([f"w{i}" for i in range(MAX_CHOICES + 1)], "guided_choice")
    tiny.prompter.compile(Constraint.choice([f"w{i}" for i in range(MAX_CHOICES)]))
    panic = (
        "panic: assertion failed: grammar.symbols.len() < u16::MAX\n<backtrace>\n   0: <unknown>"
    )
    assert _users_terms(panic) == "the grammar is too large or malformed for the grammar compiler"
    assert _users_terms("x" * 1000).endswith("...") and len(_users_terms("x" * 1000)) == 303
    assert _users_terms("Rule 'x' not found") == "Rule 'x' not found"
