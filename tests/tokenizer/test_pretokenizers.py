"""The regex pre-tokenizers (Llama 3 "llama-bpe", Qwen2 "qwen2", GPT-4o "gpt-4o", and the names
llama.cpp maps to the same regexes) against llama.cpp's own tokenizer.

The oracle is llama-server's `/tokenize` on a tiny model file that carries SmolLM2's real
byte-level BPE vocabulary with `tokenizer.ggml.pre` set to each name; ids recorded from it are
kept below as goldens, so the split is still checked where the binary is absent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from shared_data import SHARED

from graftlm.tokenizer import Tokenizer
from graftlm.tokenizer.bpe import PythonBPE, byte_encode, parse_merges
from graftlm.tokenizer.pretok import PRE_TOKENIZERS, collapse_text

LLAMA_SERVER = SHARED / "llama.cpp" / "bin" / "llama-server"

CORPUS = [
    "Hello world",
    "I'M sure it's fine, they're here, we've gone, I'm done, you'll see, he'd know, don't",
    "IT'S THEY'RE WE'VE I'M YOU'LL HE'D DON'T It'S tHeY'rE",
    "'s 't 're 've 'm 'll 'd 'x '",
    "1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890",
    "x1y22z333w4444 3.14159 -42 1,000,000 0x1F ²³ ½ ٣٤٥ ४२",
    "a  b   c    d\te\t\tf\n\ng\r\nh \r\n i\n \n j",
    "   leading spaces",
    "\n\nleading newlines",
    "trailing spaces   ",
    "trailing newline\n",
    " ",
    "\t",
    "\r\n",
    "!!! ??? ... --- *** ((( ))) !?!? ,,, ;;; ...\n",
    "def f(x):\n    return x**2  # square\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
    'for (int i = 0; i < n; ++i) { a[i] += b[i]; } // "quoted"',
    "https://example.com/path/to?q=1&r=two#frag user@example.org",
    "emoji 😀😃 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨",
    "中文测试，你好世界！日本語のテキスト。한국어 텍스트",
    "العربية نص تجريبي ١٢٣",
    "हिन्दी में परीक्षण, क्षत्रिय",
    "Русский текст, ПРИВЕТ мир",
    "naïve café résumé Ångström ÉCOLE Éric aÉ ÀÉ São Paulo ß ẞ",
    "Mixed: English, 中文, Русский, العربية, हिन्दी, 123, émoji 😀.",
    "non\u00a0breaking\u00a0space and\u2009thin\u3000ideographic",
    "zero\u200bwidth\u200cnon\u200djoiner",
    "\u0301lone combining e\u0301 a\u0308\u0301",
    "tab\tand\u000bvertical\u000cform\x1cfile\x85nel",
    "CamelCaseWord snake_case kebab-case UPPER_CASE mixedCASEWord",
    "a'b a's A'S 'S 'Ll x'll x'LL don’t",
    " ?? x\n\n\n  y  \n",
    "/path/to/file.txt\n/another/",
    "€100 £50 ¥1000 $5.99",
    "ＦＵＬＬ width ｌｅｔｔｅｒｓ １２３",
]

# tokenizer.ggml.pre names whose ids llama-server gives below (the names the binary here knows
# of each regex family; the others have the same splitter in the table)
ORACLE_NAMES = ["llama-bpe", "qwen2", "gpt-4o", "smaug-bpe", "falcon3", "pixtral", "megrez",
                "llama4", "stablelm2", "dbrx", "minimax-m2"]  # fmt: skip


# llama-server's words (its ids on the vocabulary below, as text) for a few corpus strings:
# the split is checked without the binary or SmolLM2's file.
GOLDEN_SPLITS: dict[str, dict[str, list[str]]] = json.loads(
    (Path(__file__).parent / "pretok_golden.json").read_text(encoding="utf-8")
)


@pytest.mark.parametrize("pre", sorted(GOLDEN_SPLITS))
def test_splits_equal_recorded_llama_server_words(pre: str) -> None:
    for text, words in GOLDEN_SPLITS[pre].items():
        assert PRE_TOKENIZERS[pre].split(text) == words, repr(text)


def discriminating(meta: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """`meta`'s vocabulary plus, for every word any pre-tokenizer family makes of `texts`, a
    chain of lowest-rank merges that joins the word's tokens into one. SmolLM2's own vocabulary
    was trained on GPT-2's split and holds no token across its boundaries, so most other splits
    would give it the same ids; with these entries a word boundary in another place shows."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    merges = list(meta["tokenizer.ggml.merges"])
    token_to_id = {t: i for i, t in enumerate(tokens)}
    bpe = PythonBPE(token_to_id, parse_merges(merges))
    seen = set(merges)
    families = ("smollm", "gpt-2", "llama-bpe", "qwen2", "gpt-4o")
    words = sorted({w for f in families for t in texts for w in PRE_TOKENIZERS[f].split(t)})
    for word in words:
        parts = [tokens[i] for i in bpe.word_ids(byte_encode(word))]
        left = parts[0]
        for right in parts[1:]:
            merge = f"{left} {right}"
            left += right
            if merge not in seen:
                seen.add(merge)
                merges.append(merge)
            if left not in token_to_id:
                token_to_id[left] = len(tokens)
                tokens.append(left)
                types.append(1)
    return {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges}  # fmt: skip


