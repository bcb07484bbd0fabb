#!/usr/bin/env bash
# One device call after a change to the cache, addressing or kernels (fits 10 minutes):
#   bash benchmarks/gpu_check.sh OUT_DIR
# 1. every kernel test compiled on the GPU (tests/ops_triton, tests/ops);
# 2. the attention and indexer microbenchmarks (paged rows against dense tables: same output,
#    timings side by side);
# 3. the GPU suite without its kernel scripts: oracle, greedy identity fast vs reference path,
#    batch-1 / batch-64 decode and prefill timings beside the roofline, dsv4 vs transformers.
# Wheels in .whl/ (transformers >= 5.23 for the oracle) are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-out}}
mkdir -p "$OUT"
source benchmarks/wheels.sh
t0=$(date +%s)
DSV4_TRITON_DEVICE=cuda python3 -m pytest -q -n 14 -p no:cacheprovider tests/ops_triton tests/ops \
  > "$OUT/pytest_ops_cuda.txt" 2>&1
echo "kernel tests (rc $?, $(( $(date +%s) - t0 )) s): $(tail -n 1 "$OUT/pytest_ops_cuda.txt")"
for k in attention indexer; do
  python3 -m benchmarks.kernels.$k > "$OUT/kernels-$k.txt" 2>&1
  echo "kernels.$k rc $? ($(( $(date +%s) - t0 )) s)"
done
python3 -m benchmarks.gpu_suite --out "$OUT" --budget-s "${BUDGET_S:-200}" --skip-kernels 2>&1 | tee "$OUT/suite-log.txt"
