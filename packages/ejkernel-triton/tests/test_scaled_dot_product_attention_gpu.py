"""GPU conformance of ``scaled_dot_product_attention`` with platform="triton" (``-m gpu``; registered for the
run by EJKERNEL_UNVERIFIED_KERNELS=1, which scripts/device/gpu_tests.sh sets)."""

from __future__ import annotations

import jax
import pytest

from ejkernel.kernels._registry import kernel_registry
from ejkernel.testing.scaled_dot_product_attention import ScaledDotProductAttentionConformance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
    pytest.mark.skipif(not kernel_registry.find("scaled_dot_product_attention", "triton", "gpu"),
                       reason="not registered: set EJKERNEL_UNVERIFIED_KERNELS=1 (gpu_tests.sh does)"),
]


class TestTritonScaledDotProductAttentionConformance(ScaledDotProductAttentionConformance):
    platform = "triton"
    allow_unsupported = True  # bias and attention_mask are refused (the dispatcher takes XLA)
    verify_reference = False
