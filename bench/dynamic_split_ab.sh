#!/bin/bash
# (GRAFTLM_DYNAMIC: csrc/graftlm.h share_take). 2 threads: wall ms/step; 1 thread: CPU ms/step (--cpu).
# ROUNDS=6 PY=.venv/bin/python bench/dynamic_split_ab.sh DIR/llama-1b-q4_k_m.gguf DIR/qwen3-30b-a3b-6l-q4_k_m.gguf
# (the files from bench/real_shapes.py)
# alternated A/B of GRAFTLM_DYNAMIC=0 / =1, rounds of every config; one line a run
[ $# = 2 ] || { echo "usage: $0 DENSE.gguf MOE.gguf" >&2; exit 2; }
L=$(realpath "$1"); Q=$(realpath "$2")
cd "$(dirname "$0")/.."
for r in $(seq ${ROUNDS:-6}); do
  if [ $((r % 2)) = 1 ]; then order="0 1"; else order="1 0"; fi
  for cfg in "llama 2" "moe 2" "llama 1" "moe 1"; do
    set -- $cfg; m=$L; [ $1 = moe ] && m=$Q
    for d in $order; do
      out=$(GRAFTLM_DYNAMIC=$d PYTHONPATH=src ${PY:-.venv/bin/python} bench/decode_step.py 1 --model $m --steps 12 --threads $2 --cpu 2>&1 | grep "rows")
      echo "round=$r model=$1 threads=$2 dynamic=$d $out"
    done
  done
done
