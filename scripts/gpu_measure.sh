#!/usr/bin/env bash
# The open issues' GPU measurements in one device call (benchmarks/gpu/README.md, "Next"),
# each under its own time limit so one slow item cannot take the others' time:
#   OUT=$OUT bash scripts/gpu_measure.sh [ITEMS=structured,mixed,mixed1,fp8]
# structured: benchmarks.gpu.structured_decode (issue 29); mixed: benchmarks.mixed_workload,
# 1B shape, pp=2 on one GPU (mixed) and pp=1 (mixed1) (issue 32); fp8: benchmarks.gpu.fp8_decode's gemm and
# kv sections (issue 34); chaos (not by default): benchmarks.chaos at pp=2 on one GPU, tiny
# Llama, 2 rounds of 2 kills under 32 streams (issue 31); prefill (not by default: run 15 measured it):
# benchmarks.gpu.pipelined_prefill at 16k and 32k tokens (issue 32); debt1b, debt8b,
# families, moe (not by default; one device call each): issue 35's targets. Each writes $OUT/<item>*.txt (its log) and its JSON.
set -u
ITEMS=${1:-structured,mixed,mixed1,fp8}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
bash scripts/gpu_run.sh 1 0 > /dev/null 2>&1  # installs the carried wheels (.whl/)
export PYTHONPATH=/tmp/site:$PWD/src RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false
nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1

item() {  # item NAME SECONDS COMMAND...: run COMMAND if NAME is in ITEMS
  local name=$1 seconds=$2
  shift 2
  case ",$ITEMS," in *",$name,"*) ;; *) return ;; esac
  echo "== $name: $*" >> "$OUT/items.txt"
  local start=$SECONDS
  timeout "$seconds" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name: rc $? in $((SECONDS - start)) s" >> "$OUT/items.txt"
}

item structured 150 python3 -m benchmarks.gpu.structured_decode --out "$OUT/structured"
item mixed 250 python3 -m benchmarks.mixed_workload --device cuda --model 1b --pp 2 \
  --chats 256 --longs 2 --long-len 8192 --reps 4 --out "$OUT/mixed_pp2.json"
item mixed1 160 python3 -m benchmarks.mixed_workload --device cuda --model 1b --pp 1 \
  --chats 256 --longs 2 --long-len 8192 --reps 4 --out "$OUT/mixed_pp1.json"
item fp8 120 python3 -m benchmarks.gpu.fp8_decode --out "$OUT/fp8" --sections gemm,kv \
  --budget-s 110
item chaos 230 bash -c "python3 -c 'from raypp.testing.tiny_model import make_tiny_model; \
make_tiny_model(\"/tmp/tiny_llama\")' && python3 -m benchmarks.chaos --model /tmp/tiny_llama -pp 2 \
--rounds 2 --engine-args '{\"device\": \"cuda\", \"workers_per_gpu\": 2}' --json $OUT/chaos.json"
# issue 35's targets (benchmarks/gpu/debt_targets.py), one call each; merge the calls' files
# here with `python -m benchmarks.gpu.debt_targets --out DIR --summarize`
item debt1b 530 python3 -m benchmarks.gpu.debt_targets --out "$OUT/debt" --budget-s 480 \
  --sections defaults_1b,async_k32,prefix
item debt8b 530 python3 -m benchmarks.gpu.debt_targets --out "$OUT/debt" --budget-s 480 \
  --sections defaults_8b
item families 530 python3 -m benchmarks.gpu.debt_targets --out "$OUT/debt" --budget-s 480 \
  --sections families
item moe 530 python3 -m benchmarks.gpu.debt_targets --out "$OUT/debt" --budget-s 480 \
  --sections moe
item prefill 90 python3 -m benchmarks.gpu.pipelined_prefill --out "$OUT/prefill" \
  --lens 16384,32768 --reps 1 --budget-s 80
cat "$OUT/items.txt"
for f in "$OUT"/*.txt; do echo "=== $f"; grep -v "leaked\|nanobind" "$f" | tail -12; done
