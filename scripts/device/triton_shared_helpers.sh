#!/usr/bin/env bash
# Issue #18 (shared Triton device helpers): timings of the refactored Triton kernels ON THE DEVICE, to set
# beside today's pre-refactor results in benchmarks/results (same scripts, same shapes). From the repo root,
# after `bash scripts/device/prepare.sh` here (carry: [".whl"]):
#
#   bash scripts/device/triton_shared_helpers.sh     # or: bash scripts/device/batch.sh triton_shared_helpers
#
# The refactor moved code into inlined @triton.jit helpers; on the CPU the sm_90 TTGIR of every flash,
# block-sparse, decode, ragged-page and linear-attention kernel was compared op by op with the code before it
# (identical, except the dQ kernels' row mask: one 2-D compare instead of a 1-D compare + expand, outside the
# loops). Correctness on the GPU: scripts/device/gpu_tests.sh (the whole suite; not repeated here).
#
# Writes under $OUT/triton_shared_helpers/: blocksparse.log + JSON/PNG (benchmarks/blocksparse.py --final:
# S=16k, 10 %: dense Triton flash attention and block-sparse, fwd and fwd+bwd), decode.log + JSON/PNG
# (benchmarks/decode.py, 32 x 4096, pages of 16, no sweep, no mixed batch), linear.log + JSON/PNG
# (benchmarks/linear_attention.py at 4096, no numerics). Each part under its own timeout (45 + 45 + 45 s, about
# 140 s on one H200 with compiles); one failing part does not stop the others. Prints a summary; exit 1 if a
# part failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/triton_shared_helpers.sh "$@"
fi

OUT=${OUT:-/tmp/out}
DIR="$OUT/triton_shared_helpers"
mkdir -p "$DIR"
unset JAX_PLATFORMS
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
failed=0

part() {  # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    local start=$(date +%s)
    timeout --kill-after=3 "$seconds" "$@" >"$DIR/$name.log" 2>&1
    local status=$?
    echo "$name: exit $status in $(($(date +%s) - start)) s" | tee -a "$DIR/summary.txt"
    [ "$status" -eq 0 ] || failed=1
}

part blocksparse 45 python3 benchmarks/blocksparse.py --final --warmup 2 --reps 5 --calls 3 --out "$DIR"
part decode 45 python3 benchmarks/decode.py --shapes 32x4096 --standard 32x4096 --page-sizes 16 --no-sweep \
    --no-mixed --impls ejkernel-triton --warmup 2 --reps 5 --calls 5 --out "$DIR"
part linear 45 python3 benchmarks/linear_attention.py --seqs 4096 --xla-seqs "" --no-numerics --warmup 2 --reps 5 \
    --calls 3 --out "$DIR"

echo "== triton_shared_helpers summary =="
cat "$DIR/summary.txt"
for name in blocksparse decode linear; do
    echo "-- $name (last lines) --"
    tail -n 15 "$DIR/$name.log"
done
exit $failed
