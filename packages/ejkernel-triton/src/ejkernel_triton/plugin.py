"""Entry point of the Triton backend. Imports neither triton nor jax-triton: kernels load on first call."""

from __future__ import annotations

import os

from ejkernel.plugins.checks import first_reason, missing_module, no_device, unverified_requested, version_below
from ejkernel.plugins.declare import DeclaredBackend

NAME = "triton"
DISTRIBUTION = "ejkernel-triton"
MIN_TRITON = "3.6.0"
MIN_JAX_TRITON = "0.3.1"

# algorithm -> "module:IMPLEMENTATION" (an ejkernel.Implementation); priority 15 puts these above the XLA
# fallback (0) and above Pallas's GPU kernels (10), which the measurements rank below them (README: H100
# and H200, 2026-11-22, flash attention forward 1.09-1.23 x Pallas, forward+backward 0.98-1.15 x). They
# register for the GPU; on a CPU-only machine the dispatcher still names them (with check_usable's reason)
# when it falls back to XLA. With TRITON_INTERPRET=1 they also register for the CPU and run in Triton's
# interpreter. Tuned blocks per device kind (tuned/flash_attention.json) are read by
# the implementation's heuristic (flash_attention/tuning.py); a device kind with a table has nothing to
# autotune, so no shipped-configs hook is needed.
IMPLEMENTATIONS: dict[str, str] = {
    "flash_attention": "ejkernel_triton.flash_attention:IMPLEMENTATION",
    "page_attention": "ejkernel_triton.decode.page_attention:IMPLEMENTATION",
    "ragged_decode_attention": "ejkernel_triton.decode.ragged_decode_attention:IMPLEMENTATION",
    "gla": "ejkernel_triton.linear_attention:IMPLEMENTATION",
    "lightning_attention": "ejkernel_triton.linear_attention:IMPLEMENTATION",
    "recurrent": "ejkernel_triton.linear_attention:IMPLEMENTATION",
    "blocksparse_attention": "ejkernel_triton.blocksparse_attention:IMPLEMENTATION",
    "mean_pooling": "ejkernel_triton.mean_pooling:IMPLEMENTATION",
    "ragged_page_attention": "ejkernel_triton.ragged_page_attention:IMPLEMENTATION",
    "ring_attention": "ejkernel_triton.ring_attention:IMPLEMENTATION",
    "native_sparse_attention": "ejkernel_triton.native_sparse_attention:IMPLEMENTATION",
    "scaled_dot_product_attention": "ejkernel_triton.scaled_dot_product_attention:IMPLEMENTATION",
}


# Built and checked in Triton's interpreter and lowered for sm_90, not yet run on a GPU: registered only in
# the interpreter (CPU tests) or with EJKERNEL_UNVERIFIED_KERNELS=1 (the device run that verifies them; then
# they move up into IMPLEMENTATIONS). A GPU user never gets a kernel no GPU has checked.
UNVERIFIED: dict[str, str] = {}


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _no_gpu() -> str | None:
    if interpret_requested():
        return None
    reason = no_device("gpu")
    if reason:
        return (f"{reason}: Triton kernels need an NVIDIA GPU (set TRITON_INTERPRET=1 before importing triton "
                "to run them, slowly, in Triton's interpreter on the CPU)")
    return None


def check_usable() -> str | None:
    return first_reason(
        lambda: missing_module("triton"),
        lambda: version_below("triton", MIN_TRITON),
        lambda: missing_module("jax_triton", "jax-triton"),
        lambda: version_below("jax-triton", MIN_JAX_TRITON),
        _no_gpu,
    )


BACKEND = DeclaredBackend(
    name=NAME,
    distribution=DISTRIBUTION,
    platform="triton",
    targets=("gpu",),
    implementations=IMPLEMENTATIONS,
    unverified=UNVERIFIED,
    include_unverified=lambda: interpret_requested() or unverified_requested(),
    register_for=("gpu", "cpu") if interpret_requested() else ("gpu",),
    priority=15,
    check_usable=check_usable,
    description="Triton kernels for NVIDIA GPUs through jax-triton",
)
ejkernel_backend_info, ejkernel_register_kernels = BACKEND.hooks()
