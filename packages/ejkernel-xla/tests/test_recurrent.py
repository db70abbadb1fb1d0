"""XLA ``recurrent_attention`` against the shared conformance suite."""

from __future__ import annotations

from ejkernel.testing.recurrent import RecurrentConformance


class TestXlaRecurrent(RecurrentConformance):
    platform = "xla"
