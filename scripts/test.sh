#!/usr/bin/env bash
# Installs everything, then runs the whole test suite on the CPU. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
