"""The shared flash_attention conformance suite through ``platform="pallas"`` on CPU, in interpret mode.

``EJKERNEL_PALLAS_INTERPRET=1`` registers the TPU kernels for the CPU (Pallas' generic interpreter); the
GPU kernels are covered by ``test_gpu_flash_attention.py`` here and by the suite on the device.
"""

from __future__ import annotations

import pytest

from ejkernel.testing.flash_attention import FlashAttentionConformance
from ejkernel.testing.numerics import INTERPRET_COMPILER_OPTIONS


class TestPallasTpuFlashAttentionConformance(FlashAttentionConformance):
    platform = "pallas"
    compiler_options = INTERPRET_COMPILER_OPTIONS  # the interpreted kernels are compile-bound on CPU
    verify_reference = False  # backend-independent, run by the XLA suite

    @pytest.fixture(autouse=True)
    def _interpret_mode(self, pallas_interpret):
        yield


@pytest.mark.gpu
class TestPallasGpuFlashAttentionConformance(FlashAttentionConformance):
    """On an NVIDIA GPU (``pytest -m gpu`` on the device): the Triton-lowered kernels. Bias and boolean
    mask are refused with UnsupportedFeature and reported as skips naming the reason."""

    platform = "pallas"
    allow_unsupported = True
