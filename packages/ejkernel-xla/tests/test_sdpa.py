"""XLA ``scaled_dot_product_attention`` against the shared conformance suite, plus the matmul precision
of forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.modules import scaled_dot_product_attention
from ejkernel.testing.flash_attention import attention_inputs
from ejkernel.testing.numerics import call_precision_cases, matmul_precisions
from ejkernel.testing.scaled_dot_product_attention import ScaledDotProductAttentionConformance


class TestXlaScaledDotProductAttention(ScaledDotProductAttentionConformance):
    platform = "xla"


@call_precision_cases()
def test_matmuls_run_at_the_call_precision(dtype, precision, expected):
    inputs = attention_inputs(37, batch=1, q_len=10, num_heads=2, head_dim=16, dtype=dtype)

    def loss(query, key, value):
        out = scaled_dot_product_attention(query, key, value, causal=True, precision=precision, platform="xla")
        return out.astype(jnp.float32).sum()

    found = matmul_precisions(jax.grad(loss, argnums=(0, 1, 2)), *inputs.values())
    assert found and set(found) == {expected}, found
