"""Pre-tokenizers of `tokenizer.ggml.pre`: the name -> how llama.cpp cuts text into BPE words.

The table follows llama.cpp's name -> LLAMA_VOCAB_PRE_TYPE_* mapping (`llama_vocab::impl::load` in
`src/llama-vocab.cpp`) with each type's flags, and each type's list of regexes
(`llm_tokenizer_bpe`'s constructor), as the build in ../shared/llama.cpp has them; how a list of
regexes cuts text is `regex_split`. The GPT-2 family runs llama.cpp's hand-written GPT-2 matcher
(`bpe.split_gpt2`, optionally after the digit pass). Names llama.cpp knows whose BPE is not GPT-2's
byte-level one are in `NOT_SERVED` (refused with the reason); other unknown names are refused, as
llama.cpp refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from graftlm.tokenizer.bpe import PRE_TOKENIZERS as GPT2_PRE_TOKENIZERS
from graftlm.tokenizer.bpe import pre_tokenize
from graftlm.tokenizer.regex_split import (
    GPT2_REGEX,
    chain_splitter,
    collapse_pattern,
    collapse_text,
    regex_splitter,
)

__all__ = ["PRE_TOKENIZERS", "NOT_SERVED", "PreTokenizer", "collapse_pattern", "collapse_text"]

# llama.cpp's regexes (`llm_tokenizer_bpe` in src/llama-vocab.cpp), verbatim but for C++ string
# escapes; non-ASCII characters as \u escapes.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# o200k's upper/lower-case words, as llama.cpp rewrites them for the collapsed text
_CASED_WORDS = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
)
GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_REGEX = _CASED_WORDS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GRANITE_EMB_MULTI_REGEX = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
    + _CONTRACTIONS
    + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
    + _CONTRACTIONS
    + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SUBCLASS_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + "?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + "?"
)
YOUTU_REGEX = _SUBCLASS_WORDS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
TINY_AYA_REGEX = (
    _SUBCLASS_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
JAIS2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
    r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
QWEN35_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
BAILINGMOE_REGEX = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
UFAKZEKA_REGEX = (
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MINICPM5_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
EXAONE_MOE_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
# DeepSeek V3 / AFMoE: ASCII punctuation before a Latin word, then words that may start with a
# digit or space, punctuation-and-symbol runs
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
)
DEEPSEEK3_REGEX = _DEEPSEEK3_WORDS + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPARK2_5_REGEX = _DEEPSEEK3_WORDS + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
# the letters DeepSeek LLM's tokenizer.json lists (Latin, Greek, Cyrillic, Armenian, ...)
_DEEPSEEK_LETTERS = (
    r"A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    r"\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    r"\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    r"\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    r"\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    r"\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    r"\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    r"\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    r"\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    r"\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    r"\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    r"\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_KANA = r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
DEEPSEEK_LLM_REGEXES = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
)
DEEPSEEK_CODER_REGEXES = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
DEEPSEEK3_REGEXES = (r"\p{N}{1,3}", _CJK_KANA, DEEPSEEK3_REGEX)
SPARK2_5_REGEXES = (r"\p{N}{1,3}", _CJK_KANA, SPARK2_5_REGEX, r"\p{N}")
YOUTU_REGEXES = (
    r"[\uac00-\ud7a3\u3131-\u318e]+"
    r"|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+"
    r"|[\u3105-\u312f]+|" + _CJK_KANA,
    YOUTU_REGEX,
)
FALCON_REGEXES = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, r"[0-9][0-9][0-9]")
DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")
BLOOM_REGEX = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
CHAMELEON_REGEXES = (
    r"<sentinel:[0-9]+>",
    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    r"([\t\n]|    |  )",
    r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]",
    GPT2_REGEX,
)
TINY_AYA_REGEXES = (r"\d{1,3}(?=(?:\d{3})*\b)", TINY_AYA_REGEX)
SUPERBPE_REGEXES = (r"\p{N}+", r"(?=(\d{3})+(?!\d))")
AFMOE_REGEXES = (
    r"\p{AFMoE_digits}",
    r"[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
    r"\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
    r"\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
    DEEPSEEK3_REGEX,
)
LAGUNA_REGEXES = (r"[^\n]+|[\n]+", QWEN2_REGEX)
MINICPM5_REGEXES = (r"\p{N}{1,3}", MINICPM5_REGEX)
KIMI_K2_REGEXES = (r"\p{Han}+",)


@dataclass(frozen=True)
class PreTokenizer:
    """What a `tokenizer.ggml.pre` name sets in llama.cpp's `llama_vocab::impl::load`."""

    split: Callable[[str], list[str]]  # raw text -> words (not yet byte-encoded)
    clean_spaces: bool  # the detokenizer's clean-up pass
    ignore_merges: bool = False  # a word that is a vocabulary entry is that token, unmerged
    add_bos: bool = False  # default of tokenizer.ggml.add_bos_token
    bos_default: int | None = 11  # BOS id when tokenizer.ggml.bos_token_id is absent
    # Gemma 4 style: spaces escaped as U+2581, merges on raw UTF-8, <0xXX> byte tokens
    raw_utf8: bool = False
    whole_newlines: bool = False  # a word of newlines that is a vocabulary entry is that token


def _gpt2(split_numbers: bool, clean_spaces: bool) -> PreTokenizer:
    return PreTokenizer(lambda text: pre_tokenize(text, split_numbers), clean_spaces)


_llama3 = regex_splitter(LLAMA3_REGEX)
_qwen2 = regex_splitter(QWEN2_REGEX)
_gpt4o = regex_splitter(GPT4O_REGEX)

