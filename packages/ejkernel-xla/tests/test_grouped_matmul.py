"""XLA ``grouped_matmul`` against the shared conformance suite."""

from __future__ import annotations

from ejkernel.testing.grouped_matmul import GroupedMatmulConformance


class TestXlaGroupedMatmul(GroupedMatmulConformance):
    platform = "xla"