def tiny_model_with_tokenizer(
    meta: dict[str, Any], dst: Path, pre: str, add_bos: bool | None = False
) -> Path:
    """A one-layer random llama with `meta`'s tokenizer, `tokenizer.ggml.pre` = pre, and
    `tokenizer.ggml.add_bos_token` = add_bos (None: not written, so the name's default shows;
    scripts/pretok_oracle.py writes its models so)."""
    n_vocab = len(meta["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(dst), "llama")
    d, n_head, n_ff = 32, 2, 64
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(d // n_head)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    rng = np.random.default_rng(0)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (0.02 * rng.standard_normal(shape)).astype(np.float32))

    t("token_embd.weight", n_vocab, d)
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        w.add_tensor(f"{name}.weight", np.ones(d, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        t(f"blk.0.{name}.weight", d, d)
    t("blk.0.ffn_gate.weight", n_ff, d)
    t("blk.0.ffn_up.weight", n_ff, d)
    t("blk.0.ffn_down.weight", d, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


class _LlamaServer:
    def __init__(self, model: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "LD_LIBRARY_PATH": str(LLAMA_SERVER.parent)}
        cmd = [str(LLAMA_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "-t", "1", "-c", "256", "-np", "1"]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None:
                    err = (
                        self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    )
                    raise RuntimeError(
                        f"llama-server exited with {self.proc.returncode}: {err[-800:]}"
                    ) from None
                time.sleep(0.1)
        raise RuntimeError("llama-server did not become healthy")

    def tokenize(self, text: str) -> list[int]:
        body = json.dumps({"content": text, "add_special": False}).encode()
        req = urllib.request.Request(
            self.url + "/tokenize", body, {"Content-Type": "application/json"}
        )
        ids: list[int] = json.load(urllib.request.urlopen(req, timeout=60))["tokens"]
        return ids

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _with_pre(meta: dict[str, Any], pre: str) -> dict[str, Any]:
    return {**meta, "tokenizer.ggml.pre": pre}


@pytest.fixture(scope="module")
def oracle_meta(smollm2_meta: dict[str, Any]) -> dict[str, Any]:
    return discriminating(smollm2_meta, CORPUS)


@pytest.mark.parametrize("pre", ORACLE_NAMES)
def test_ids_equal_llama_servers(pre: str, oracle_meta: dict[str, Any], tmp_path: Path) -> None:
    """Every corpus string: graftlm's ids equal llama-server's for the same vocabulary."""
    if not LLAMA_SERVER.exists():
        pytest.skip(f"{LLAMA_SERVER} is not here")
    model = tiny_model_with_tokenizer(oracle_meta, tmp_path / f"tiny-{pre}.gguf", pre)
    tok = Tokenizer.from_metadata(_with_pre(oracle_meta, pre))
    server = _LlamaServer(model)
    try:
        bad = []
        for text in CORPUS:
            want = server.tokenize(text)
            got = tok.encode(text, add_special=False)
            if got != want:
                bad.append((text, got, want))
    finally:
        server.close()
    assert not bad, f"{pre}: {len(bad)}/{len(CORPUS)} strings differ, first: {bad[0]!r}"


def test_collapse_text_classes() -> None:
    assert collapse_text("aé1٣ \u00a0!\u0301😀") == "a\xd21\xd1 \x0b!\xd0\xd0"


def test_names_map_as_llama_cpp_maps_them() -> None:
    """Each name's splitter and flags, as `llama_vocab::impl::load` sets them."""
    splitter = {pre: PRE_TOKENIZERS[pre].split for pre in ("llama-bpe", "qwen2", "gpt-4o")}
    families = {
        "llama-bpe": ["llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                      "jina-v5-nano", "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"],
        "qwen2": ["deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                  "solar-open", "grok-2"],
        "gpt-4o": ["llama4", "kanana2", "talkie", "minimax-m2"],
    }  # fmt: skip
    for family, names in families.items():
        for name in names:
            assert PRE_TOKENIZERS[name].split is splitter[family], name
    llama3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
              "lfm2", "jina-v5-nano"}  # fmt: skip
    clean = llama3 | {"dbrx", "smaug-bpe", "glm4", "chatglm-bpe", "megrez", "stablelm2"}
    # GLM's "glm4" also takes vocabulary words whole in the llama.cpp build we compare against
    ignores_merges = llama3 | {"glm4"}
    for name in (*splitter, *(n for names in families.values() for n in names)):
        spec = PRE_TOKENIZERS[name]
        assert spec.add_bos == (name in llama3), name
        assert spec.ignore_merges == (name in ignores_merges), name
        assert spec.clean_spaces == (name in clean), name
        assert spec.bos_default == (None if name in ("glm4", "chatglm-bpe") else 11), name


def test_llama3_takes_a_vocabulary_word_whole(make_gpt2: Any) -> None:
    """ignore_merges: "hello" is an entry no merge builds; Llama 3 takes it whole, Qwen2 not."""
    extra = [("hello", 1)]
    llama3 = make_gpt2(["h e", "l l"], extra=extra, pre="llama-bpe")
    qwen2 = make_gpt2(["h e", "l l"], extra=extra, pre="qwen2")
    assert [llama3.token_text(i) for i in llama3.encode("hello", add_special=False)] == ["hello"]
    assert [qwen2.token_text(i) for i in qwen2.encode("hello")] == ["he", "ll", "o"]
    assert llama3.add_bos and llama3.encode("hello")[0] == llama3.bos_id
    assert not qwen2.add_bos
