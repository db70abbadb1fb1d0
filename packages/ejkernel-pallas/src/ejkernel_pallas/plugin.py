"""Entry point of the Pallas backend (TPU kernels through Mosaic, GPU kernels through Triton/Mosaic GPU)."""

from __future__ import annotations

from ejkernel.plugins.checks import no_device
from ejkernel.plugins.declare import DeclaredBackend

from ejkernel_pallas.interpret import INTERPRET_ENV, interpret_mode, need_device_message

NAME = "pallas"
DISTRIBUTION = "ejkernel-pallas"

# (algorithm, backend) -> "module:function". Priority 10 puts these above the XLA fallback. On a machine
# with neither TPU nor GPU the dispatcher names these kernels (with check_usable's reason and how to run
# them) when it falls back; with EJKERNEL_PALLAS_INTERPRET set they also register for the CPU and run in
# Pallas interpret mode.
_KERNELS = {
    "flash_attention": ("ejkernel_pallas.flash_attention:flash_attention", ("tpu", "gpu")),
    "grouped_matmul": ("ejkernel_pallas.grouped_matmul:IMPLEMENTATION", ("tpu",)),
    "page_attention": ("ejkernel_pallas.page_attention:IMPLEMENTATION", ("tpu",)),
    "ragged_page_attention": ("ejkernel_pallas.ragged_page_attention:IMPLEMENTATION", ("tpu",)),
    "ring_attention": ("ejkernel_pallas.ring_attention:ring_attention", ("tpu",)),
}


def implementations(interpret: bool) -> dict[tuple[str, str], str]:
    """(algorithm, backend) -> target: the device registrations, plus ``cpu`` ones with ``interpret``."""
    return {
        (algorithm, backend): target
        for algorithm, (target, backends) in _KERNELS.items()
        for backend in (*backends, *(("cpu",) if interpret else ()))
    }


IMPLEMENTATIONS: dict[tuple[str, str], str] = implementations(interpret_mode() is not None)

__all__ = [
    "DISTRIBUTION",
    "IMPLEMENTATIONS",
    "INTERPRET_ENV",
    "NAME",
    "check_usable",
    "implementations",
    "interpret_requested",
]


def interpret_requested() -> bool:
    return interpret_mode() is not None


def check_usable() -> str | None:
    if interpret_requested():
        return None
    reason = no_device("tpu", "gpu")
    if reason:
        return f"{reason}. {need_device_message()}"
    return None


BACKEND = DeclaredBackend(
    name=NAME,
    distribution=DISTRIBUTION,
    platform="pallas",
    targets=("tpu", "gpu"),
    implementations=IMPLEMENTATIONS,
    priority=10,
    check_usable=check_usable,
    description="Pallas kernels: Mosaic TPU, and Triton/Mosaic lowering on NVIDIA GPUs",
)
ejkernel_backend_info, ejkernel_register_kernels = BACKEND.hooks()
