#!/usr/bin/env bash
# The GPU checks, in one run on a lent machine (its image has PyTorch with CUDA, pytest,
# transformers and tokenizers; nothing can be fetched there). Stage first, here:
#   bash scripts/stage_device.sh
# then run this there, carrying .device. What it prints also goes to $OUT (default ./device-out):
#   tests.log   the device tests (tests/test_device.py: CUDA against the CPU for every tiny family)
#   bench.md    graftlm bench on a random model of SmolLM2's shape, base and with a rank-8 adapter
# DEVICE=cpu runs the same steps on the CPU (to check the script itself).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .device/whl ] && ! "$PY" -c "import gguf" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1
[ -d .device/shared ] && export GRAFTLM_SHARED=$PWD/.device/shared
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
status=0
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_device.py tests/test_bench.py 2>&1 | tee "$OUT/tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
"$PY" bench/device_model.py /tmp/graftlm-synth || exit 1
M=/tmp/graftlm-synth/model.gguf
(
  set -e
  "$PY" -m graftlm bench --device "$DEVICE" -m $M -p 128 512 -n 128 -r 3 --no-llama-cpp
  "$PY" -m graftlm bench --device "$DEVICE" -m $M -p 512 -n 128 -r 3 --no-llama-cpp --lora /tmp/graftlm-synth/lora.gguf
  "$PY" -m graftlm run --device "$DEVICE" -m $M -p hello -n 16 --temp 0 --lora /tmp/graftlm-synth/lora.gguf
) 2>&1 | tee "$OUT/bench.md"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
