"""Entry point of the CUDA backend (native kernels through the XLA FFI, built with nvcc)."""

from __future__ import annotations

from ejkernel.plugins.checks import no_device
from ejkernel.plugins.declare import DeclaredBackend

# algorithm -> "module:function". Empty until the first FFI kernel lands; the backend says so honestly.
IMPLEMENTATIONS: dict[str, str] = {}

BACKEND = DeclaredBackend(
    name="cuda",
    distribution="ejkernel-cuda",
    platform="cuda",
    targets=("gpu",),
    implementations=IMPLEMENTATIONS,
    priority=20,
    check_usable=lambda: no_device("gpu"),
    description="native CUDA kernels (sm_90a) through the XLA FFI",
)
ejkernel_backend_info, ejkernel_register_kernels = BACKEND.hooks()
