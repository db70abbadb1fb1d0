#!/usr/bin/env bash
# Every test that needs a GPU, in one command, ON THE DEVICE (through the device tool's `run`, after
# `bash scripts/device/prepare.sh` here, with `carry: [".whl"]`), from the repo root:
#
#   bash scripts/device/gpu_tests.sh                 # all of it (H200 8 min 20 s on 2026-11-24: near a call's 10 min)
#   bash scripts/device/gpu_tests.sh --part kernels  # the Triton and Pallas packages (H100 4 min 39 s, 2026-11-26)
#   bash scripts/device/gpu_tests.sh --part portable # XLA, CUDA, core and cross-package tests (H100 5 min 24 s)
#   bash scripts/device/gpu_tests.sh -k flash        # extra arguments go to pytest
#
# The two parts are two device calls on the same warm machine (chain them: it is released after 30 s idle);
# each writes $OUT/gpu-tests-<part>.json and .log beside the usual names.
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
PART=""
if [ "${1:-}" = "--part" ]; then
    PART=${2:?"--part takes kernels or portable"}
    shift 2
    case "$PART" in
        kernels) set -- packages/ejkernel-triton/tests packages/ejkernel-pallas/tests "$@" ;;
        portable) set -- packages/ejkernel-xla/tests packages/ejkernel-cuda/tests packages/ejkernel-core/tests tests "$@" ;;
        *) echo "--part takes kernels or portable, not $PART" >&2; exit 2 ;;
    esac
fi
# Workers share the GPU: none preallocates, each may grow to an equal share of 90 % of its memory. The
# suite is compile-bound (Triton and XLA compiles on the host's cores): as many workers as the host has
# cores to spare (2 left for the xdist controller and the GPU driver), but at least 7 GiB of GPU memory
# each: 14 on an H200 (16 cores, 141 GiB), 10 on an H100 (80 GiB). Measured 2026-11-23: H200, 8 workers,
# 9 min 12 s, 14 workers 6 min 25 s (679 passed); H100, 10 workers, 7 min 51 s (679 passed).
if [ -z "${GPU_TEST_WORKERS:-}" ]; then
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 || true)
    GPU_TEST_WORKERS=$(python3 -c "
import os, sys
gpu_gib = float(sys.argv[1]) / 1024 if sys.argv[1].strip().isdigit() else 80.0
print(max(1, min((os.cpu_count() or 8) - 2, int(0.9 * gpu_gib / 7))))" "${gpu_mib:-}")
fi
WORKERS=$GPU_TEST_WORKERS
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Kernels no GPU has checked yet are registered for this run only (each plugin's UNVERIFIED mapping).
export EJKERNEL_UNVERIFIED_KERNELS=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(python3 -c "print(round(0.9 / $WORKERS, 3))")}
export PYTHONPATH=$PWD/scripts/device${PYTHONPATH:+:$PYTHONPATH}
unset JAX_PLATFORMS  # JAX picks the GPU (the ring-attention suite starts its own CPU processes)

# worksteal (xdist >= 3.2) hands a busy worker's queued tests to an idle one: the slowest tests take 40-80 s
DIST=$(python3 -c "import xdist; v = tuple(int(x) for x in xdist.__version__.split('.')[:2]); print('worksteal' if v >= (3, 2) else 'load')")
echo "pytest-xdist: $WORKERS workers, --dist $DIST"
python3 -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print('JAX sees', jax.devices())"

set +e
# --continue-on-collection-errors: a CPU-only test module that cannot import here must not hide the rest
# (it is listed in the summary's collection_errors and still fails the run)
python3 -m pytest -p gpu_suite -m "not tpu" -n "$WORKERS" --dist "$DIST" -q -rfEs --continue-on-collection-errors \
    --gpu-summary "$OUT/gpu-tests.json" --junitxml "$OUT/gpu-tests.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.log"
status=${PIPESTATUS[0]}
set -e
if [ -n "$PART" ]; then
    cp "$OUT/gpu-tests.json" "$OUT/gpu-tests-$PART.json"
    cp "$OUT/gpu-tests.log" "$OUT/gpu-tests-$PART.log"
fi
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
