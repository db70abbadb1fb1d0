"""Ring attention with the TPU block kernels, interpret mode: the shared suite (a 4-device CPU mesh in a
subprocess, 8 with EJKERNEL_PALLAS_CONFORMANCE=1; one device in process)."""

from __future__ import annotations

import pytest
from pallas_test_helpers import full_conformance

from ejkernel.testing.ring_attention import RingAttentionConformance
from ejkernel.testing.numerics import INTERPRET_COMPILER_OPTIONS


class TestPallasRingAttentionConformance(RingAttentionConformance):
    platform = "pallas"
    compiler_options = INTERPRET_COMPILER_OPTIONS  # the interpreted kernels are compile-bound on CPU
    # Under shard_map only the TPU-faithful interpreter runs (NOTES.md), at a cost growing with devices x
    # ring steps: 8 devices take ~150 s on 2 cores, 4 devices (3 hops, all cases) a quarter of the run time.
    devices = 8 if full_conformance() else 4

    @pytest.fixture(autouse=True)
    def _interpret_mode(self, pallas_interpret):
        yield

