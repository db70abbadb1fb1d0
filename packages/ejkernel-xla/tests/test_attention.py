"""XLA ``attention`` (dense, returns the weights) against the shared conformance suite."""

from __future__ import annotations

from ejkernel.testing.attention import AttentionConformance


class TestXlaAttention(AttentionConformance):
    platform = "xla"
