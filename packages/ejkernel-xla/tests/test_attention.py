"""XLA ``attention`` (dense, returns the weights) against the shared conformance suite, plus the matmul
precision of forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.modules import attention
from ejkernel.testing.attention import AttentionConformance
from ejkernel.testing.flash_attention import attention_inputs
from ejkernel.testing.numerics import call_precision_cases, matmul_precisions


class TestXlaAttention(AttentionConformance):
    platform = "xla"


@call_precision_cases()
def test_matmuls_run_at_the_call_precision(dtype, precision, expected):
    inputs = attention_inputs(46, batch=1, q_len=10, num_heads=2, head_dim=16, dtype=dtype, bias_shape=(1, 2, 10, 10))

    def loss(query, key, value, bias):
        out, weights = attention(query, key, value, bias, dropout_prob=0.3, precision=precision, platform="xla")
        return out.astype(jnp.float32).sum() + weights.astype(jnp.float32).sum()

    found = matmul_precisions(jax.grad(loss, argnums=(0, 1, 2, 3)), *inputs.values())
    assert found and set(found) == {expected}, found
