#!/usr/bin/env bash
# Installs everything, lists the backends, and runs one flash_attention call on this machine.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
.venv/bin/ejkernel list-backends
exec .venv/bin/python scripts/demo.py
