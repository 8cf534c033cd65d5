#!/usr/bin/env bash
# Every CUDA test module on the device machine, in one call: the kernel-level tests in
# parallel (pytest-xdist, in the background) while the engine tests (a Ray cluster and
# LLM engines, which size their KV cache from the GPU's free memory) run serially.
#   OUT=$OUT bash scripts/gpu_cuda_tests.sh [ENGINE_SECONDS=540] [MODULES...]
# MODULES default to tests/test_cuda*.py. Output: $OUT/pytest_kernels.txt,
# $OUT/pytest_engines.txt (-v, with durations), $OUT/failures.txt (each failure's traceback,
# written as it happens: kept when the timeout stops pytest), $OUT/nvidia_smi.txt,
# $OUT/commit.txt.
set -u
SECONDS_ENGINES=${1:-540}
shift || true
MODULES=("$@")
[ ${#MODULES[@]} -gt 0 ] || MODULES=(tests/test_cuda*.py)
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
bash scripts/gpu_run.sh 1 0 > /dev/null 2>&1  # installs the carried wheels (.whl/)
export PYTHONPATH=/tmp/site:$PWD/src RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false
export RAYPP_FAILURES_FILE=$OUT/failures.txt  # tracebacks as they happen (tests/conftest.py)
nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || echo "no git here" > "$OUT/commit.txt"
# engine tests: those that start LLM engines (names say what they compare against)
# ENGINE_K narrows them (a pytest -k expression over engine test names); KERNELS=0 skips
# the kernel-level tests.
ALL_ENGINES="matches_transformers or on_cuda_equals or layout_on_one_gpu or pipeline_logprobs or killed_stage"
ENGINE_K="($ALL_ENGINES) and (${ENGINE_K:-$ALL_ENGINES})"
if [ "${KERNELS:-1}" != 0 ]; then
  timeout $((SECONDS_ENGINES - 20)) python3 -m pytest -n 6 "${MODULES[@]}" -k "not ($ALL_ENGINES)" -q \
    -p no:cacheprovider -rfE --durations=15 > "$OUT/pytest_kernels.txt" 2>&1 &
fi
timeout "$SECONDS_ENGINES" python3 -m pytest "${MODULES[@]}" -k "$ENGINE_K" -v -p no:cacheprovider \
  -rfE --durations=40 > "$OUT/pytest_engines.txt" 2>&1
wait
[ -f "$OUT/pytest_kernels.txt" ] && tail -4 "$OUT/pytest_kernels.txt"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest_engines.txt" | tail -60
[ -f "$OUT/failures.txt" ] && grep -E "^=====|^E " "$OUT/failures.txt" | head -80
