"""Entry point of the Pallas backend (TPU kernels through Mosaic, GPU kernels through Triton/Mosaic GPU)."""

from __future__ import annotations

from ejkernel.plugins.checks import no_device
from ejkernel.plugins.declare import DeclaredBackend

from ejkernel_pallas.interpret import INTERPRET_ENV, interpret_family, interpret_mode, need_device_message

NAME = "pallas"
DISTRIBUTION = "ejkernel-pallas"

# algorithm -> {hardware: "module:attribute"}. Priority 10 puts these above the XLA fallback; on a Hopper GPU
# flash and block-sparse attention rank above the Triton backend's for the calls their Mosaic GPU kernels take
# (``priority_for``: mosaic_attention.MEASURED_PRIORITY). On a machine
# with neither TPU nor GPU the dispatcher names these kernels (with check_usable's reason and how to run
# them) when it falls back; with EJKERNEL_PALLAS_INTERPRET set when the plugin loads they also register for
# the CPU and run in Pallas interpret mode.
_KERNELS = {
    "flash_attention": {
        "tpu": "ejkernel_pallas.tpu_flash_attention:IMPLEMENTATION",
        "gpu": "ejkernel_pallas.gpu_flash_attention:IMPLEMENTATION",
    },
    "blocksparse_attention": {
        "tpu": "ejkernel_pallas.blocksparse_attention:IMPLEMENTATION",
        "gpu": "ejkernel_pallas.blocksparse_attention_gpu:IMPLEMENTATION",
    },
    "grouped_matmul": {"tpu": "ejkernel_pallas.grouped_matmul:IMPLEMENTATION"},
    "page_attention": {"tpu": "ejkernel_pallas.page_attention:IMPLEMENTATION"},
    "ragged_page_attention": {"tpu": "ejkernel_pallas.ragged_page_attention:IMPLEMENTATION"},
    "ring_attention": {"tpu": "ejkernel_pallas.ring_attention:IMPLEMENTATION"},
}


def implementations(interpret: str | None) -> dict[tuple[str, str], str]:
    """(algorithm, backend) -> target: the device registrations, plus ``cpu`` ones in interpret mode
    ``interpret`` (an ``interpret_mode()`` value): the kernels of the family that mode runs, the TPU ones
    where an algorithm has no other."""
    registered = {}
    for algorithm, targets in _KERNELS.items():
        registered.update({(algorithm, backend): target for backend, target in targets.items()})
        if interpret is not None:
            registered[(algorithm, "cpu")] = targets.get(interpret_family(interpret), targets["tpu"])
    return registered


IMPLEMENTATIONS: dict[tuple[str, str], str] = implementations(interpret_mode())

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
