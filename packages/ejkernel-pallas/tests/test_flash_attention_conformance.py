"""The shared flash_attention conformance suite through ``platform="pallas"`` on CPU, in interpret mode.

``EJKERNEL_PALLAS_INTERPRET=1`` routes the calls to the TPU kernels (Pallas' generic interpreter); the
GPU kernels are covered by ``test_gpu_flash_attention.py`` here and by the suite on the device.
"""

from __future__ import annotations

import pytest

from ejkernel.testing.flash_attention import FlashAttentionConformance


class TestPallasTpuFlashAttentionConformance(FlashAttentionConformance):
    platform = "pallas"

    @pytest.fixture(autouse=True)
    def _interpret_mode(self, pallas_interpret):
        yield
