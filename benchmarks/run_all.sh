#!/usr/bin/env bash
# Reproduces every number in benchmarks/README.md (about 6–10 minutes on a 2-core box).
# Usage: benchmarks/run_all.sh [MODEL_DIR] [all|hop|engine]
#   MODEL_DIR defaults to /tmp/raypp-bench-llama512 (written if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
RAYPP="${RAYPP:-.venv/bin/raypp}"
MODEL="${1:-/tmp/raypp-bench-llama512}"
WHAT="${2:-all}"
OUT=benchmarks
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false

# The model the performance targets are stated for: Llama, hidden 512, 8 layers, fp32, ~25 M params.
[ -f "$MODEL/config.json" ] || "$RAYPP" bench make-model --out "$MODEL" --hidden 512 --layers 8

if [ "$WHAT" != engine ]; then
  # 1. One compiled-graph hop, per transport (1x4096 and 64x4096 fp32; 1, 2, 3 stages).
  "$RAYPP" bench hop --steps 200 --warmup 20 --json "$OUT/hop.json"
fi
[ "$WHAT" = hop ] && exit 0

# 2. Pipelining: pp=2, 32 requests (32 prompt + 64 forced output tokens each), 1 vs 2 in flight.
COMMON=(--model "$MODEL" -pp 2 --dtype float32 --num-prompts 32 --input-len 32 --output-len 64)
"$RAYPP" bench throughput "${COMMON[@]}" --max-inflight 1 \
  --json "$OUT/throughput_pp2_inflight1.json" --timeline "$OUT/timeline_pp2_inflight1"
"$RAYPP" bench throughput "${COMMON[@]}" --max-inflight 2 \
  --json "$OUT/throughput_pp2_inflight2.json" --timeline "$OUT/timeline_pp2_inflight2"

# 3. Continuous batching: the same engine (pp=2, 2 in flight), one request at a time.
"$RAYPP" bench throughput "${COMMON[@]}" --max-inflight 2 --num-prompts 8 --concurrency 1 \
  --json "$OUT/throughput_pp2_one_at_a_time.json"

# 4. Run 2b with other stage-to-stage paths: Ray's shm transport instead of
#    RayPPCommunicator, and the direct control plane (no compiled graph).
RAYPP_USE_RAY_WRAPPED_PP_COMM=0 "$RAYPP" bench throughput "${COMMON[@]}" --max-inflight 2 \
  --json "$OUT/throughput_pp2_inflight2_rayshm.json"
"$RAYPP" bench throughput "${COMMON[@]}" --max-inflight 2 --control-plane direct \
  --json "$OUT/throughput_pp2_inflight2_direct.json" --timeline "$OUT/timeline_pp2_inflight2_direct"
