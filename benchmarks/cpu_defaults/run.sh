#!/usr/bin/env bash
# Issue 21's CPU measurements with the engine's defaults, one run on a quiet 2-core VM.
# Usage: bash benchmarks/cpu_defaults/run.sh OUT_DIR   (needs `raypp` on PATH)
set -euo pipefail
out=${1:?output directory}
mkdir -p "$out"
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
smol=$(raypp fetch demo)               # SmolLM2-135M-Instruct GGUF, cached
raypp bench make-model --out /tmp/raypp-cpu-llama512 >/dev/null   # 25 M parameters, fp32
for i in 1 2 3; do  # 1-stage batch-1 decode against transformers' generate
  raypp bench throughput --model "$smol" --num-prompts 1 --input-len 32 --output-len 128 \
    --compare-hf --json "$out/smol_b1_run$i.json"
done
raypp bench throughput --model "$smol" --num-prompts 16 --input-len 64 --output-len 32 \
  --compare-hf --json "$out/smol_16prompts.json"
for i in 1 2; do  # pp = 2: micro-batches in flight
  for inflight in 1 2 3; do
    raypp bench throughput --model /tmp/raypp-cpu-llama512 -pp 2 --dtype float32 \
      --num-prompts 64 --input-len 32 --output-len 64 --max-inflight $inflight \
      --json "$out/pp2_n64_inflight${inflight}_run$i.json"
  done
done
