"""GPU conformance of ``scaled_dot_product_attention`` with platform="triton" (``-m gpu``)."""

from __future__ import annotations

from ejkernel.testing.scaled_dot_product_attention import ScaledDotProductAttentionConformance
from gpu_support import GPU_ONLY

pytestmark = GPU_ONLY


class TestTritonScaledDotProductAttentionConformance(ScaledDotProductAttentionConformance):
    platform = "triton"
    allow_unsupported = True  # bias and attention_mask are refused (the dispatcher takes XLA)
    verify_reference = False
