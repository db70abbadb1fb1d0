"""XLA ``gla_attention`` against the shared conformance suite (the engine's own checks: test_recurrent.py)."""

from __future__ import annotations

from ejkernel.testing.gla import GLAConformance
from ejkernel_xla.recurrent import XlaLinearAttentionConfig


class TestXlaGLA(GLAConformance):
    platform = "xla"
    chunk_config = XlaLinearAttentionConfig
