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


def test_heuristic_config_spells_out_the_blocks():
    """The heuristic config is the block sizes a ring step over the shard runs (the defaults, capped at the
    shard's lengths): no field left at None; a partial user config resolves the same way."""
    import dataclasses

    from ejkernel.modules.operations.ring_attention import RingAttention
    from ejkernel_xla.ring_attention import IMPLEMENTATION

    arrays, options = case_inputs("full_softcap_sinks", devices=1)
    call = RingAttention().validate(**arrays, **options)
    q_len, kv_len = call.query.shape[1], call.key.shape[1]
    config = IMPLEMENTATION.heuristic_config(call)
    assert config == XlaBlockConfig(min(512, q_len), min(512, kv_len), min(512, q_len), min(512, kv_len))
    assert all(getattr(config, f.name) is not None for f in dataclasses.fields(config))
    shape = (q_len, kv_len, call.query.shape[3])
    assert XlaBlockConfig().with_blocks(*shape) == config == config.with_blocks(*shape)
    assert XlaBlockConfig(block_q=2).with_blocks(*shape) == dataclasses.replace(config, block_q=2, bwd_block_q=2)
