"""The shared flash_attention conformance suite through ``platform="pallas"`` on CPU, in interpret mode.

``EJKERNEL_PALLAS_INTERPRET=1`` registers the TPU kernels for the CPU (Pallas' generic interpreter); the
GPU kernels are covered by ``test_gpu_flash_attention.py`` here and by the suite on the device (twice:
the heuristic's config, which takes the Mosaic GPU kernels on Hopper, and the Triton-lowered kernels alone).
"""

from __future__ import annotations

import pytest
from pallas_test_helpers import InterpretedConformance

from ejkernel.testing.flash_attention import FlashAttentionConformance
from ejkernel_pallas.gpu_flash_attention import GpuFlashTuning


class TestPallasTpuFlashAttentionConformance(InterpretedConformance, FlashAttentionConformance):
    verify_reference = False  # backend-independent, run by the XLA suite


@pytest.mark.gpu
class TestPallasGpuFlashAttentionConformance(FlashAttentionConformance):
    """On an NVIDIA GPU (``pytest -m gpu`` on the device), with the heuristic's config: on a Hopper GPU the
    Mosaic GPU kernels wherever they take the call, the Triton-lowered ones elsewhere. Bias and boolean
    mask are refused with UnsupportedFeature and reported as skips naming the reason."""

    platform = "pallas"
    allow_unsupported = True


@pytest.mark.gpu
class TestPallasGpuTritonLoweredFlashAttentionConformance(TestPallasGpuFlashAttentionConformance):
    """The same with the Triton-lowered kernels for every call (the Mosaic ones off)."""

    cfg = GpuFlashTuning()
