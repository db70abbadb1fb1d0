"""Entry point of the Pallas backend (TPU kernels through Mosaic, GPU kernels through Triton/Mosaic GPU)."""

from __future__ import annotations

import os

from ejkernel import BackendInfo, hookimpl
from ejkernel.plugins.checks import distribution_version, no_device

NAME = "pallas"
DISTRIBUTION = "ejkernel-pallas"
INTERPRET_ENV = "EJKERNEL_PALLAS_INTERPRET"

# (algorithm, backend) -> "module:function". Priority 10 puts these above the XLA fallback.
IMPLEMENTATIONS: dict[tuple[str, str], str] = {}


def interpret_requested() -> bool:
    return os.environ.get(INTERPRET_ENV, "").strip() not in ("", "0", "false", "False")


def check_usable() -> str | None:
    if interpret_requested():
        return None
    reason = no_device("tpu", "gpu")
    if reason:
        return f"{reason} (Pallas kernels run on CPU only in interpret mode: set {INTERPRET_ENV}=1)"
    return None


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        distribution=DISTRIBUTION,
        version=distribution_version(DISTRIBUTION),
        platforms=("pallas",),
        targets=("tpu", "gpu"),
        check_usable=check_usable,
        description="Pallas kernels: Mosaic TPU, and Triton/Mosaic lowering on NVIDIA GPUs",
    )


@hookimpl
def ejkernel_register_kernels(registry, plugin: str) -> None:
    for (algorithm, backend), target in IMPLEMENTATIONS.items():
        registry.register_lazy(algorithm, "pallas", backend, target, priority=10, plugin=plugin)