# name -> pre-tokenizer, following llama.cpp's name -> LLAMA_VOCAB_PRE_TYPE_* table.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    name: _gpt2(split_numbers, clean)
    for name, (split_numbers, clean) in GPT2_PRE_TOKENIZERS.items()
}
# GPT2 with add_sep (which only embeddings use)
for _name in ("jina-v1-en", "jina-v2-code", "roberta-bpe"):
    PRE_TOKENIZERS[_name] = _gpt2(False, True)
# LLAMA3: Llama 3.x, Falcon 3, Pixtral, LFM2, ...
for _name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
              "lfm2", "jina-v5-nano"):  # fmt: skip
    PRE_TOKENIZERS[_name] = PreTokenizer(_llama3, True, ignore_merges=True, add_bos=True)
# DBRX, SMAUG: the Llama 3 regex without Llama 3's flags; CHATGLM4: the same, and no default BOS
PRE_TOKENIZERS["dbrx"] = PreTokenizer(_llama3, True)
PRE_TOKENIZERS["smaug-bpe"] = PreTokenizer(_llama3, True)
PRE_TOKENIZERS["chatglm-bpe"] = PreTokenizer(_llama3, True, bos_default=None)
# GLM-4.5+ and GLM-5 files: CHATGLM4 with ignore_merges (as their tokenizer.json); the build in
# ../shared/llama.cpp takes vocabulary words whole for these two names, not for "chatglm-bpe"
for _name in ("glm4", "glm5"):
    PRE_TOKENIZERS[_name] = PreTokenizer(_llama3, True, ignore_merges=True, bos_default=None)
# QWEN2 (and STABLELM2, HUNYUAN, SOLAR_OPEN, GROK_2: the same regex): Qwen 2/2.5/3, Qwen3-MoE, ...
for _name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"):
    PRE_TOKENIZERS[_name] = PreTokenizer(_qwen2, False)
for _name in ("megrez", "stablelm2"):
    PRE_TOKENIZERS[_name] = PreTokenizer(_qwen2, True)
# GPT4O (and MINIMAX_M2): o200k's regex; gpt-oss, Llama 4, ...
for _name in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"):
    PRE_TOKENIZERS[_name] = PreTokenizer(_gpt4o, False)


def _add(names: Sequence[str], patterns: Sequence[str], clean_spaces: bool, **flags: bool) -> None:
    split = chain_splitter(patterns)
    for name in names:
        PRE_TOKENIZERS[name] = PreTokenizer(split, clean_spaces, **flags)


# DEFAULT: what llama.cpp runs for "default" and for a file without tokenizer.ggml.pre
_add(["default"], DEFAULT_REGEXES, True)
_add(["deepseek-llm"], DEEPSEEK_LLM_REGEXES, False)
_add(["deepseek-coder"], DEEPSEEK_CODER_REGEXES, False)
# DEEPSEEK3_LLM (and HUNYUAN_DENSE, JOYAI_LLM, HY_V4): DeepSeek V3/R1, Kimi-style CJK runs
_add(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], DEEPSEEK3_REGEXES, False)
_add(["spark2_5"], SPARK2_5_REGEXES, False)
_add(["youtu"], YOUTU_REGEXES, False, ignore_merges=True)
_add(["falcon"], FALCON_REGEXES, True)
_add(["jais-2"], [JAIS2_REGEX], True)
_add(["qwen35"], [QWEN35_REGEX], False)
# PORO, BLOOM, GPT3_FINNISH: one regex; VIKING adds the digit pass
_add(["poro-chat"], [BLOOM_REGEX], False)
_add(["bloom", "gpt3-finnish"], [BLOOM_REGEX], True)
_add(["viking"], [BLOOM_REGEX, r"\p{N}"], False)
# TEKKEN: Mistral Nemo, Mistral Small 3, Pixtral's tokenizer.json
_add(["tekken"], [TEKKEN_REGEX], False, ignore_merges=True, add_bos=True)
_add(["chameleon"], CHAMELEON_REGEXES, False, add_bos=True)
_add(["exaone-moe"], [EXAONE_MOE_REGEX], True)
_add(["granite-embed-multi-97m"], [GRANITE_EMB_MULTI_REGEX], False, ignore_merges=True)
_add(["tiny_aya", "cohere2moe"], TINY_AYA_REGEXES, False)
_add(["superbpe"], SUPERBPE_REGEXES, False)
_add(["bailingmoe", "bailingmoe2", "llada-moe"], [BAILINGMOE_REGEX], False)
_add(["seed-coder"], [SEED_CODER_REGEX], False)
_add(["kimi-k2"], KIMI_K2_REGEXES, False)
_add(["ufakzeka"], [UFAKZEKA_REGEX], False)
_add(["afmoe"], AFMOE_REGEXES, False)
_add(["laguna"], LAGUNA_REGEXES, False)
_add(["minicpm5"], MINICPM5_REGEXES, True, ignore_merges=True)

# GEMMA4 (and SARVAM_MOE): SentencePiece-style BPE, spaces escaped as U+2581, merges over whole
# lines of raw UTF-8; GEMMA4 takes a run of newlines that is a vocabulary entry whole, and adds
# BOS by default (llama.cpp overrides add_bos for it)
_NEWLINES = r"[^\n]+|[\n]+"
_add(["gemma4", "granite-embed-multi-311m"], [_NEWLINES], True, add_bos=True, raw_utf8=True,
     whole_newlines=True)  # fmt: skip
_add(["sarvam-moe"], [_NEWLINES], False, raw_utf8=True)

# Names llama.cpp knows that we refuse, with the reason.
NOT_SERVED: dict[str, str] = {
    "whitespace": "its BPE runs on raw UTF-8 split at whitespace, not on GPT-2 bytes",
    "mmbert": "an embedding model's tokenizer (a space prefix and a pre-split not reproduced here)",
}
