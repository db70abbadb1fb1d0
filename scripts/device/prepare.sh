#!/usr/bin/env bash
# Run HERE (the development machine), before a device call: fills .whl/ (git-ignored) with wheels of
# our five distributions and of the Python packages the device image lacks, so that a `run` call can
# carry them (`carry: [".whl"]`) and scripts/device/run.sh can install them there.
#
#   bash scripts/device/prepare.sh                 # our packages + jax-triton
#   EXTRA_WHEELS="foo==1.2 bar==3.4" bash scripts/device/prepare.sh   # + more from PyPI (pure or manylinux x86-64)
#   FROM_HEAD=1 bash scripts/device/prepare.sh     # build from the last commit, not the working tree, and
#       put that commit's files into .whl/head.tar (several people editing one tree: the device then runs
#       what was committed: `mkdir -p /tmp/head && tar xf .whl/head.tar -C /tmp/head && cp -r .whl /tmp/head/
#       && cd /tmp/head && bash scripts/device/gpu_tests.sh`)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
UV=${UV:-/root/.pyenv/versions/3.12.1/bin/uv}
PY=${PY:-/root/.pyenv/versions/3.12.1/bin/python3}
mkdir -p .whl
rm -f .whl/ejkernel*.whl .whl/head.tar
SOURCE=$PWD
if [ -n "${FROM_HEAD:-}" ]; then
    SOURCE=$(mktemp -d)
    git archive HEAD -o .whl/head.tar
    tar xf .whl/head.tar -C "$SOURCE"
    echo "building from $(git rev-parse --short HEAD) (the working tree's uncommitted changes left out)"
fi
for pkg in "$SOURCE"/packages/*/; do
    name=$(basename "$pkg")
    (cd "$SOURCE" && "$UV" build -q --python "$PY" --wheel --package "$name" -o "$OLDPWD/.whl")
done
[ "$SOURCE" = "$PWD" ] || rm -rf "$SOURCE"
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
