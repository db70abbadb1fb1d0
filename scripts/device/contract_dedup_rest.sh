#!/usr/bin/env bash
# Issue #18, second half (keywords once per operation): the XLA conformance suites of the seven operations
# moved to `@public_function` + `canonicalize(args)` in this step (blocksparse_attention, page_attention,
# ragged_page_attention, ragged_decode_attention, recurrent, gla, lightning_attention) with JAX on the GPU;
# four of their XLA implementations are now `JittedImplementation`s (one compiled program per call
# signature). ON THE DEVICE, from the repo root, after `bash scripts/device/prepare.sh` here
# (carry: [".whl"]):
#
#   bash scripts/device/contract_dedup_rest.sh      # or: bash scripts/device/batch.sh contract_dedup_rest
#
# Writes under $OUT/contract_dedup_rest/: tests.log / tests.xml (pytest, 4 xdist workers sharing the GPU)
# and summary.txt. At most ~130 s on one H200, compile included. Exit status 1 if the tests failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/contract_dedup_rest.sh "$@"
fi

OUT=${OUT:-/tmp/out}
DIR="$OUT/contract_dedup_rest"
mkdir -p "$DIR"
unset JAX_PLATFORMS  # JAX on the GPU
export XLA_PYTHON_CLIENT_PREALLOCATE=false

start=$(date +%s)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout --kill-after=5 125 python3 -m pytest -n 4 --dist load -q -rfEs \
    -p no:cacheprovider --junitxml "$DIR/tests.xml" \
    packages/ejkernel-xla/tests/test_blocksparse_attention.py packages/ejkernel-xla/tests/test_page_attention.py \
    packages/ejkernel-xla/tests/test_ragged_page_attention.py \
    packages/ejkernel-xla/tests/test_ragged_decode_attention.py packages/ejkernel-xla/tests/test_recurrent.py \
    packages/ejkernel-xla/tests/test_gla.py packages/ejkernel-xla/tests/test_lightning_attention.py \
    >"$DIR/tests.log" 2>&1
status=$?
took=$(($(date +%s) - start))

{
    echo "contract_dedup_rest: XLA suites of the 7 operations on the GPU: exit $status in ${took} s" \
        "(124/137: timed out)"
    tail -n 3 "$DIR/tests.log"
    grep -E "^(FAILED|ERROR)" "$DIR/tests.log" | head -n 20
} | tee "$DIR/summary.txt"
[ "$status" -eq 0 ]
