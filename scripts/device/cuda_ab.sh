#!/usr/bin/env bash
# A/B of a candidate ejkernel-cuda build against the carried one, ON THE DEVICE (carry: [".whl"]):
#
#   uv build --wheel --package ejkernel-cuda -o .whl/cand     # here, from the candidate's tree
#   bash scripts/device/cuda_ab.sh [--tests] [ROUNDS]          # there (ROUNDS: 2)
#   MEASURE=kernels KERNEL=flash_forward_kernel CASE=flash-shapes bash scripts/device/cuda_ab.sh --tests
#   CANDIDATES="cand cand126" bash scripts/device/cuda_ab.sh     # several candidates (.whl/<name>/, one wheel each)
#   MEASURE=paged CANDIDATES="p3 p6" bash scripts/device/cuda_ab.sh 3   # the paged kernel's mixed batch
#
# --tests: each candidate's GPU tests (TEST_PATHS, default the cuda package, dispatch, export) run first, and a
# failure stops the A/B (a wrong kernel's times mean nothing). Then ROUNDS rounds of every build (the baseline:
# the carried wheel), the order rotating by one build per round (in the paged probe's rounds on an H100 the first
# process of each round read 2-3 % faster: use a multiple of the build count), measuring by MEASURE:
# - probe (default): benchmarks/experiments/cuda_flash_probe.py (standard shapes, FA3 beside them: compare each
#   build's ratio to FA3 in its own process); $OUT/cuda-ab.jsonl, one line per measurement with build and round;
# - paged: benchmarks/experiments/cuda_paged_probe.py on the mixed batch and its parts (PARTS, default
#   mixed,decode,prefill), LAYERS (default 8) calls per executable, the default schedule; $OUT/paged-ab.jsonl;
# - kernels: Nsight Compute's durations of the kernels matching KERNEL (default flash_backward_kernel) in
#   `benchmarks/experiments/kernel_times.py --case CASE` (default flash: S = 2k causal, then 8k), in launch
#   order; $OUT/kernel-ab.txt, one line per process.
# Every process runs under a time limit (LIMIT_S, default 150 s; the tests 300 s): a candidate that hangs is
# killed and reported instead of holding the call to the device tool's limit (one hang once took a session's
# remaining device time), and no process starts that would likely end past DEADLINE_S seconds after the start
# (default 560: the device tool's 600-s call limit; the estimate is the last process's duration), so a call that
# asked for too many rounds returns what it measured instead of being cut off mid-process. Exit status: 0; 1 if
# the tests failed, a process hung or failed, or the deadline cut rounds; 2 without an installable candidate.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/cuda_ab.sh "$@"
fi
OUT=${OUT:-/tmp/out}
TESTS=0
ROUNDS=2
for argument in "$@"; do
    case $argument in
        --tests) TESTS=1 ;;
        *[!0-9]* | '') echo "arguments: [--tests] [ROUNDS, a whole number], not '$argument'" >&2; exit 2 ;;
        *) ROUNDS=$argument ;;
    esac
done
MEASURE=${MEASURE:-probe}
case $MEASURE in
    probe | paged | kernels) ;;
    *) echo "MEASURE must be probe, paged or kernels, not '$MEASURE'" >&2; exit 2 ;;
esac
KERNEL=${KERNEL:-flash_backward_kernel}
CASE=${CASE:-flash}
LIMIT_S=${LIMIT_S:-150}
DEADLINE_S=${DEADLINE_S:-560}
read -r -a CANDS <<< "${CANDIDATES:-cand}"
for name in "${CANDS[@]}"; do
    case $name in
        baseline | *[!A-Za-z0-9._-]*) echo "CANDIDATES: '$name' is not a usable name (.whl/<name>/, not 'baseline')" >&2
                                     exit 2 ;;
    esac
done
BASE_PATH=$PYTHONPATH
mkdir -p "$OUT"
for name in "${CANDS[@]}"; do
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "/tmp/site_$name" \
        .whl/"$name"/ejkernel_cuda-*.whl ||
        { echo "could not install .whl/$name/ejkernel_cuda-*.whl (pip says why above; build it here as above)" >&2
          exit 2; }
done
status=0

if [ "$TESTS" = 1 ]; then
    for name in "${CANDS[@]}"; do
        echo "$name's GPU tests $(date -u +%H:%M:%S)"
        PYTHONPATH=/tmp/site_$name:$BASE_PATH OUT=$OUT/tests-$name timeout --kill-after=10 300 \
            bash scripts/device/gpu_tests.sh \
            ${TEST_PATHS:-packages/ejkernel-cuda/tests tests/test_dispatch.py tests/test_export.py} \
            2>&1 | tail -3
        code=${PIPESTATUS[0]}
        if [ "$code" != 0 ]; then
            echo "$name's tests failed or hung (exit $code): no timing" >&2
            exit 1
        fi
    done
fi

tag_rows() {  # build round file: the JSON lines of stdin with the build and round added, appended to file
    grep '^{' | python3 -c "
import json, sys
for line in sys.stdin:
    row = json.loads(line); row.update(build=sys.argv[1], round=int(sys.argv[2])); print(json.dumps(row), flush=True)
" "$1" "$2" | tee -a "$3"
}

measure_probe() {  # build round
    timeout --kill-after=10 "$LIMIT_S" env OUT= python3 benchmarks/experiments/cuda_flash_probe.py \
        --impls ejkernel-cuda-native,flash-attn3 --reps 30 | tag_rows "$1" "$2" "$OUT/cuda-ab.jsonl"
    return "${PIPESTATUS[0]}"
}

measure_paged() {  # build round
    local share
    share=$(python3 -c 'from ejkernel_cuda.ragged_page_attention import PACKED_SHARE; print(PACKED_SHARE)') || return 1
    timeout --kill-after=10 "$LIMIT_S" env OUT= python3 benchmarks/experiments/cuda_paged_probe.py --impls cuda \
        --shares "$share" --parts "${PARTS:-mixed,decode,prefill}" --layers "${LAYERS:-8}" |
        tag_rows "$1" "$2" "$OUT/paged-ab.jsonl"
    return "${PIPESTATUS[0]}"
}

measure_kernels() {  # build round
    local csv code times
    csv=$(timeout --kill-after=10 "$LIMIT_S" ncu --clock-control none -k "regex:$KERNEL" \
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
    echo "$1 round $2: $times" | tee -a "$OUT/kernel-ab.txt"
    return "$code"
}

BUILDS=("${CANDS[@]}" baseline)
last=0
for round in $(seq "$ROUNDS"); do
    for i in "${!BUILDS[@]}"; do
        build=${BUILDS[$(((i + round - 1) % ${#BUILDS[@]}))]}
        if [ $((SECONDS + last)) -gt "$DEADLINE_S" ]; then
            echo "stopping before $build round $round: ${SECONDS} s gone, the last process took ${last} s," \
                "DEADLINE_S is $DEADLINE_S" >&2
            exit 1
        fi
        started=$SECONDS
        path=$BASE_PATH
        [ "$build" = baseline ] || path=/tmp/site_$build:$BASE_PATH
        PYTHONPATH=$path "measure_$MEASURE" "$build" "$round"
        code=$?
        last=$((SECONDS - started))
        if [ "$code" != 0 ]; then
            echo "$build round $round: exit $code (killed after ${LIMIT_S} s, or failed)" >&2
            status=1
        fi
    done
done
exit $status
