"""Entry point of the CUDA backend: NVIDIA's kernels for NVIDIA GPUs. Imports no kernel module: they load on
first call.

Its attention runs on cuDNN's fused flash attention through JAX's cuDNN custom call (``cudnn_attention.py``)
and, for the calls cuDNN refuses, on our own Hopper (sm_90a) kernels through the XLA FFI
(``native_flash.py``; the library ``hatch_build.py`` builds with nvcc). The backend is usable wherever cuDNN
is; ``ejkernel list-backends`` shows the native kernels as a part of their own (usable only on an sm_90 GPU
with the library built and loadable).
"""

from __future__ import annotations

from ejkernel.plugins.checks import first_reason, no_device
from ejkernel.plugins.declare import DeclaredBackend

# algorithm -> "module:IMPLEMENTATION". Priority 20 puts these above Triton (15), Pallas (10) and XLA (0):
# cuDNN's flash attention and our native kernels are the fastest we measure on Hopper (the config picks one of
# them per call: flash_attention.native_preferred); flash attention ranks the calls only the native kernels
# take lower (flash_attention.NATIVE_PRIORITY); the others are refused (UnsupportedFeature) and the dispatcher
# goes down the list.
IMPLEMENTATIONS: dict[str, str] = {
    "flash_attention": "ejkernel_cuda.flash_attention:IMPLEMENTATION",
    "ring_attention": "ejkernel_cuda.ring_attention:IMPLEMENTATION",
    "scaled_dot_product_attention": "ejkernel_cuda.scaled_dot_product_attention:IMPLEMENTATION",
    # the paged forward (csrc/flash_attention/paged_forward.cu); ranked above Triton under platform="auto"
    # (ragged_page_attention.PRIORITY: measured faster)
    "ragged_page_attention": "ejkernel_cuda.ragged_page_attention:IMPLEMENTATION",
}


# Not yet run on a GPU: registered only with EJKERNEL_UNVERIFIED_KERNELS=1 (the device run that verifies
# them; then they move up into IMPLEMENTATIONS).
UNVERIFIED: dict[str, str] = {}


def _cudnn_missing() -> str | None:
    from ejkernel_cuda.cudnn_attention import api_missing

    return api_missing()


NATIVE_PART = "native flash attention (sm_90a)"


def _parts() -> dict[str, str | None]:
    from ejkernel_cuda.native_flash import usable_here

    return {NATIVE_PART: usable_here()}


BACKEND = DeclaredBackend(
    name="cuda",
    distribution="ejkernel-cuda",
    platform="cuda",
    targets=("gpu",),
    implementations=IMPLEMENTATIONS,
    unverified=UNVERIFIED,
    priority=20,
    check_usable=lambda: first_reason(lambda: no_device("gpu"), _cudnn_missing),
    description="NVIDIA GPU kernels: cuDNN's flash attention, our sm_90a flash and paged attention through the XLA FFI",
    check_parts=_parts,
)
ejkernel_backend_info, ejkernel_register_kernels = BACKEND.hooks()
