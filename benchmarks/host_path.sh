#!/usr/bin/env bash
# The host path on the H200 in one device call (about 3 minutes):
#   bash benchmarks/host_path.sh OUT_DIR [benchmarks.host_path flags...]
# The server's wheels travel in .whl/ (fetch them as benchmarks/prefix_cache.sh says, then name
# .whl in the call's carry). Prints the table against the targets; JSON in OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-out}}
shift || true
mkdir -p "$OUT"
source benchmarks/wheels.sh
python3 -m benchmarks.host_path --out "$OUT/host_path.json" "$@" 2>&1 | tee "$OUT/host_path.txt"
