#!/usr/bin/env bash
# The Pallas (Triton-lowered) block-sparse attention on the device (issue #17): its GPU tests, then the
# benchmark against our dense flash attention. ON THE DEVICE, from the repo root, after
# `bash scripts/device/prepare.sh` here (carry: [".whl"]):
#
#   bash scripts/device/blocksparse_pallas.sh          # or: bash scripts/device/batch.sh blocksparse_pallas
#
# Writes under $OUT/blocksparse_pallas/: tests.log and tests.xml (pytest -m gpu of
# packages/ejkernel-pallas/tests/test_blocksparse_attention_gpu.py: the shared block-sparse suite at 16 x 16
# mask blocks, 4 xdist workers sharing the GPU), benchmark.log, <gpu>-<date>-blocksparse-pallas.json and .png
# (benchmarks/blocksparse_pallas.py: S=16k, 10 % block density, fwd and fwd+bwd, pallas and triton
# block-sparse vs pallas and triton dense flash attention; numerics against XLA f32 at S=2048). About
# 120 s on one H200, compile included: each part under its own timeout; one failing part does not stop
# the other. Prints a summary (test counts, the target line MET / NOT MET). Exit status 1 if a part failed.
#
# FINAL=1: no tests (gpu_tests.sh runs them), only `benchmarks/blocksparse_pallas.py --final` (S=16k, 10 %:
# pallas block-sparse with its default config and dense Triton flash, fwd and fwd+bwd; no numerics),
# <= 25 s on one H200 with compiles; writes benchmark.log, JSON and PNG under $DIR.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/blocksparse_pallas.sh "$@"
fi

OUT=${OUT:-/tmp/out}
DIR="$OUT/blocksparse_pallas"
mkdir -p "$DIR"
unset JAX_PLATFORMS
export XLA_PYTHON_CLIENT_PREALLOCATE=false
failed=0

if [ -n "${FINAL:-}" ]; then
    start=$(date +%s)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout --kill-after=3 25 python3 benchmarks/blocksparse_pallas.py --final \
        --seq 16384 --density 0.1 --reps 5 --calls 3 --out "$DIR" >"$DIR/benchmark.log" 2>&1
    bench_status=$?
    echo "== blocksparse_pallas (FINAL) summary =="
    echo "benchmark: exit $bench_status in $(($(date +%s) - start)) s"
    grep -E "^(target|\| fwd)" "$DIR/benchmark.log" | head -n 12
    if [ "$bench_status" -ne 0 ]; then  # cut short: the rows measured so far (also in the JSON)
        grep -F '{"kind"' "$DIR/benchmark.log" | cut -c1-220 | head -n 12
        tail -n 8 "$DIR/benchmark.log"
    fi
    exit "$bench_status"
fi

# 1. GPU tests: 4 workers, each may grow to 1/5 of the GPU's memory.
start=$(date +%s)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout --kill-after=5 150 python3 -m pytest -m gpu -n 4 --dist load -q -rfEs \
    -p no:cacheprovider --junitxml "$DIR/tests.xml" \
    packages/ejkernel-pallas/tests/test_blocksparse_attention_gpu.py >"$DIR/tests.log" 2>&1
tests_status=$?
tests_took=$(($(date +%s) - start))
[ "$tests_status" -eq 0 ] || failed=1

# 2. Benchmark, alone on the GPU (the JSON is rewritten after every row).
start=$(date +%s)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout --kill-after=5 85 python3 benchmarks/blocksparse_pallas.py \
    --seq 16384 --density 0.1 --reps 5 --calls 3 --out "$DIR" >"$DIR/benchmark.log" 2>&1
bench_status=$?
bench_took=$(($(date +%s) - start))
[ "$bench_status" -eq 0 ] || failed=1

echo "== blocksparse_pallas summary =="
echo "tests: exit $tests_status in ${tests_took} s: $(tail -n 1 "$DIR/tests.log")"
grep -E "^(FAILED|ERROR)" "$DIR/tests.log" | head -n 15
echo "benchmark: exit $bench_status in ${bench_took} s"
grep -E "^(target|numerics|\| fwd)" "$DIR/benchmark.log" | head -n 20
[ "$bench_status" -eq 0 ] || tail -n 8 "$DIR/benchmark.log"
exit "$failed"
