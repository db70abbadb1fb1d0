#!/usr/bin/env bash
# Every test that needs a GPU, in one command, ON THE DEVICE (through the device tool's `run`, after
# `bash scripts/device/prepare.sh` here, with `carry: [".whl"]`), from the repo root:
#
#   bash scripts/device/gpu_tests.sh                 # all of it, ~3-5 min on one H100/H200
#   bash scripts/device/gpu_tests.sh -k flash        # extra arguments go to pytest
#
# Runs, in one pytest session with xdist: every test marked `gpu` (the Triton and Pallas GPU kernels and
# their shared conformance suites) and the XLA package's whole suite (every shared conformance suite of
# every operation, with JAX on the GPU). Selection and labels: scripts/device/gpu_suite.py. Writes into
# $OUT: gpu-tests.json (passed/failed/skipped per backend and operation, device, date, versions; copy it
# to benchmarks/results/<device>-<date>-gpu-tests.json), gpu-tests.xml (junit) and gpu-tests.log.
# Exit status: pytest's (0 = every selected test passed or was skipped with a reason).
#
# Every kernel change runs this before it is merged (docs/DEVELOPING.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# Install the carried wheels first (scripts/device/run.sh), then come back here.
if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/gpu_tests.sh "$@"
fi

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# Workers share the GPU: none preallocates, each may grow to an equal share of 90 % of its memory.
WORKERS=${GPU_TEST_WORKERS:-8}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(python3 -c "print(round(0.9 / $WORKERS, 3))")}
export PYTHONPATH=$PWD/scripts/device${PYTHONPATH:+:$PYTHONPATH}
unset JAX_PLATFORMS  # JAX picks the GPU (the ring-attention suite starts its own CPU processes)

python3 -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print('JAX sees', jax.devices())"

set +e
# --continue-on-collection-errors: a CPU-only test module that cannot import here must not hide the rest
# (it is listed in the summary's collection_errors and still fails the run)
python3 -m pytest -p gpu_suite -m "not tpu" -n "$WORKERS" --dist load -q -rfEs --continue-on-collection-errors \
    --gpu-summary "$OUT/gpu-tests.json" --junitxml "$OUT/gpu-tests.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.log"
status=${PIPESTATUS[0]}
set -e
python3 -c "
import json, sys
doc = json.load(open(sys.argv[1]))
print('device:', doc['device']); print('totals:', doc['totals'], 'in', doc['wall_s'], 's')
for backend, ops in doc['per_operation'].items():
    for op, counts in ops.items():
        print(f'  {backend:8s} {op:30s}', counts)
for error in doc['collection_errors']:
    print('  could not collect', error['module'], error['message'])
for name in doc['registered_but_untested']:
    print('  registered for the GPU but no test ran:', name)
" "$OUT/gpu-tests.json" || true
exit "$status"
