"""XLA ``ring_attention`` against the shared conformance suite (8 CPU devices in a subprocess)."""

from __future__ import annotations

from ejkernel.testing.ring_attention import RingAttentionConformance


class TestXlaRingAttention(RingAttentionConformance):
    platform = "xla"
