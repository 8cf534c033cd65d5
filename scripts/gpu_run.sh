#!/usr/bin/env bash
# One device call (benchmarks/gpu/README.md): install the carried wheels (.whl/), run the
# CUDA tests, then the decode benchmark (python -m benchmarks.gpu.decode, run from the repo
# root) in the time left. Results go to $OUT.
#   bash scripts/gpu_run.sh [TOTAL_SECONDS=560] [PYTEST_SECONDS=200 (0: skip the tests)]
# Optional: TESTS (pytest arguments, split on spaces; default: both CUDA test modules,
# tests/test_cuda.py and tests/test_cuda_kernels.py),
# TESTS_K (a pytest -k expression, spaces allowed), SECTIONS (the benchmark's --sections;
# default: all).
# The benchmark needs ~300 s and the tests ~300 s: run them in separate calls
# (benchmark only: 575 0; tests only: a total the tests use up, e.g. 340 320).
set -u
START=$(date +%s)
TOTAL=${1:-560}
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# gpu-wheels.sh repacks Ray's wheel with zipfile, which drops these executable bits
chmod +x /tmp/site/ray/core/src/ray/gcs/gcs_server /tmp/site/ray/core/src/ray/raylet/raylet
export PYTHONPATH=/tmp/site:$PWD/src RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false
if [ "${2:-200}" -gt 0 ]; then
  # shellcheck disable=SC2086 # TESTS is a list of pytest arguments
  timeout "${2:-200}" python3 -m pytest ${TESTS:-tests/test_cuda.py tests/test_cuda_kernels.py} \
    ${TESTS_K:+-k "$TESTS_K"} -q -p no:cacheprovider -rfE 2>&1 \
    | tee "$OUT/pytest.txt" | tail -15
fi
BUDGET=$((TOTAL - 30 - $(date +%s) + START))
if [ "$BUDGET" -lt 60 ]; then
  echo "no time left for the benchmark"
  exit 0
fi
echo "benchmark budget ${BUDGET} s"
timeout $((BUDGET + 25)) python3 -m benchmarks.gpu.decode --out "$OUT" --budget-s "$BUDGET" \
  ${SECTIONS:+--sections "$SECTIONS"} > "$OUT/log.txt" 2>&1
tail -c 6000 "$OUT/log.txt"
