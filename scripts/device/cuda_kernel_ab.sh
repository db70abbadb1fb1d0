#!/usr/bin/env bash
# Kernel-time A/B of a candidate ejkernel-cuda build against the carried one, ON THE DEVICE (carry: [".whl"]):
#
#   uv build --wheel --package ejkernel-cuda -o .whl/cand                   # here, from the candidate's tree
#   bash scripts/device/cuda_kernel_ab.sh [--tests] [ROUNDS]                # there (ROUNDS: 2)
#   KERNEL=flash_forward_kernel CASE=flash-shapes bash scripts/device/cuda_kernel_ab.sh
#
# --tests: the candidate's GPU tests (the cuda package, dispatch, export) run first, and a failure stops the
# A/B (a wrong kernel's times mean nothing). Then, per round, both builds under Nsight Compute
# (`benchmarks/experiments/kernel_times.py --case CASE`, default flash: S = 2k causal, then 8k; durations of the
# kernels matching KERNEL, default flash_backward_kernel, in launch order), the baseline first in odd rounds
# and second in even ones. Every process runs under a time limit (LIMIT_S, default 150 s; the tests 300 s): a
# candidate that hangs is killed and reported instead of holding the call until the device tool's limit (one
# hang once took a session's remaining device time). Writes $OUT/kernel-ab.txt: one line per process (build,
# round, microseconds). Exit status: 0, or 1 if the tests failed or a process hung.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/cuda_kernel_ab.sh "$@"
fi
OUT=${OUT:-/tmp/out}
TESTS=0
if [ "${1:-}" = "--tests" ]; then TESTS=1; shift; fi
ROUNDS=${1:-2}
KERNEL=${KERNEL:-flash_backward_kernel}
CASE=${CASE:-flash}
LIMIT_S=${LIMIT_S:-150}
CAND=/tmp/site_cand
BASE_PATH=$PYTHONPATH
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$CAND" .whl/cand/ejkernel_cuda-*.whl
status=0

if [ "$TESTS" = 1 ]; then
    echo "candidate's GPU tests $(date -u +%H:%M:%S)"
    PYTHONPATH=$CAND:$BASE_PATH OUT=$OUT/tests timeout --kill-after=10 300 bash scripts/device/gpu_tests.sh \
        packages/ejkernel-cuda/tests tests/test_dispatch.py tests/test_export.py 2>&1 | tail -3
    code=${PIPESTATUS[0]}
    if [ "$code" != 0 ]; then
        echo "the candidate's tests failed or hung (exit $code): no timing" >&2
        exit 1
    fi
fi

for round in $(seq "$ROUNDS"); do
    order="baseline candidate"
    [ $((round % 2)) = 0 ] && order="candidate baseline"
    for build in $order; do
        path=$BASE_PATH
        [ "$build" = candidate ] && path=$CAND:$BASE_PATH
        csv=$(PYTHONPATH=$path timeout --kill-after=10 "$LIMIT_S" ncu --clock-control none -k "regex:$KERNEL" \
            --metrics gpu__time_duration.sum --csv python3 benchmarks/experiments/kernel_times.py --case "$CASE" \
            2>/dev/null)
        code=$?
        times=$(echo "$csv" | python3 -c "
import csv, sys
rows = [r for r in csv.reader(sys.stdin) if len(r) > 10]
if rows:
    header = rows[0]
    name, value = header.index('Metric Name'), header.index('Metric Value')
    print(' '.join(f'{float(r[value].replace(\",\", \"\")) / 1e3:.1f}' for r in rows[1:]
                   if r[name] == 'gpu__time_duration.sum'))
")
        if [ "$code" != 0 ]; then
            times="$times (exit $code: killed after ${LIMIT_S} s or failed)"
            status=1
        fi
        echo "$build round $round: $times" | tee -a "$OUT/kernel-ab.txt"
    done
done
exit $status
