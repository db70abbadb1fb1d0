"""XLA ``page_attention`` against the shared conformance suite, plus XLA-specific checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.modules.operations.page_attention import PageAttentionConfig
from ejkernel.testing.numerics import assert_close
from ejkernel.testing.page_attention import SHAPES, PageAttentionConformance, reference_page_attention, run_jitted


class TestXlaPageAttention(PageAttentionConformance):
    platform = "xla"

    def test_every_pages_per_compute_block_agrees(self):
        inputs = self.make_inputs(11, SHAPES["gqa4_odd"], "float32")
        expected = run_jitted(reference_page_attention, **inputs)
        for pages in (3,):
            out = jax.jit(lambda **kw: self.call(**kw, cfg=PageAttentionConfig(pages_per_compute_block=pages)))(
                **inputs
            )  # noqa: B023
            assert_close(out, expected, dtype=jnp.float32, name=f"pages_per_compute_block={pages}")
