#!/usr/bin/env python3
"""Regenerate tests/tokenizer/pretok_oracle.json: llama.cpp's ids for every pre-tokenizer name.

For each `tokenizer.ggml.pre` name (ours, the ones we refuse, and a few llama.cpp might know that we
do not), writes a one-layer random llama whose tokenizer is the test's oracle vocabulary
(`oracle_metadata` in tests/tokenizer/test_pretok_oracle.py) with that name, starts llama-server on
127.0.0.1 with it, and records `/tokenize`'s ids for every text (special tokens off) and for one
probe with special tokens on. Names llama-server refuses to load are recorded with its message.

    PYTHONPATH=src python scripts/pretok_oracle.py [--server ../shared/llama.cpp/bin/llama-server]

Takes about two minutes (one server start per name). The tests never need llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "tokenizer"), str(REPO / "tests")]  # the tests' helpers

from test_pretok_oracle import DATA, ESCAPED_SPACE, metadata_for  # noqa: E402
from test_pretokenizers import tiny_model_with_tokenizer  # noqa: E402

from graftlm.tokenizer.pretok import NOT_SERVED, PRE_TOKENIZERS  # noqa: E402

# Names llama.cpp may know that our table does not have (its binary holds them as strings), and
# one it cannot know: each is recorded as loaded or refused.
CANDIDATES = ["mmbert", "glm5", "no-such-pre-tokenizer"]

TEXTS = [
    "Hello world",
    "I'M sure it's fine, they're here, we've gone, I'm done, you'll see, he'd know, don't",
    "IT'S THEY'RE WE'VE I'M YOU'LL HE'D DON'T It'S tHeY'rE",
    "'s 't 're 've 'm 'll 'd 'x '",
    "a'b a's A'S 'S 'Ll x'll x'LL don’t",
    "1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890",
    "x1y22z333w4444v55555 a12345b 12345abc",
    "3.14159 -42 1,000,000 2024-01-15 0x1F $5.99 €100 £50 ¥1000",
    "²³ ½ ٣٤٥ ४२ ١٢٣٤٥ é123456 ab1234 日本123",
    "a  b   c    d\te\t\tf\n\ng\r\nh \r\n i\n \n j",
    "   leading spaces",
    "\n\nleading newlines",
    "trailing spaces   ",
    "trailing newline\n",
    "x  \n",
    " ",
    "\t",
    "\r\n",
    "\n\n\n",
    " " * 40 + "x" + " " * 9 + "y\t\t\t\tz",
    "!!! ??? ... --- *** ((( ))) !?!? ,,, ;;; ...\n",
    "~~~ ^^^ ||| $$$ +++ <=> `x` @@ ## %% && __ {} [] \\\\ //",
    "def f(x):\n    return x**2  # square\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
    'for (int i = 0; i < n; ++i) { a[i] += b[i]; } // "quoted"',
    "https://example.com/path/to?q=1&r=two#frag user@example.org",
    ".Net ,word !Bang (paren) 'quote 'tis -dash",
    "emoji 😀😃 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨",
    "中文测试，你好世界！日本語のテキスト。한국어 텍스트",
    "カタカナ ひらがな 漢字 ｶﾀｶﾅ 㐀䶵 豈 ㄅㄆ ㄱㄴ︰﹏",
    "ภาษาไทย ພາສາລາວ ភាសាខ្មែរ မြန်မာ ꩠꩡ",
    "العربية نص تجريبي ١٢٣",
    "हिन्दी में परीक्षण, क्षत्रिय।",
    "Русский текст, ПРИВЕТ мир Ελληνικά ΑΒΓ Հայերեն",
    "naïve café résumé Ångström ÉCOLE Éric aÉ ÀÉ São Paulo ß ẞ",
    "Mixed: English, 中文, Русский, العربية, हिन्दी, 123, émoji 😀.",
    "non\u00a0breaking\u00a0space and\u2009thin\u3000ideographic",
    "zero\u200bwidth\u200cnon\u200djoiner",
    "\u0301lone combining e\u0301 a\u0308\u0301 x\u0301y",
    "tab\tand\u000bvertical\u000cform\x1cfile\x85nel",
    "CamelCaseWord snake_case kebab-case UPPER_CASE mixedCASEWord HTTPServer",
    " ?? x\n\n\n  y  \n",
    "/path/to/file.txt\n/another/",
    "ＦＵＬＬ width ｌｅｔｔｅｒｓ １２３ ！？（）：",
    "<sentinel:5> IMGIMGABCZ IMGIMGAZ  two  spaces    four",
    "Hello , world ! it 's a ' b ' . ok ? I 've you 're",
    # Unicode 15: a mark, punctuation, symbols, letters and digits Python 3.11 does not know
    "x\u0cf3y a\U00011f43\U00011f44b \U0001fa75\U0001fa76 c\u2ffc \U00011f04\U00011f05 \U00011f51\U00011f52",
]
SPECIAL_TEXT = "Hello world"


def vocabulary_words(texts: list[str]) -> list[str]:
    """Every word any of our splitters makes of `texts`, sorted."""
    splitters = {id(spec.split): spec.split for spec in PRE_TOKENIZERS.values()}
    return sorted({w for split in splitters.values() for t in texts for w in split(t)})


def raw_vocabulary_words(texts: list[str]) -> list[str]:
    """For the Gemma 4 style vocabulary: the Llama 3 words of the texts, spaces escaped."""
    split = PRE_TOKENIZERS["llama-bpe"].split
    return sorted({w for t in texts for w in split(t.replace(" ", ESCAPED_SPACE))})


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.load(urllib.request.urlopen(req, timeout=60))


def run_server(
    server: Path, model: Path, texts: list[str]
) -> tuple[list[list[int]], list[int]] | str:
    """(ids of each text, ids of SPECIAL_TEXT with special tokens), or the error it exited with."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LD_LIBRARY_PATH": str(server.parent)}
    cmd = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", "1", "-c", "256", "-np", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    lines = [x for x in err.splitlines() if "pre-tokenizer" in x or "error" in x]
                    line = (lines or err.splitlines()[-1:] or ["exited"])[0]
                    return line[line.find("error") :][:300]
                time.sleep(0.1)
        else:
            return "did not become healthy"
        try:
            ids = [
                _post(url + "/tokenize", {"content": t, "add_special": False})["tokens"]
                for t in texts
            ]
            special = _post(url + "/tokenize", {"content": SPECIAL_TEXT, "add_special": True})
        except OSError as exc:  # it loaded the file but died tokenizing
            return f"failed to tokenize: {exc}"
        return ids, special["tokens"]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--server", type=Path, default=REPO.parent / "shared/llama.cpp/bin/llama-server"
    )
    ap.add_argument("--names", nargs="*", help="only these names (default: all)")
    args = ap.parse_args()
    names = args.names or sorted({*PRE_TOKENIZERS, *NOT_SERVED, *CANDIDATES})
    table: dict[str, int] = {}
    out: dict[str, Any] = {
        "llama_server": os.path.relpath(args.server, REPO),
        "texts": TEXTS,
        "special_text": SPECIAL_TEXT,
        "words": vocabulary_words(TEXTS),
        "raw_words": raw_vocabulary_words(TEXTS),
        "ids": [],
        "names": {},
        "refused": {},
    }

    def key(ids: list[int]) -> int:
        text = " ".join(map(str, ids))
        if text not in table:
            table[text] = len(table)
            out["ids"].append(text)
        return table[text]

    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model = Path(tmp) / "tiny.gguf"
            meta, texts = metadata_for(name, out)
            tiny_model_with_tokenizer(meta, model, meta["tokenizer.ggml.pre"], add_bos=None)
            got = run_server(args.server, model, texts)
            if isinstance(got, str):
                out["refused"][name] = got
                print(f"{name}: refused: {got}", flush=True)
                continue
            ids, special = got
            out["names"][name] = {"ids": [key(x) for x in ids], "special": key(special)}
            print(f"{name}: {sum(map(len, ids))} ids", flush=True)
    DATA.write_text(json.dumps(out, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
