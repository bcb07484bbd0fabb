#!/usr/bin/env bash
# Several GPU benchmarks in one device call, each under its own time limit:
#   bash benchmarks/gpu_round.sh OUT_DIR STEP[:SECONDS] ...
# STEP is a module of benchmarks/ (run as `python3 -m benchmarks.STEP` with OUT=OUT_DIR/STEP, its
# output in OUT_DIR/STEP.txt) or one of:
#   kernels   the kernel tests compiled on the GPU (ARGS_kernels: test paths; default tests/ops_triton
#             tests/ops)
#   host_path benchmarks/host_path.sh; prefix_cache benchmarks/prefix_cache.sh
# A step's own flags come from ARGS_<step, dots as _> (e.g. ARGS_prefix_cache="--models demo").
# Wheels in .whl/ are installed into /tmp/site first (see benchmarks/gpu_check.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1   # a step killed by its timeout still leaves its output
cd "$(dirname "$0")/.."
OUT=$1; shift
mkdir -p "$OUT"
source benchmarks/wheels.sh
t0=$(date +%s)
for spec in "$@"; do
  step=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=240
  s0=$(date +%s)
  args_var=ARGS_${step//./_}; read -r -a args <<< "${!args_var:-}"
  case $step in
    kernels) [ ${#args[@]} -gt 0 ] || args=(tests/ops_triton tests/ops)
             DSV4_TRITON_DEVICE=cuda timeout "$limit" python3 -m pytest -q -n 14 -p no:cacheprovider \
               "${args[@]}" > "$OUT/kernels.txt" 2>&1 ;;
    host_path|prefix_cache) timeout "$limit" bash "benchmarks/$step.sh" "$OUT/$step" "${args[@]}" > "$OUT/$step.txt" 2>&1 ;;
    *) OUT=$OUT/$step timeout "$limit" python3 -m "benchmarks.$step" "${args[@]}" > "$OUT/$step.txt" 2>&1 ;;
  esac
  rc=$?
  echo "=== $step: rc $rc, $(( $(date +%s) - s0 )) s (total $(( $(date +%s) - t0 )) s)"
  tail -n 25 "$OUT/$step.txt"
done
