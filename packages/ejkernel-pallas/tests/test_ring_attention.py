"""Ring attention with the TPU block kernels, interpret mode: the shared suite (a 4-device CPU mesh in a
subprocess, 8 with EJKERNEL_PALLAS_CONFORMANCE=1; one device in process)."""

from __future__ import annotations

import jax
import pytest
from pallas_test_helpers import InterpretedConformance, full_conformance

from ejkernel.modules import ring_attention
from ejkernel.testing.numerics import matmul_precisions
from ejkernel.testing.ring_attention import RingAttentionConformance, case_inputs


class TestPallasRingAttentionConformance(InterpretedConformance, RingAttentionConformance):
    # Under shard_map only the TPU-faithful interpreter runs (NOTES.md), at a cost growing with devices x
    # ring steps: 8 devices take ~150 s on 2 cores, 4 devices (3 hops, all cases) a quarter of the run time.
    devices = 8 if full_conformance() else 4
    refused_cases = 1  # the zig-zag layout: the TPU block kernels take contiguous shards (platform="xla" does)


@pytest.mark.parametrize("precision, expected", [(None, jax.lax.Precision.HIGHEST), ("high", jax.lax.Precision.HIGH)])
def test_float32_dots_take_the_calls_precision(pallas_interpret, precision, expected):
    """Mosaic's default dot is bf16 passes: a float32 call's precision reaches every dot, in the block
    kernels (forward, dK/dV, dQ) and in the merges outside them (delta, sink gradient)."""
    arrays, options = case_inputs("full_softcap_sinks", devices=1)

    def loss(query):
        return ring_attention(**{**arrays, "query": query}, **options, precision=precision, platform="pallas").sum()

    found = matmul_precisions(jax.grad(loss), arrays["query"])
    assert found and set(found) == {expected}, found
