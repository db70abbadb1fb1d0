"""Entry point of the Triton backend. Imports neither triton nor jax-triton: kernels load on first call."""

from __future__ import annotations

from ejkernel import BackendInfo, hookimpl
from ejkernel.plugins.checks import distribution_version, first_reason, missing_module, no_device, version_below

NAME = "triton"
DISTRIBUTION = "ejkernel-triton"
MIN_TRITON = "3.6.0"
MIN_JAX_TRITON = "0.3.1"

# algorithm -> "module:function"; priority 10 puts these above the XLA fallback on GPUs.
IMPLEMENTATIONS: dict[str, str] = {
    "flash_attention": "ejkernel_triton.flash_attention:flash_attention",
}


def check_usable() -> str | None:
    return first_reason(
        lambda: missing_module("triton"),
        lambda: version_below("triton", MIN_TRITON),
        lambda: missing_module("jax_triton", "jax-triton"),
        lambda: version_below("jax-triton", MIN_JAX_TRITON),
        lambda: no_device("gpu"),
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
        registry.register_lazy(algorithm, "triton", "gpu", target, priority=10, plugin=plugin)
