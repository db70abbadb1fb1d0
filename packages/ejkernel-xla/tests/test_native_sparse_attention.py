"""XLA ``native_sparse_attention`` against the shared conformance suite, plus the selected branch in
several query chunks and the matmul precision of forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.testing.native_sparse_attention import CASES, NativeSparseAttentionConformance
from ejkernel.testing.numerics import call_precision_cases, matmul_precisions
from ejkernel_xla.native_sparse_attention import XlaNsaConfig


class TestXlaNativeSparseAttention(NativeSparseAttentionConformance):
    platform = "xla"

    def test_query_chunks_across_the_sequence(self):
        """Chunks smaller than the sequence and not dividing it (37 rows in chunks of 8)."""
        self.cfg = XlaNsaConfig(query_chunk=8)
        inputs, static = self.make_inputs(8, CASES["gqa"], "float32", gates=("g_cmp", "g_slc", "g_swa"), indices=False)
        self.check(inputs, {**static, "window_size": 5}, "float32")

    @call_precision_cases()
    def test_matmuls_run_at_the_call_precision(self, dtype, precision, expected):
        inputs, static = self.make_inputs(9, CASES["gqa"], dtype, gates=("g_cmp", "g_slc", "g_swa"), indices=False)
        counts = inputs.pop("block_counts")
        wrt = list(inputs)

        def loss(*diff):
            out = self.call(**dict(zip(wrt, diff)), block_counts=counts, **static, window_size=5, precision=precision)
            return out.astype(jnp.float32).sum()

        found = matmul_precisions(jax.grad(loss, argnums=range(len(wrt))), *inputs.values())
        assert found and set(found) == {expected}, found
