#!/usr/bin/env bash
# Run HERE (the development machine), before a device call: fills .whl/ (git-ignored) with wheels of
# our five distributions and of the Python packages the device image lacks, so that a `run` call can
# carry them (`carry: [".whl"]`) and scripts/device/run.sh can install them there.
#
#   bash scripts/device/prepare.sh                 # our packages + jax-triton
#   EXTRA_WHEELS="foo==1.2 bar==3.4" bash scripts/device/prepare.sh   # + more from PyPI (pure or manylinux x86-64)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
UV=${UV:-/root/.pyenv/versions/3.12.1/bin/uv}
PY=${PY:-/root/.pyenv/versions/3.12.1/bin/python3}
mkdir -p .whl
rm -f .whl/ejkernel*.whl
for pkg in packages/*/; do
    name=$(basename "$pkg")
    "$UV" build -q --wheel --package "$name" -o .whl
done
# The device image has jax/jaxlib/triton but not jax-triton or beartype (both pure Python): uv.lock versions.
for req in jax-triton==0.3.1 beartype==0.23.1 ${EXTRA_WHEELS:-}; do
    base=${req%%==*}
    if ! ls .whl/"${base//-/_}"-*.whl >/dev/null 2>&1; then
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any -d .whl "$req"
    fi
done
ls -la .whl
du -sh .whl
