"""Ring attention with the TPU block kernels, interpret mode: the shared suite (8-device CPU mesh in a
subprocess, one device in process)."""

from __future__ import annotations

import pytest
from pallas_test_helpers import interpret_conformance

from ejkernel.testing.ring_attention import RingAttentionConformance


@interpret_conformance
class TestPallasRingAttentionConformance(RingAttentionConformance):
    platform = "pallas"

    @pytest.fixture(autouse=True)
    def _interpret_mode(self, pallas_interpret):
        yield
