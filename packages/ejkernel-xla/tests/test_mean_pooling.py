"""XLA ``mean_pooling`` against the shared conformance suite."""

from __future__ import annotations

from ejkernel.testing.mean_pooling import MeanPoolingConformance


class TestXlaMeanPooling(MeanPoolingConformance):
    platform = "xla"
