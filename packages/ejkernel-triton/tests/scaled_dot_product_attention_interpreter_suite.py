"""The shared scaled_dot_product_attention conformance suite with platform="triton" (the Triton flash kernels
through ``ThroughFlashAttention``), run in Triton's interpreter (collected only by
test_scaled_dot_product_attention.py, in a pytest subprocess started with TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import pytest

from ejkernel.testing.scaled_dot_product_attention import ScaledDotProductAttentionConformance

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 (through test_scaled_dot_product_attention.py)",
                allow_module_level=True)


class TestTritonScaledDotProductAttentionInterpreted(ScaledDotProductAttentionConformance):
    platform = "triton"
    allow_unsupported = True  # bias and attention_mask are refused (the dispatcher takes XLA)
    verify_reference = False

    # Triton's interpreter computes on numpy, which has no bfloat16: float32 and float16 here, bfloat16 on the GPU
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["float32", "float16"])
    def test_dtypes(self, dtype):
        super().test_dtypes(dtype)
