"""Entry point of the Triton backend. Imports neither triton nor jax-triton: kernels load on first call."""

from __future__ import annotations

import os

from ejkernel import BackendInfo, hookimpl
from ejkernel.plugins.checks import distribution_version, first_reason, missing_module, no_device, version_below

NAME = "triton"
DISTRIBUTION = "ejkernel-triton"
MIN_TRITON = "3.6.0"
MIN_JAX_TRITON = "0.3.1"

# algorithm -> "module:function"; priority 10 puts these above the XLA fallback. They register for
# "gpu" and also for "cpu": on a machine without a GPU the dispatcher then meets them, finds the backend
# unusable (check_usable says why), logs the reason and falls back to XLA; an explicit platform="triton"
# gets that reason as its error. With TRITON_INTERPRET=1 they run in Triton's interpreter on the CPU.
IMPLEMENTATIONS: dict[str, str] = {
    "flash_attention": "ejkernel_triton.flash_attention:flash_attention",
}
TARGETS = ("gpu", "cpu")


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


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        distribution=DISTRIBUTION,
        version=distribution_version(DISTRIBUTION),
        platforms=("triton",),
        targets=("gpu",),
        check_usable=check_usable,
        description="Triton kernels for NVIDIA GPUs through jax-triton",
    )


@hookimpl
def ejkernel_register_kernels(registry, plugin: str) -> None:
    for algorithm, target in IMPLEMENTATIONS.items():
        for backend in TARGETS:
            registry.register_lazy(algorithm, "triton", backend, target, priority=10, plugin=plugin)
