#!/usr/bin/env bash
# A/B of a candidate ejkernel-cuda build against the carried one, ON THE DEVICE (carry: [".whl"]):
#
#   uv build --wheel --package ejkernel-cuda -o .whl/cand     # here, from the candidate's tree
#   bash scripts/device/cuda_ab.sh [ROUNDS] [--tests]          # there
#
# Times both libraries with benchmarks/experiments/cuda_flash_probe.py (standard shapes, FA3 beside them),
# alternating candidate and baseline ROUNDS times (default 2) so that drift hits both, the candidate first in odd
# rounds and second in even ones (in the paged probe's rounds on an H100 the first process of each round read
# 2-3 % faster: use an even count, and compare each build's ratio to FA3 in its own process); --tests then runs the
# GPU tests of the cuda package, dispatch and export against the candidate (scripts/device/gpu_tests.sh).
# Writes $OUT/cuda-ab.jsonl (one line per measurement, with the build's name and round) and gpu-tests.*.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/cuda_ab.sh "$@"
fi
OUT=${OUT:-/tmp/out}
ROUNDS=${1:-2}
CAND=/tmp/cand
rm -rf "$CAND" && mkdir -p "$CAND"
python3 -m zipfile -e .whl/cand/ejkernel_cuda-*.whl "$CAND"
LIB=$(find "$CAND" -name libejkernel_cuda.so | head -1)
for round in $(seq "$ROUNDS"); do
    order="candidate baseline"
    [ $((round % 2)) = 0 ] && order="baseline candidate"
    for build in $order; do
        args=()
        [ "$build" = candidate ] && args=(--library "$LIB")
        OUT= python3 benchmarks/experiments/cuda_flash_probe.py "${args[@]}" --impls ejkernel-cuda-native,flash-attn3 \
            --reps 30 | grep '^{' | python3 -c "
import json, sys
for line in sys.stdin:
    row = json.loads(line); row.update(build='$build', round=$round); print(json.dumps(row), flush=True)
" | tee -a "$OUT/cuda-ab.jsonl"
    done
done
if [ "${2:-}" = "--tests" ]; then
    python3 -m pip install -q --no-index --no-deps --force-reinstall --upgrade --target /tmp/site .whl/cand/ejkernel_cuda-*.whl
    bash scripts/device/gpu_tests.sh packages/ejkernel-cuda/tests tests/test_dispatch.py tests/test_export.py
fi
