#!/usr/bin/env bash
# Issue #18 (keywords once per operation): the XLA conformance suites of the operations whose validation
# moved to `@public_function` + `canonicalize(args)` (attention, sdpa, MLA, NSA, ring, grouped_matmul,
# mean_pooling), with JAX on the GPU, and the host cost of the new validation path. ON THE DEVICE, from the
# repo root, after `bash scripts/device/prepare.sh` here (carry: [".whl"]):
#
#   bash scripts/device/contract_dedup.sh          # or: bash scripts/device/batch.sh contract_dedup
#
# Writes under $OUT/contract_dedup/: tests.log / tests.xml (pytest, 4 xdist workers sharing the GPU) and
# overhead.json (device, date, versions; microseconds per FlashAttention().validate and per eager
# flash_attention call of a tiny cached shape, median of 200). About 100-130 s on one H200, compile
# included; each part under its own timeout, one failing part does not stop the other. Prints a summary.
# Exit status 1 if a part failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/contract_dedup.sh "$@"
fi

OUT=${OUT:-/tmp/out}
DIR="$OUT/contract_dedup"
mkdir -p "$DIR"
unset JAX_PLATFORMS  # JAX on the GPU (the ring suite starts its own CPU processes)
export XLA_PYTHON_CLIENT_PREALLOCATE=false
failed=0

# 1. The XLA suites of the migrated operations on the GPU.
start=$(date +%s)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout --kill-after=5 100 python3 -m pytest -n 4 --dist load -q -rfEs \
    -p no:cacheprovider --junitxml "$DIR/tests.xml" \
    packages/ejkernel-xla/tests/test_attention.py packages/ejkernel-xla/tests/test_sdpa.py \
    packages/ejkernel-xla/tests/test_multi_head_latent_attention.py \
    packages/ejkernel-xla/tests/test_native_sparse_attention.py packages/ejkernel-xla/tests/test_ring_attention.py \
    packages/ejkernel-xla/tests/test_grouped_matmul.py packages/ejkernel-xla/tests/test_mean_pooling.py \
    >"$DIR/tests.log" 2>&1
tests_status=$?
tests_took=$(($(date +%s) - start))
[ "$tests_status" -eq 0 ] || failed=1

# 2. Host overhead of the validation path (binding to the public signature, canonicalize, build).
start=$(date +%s)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout --kill-after=5 40 python3 - "$DIR/overhead.json" >"$DIR/overhead.log" 2>&1 <<'EOF'
import datetime, json, statistics, sys, time

import jax, jax.numpy as jnp

import ejkernel
from ejkernel.modules import flash_attention
from ejkernel.modules.operations.flash_attention import FlashAttention

q = jax.random.normal(jax.random.key(0), (1, 128, 4, 64), jnp.bfloat16)
k = jax.random.normal(jax.random.key(1), (1, 128, 4, 64), jnp.bfloat16)
v = jax.random.normal(jax.random.key(2), (1, 128, 4, 64), jnp.bfloat16)


def median_us(fn, reps=200):
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


validate_us = median_us(lambda: FlashAttention().validate(q, k, v, causal=True, sliding_window=32))
call_us = median_us(lambda: flash_attention(q, k, v, causal=True).block_until_ready())
doc = {
    "device": str(jax.devices()[0].device_kind), "date": datetime.datetime.now(datetime.UTC).isoformat(),
    "versions": {"jax": jax.__version__, "ejkernel": getattr(ejkernel, "__version__", "?")},
    "shape": "q/k/v bf16 [1, 128, 4, 64], causal, window 32",
    "validate_us_median": round(validate_us, 1), "eager_flash_attention_call_us_median": round(call_us, 1),
}
json.dump(doc, open(sys.argv[1], "w"), indent=1)
print(json.dumps(doc))
EOF
overhead_status=$?
overhead_took=$(($(date +%s) - start))
[ "$overhead_status" -eq 0 ] || failed=1

echo "== contract_dedup summary =="
echo "tests: exit $tests_status in ${tests_took} s: $(tail -n 1 "$DIR/tests.log")"
grep -E "^(FAILED|ERROR)" "$DIR/tests.log" | head -n 15
echo "overhead: exit $overhead_status in ${overhead_took} s: $(tail -n 1 "$DIR/overhead.log")"
exit "$failed"
