#!/usr/bin/env bash
# Installs everything this repo needs into .venv (Python >= 3.12, uv, the locked workspace).
# Sourced by demo.sh and test.sh; safe to run again (a no-op when nothing changed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

find_python() {
  local candidate
  for candidate in "${EJKERNEL_PYTHON:-}" python3.12 python3.13 python3 \
      /root/.pyenv/versions/3.1[2-9]*/bin/python3 "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

if ! PYTHON=$(find_python); then
  echo "ejkernel needs Python >= 3.12 (jax >= 0.11 does), and none was found." >&2
  echo "Install one (e.g. 'pyenv install 3.12' or your OS package python3.12), or set EJKERNEL_PYTHON=/path/to/python3.12." >&2
  exit 1
fi

if "$PYTHON" -m uv --version >/dev/null 2>&1; then
  UV=("$PYTHON" -m uv)
elif command -v uv >/dev/null 2>&1; then
  UV=(uv)
else
  echo "Installing uv into $PYTHON ..." >&2
  "$PYTHON" -m pip install --quiet uv 2>/dev/null || "$PYTHON" -m pip install --quiet --user uv
  UV=("$PYTHON" -m uv)
fi

"${UV[@]}" sync --locked --quiet --python "$PYTHON"

# On a machine without an NVIDIA driver, keep jax on the CPU (the CUDA plugin is installed for lowering).
if ! command -v nvidia-smi >/dev/null 2>&1; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
fi
