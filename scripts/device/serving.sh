#!/usr/bin/env bash
# The Triton serving kernels on the device (issue #11): page_attention, ragged_decode_attention and
# ragged_page_attention. Their GPU tests, then benchmarks/decode.py (decode shapes, the decode schedule
# candidates at the standard shape, the mixed prefill + decode batch). ON THE DEVICE, from the repo root, after
# `EXTRA_WHEELS="flash-attn3-jax==0.2.3" bash scripts/device/prepare.sh` here (carry: [".whl"]):
#
#   bash scripts/device/serving.sh          # or: bash scripts/device/batch.sh serving
#
# Writes under $OUT/serving/: tests.log and tests.xml (pytest -m gpu of test_decode_gpu.py and
# test_ragged_page_attention_gpu.py, 8 xdist workers sharing the GPU), benchmark.log and
# <gpu>-<date>-decode.json / .png (benchmarks/decode.py, in this order: the mixed batch of 4 prefill chunks of
# 512 + 60 decode rows over 4k contexts (pages of 16 and 64, the Triton schedule candidates, its prefill and
# decode parts alone) against the bandwidth and compute ceilings; then every implementation's default at 32x4096,
# 8x4096, 64x4096, 32x1024, 32x2048 (SERVING_SHAPES), pages of 16 and 64: ours vs flash-attn3-jax paged vs JAX
# Pallas gqa; last the decode schedule sweep at 32x4096). About 145 s on one H200, compile included: each part under its own
# timeout, one failing part does not stop the other; the JSON is rewritten after every row, so a cut-off run
# keeps what it measured. Prints a summary. Exit status 1 if a part failed.
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

# 1. GPU tests: 8 workers, each may grow to 1/9 of the GPU's memory.
start=$(date +%s)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.11 timeout --kill-after=5 50 python3 -m pytest -m gpu -n 8 --dist load -q -rfEs \
    -p no:cacheprovider --junitxml "$DIR/tests.xml" \
    packages/ejkernel-triton/tests/test_decode_gpu.py packages/ejkernel-triton/tests/test_ragged_page_attention_gpu.py \
    >"$DIR/tests.log" 2>&1
tests_status=$?
tests_took=$(($(date +%s) - start))
[ "$tests_status" -eq 0 ] || failed=1

# 2. Benchmark, alone on the GPU: the standard shape (and its sweep) first, the mixed batch last.
start=$(date +%s)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout --kill-after=5 ${SERVING_BENCH_S:-85} python3 benchmarks/decode.py \
    --shapes "${SERVING_SHAPES:-32x4096,8x4096,64x4096,32x1024,32x2048}" --page-sizes 16,64 \
    --mixed-platforms triton --sweep-layouts paged --warmup 2 --reps 5 --calls 5 --rotate-bytes 128e6 --out "$DIR" \
    >"$DIR/benchmark.log" 2>&1
bench_status=$?
bench_took=$(($(date +%s) - start))
[ "$bench_status" -eq 0 ] || failed=1

echo "== serving summary =="
echo "tests: exit $tests_status in ${tests_took} s: $(tail -n 1 "$DIR/tests.log")"
grep -E "^(FAILED|ERROR)" "$DIR/tests.log" | head -n 15
echo "benchmark: exit $bench_status in ${bench_took} s"
grep -E "^(# copy|# bfloat16|B= 32 ctx=  4096|mixed )" "$DIR/benchmark.log" | head -n 60
[ "$bench_status" -eq 0 ] || tail -n 5 "$DIR/benchmark.log"
exit "$failed"
