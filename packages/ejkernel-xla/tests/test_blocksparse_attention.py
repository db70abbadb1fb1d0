"""XLA ``blocksparse_attention`` against the shared conformance suite, plus the matmul precision of
forward and backward (custom VJP)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.testing.blocksparse_attention import CASES, BlockSparseAttentionConformance
from ejkernel.testing.numerics import call_precision_cases, matmul_precisions


class TestXlaBlockSparseAttention(BlockSparseAttentionConformance):
    platform = "xla"

    @call_precision_cases()
    def test_matmuls_run_at_the_call_precision(self, dtype, precision, expected):
        inputs, static = self.make_inputs(8, CASES["gqa_per_head"], dtype)
        inputs["softmax_aux"] = jnp.zeros((4, 2), dtype)

        def loss(*diff):
            out = self.call(**dict(zip(inputs, diff)), **static, precision=precision)
            return out.astype(jnp.float32).sum()

        found = matmul_precisions(jax.grad(loss, argnums=range(len(inputs))), *inputs.values())
        assert found and set(found) == {expected}, found
