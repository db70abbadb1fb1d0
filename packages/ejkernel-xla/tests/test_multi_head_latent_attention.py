"""XLA ``multi_head_latent_attention`` against the shared conformance suite, plus both XLA forms."""

from __future__ import annotations

import jax

from ejkernel.modules.operations.multi_head_latent_attention import MultiHeadLatentAttentionConfig
from ejkernel.testing.multi_head_latent_attention import (
    CASES,
    MultiHeadLatentAttentionConformance,
    reference_multi_head_latent_attention,
)
from ejkernel.testing.numerics import assert_close
from ejkernel.testing.page_attention import run_jitted


class TestXlaMultiHeadLatentAttention(MultiHeadLatentAttentionConformance):
    platform = "xla"

    def test_both_forms_agree(self):
        inputs = self.make_inputs(11, CASES["expanded_rope"], "float32")
        expected = run_jitted(reference_multi_head_latent_attention, **inputs, causal=True)
        for absorb in (True, False):
            cfg = MultiHeadLatentAttentionConfig(absorb=absorb)
            out = jax.jit(lambda **kw: self.call(**kw, causal=True, cfg=cfg))(**inputs)  # noqa: B023
            assert_close(out, expected, dtype="float32", name=f"absorb={absorb}")
