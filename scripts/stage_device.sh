#!/usr/bin/env bash
# Stage, here, what a lent GPU machine needs beside the working tree, in .device/ (git-ignored,
# carried): the wheels its image lacks (gguf) and the tiny fixture models from ../shared, which
# does not travel. Then, with the device tool:
#   run(command="bash scripts/device_check.sh", carry=[".device"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >>.git/info/exclude
rm -rf .device
mkdir -p .device/whl .device/shared/fixtures
PY=${PYTHON:-python3}
GGUF=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('gguf'))" 2>/dev/null || echo 0.19.0)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .device/whl "gguf==$GGUF"
cp -r ../shared/fixtures/tiny .device/shared/fixtures/
du -sh .device
