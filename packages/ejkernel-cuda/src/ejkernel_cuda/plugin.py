"""Entry point of the CUDA backend (native kernels through the XLA FFI, built with nvcc)."""

from __future__ import annotations

from ejkernel import BackendInfo, hookimpl
from ejkernel.plugins.checks import distribution_version, no_device

NAME = "cuda"
DISTRIBUTION = "ejkernel-cuda"

# algorithm -> "module:function". Empty until the first FFI kernel lands; the backend says so honestly.
IMPLEMENTATIONS: dict[str, str] = {}


def check_usable() -> str | None:
    return no_device("gpu")


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        distribution=DISTRIBUTION,
        version=distribution_version(DISTRIBUTION),
        platforms=("cuda",),
        targets=("gpu",),
        check_usable=check_usable,
        description="native CUDA kernels (sm_90a) through the XLA FFI",
    )


@hookimpl
def ejkernel_register_kernels(registry, plugin: str) -> None:
    for algorithm, target in IMPLEMENTATIONS.items():
        registry.register_lazy(algorithm, "cuda", "gpu", target, priority=20, plugin=plugin)
