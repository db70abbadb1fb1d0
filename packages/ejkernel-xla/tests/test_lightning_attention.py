"""XLA ``lightning_attention`` against the shared conformance suite (the engine's own checks:
test_recurrent.py)."""

from __future__ import annotations

from ejkernel.testing.lightning_attention import LightningAttentionConformance
from ejkernel_xla.recurrent import XlaLinearAttentionConfig


class TestXlaLightningAttention(LightningAttentionConformance):
    platform = "xla"
    chunk_config = XlaLinearAttentionConfig
