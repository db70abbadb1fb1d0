"""XLA ``gla_attention`` against the shared conformance suite."""

from __future__ import annotations

from ejkernel.testing.gla import GLAConformance


class TestXlaGLA(GLAConformance):
    platform = "xla"
