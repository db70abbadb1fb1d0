#!/usr/bin/env bash
# Run ON THE DEVICE (through the device tool's `run`, with `carry: [".whl"]`), from the repo root:
#
#   bash scripts/device/run.sh <command ...>
#   e.g. bash scripts/device/run.sh python3 benchmarks/attention.py --head-dims 128
#   (every GPU test: bash scripts/device/gpu_tests.sh, which calls this itself)
#
# Installs the carried wheels (our distributions with their entry points, plus jax-triton) into
# /tmp/site without touching the image's packages, puts that first on PYTHONPATH, records the
# machine (GPU, driver, versions) into $OUT/machine.txt, then runs the command. Fresh machines are
# bare: every call installs again (a few seconds).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "no wheels in .whl/: run scripts/device/prepare.sh here and pass carry=[\".whl\"]" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export EJKERNEL_DEVICE_READY=1  # scripts that call run.sh themselves (gpu_tests.sh) do not install twice
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader || true
    python3 -c "import sys, jax, jaxlib, triton, jax_triton; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__); print(jax.devices())"
} 2>&1 | tee "$OUT/machine.txt"
exec "$@"
