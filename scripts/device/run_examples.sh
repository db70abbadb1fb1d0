#!/usr/bin/env bash
# The examples' GPU runs and the GPU export tests, ON THE DEVICE (through the device tool's `run`, after
# `EXTRA_WHEELS="flax==0.12.12" bash scripts/device/prepare.sh` here -- the flax of uv.lock, which the
# examples were written against, over the image's own -- with `carry: [".whl"]`), from the repo root:
#
#   bash scripts/device/run_examples.sh              # ~5-7 min on one H100
#
# Writes into $OUT (at most 8 files come back):
#   train_gpt-gpu-100m.json / .png     the ~100M-parameter GPT, seq 4096, ejkernel flash_attention vs
#                                      jax.nn.dot_product_attention(implementation="cudnn"): tokens/s, step
#                                      time, loss curves (examples/train_gpt.py; < 4 min for both)
#   paged_generation-gpu-100m.json     batched generation through the paged KV cache, tokens/s
#   export-gpu.log                     pytest -m gpu tests/test_export.py (jax.export round trips on the GPU)
#   examples.log, machine.txt          everything printed; GPU, driver and versions
# Exit status: 1 if any of the three steps failed (each still runs).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# Install the carried wheels first (scripts/device/run.sh), then come back here.
if [ -z "${EJKERNEL_DEVICE_READY:-}" ] && [ -z "${EJKERNEL_EXAMPLES_READY:-}" ]; then
    export EJKERNEL_EXAMPLES_READY=1  # run.sh may predate EJKERNEL_DEVICE_READY
    exec bash scripts/device/run.sh bash scripts/device/run_examples.sh "$@"
fi

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
unset JAX_PLATFORMS
exec > >(tee "$OUT/examples.log") 2>&1
status=0
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
timeout 420 python3 examples/train_gpt.py --config gpu-100m --no-progress --out "$OUT" || status=1
timeout 240 python3 examples/paged_generation.py --config gpu-100m --op both --out "$OUT" || status=1
timeout 300 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_export.py 2>&1 | tee "$OUT/export-gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
