"""XLA ``scaled_dot_product_attention`` against the shared conformance suite, plus the matmul precision
of forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel.modules import scaled_dot_product_attention
from ejkernel.testing.flash_attention import attention_inputs
from ejkernel.testing.numerics import matmul_precisions
from ejkernel.testing.scaled_dot_product_attention import ScaledDotProductAttentionConformance

HIGHEST, DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT


class TestXlaScaledDotProductAttention(ScaledDotProductAttentionConformance):
    platform = "xla"


@pytest.mark.parametrize(
    "dtype,precision,expected",
    [(jnp.float32, None, HIGHEST), (jnp.float32, "default", DEFAULT), (jnp.bfloat16, None, DEFAULT)],
    ids=["float32", "float32-asked-default", "bfloat16"],
)
def test_matmuls_run_at_the_call_precision(dtype, precision, expected):
    inputs = attention_inputs(37, batch=1, q_len=10, num_heads=2, head_dim=16, dtype=dtype)

    def loss(query, key, value):
        out = scaled_dot_product_attention(query, key, value, causal=True, precision=precision, platform="xla")
        return out.astype(jnp.float32).sum()

    found = matmul_precisions(jax.grad(loss, argnums=(0, 1, 2)), *inputs.values())
    assert found and set(found) == {expected}, found
