"""XLA ``ragged_page_attention`` against the shared conformance suite, plus XLA-specific checks."""

from __future__ import annotations

import jax

from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttentionConfig
from ejkernel.testing.numerics import assert_close
from ejkernel.testing.numerics import run_jitted
from ejkernel.testing.ragged_page_attention import (
    CASES,
    RaggedPageAttentionConformance,
    reference_ragged_page_attention,
)


class TestXlaRaggedPageAttention(RaggedPageAttentionConformance):
    platform = "xla"

    def test_block_sizes_agree(self):
        inputs = self.make_inputs(11, CASES["mixed_gqa"], "float32", num_sinks=0)
        expected = run_jitted(reference_ragged_page_attention, **inputs, sliding_window=9)
        cfg = RaggedPageAttentionConfig(num_kv_pages_per_block=2, num_queries_per_block=5)
        out = jax.jit(lambda **kw: self.call(**kw, sliding_window=9, cfg=cfg))(**inputs)
        assert_close(out, expected, dtype="float32")
