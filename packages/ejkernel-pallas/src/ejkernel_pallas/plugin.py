"""Entry point of the Pallas backend (TPU kernels through Mosaic, GPU kernels through Triton/Mosaic GPU)."""

from __future__ import annotations

from ejkernel import BackendInfo, hookimpl
from ejkernel.plugins.checks import distribution_version, no_device

from ejkernel_pallas.interpret import INTERPRET_ENV, NEED_DEVICE_MESSAGE, interpret_mode

NAME = "pallas"
DISTRIBUTION = "ejkernel-pallas"

# (algorithm, backend) -> "module:function". Priority 10 puts these above the XLA fallback.
# The "cpu" entries run the kernels in interpret mode when EJKERNEL_PALLAS_INTERPRET asks for it, and
# otherwise refuse the call (UnsupportedFeature) with NEED_DEVICE_MESSAGE, so auto dispatch falls back.
_FLASH = "ejkernel_pallas.flash_attention:flash_attention"
IMPLEMENTATIONS: dict[tuple[str, str], str] = {
    ("flash_attention", "tpu"): _FLASH,
    ("flash_attention", "gpu"): _FLASH,
    ("flash_attention", "cpu"): _FLASH,
    ("grouped_matmul", "tpu"): "ejkernel_pallas.grouped_matmul:grouped_matmul",
    ("grouped_matmul", "cpu"): "ejkernel_pallas.grouped_matmul:grouped_matmul",
    ("page_attention", "tpu"): "ejkernel_pallas.page_attention:page_attention",
    ("page_attention", "cpu"): "ejkernel_pallas.page_attention:page_attention",
    ("ragged_page_attention", "tpu"): "ejkernel_pallas.ragged_page_attention:ragged_page_attention",
    ("ragged_page_attention", "cpu"): "ejkernel_pallas.ragged_page_attention:ragged_page_attention",
    ("ring_attention", "tpu"): "ejkernel_pallas.ring_attention:ring_attention",
    ("ring_attention", "cpu"): "ejkernel_pallas.ring_attention:ring_attention",
}

__all__ = ["DISTRIBUTION", "IMPLEMENTATIONS", "INTERPRET_ENV", "NAME", "check_usable", "interpret_requested"]


def interpret_requested() -> bool:
    return interpret_mode() is not None


def check_usable() -> str | None:
    if interpret_requested():
        return None
    reason = no_device("tpu", "gpu")
    if reason:
        return f"{reason}. {NEED_DEVICE_MESSAGE}"
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
