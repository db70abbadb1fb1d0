"""XLA ``ring_attention`` against the shared conformance suite (8 CPU devices in a subprocess), on every
accelerator of the host when there are two or more (the GPU suite runs this package whole), plus the
precision of its matmuls."""

from __future__ import annotations

import jax
import pytest

from ejkernel.modules import ring_attention
from ejkernel.testing.numerics import matmul_precisions
from ejkernel.testing.ring_attention import DeviceRingConformance, RingAttentionConformance, case_inputs
from ejkernel_xla.flash_attention import XlaBlockConfig


class TestXlaRingAttention(RingAttentionConformance):
    platform = "xla"


class TestXlaRingOfDevices(DeviceRingConformance):
    platform = "xla"  # the GPU ring of sinks and sliding windows (skipped with fewer than two devices)
    min_accepted = 11  # takes every case


@pytest.mark.parametrize("precision", [None, "default"])
def test_matmuls_run_at_the_call_precision(precision):
    """float32 inputs: HIGHEST unless asked otherwise, in the forward and in the custom VJP's backward."""
    arrays, options = case_inputs("full_softcap_sinks", devices=1)
    expected = jax.lax.Precision.HIGHEST if precision is None else jax.lax.Precision.DEFAULT
    cfg = XlaBlockConfig(block_q=2, block_kv=2)  # several blocks per ring step

    def loss(query):
        return ring_attention(**{**arrays, "query": query}, **options, precision=precision, cfg=cfg).sum()

    found = matmul_precisions(jax.grad(loss), arrays["query"])
    assert found and all(p == expected for p in found), found
