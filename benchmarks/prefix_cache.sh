#!/usr/bin/env bash
# Prefix caching on the H200 in one device call (fits 10 minutes with the defaults):
#   bash benchmarks/prefix_cache.sh OUT_DIR [benchmarks.prefix_cache flags...]
# 1. benchmarks.prefix_check: resend / forks / second turn on the GPU path give a cold engine's
#    greedy tokens with the expected hits (demo model, bf16);
# 2. benchmarks.prefix_cache: `dsv4 serve` + `dsv4 bench serve --dataset multiturn`, prefix caching
#    on vs off, on random:flash-slice:6 (demo tokenizer) and the demo model; table + JSON in OUT_DIR.
# The device image lacks the server's packages: fetch their wheels once, here (into .whl/, which
# .git/info/exclude ignores), then name .whl in the call's carry:
#   PYTHON=.venv/bin/python bash benchmarks/prefix_cache.sh --fetch-wheels   (any python with pip)
set -uo pipefail
cd "$(dirname "$0")/.."
SERVER_WHEELS="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pyzmq==27.3.0 msgspec==0.23.0 pydantic==2.14.4
  pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2"
if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl
  exec ${PYTHON:-python3} -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $SERVER_WHEELS
fi
OUT=${1:-${OUT:-out}}
shift || true
mkdir -p "$OUT"
source benchmarks/wheels.sh
python3 -m benchmarks.prefix_check 2>&1 | tee "$OUT/prefix_check.txt"
python3 -m benchmarks.prefix_cache --out "$OUT/prefix_cache.json" "$@" 2>&1 | tee "$OUT/prefix_cache.txt"
