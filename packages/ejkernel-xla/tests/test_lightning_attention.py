"""XLA ``lightning_attention`` against the shared conformance suite."""

from __future__ import annotations

from ejkernel.testing.lightning_attention import LightningAttentionConformance


class TestXlaLightningAttention(LightningAttentionConformance):
    platform = "xla"
