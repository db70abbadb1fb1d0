"""XLA ``scaled_dot_product_attention`` against the shared conformance suite."""

from __future__ import annotations

from ejkernel.testing.scaled_dot_product_attention import ScaledDotProductAttentionConformance


class TestXlaScaledDotProductAttention(ScaledDotProductAttentionConformance):
    platform = "xla"
