"""GPU conformance of ``scaled_dot_product_attention`` with platform="triton" (``-m gpu``)."""

from __future__ import annotations

import jax
import pytest

from ejkernel.testing.scaled_dot_product_attention import ScaledDotProductAttentionConformance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]


class TestTritonScaledDotProductAttentionConformance(ScaledDotProductAttentionConformance):
    platform = "triton"
    allow_unsupported = True  # bias and attention_mask are refused (the dispatcher takes XLA)
    verify_reference = False
