#!/usr/bin/env bash
# The GPU suite in one command (fits one device call, < 10 minutes):
#   bash benchmarks/gpu_suite.sh OUT_DIR [--skip-kernels | --quick]
# Needs transformers>=5.23 for the oracle and the baseline: wheels in .whl/ are installed
# into /tmp/site first when present (the GPU machine has no registry).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-out}}
source benchmarks/wheels.sh
python3 -m benchmarks.gpu_suite --out "$OUT" --budget-s "${BUDGET_S:-480}" "${@:2}"   # e.g. --skip-kernels
