"""XLA ``ragged_decode_attention`` against the shared conformance suite, plus XLA-specific checks."""

from __future__ import annotations

import jax
import pytest

from ejkernel.testing.numerics import assert_close, run_jitted
from ejkernel.testing.ragged_decode_attention import (
    CASES,
    RaggedDecodeAttentionConformance,
    reference_ragged_decode_attention,
)
from ejkernel_xla.ragged_decode_attention import XlaRaggedDecodeAttentionConfig


class TestXlaRaggedDecodeAttention(RaggedDecodeAttentionConformance):
    platform = "xla"


def test_block_keys_agree():
    suite = TestXlaRaggedDecodeAttention()
    inputs = suite.make_inputs(11, CASES["mha_odd"], "float32", num_sinks=2)
    expected = run_jitted(reference_ragged_decode_attention, **inputs, sliding_window=7)
    cfg = XlaRaggedDecodeAttentionConfig(block_keys=16)
    out = jax.jit(lambda **kw: suite.call(**kw, sliding_window=7, cfg=cfg))(**inputs)
    assert_close(out, expected, dtype="float32")


def test_heuristic_config_is_the_config_that_runs():
    """The heuristic spells out the step a config left at None takes (the executor stores what runs)."""
    from ejkernel_xla.ragged_decode_attention import IMPLEMENTATION

    suite = TestXlaRaggedDecodeAttention()
    inputs = suite.make_inputs(11, CASES["mha_odd"], "float32", num_sinks=2)
    cfg = suite.heuristic_config_that_runs(IMPLEMENTATION, inputs, XlaRaggedDecodeAttentionConfig())
    assert isinstance(cfg.block_keys, int)


@pytest.mark.parametrize("precision", [None, "default"])
def test_matmuls_run_at_the_call_precision(precision):
    """float32 inputs: HIGHEST unless asked otherwise, in the forward and in the gradient's matmuls."""
    suite = TestXlaRaggedDecodeAttention()
    inputs = suite.make_inputs(12, CASES["mqa"], "float32")
    expected = jax.lax.Precision.HIGHEST if precision is None else jax.lax.Precision.DEFAULT
    suite.assert_matmul_precision(inputs, "query", precision, expected)
