#!/usr/bin/env bash
# The Triton serving kernels on the device (issue #11): page_attention, ragged_decode_attention and
# ragged_page_attention. Their GPU tests, then benchmarks/decode.py. ON THE DEVICE, from the repo root, after
# `EXTRA_WHEELS="flash-attn3-jax==0.2.3" bash scripts/device/prepare.sh` here (carry: [".whl"]):
#
#   bash scripts/device/serving.sh          # or: bash scripts/device/batch.sh serving
#   FINAL=1 bash scripts/device/serving.sh  # the short final run: no tests (gpu_tests.sh runs them), <= 60 s
#
# Writes under $OUT/serving/:
# - default: tests.log and tests.xml (pytest -m gpu of test_decode_gpu.py and test_ragged_page_attention_gpu.py,
#   8 xdist workers sharing the GPU), benchmark.log and <gpu>-<date>-decode.json / .png (benchmarks/decode.py:
#   the mixed batch of 4 prefill chunks of 512 + 60 decode rows over 4k contexts with the Triton schedule
#   candidates and its parts alone; every implementation's default at SERVING_SHAPES, pages of 16 and 64: ours
#   vs flash-attn3-jax paged vs JAX Pallas gqa; last the decode schedule sweep at 32x4096). About 145 s.
# - FINAL=1: benchmark.log, JSON, PNG only (benchmarks/decode.py --final): the defaults of triton paged p16/p64,
#   triton ragged decode, flash-attn3 paged p16/p64, Pallas gqa (and cuDNN at 32x4096) at 8x4096, 32x4096,
#   64x4096, 32x1024; then the mixed batch (pages of 64: the default = fused-m64, fused-m64-n32-mix,
#   fused-m64-mix, fused-m64-n32; pages of 16: the default, fused-m64-n32-mix); then the heuristic's few open
#   questions (final_sweep_configs; pages of 16 and ragged: B=64 the former default (paged only), B=8 8 narrow /
#   16 wide splits, 32x1024 2 narrow splits). The JSON is rewritten after every row: a run cut off by the 57 s
#   limit keeps what it measured, in that order.
# Each part under its own timeout; one failing part does not stop the other. Prints a summary. Exit status 1 if a
# part failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/serving.sh "$@"
fi

OUT=${OUT:-/tmp/out}
DIR="$OUT/serving"
mkdir -p "$DIR"
unset JAX_PLATFORMS
export XLA_PYTHON_CLIENT_PREALLOCATE=false
failed=0
tests_status=skipped
tests_took=0

# 1. GPU tests: 8 workers, each may grow to 1/9 of the GPU's memory (skipped in the final run: gpu_tests.sh).
if [ -z "${FINAL:-}" ]; then
    start=$(date +%s)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.11 timeout --kill-after=5 50 python3 -m pytest -m gpu -n 8 --dist load -q -rfEs \
        -p no:cacheprovider --junitxml "$DIR/tests.xml" \
        packages/ejkernel-triton/tests/test_decode_gpu.py packages/ejkernel-triton/tests/test_ragged_page_attention_gpu.py \
        >"$DIR/tests.log" 2>&1
    tests_status=$?
    tests_took=$(($(date +%s) - start))
    [ "$tests_status" -eq 0 ] || failed=1
fi

# 2. Benchmark, alone on the GPU.
start=$(date +%s)
if [ -n "${FINAL:-}" ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout --kill-after=3 ${SERVING_BENCH_S:-57} python3 benchmarks/decode.py \
        --final --shapes "${SERVING_SHAPES:-8x4096,32x4096,64x4096,32x1024}" --page-sizes 64,16 \
        --impls ejkernel-triton,flash-attn3,jax-pallas-gqa,cudnn-dense --mixed-platforms triton \
        --mixed-parts mixed --mixed-candidates fused-m64-n32-mix,fused-m64-mix@64,fused-m64-n32@64 \
        --sweep-layouts paged,contiguous --sweep-page-sizes 16 \
        --warmup 2 --reps 5 --calls 5 --rotate-bytes 128e6 --out "$DIR" >"$DIR/benchmark.log" 2>&1
else
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout --kill-after=5 ${SERVING_BENCH_S:-85} python3 benchmarks/decode.py \
        --shapes "${SERVING_SHAPES:-32x4096,8x4096,64x4096,32x1024,32x2048}" --page-sizes 16,64 \
        --mixed-platforms triton --sweep-layouts paged --warmup 2 --reps 5 --calls 5 --rotate-bytes 128e6 \
        --out "$DIR" >"$DIR/benchmark.log" 2>&1
fi
bench_status=$?
bench_took=$(($(date +%s) - start))
[ "$bench_status" -eq 0 ] || failed=1

echo "== serving summary =="
if [ -z "${FINAL:-}" ]; then
    echo "tests: exit $tests_status in ${tests_took} s: $(tail -n 1 "$DIR/tests.log")"
    grep -E "^(FAILED|ERROR)" "$DIR/tests.log" | head -n 15
fi
echo "benchmark: exit $bench_status in ${bench_took} s"
grep -E "^(# copy|# bfloat16|B= *[0-9]+ ctx=|mixed )" "$DIR/benchmark.log" | head -n 80
[ "$bench_status" -eq 0 ] || tail -n 5 "$DIR/benchmark.log"
exit "$failed"
