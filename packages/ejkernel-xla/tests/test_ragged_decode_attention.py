"""XLA ``ragged_decode_attention`` against the shared conformance suite, plus XLA-specific checks."""

from __future__ import annotations

import jax

from ejkernel.testing.numerics import assert_close
from ejkernel.testing.numerics import run_jitted
from ejkernel.testing.ragged_decode_attention import (
    CASES,
    RaggedDecodeAttentionConformance,
    reference_ragged_decode_attention,
)


class TestXlaRaggedDecodeAttention(RaggedDecodeAttentionConformance):
    platform = "xla"

    def test_block_size_agrees(self):
        inputs = self.make_inputs(11, CASES["mha_odd"], "float32", num_sinks=2)
        expected = run_jitted(reference_ragged_decode_attention, **inputs, sliding_window=7)
        out = jax.jit(lambda **kw: self.call(**kw, block_size=16, sliding_window=7))(**inputs)
        assert_close(out, expected, dtype="float32")
