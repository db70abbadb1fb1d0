#!/usr/bin/env bash
# The Triton block-sparse attention and mean_pooling on the device (issue #12): their GPU tests, then the
# block-sparse benchmark (with the mean_pooling timing). ON THE DEVICE, from the repo root, after
# `bash scripts/device/prepare.sh` here (carry: [".whl"]):
#
#   bash scripts/device/blocksparse_triton.sh          # or: bash scripts/device/batch.sh blocksparse_triton
#
# Writes under $OUT/blocksparse_triton/: tests.log and tests.xml (pytest -m gpu of test_blocksparse_gpu.py and
# test_mean_pooling_gpu.py, 8 xdist workers sharing the GPU), benchmark.log and <gpu>-<date>-blocksparse.json
# / .png (benchmarks/blocksparse.py: S=16k and 8k, densities 0.1/0.25/0.5, fwd and fwd+bwd, Triton block-sparse
# vs dense Triton flash attention vs XLA block-sparse at 8k, with triton-const and the forward candidates (FWD_CANDIDATES) at 16k;
# mean_pooling Triton vs XLA GB/s). About 145 s on one
# H200, compile included: each part under its own timeout; one failing part does not stop the other. Prints
# a summary (test counts, the issue's targets MET / NOT MET, mean_pooling GB/s). Exit status 1 if a part failed.
#
# FINAL=1: no tests (gpu_tests.sh runs them), only `benchmarks/blocksparse.py --final` (S=16k, 10 %: dense
# Triton flash, the default block-sparse config forward and forward+backward, and the forward candidates of
# FWD_CANDIDATES), <= 45 s on one H200 with compiles; writes benchmark.log, JSON and PNG under $DIR.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/blocksparse_triton.sh "$@"
fi

OUT=${OUT:-/tmp/out}
DIR="$OUT/blocksparse_triton"
mkdir -p "$DIR"
unset JAX_PLATFORMS
export XLA_PYTHON_CLIENT_PREALLOCATE=false
failed=0

if [ -n "${FINAL:-}" ]; then
    start=$(date +%s)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout --kill-after=3 45 python3 benchmarks/blocksparse.py --final \
        --warmup 2 --reps 5 --calls 3 --out "$DIR" >"$DIR/benchmark.log" 2>&1
    bench_status=$?
    echo "== blocksparse_triton (FINAL) summary =="
    echo "benchmark: exit $bench_status in $(($(date +%s) - start)) s"
    grep -E "^(target|\| 16384)" "$DIR/benchmark.log" | sort -u | head -n 30
    if [ "$bench_status" -ne 0 ]; then  # cut short: the rows measured so far (also in the JSON)
        grep -F '{"seq"' "$DIR/benchmark.log" | cut -c1-220 | head -n 12
        tail -n 8 "$DIR/benchmark.log"
    fi
    exit "$bench_status"
fi

# 1. GPU tests: 8 workers, each may grow to 1/9 of the GPU's memory.
start=$(date +%s)
# (SmallTiles, the suite again with 16-row tiles, is left to gpu_tests.sh: the interpreter covers those paths.)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.11 timeout --kill-after=3 70 python3 -m pytest -m gpu -n 8 --dist load -q -rfEs \
    -p no:cacheprovider --junitxml "$DIR/tests.xml" -k "not SmallTiles" \
    packages/ejkernel-triton/tests/test_blocksparse_gpu.py packages/ejkernel-triton/tests/test_mean_pooling_gpu.py \
    >"$DIR/tests.log" 2>&1
tests_status=$?
tests_took=$(($(date +%s) - start))
[ "$tests_status" -eq 0 ] || failed=1

# 2. Benchmark, alone on the GPU (S=16k first: the targets; the JSON is rewritten after every row).
start=$(date +%s)
# XLA only at 8k (batch 1 measured it at 16k: 100-110 x slower than dense Triton flash, ~25 s of this budget).
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout --kill-after=3 64 python3 benchmarks/blocksparse.py \
    --seqs 16384 8192 --xla-max-seq 8192 --reps 5 --calls 3 --out "$DIR" >"$DIR/benchmark.log" 2>&1
bench_status=$?
bench_took=$(($(date +%s) - start))
[ "$bench_status" -eq 0 ] || failed=1

echo "== blocksparse_triton summary =="
echo "tests: exit $tests_status in ${tests_took} s: $(tail -n 1 "$DIR/tests.log")"
grep -E "^(FAILED|ERROR)" "$DIR/tests.log" | head -n 15
echo "benchmark: exit $bench_status in ${bench_took} s"
grep -E "^(target|mean_pooling|\| 16384 \| fwd)" "$DIR/benchmark.log" | sort -u | head -n 40
[ "$bench_status" -eq 0 ] || tail -n 5 "$DIR/benchmark.log"
exit "$failed"
